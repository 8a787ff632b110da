"""Pack sessions into fixed ``[rows, width]`` training rows.

**Chains.** A session's calls are joined into chains: call k + 1 extends call k's chain only
when its prompt ids start with every id of the chain so far, sampled ids included, so the
chain is exactly the context the engine read for its last call followed by what it drew.
Any other call (a prompt that drops, edits or re-renders earlier ids) starts a new chain.
A prompt that merely starts with the previous *prompt* never merges: that would splice
sampled ids into a context the model did not see.

**Rows.** Chains are placed first-fit decreasing: longest first, each into the first row with
room, at that row's end. Each row holds its chains back to back, each a segment of its own
(``text_segment_ids`` 1, 2, ... in column order, 0 = padding) with positions restarting at 0,
so attention and rotary positions never cross chains. The order chains are placed in has no
meaning for training, since every column carries its session and call; sorting by length is
what gets the skewed length mixes of agentic runs to a real-token share above 97% (see
``benchmarks/packing.py``), where plain first-fit in arrival order leaves the tail of every
near-width row empty.

**Which sessions train.** COMPLETED and AGENT_ERROR sessions train on their reward.
INFRA_ERROR and CANCELLED sessions never train: no rows, no part in any baseline. TRUNCATED
sessions follow ``truncation``: ``"mask"`` treats them like infrastructure failures,
``"score"`` trains them on their reward, ``"zero"`` trains them on reward 0. Advantages are
computed over the training sessions of each (task, group) by the named estimator
(:mod:`dew_pipe.objectives.rl.advantages`). A session is known by (task, group, sample,
attempt), and a batch holds each session once: ``pack`` refuses a second copy, which would
otherwise train twice and count twice in its group's baseline. :func:`trains` and
:func:`session_chains` are these rules as functions, for whatever reports on a packed batch.
``drop_zero_advantage`` then takes out the groups whose advantages all came out 0: they
train nothing, so leaving them out only saves their rows (a report on such a batch should
count them as dropped, not as training).

**Shared prompts.** With ``share_prompts=True`` a group's completions of one prompt are
laid out as a block: the prompt without its last id, once, as a segment of its own, then
each completion as a segment that starts with that last id (at its usual position) and reads
the prompt's keys through ``text_prefix_segments``. Every sampled id keeps its own column,
predicted from the same context at the same positions as in a plain chain, so log-probs,
losses and gradients are those of the plain layout up to float rounding; the prompt is
encoded once per block instead of once per completion. A session shares only when it is one
chain; a block that would pass ``width`` is split, each part with its own copy of the prompt.
Prompt columns carry no session: ``advantages`` and ``session_weights`` are 0 there and
``session_index`` -1. A prompt id predicted inside the shared copy is counted once per block
by a perplexity over unsampled ids (``GRPOObjective.evaluate``), not once per completion, and
the transition into each completion's first id is not counted.

**Columns** (all ``[rows, width]`` unless noted; "sampled" = positions of sampled ids):

==================== ======= ============================================================
column               dtype   value
==================== ======= ============================================================
input_ids            int32   the chains' ids; 0 on padding
text_segment_ids     int32   chain number within the row, from 1; 0 on padding
text_positions       int32   position within the chain, from 0; 0 on padding
response_mask        int32   1 on sampled ids (EOS included), else 0
old_log_probs        float32 raw log-probs when the call recorded them, else behavior; sampled
behavior_log_probs   float32 the engine's sampling log-probs; on sampled ids, else 0
advantages           float32 the session's advantage on every id of its chains, else 0
versions             int32   the call's policy version on sampled ids, else -1
session_index        int32   index of the session in ``sessions`` on sampled ids, else -1
call_index           int32   index of the call in its session on sampled ids, else -1
session_weights      float32 1 / (sampled ids of the session) on every id of its chains
routed_experts       engine  ``[rows, width, layers, top_k]`` expert ids, 0 where not routed
routed               bool    true where a call's routing record covers the id
support_ids          int32   ``[rows, support_capacity]`` kept ids of each sampled id, -1 pad
support_columns      int32   ``[rows, support_capacity]`` column of the sampled id, -1 pad
text_prefix_segments int32   with ``share_prompts``: the segment of the shared prompt a
                             completion's ids continue; 0 elsewhere
==================== ======= ============================================================

``session_weights`` makes ``aggregation="session-mean"`` a batch-level reduction: with m the
response mask, w the weights and l the per-token loss, ``sum(l * m * w)`` is the sum over
sessions of each session's token mean and ``sum(m * w)`` is the number of training sessions
with at least one sampled id, so their ratio is the mean over sessions of each session's
token mean. A session with no sampled id at all gets weight 0.

Routing columns appear when any call of any session recorded ``routed_experts`` (every such
record must share layers, top_k and dtype). A call's record covers the first ``n`` ids of its
own context-plus-draw; within a chain a later call's record replaces an earlier one where
both cover an id, as verl keeps the last turn's routing. Support columns appear when any call
recorded a ``support``; ``support_capacity`` is then required so every batch has one shape.
Each row lists the supports of its sampled ids back to back in column order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.advantages import ESTIMATORS, compute_advantages
from dew_pipe.objectives.rl.session_records import Call, Session, Status, check_sessions

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["TRUNCATIONS", "chain_lengths", "pack", "rows_needed", "session_chains"]

TRUNCATIONS = ("mask", "score", "zero")
"""How ``pack`` treats TRUNCATED sessions: no training, their reward, or reward 0."""

_ALWAYS = (Status.COMPLETED, Status.AGENT_ERROR)
_NEVER = (Status.INFRA_ERROR, Status.CANCELLED)


def session_chains(calls: Sequence[Call]) -> list[list[int]]:
    """Split calls into strict chains: lists of call indices, in submission order.

    Args:
        calls: one session's calls.

    Returns:
        The chains; each chain's ids are its last call's prompt followed by its sampled ids.

    Example:
        >>> a = Call([1, 2], [3], [-0.1], "stop", 0)
        >>> b = Call([1, 2, 3, 9], [4], [-0.2], "stop", 0)   # extends a: merges
        >>> c = Call([1, 2, 9], [5], [-0.3], "stop", 0)      # drops a's draw: new chain
        >>> session_chains([a, b, c])
        [[0, 1], [2]]
    """
    chains: list[list[int]] = []
    for index, call in enumerate(calls):
        if chains and _extends(call, calls[chains[-1][-1]]):
            chains[-1].append(index)
        else:
            chains.append([index])
    return chains


def _extends(call: Call, previous: Call) -> bool:
    """True when ``call``'s prompt starts with ``previous``'s prompt and sampled ids."""
    p, s = previous.prompt_ids.size, previous.sampled_ids.size
    prompt = call.prompt_ids
    return (
        prompt.size >= p + s
        and np.array_equal(prompt[:p], previous.prompt_ids)
        and np.array_equal(prompt[p : p + s], previous.sampled_ids)
    )


def check_truncation(truncation: Any) -> str:
    """``truncation`` when it is one of :data:`TRUNCATIONS`.

    Raises:
        ValueError: anything else.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation: expected one of {list(TRUNCATIONS)}, got {truncation!r}")
    return truncation


def trains(session: Session, truncation: str) -> bool:
    """Whether ``session`` trains (takes rows and a part in its group's baseline).

    COMPLETED and AGENT_ERROR sessions always do, INFRA_ERROR and CANCELLED ones never;
    TRUNCATED ones do unless ``truncation`` is ``"mask"``.

    Example:
        >>> s = Session(0, 0, 0, 0, [], "TRUNCATED")
        >>> trains(s, "mask"), trains(s, "score")
        (False, True)
    """
    if session.status in _ALWAYS:
        return True
    if session.status in _NEVER:
        return False
    return truncation != "mask"


def _check_common(sessions: Any, width: Any, truncation: Any) -> int:
    check_sessions(sessions)
    check_truncation(truncation)
    return check_int("width", width, minimum=1)


def _plan(
    sessions: Sequence[Session], width: int, truncation: str
) -> tuple[list[int], list[tuple[int, list[int]]], np.ndarray]:
    """Training sessions, their chains (session, call indices) and the chain lengths."""
    training = [i for i, s in enumerate(sessions) if trains(s, truncation)]
    chains: list[tuple[int, list[int]]] = []
    lengths: list[int] = []
    for i in training:
        calls = sessions[i].calls
        for chain in session_chains(calls):
            length = calls[chain[-1]].length
            if length > width:
                raise ValueError(
                    f"sessions[{i}] ({sessions[i].describe()}): calls {chain[0]}..{chain[-1]} "
                    f"form a chain of {length} ids, longer than width {width}"
                )
            chains.append((i, chain))
            lengths.append(length)
    return training, chains, np.asarray(lengths, dtype=np.int64)


def chain_lengths(
    sessions: Sequence[Session],
    width: int,
    truncation: str = "mask",
    *,
    share_prompts: bool = False,
) -> np.ndarray:
    """Lengths of the chains :func:`pack` would place, in session then call order.

    Args:
        sessions: the sessions of a batch.
        width: the row width; a longer chain raises as it would in ``pack``.
        truncation: ``"mask"``, ``"score"`` or ``"zero"``; under ``"mask"`` TRUNCATED
            sessions take no rows.
        share_prompts: the lengths of what ``pack(..., share_prompts=True)`` places
            instead: each shared block (one prompt and the completions that continue it)
            counts as one piece, the chains that share nothing as before.

    Returns:
        ``[pieces]`` int64 lengths.

    Raises:
        TypeError, ValueError: bad arguments, or a chain longer than ``width``.

    Example:
        >>> s = Session(0, 0, 0, 0, [Call([1, 2], [3], [-0.1], "stop", 0)], "COMPLETED", 1.0)
        >>> chain_lengths([s], width=8).tolist()
        [3]
    """
    width = _check_common(sessions, width, truncation)
    _check_flag("share_prompts", share_prompts)
    _, chains, lengths = _plan(sessions, width, truncation)
    if share_prompts:
        return _share(sessions, chains, lengths, width).lengths
    return lengths


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")


class _Pieces:
    """What ``pack`` places: plain chains, and blocks of one shared prompt followed by the
    completions of a group that continue it (each as a chain whose first ``skip`` ids are
    the prompt's, written once at the block's start)."""

    def __init__(self) -> None:
        self.lengths_list: list[int] = []
        self.members: list[list[int]] = []  # chain indices of each piece, in column order
        self.skip: list[int] = []  # shared ids at each piece's start (0: a plain chain)

    def add(self, members: list[int], skip: int, length: int) -> None:
        self.members.append(members)
        self.skip.append(skip)
        self.lengths_list.append(length)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.lengths_list, dtype=np.int64)


def _plain(lengths: np.ndarray) -> _Pieces:
    pieces = _Pieces()
    for k, length in enumerate(lengths.tolist()):
        pieces.add([k], 0, length)
    return pieces


def _share(
    sessions: Sequence[Session],
    chains: list[tuple[int, list[int]]],
    lengths: np.ndarray,
    width: int,
) -> _Pieces:
    """Group the chains that can share their prompt into blocks; the rest stay plain.

    Chains share when their sessions are of one (task, group), each session is that one
    chain, and the chains' first calls have the same prompt ids (at least 2). The block
    holds the prompt without its last id once, then each chain from that last id on, so
    every completion's first sampled id is still predicted from a column of its own.
    Members go into a block in chain order while it fits ``width``; a block left with one
    member is a plain chain.
    """
    count: dict[int, int] = {}
    for i, _ in chains:
        count[i] = count.get(i, 0) + 1
    families: dict[tuple, list[int]] = {}
    alone: list[int] = []
    for k, (i, chain) in enumerate(chains):
        session = sessions[i]
        prompt = session.calls[chain[0]].prompt_ids
        if count[i] != 1 or prompt.size < 2:
            alone.append(k)
            continue
        key = (session.task, session.group, prompt.dtype.str, prompt.tobytes())
        families.setdefault(key, []).append(k)
    pieces = _Pieces()
    blocks: list[tuple[int, list[int]]] = []
    for members in families.values():
        skip = sessions[chains[members[0]][0]].calls[chains[members[0]][1][0]].prompt_ids.size - 1
        block: list[int] = []
        used = skip
        for k in members:
            branch = int(lengths[k]) - skip
            if block and used + branch > width:
                blocks.append((skip, block))
                block, used = [], skip
            block.append(k)
            used += branch
        blocks.append((skip, block))
    order = sorted(blocks, key=lambda b: b[1][0])  # first member's chain order
    for skip, block in order:
        if len(block) == 1:
            alone.append(block[0])
        else:
            length = skip + sum(int(lengths[k]) - skip for k in block)
            pieces.add(block, skip, length)
    for k in sorted(alone):
        pieces.add([k], 0, int(lengths[k]))
    return pieces


def _place(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing: (row, offset) of each chain and the number of rows used.

    ``bound`` stays at or above every open row's free room, so a chain longer than it
    opens a row without scanning the others. When chains fill most of a row (one
    completion per row, say) that is nearly every chain, and placing costs O(chains)
    instead of O(chains x rows), which a scheduler checking each completed group against
    its whole batch paid once per group. The placement is first-fit decreasing's either way.
    """
    n = lengths.size
    row = np.zeros(n, np.int64)
    offset = np.zeros(n, np.int64)
    free = np.zeros(max(n, 1), np.int64)  # free room of each open row
    used, bound = 0, 0
    sizes = lengths.tolist()
    for i in np.argsort(-lengths, kind="stable").tolist():
        length = sizes[i]
        r = used
        if length <= bound:
            fits = free[:used] >= length
            first = int(fits.argmax())
            if fits[first]:
                r = first
            else:  # no open row has this much room
                bound = length - 1
        if r == used:
            free[r] = width
            used += 1
            bound = max(bound, width - length)
        row[i], offset[i] = r, width - free[r]
        free[r] -= length
    return row, offset, used


def rows_needed(lengths: Any, width: int) -> int:
    """How many rows of ``width`` :func:`pack` fills with chains of these lengths.

    Args:
        lengths: chain lengths, as :func:`chain_lengths` returns them.
        width: the row width.

    Returns:
        The number of rows; 0 for no chains.

    Raises:
        ValueError: a length is not in [1, width].

    Example:
        >>> rows_needed([5, 3, 4, 4], width=8)
        2
    """
    width = check_int("width", width, minimum=1)
    array = np.asarray(lengths)
    if array.size == 0:
        return 0
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"lengths: expected a 1-D integer array, got {array.dtype} {array.shape}")
    if array.min() < 1 or array.max() > width:
        raise ValueError(
            f"lengths: expected values in [1, {width}], got {array.min()}..{array.max()}"
        )
    return _place(array.astype(np.int64), width)[2]


def _rewards(sessions: Sequence[Session], training: list[int], truncation: str) -> np.ndarray:
    rewards = np.zeros(len(training), np.float64)
    for k, i in enumerate(training):
        session = sessions[i]
        if session.status is Status.TRUNCATED and truncation == "zero":
            continue
        if session.reward is None:
            raise ValueError(
                f"sessions[{i}] ({session.describe()}): reward is None, but a session that "
                f"trains needs its verifier reward"
            )
        rewards[k] = session.reward
    return rewards


def _group_ids(sessions: Sequence[Session], training: list[int]) -> np.ndarray:
    keys: dict[tuple[Any, int], int] = {}
    return np.asarray(
        [keys.setdefault((sessions[i].task, sessions[i].group), len(keys)) for i in training],
        dtype=np.int64,
    )


def _check_counts(rows: Any, support_capacity: Any, estimator: Any) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {sorted(ESTIMATORS)}, got {estimator!r}")
    check_int("rows", rows, minimum=0, allow_none=True)
    check_int("support_capacity", support_capacity, minimum=1, allow_none=True)


def _check_unique(sessions: Sequence[Session]) -> None:
    """Refuse a session given twice: it would take rows twice and count twice in its baseline."""
    seen: dict[tuple[int, int, int, int], int] = {}
    for i, s in enumerate(sessions):
        first = seen.setdefault((s.task, s.group, s.sample, s.attempt), i)
        if first != i:
            raise ValueError(
                f"sessions[{i}] ({s.describe()}): the same session as sessions[{first}]; "
                "each (task, group, sample, attempt) may appear once in a batch"
            )


def pack(
    sessions: Sequence[Session],
    width: int,
    rows: int | None = None,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
    *,
    arrow: bool = False,
    drop_zero_advantage: bool = False,
    row_multiple: int | None = None,
    share_prompts: bool = False,
) -> dict[str, np.ndarray] | pa.RecordBatch:
    """Build one packed training batch from sessions (see the module docstring for columns).

    Args:
        sessions: the batch's sessions; ``session_index`` refers to positions in this list.
        width: ids per row (``GRPOObjective(seq_len=width - 1)``).
        rows: rows of the batch; None uses as many as the chains need. Unused rows are
            all padding.
        estimator: ``"group"`` (GRPO), ``"mean"`` (Dr.GRPO) or ``"rloo"``.
        truncation: ``"mask"``, ``"score"`` or ``"zero"`` for TRUNCATED sessions.
        support_capacity: entries per row of ``support_ids``/``support_columns``; required
            when any call recorded a support. Given without any support, the columns are
            still written (all -1), so a stream keeps one shape.
        arrow: return the Arrow packed-rows batch of :mod:`dew_pipe.batches` instead; it
            shares the arrays' memory, and ``batches.packed_from_arrow`` gives the same
            arrays back without a copy.
        drop_zero_advantage: leave out the sessions of every (task, group) whose advantages
            are all exactly 0 (under "group", "mean" and "rloo": a group whose rewards are
            all equal). Their policy gradient is zero, so the update loses nothing but
            their rows. The policy loss's token (or session) mean is then over the kept
            sessions, as in DAPO's dynamic sampling, and a KL term no longer sees them;
            ``SampledRollout(drop_zero_advantage=True)`` scales the kept advantages to
            keep the whole batch's mean instead.
        row_multiple: with ``rows=None``, round the rows the chains need up to a multiple
            of this, and give a batch with nothing to train one multiple of padding rows,
            so a stream of batches that shrink with ``drop_zero_advantage`` compiles its
            update for few shapes and never for an empty batch. None: exactly the rows
            the chains need (0 for none).
        share_prompts: write a group's prompt once for all of its completions (see
            "Shared prompts" in the module docstring) and add the ``text_prefix_segments``
            column. A GRPO group of G completions of a P-id prompt then takes
            ``P - 1 + sum(completion + 1)`` ids instead of ``G * P + sum(completion)``,
            and the update runs its prompt through the decoder once instead of G times.

    Returns:
        ``{name: array}`` with every column ``[rows, width]`` (routing
        ``[rows, width, layers, top_k]``, support ``[rows, support_capacity]``), or that
        batch as a ``pyarrow.RecordBatch`` when ``arrow`` is true.

    Raises:
        TypeError: a session is not a Session; an integer argument that is not an int.
        ValueError: bad arguments; the same session twice (one (task, group, sample,
            attempt) at two indices; names both); a chain longer than ``width`` (names the
            session); fewer
            ``rows`` than the chains need (names the rows needed); a training session
            without a reward; support without ``support_capacity`` or overflowing it (names
            the row and the capacity needed); routing records of different shapes.

    Example:
        >>> call = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)
        >>> a = Session(0, 0, 0, 0, [call], "COMPLETED", reward=1.0)
        >>> b = Session(0, 0, 1, 0, [call], "COMPLETED", reward=0.0)
        >>> batch = pack([a, b], width=8)
        >>> batch["input_ids"].tolist()
        [[5, 6, 7, 2, 5, 6, 7, 2]]
        >>> batch["advantages"][0, [0, 4]].astype(float).round(4).tolist()
        [0.7071, -0.7071]
    """
    width = _check_common(sessions, width, truncation)
    _check_counts(rows, support_capacity, estimator)
    check_int("row_multiple", row_multiple, minimum=1, allow_none=True)
    _check_flag("drop_zero_advantage", drop_zero_advantage)
    _check_flag("share_prompts", share_prompts)
    _check_unique(sessions)
    routing = _shared_routing(sessions)
    supported = any(c.support is not None for s in sessions for c in s.calls)
    if supported and support_capacity is None:
        raise ValueError(
            "support_capacity: calls recorded a support, so a capacity is required "
            "(top-k times the sampled ids a row holds)"
        )
    training, chains, lengths = _plan(sessions, width, truncation)
    rewards = _rewards(sessions, training, truncation)
    group_ids = _group_ids(sessions, training)
    advantages = compute_advantages(rewards, group_ids, estimator)
    if drop_zero_advantage:
        training, chains, lengths, advantages = _informative(
            training, chains, lengths, advantages, group_ids
        )
    pieces = _share(sessions, chains, lengths, width) if share_prompts else _plain(lengths)
    row, offset, needed = _place(pieces.lengths, width)
    if rows is None:
        rows = needed if row_multiple is None else max(1, -(-needed // row_multiple)) * row_multiple
    elif needed > rows:
        raise ValueError(
            f"rows: the chains of {len(training)} training sessions need {needed} rows of "
            f"width {width}, but rows={rows}"
        )
    placed = _Placed(chains, lengths, pieces, row, offset, int(rows), width)
    by_session = dict(zip(training, advantages.tolist(), strict=True))
    batch = _core(sessions, placed, by_session)
    if not share_prompts:
        del batch["text_prefix_segments"]
    if routing is not None:
        batch.update(_routing(sessions, placed, *routing))
    if support_capacity is not None:
        batch.update(_support(sessions, placed, int(support_capacity)))
    if arrow:
        from dew_pipe.batches import packed_to_arrow  # pyarrow only when asked for

        return packed_to_arrow(batch)
    return batch


def _informative(
    training: list[int],
    chains: list[tuple[int, list[int]]],
    lengths: np.ndarray,
    advantages: np.ndarray,
    group_ids: np.ndarray,
) -> tuple[list[int], list[tuple[int, list[int]]], np.ndarray, np.ndarray]:
    """The training sessions (with their chains and advantages) of the groups whose
    advantages are not all 0."""
    flat = np.ones(int(group_ids.max()) + 1 if group_ids.size else 0, bool)
    np.logical_and.at(flat, group_ids, advantages == 0)
    keep = ~flat[group_ids]
    kept = {i for i, k in zip(training, keep.tolist(), strict=True) if k}
    on = [i in kept for i, _ in chains]
    return (
        [i for i in training if i in kept],
        [c for c, k in zip(chains, on, strict=True) if k],
        lengths[np.asarray(on, dtype=bool)],
        advantages[keep],
    )


class _Placed:
    """Where each chain landed: (session, call indices), row and offset, the batch shape,
    and the shared prompts written once for several chains.

    A chain's offset is the column its first id would take; a chain that continues a
    shared prompt (``skip`` > 0) writes only its ids from ``skip`` on, after the prompt's
    ``skip`` ids written at ``prefixes[prefix]``: ``(row, column, skip, chain)``, the chain
    whose first call supplies them.
    """

    def __init__(self, chains, lengths, pieces, row, offset, rows: int, width: int) -> None:
        self.chains: list[tuple[int, list[int]]] = chains
        self.rows = rows
        self.width = width
        count = len(chains)
        self.row, self.offset = [0] * count, [0] * count
        self.skip, self.prefix = [0] * count, [-1] * count
        self.prefixes: list[tuple[int, int, int, int]] = []
        for members, skip, r, o in zip(
            pieces.members, pieces.skip, row.tolist(), offset.tolist(), strict=True
        ):
            if skip:
                self.prefixes.append((r, o, skip, members[0]))
                o += skip
            for k in members:
                self.row[k], self.offset[k] = r, o - skip
                self.skip[k], self.prefix[k] = skip, len(self.prefixes) - 1 if skip else -1
                o += int(lengths[k]) - skip

    def __iter__(self):
        return iter(zip(self.chains, self.row, self.offset, strict=True))


def _core(
    sessions: Sequence[Session], placed: _Placed, advantage: dict[int, float]
) -> dict[str, np.ndarray]:
    shape = (placed.rows, placed.width)
    ids, segments, positions, mask, versions, session_index, call_index, prefix_segments = (
        np.zeros(shape, np.int32) for _ in range(8)
    )
    for column in (versions, session_index, call_index):
        column.fill(-1)
    old, behavior, advantages, weights = (np.zeros(shape, np.float32) for _ in range(4))
    sampled = {i: sum(c.sampled_ids.size for c in sessions[i].calls) for i in advantage}
    arange = np.arange(placed.width, dtype=np.int32)
    # Segments are numbered in column order within each row, shared prompts included.
    spans = [
        (r, o + skip, "chain", k)
        for k, (r, o, skip) in enumerate(zip(placed.row, placed.offset, placed.skip, strict=True))
    ]
    spans += [(r, o, "prompt", p) for p, (r, o, _, _) in enumerate(placed.prefixes)]
    segment_of_prefix = [0] * len(placed.prefixes)
    chains_in_row = [0] * placed.rows
    for r, start, kind, index in sorted(spans):
        chains_in_row[r] += 1
        if kind == "prompt":
            _, _, skip, k = placed.prefixes[index]
            i, chain = placed.chains[k]
            ids[r, start : start + skip] = sessions[i].calls[chain[0]].prompt_ids[:skip]
            segments[r, start : start + skip] = chains_in_row[r]
            positions[r, start : start + skip] = arange[:skip]
            segment_of_prefix[index] = chains_in_row[r]
            continue
        i, chain = placed.chains[index]
        o, skip = placed.offset[index], placed.skip[index]
        calls = sessions[i].calls
        last = calls[chain[-1]]
        end = o + last.length
        whole = np.concatenate([last.prompt_ids, last.sampled_ids])
        ids[r, start:end] = whole[skip:]
        segments[r, start:end] = chains_in_row[r]
        positions[r, start:end] = arange[skip : end - o]
        advantages[r, start:end] = advantage[i]
        weights[r, start:end] = 1.0 / sampled[i] if sampled[i] else 0.0
        for j in chain:
            call = calls[j]
            begin = o + call.prompt_ids.size
            stop = begin + call.sampled_ids.size
            mask[r, begin:stop] = 1
            behavior[r, begin:stop] = call.behavior_log_probs
            old[r, begin:stop] = call.old_log_probs
            versions[r, begin:stop] = call.version
            session_index[r, begin:stop] = i
            call_index[r, begin:stop] = j
    for k, p in enumerate(placed.prefix):
        if p >= 0:
            r, o = placed.row[k], placed.offset[k]
            end = o + sessions[placed.chains[k][0]].calls[placed.chains[k][1][-1]].length
            prefix_segments[r, o + placed.skip[k] : end] = segment_of_prefix[p]
    return {
        "input_ids": ids,
        "text_segment_ids": segments,
        "text_positions": positions,
        "response_mask": mask,
        "old_log_probs": old,
        "behavior_log_probs": behavior,
        "advantages": advantages,
        "versions": versions,
        "session_index": session_index,
        "call_index": call_index,
        "session_weights": weights,
        "text_prefix_segments": prefix_segments,
    }


def _shared_routing(sessions: Sequence[Session]) -> tuple[tuple[int, int], np.dtype] | None:
    """(layers, top_k) and dtype shared by every routing record; None when none recorded."""
    spec = None
    for i, session in enumerate(sessions):
        for j, call in enumerate(session.calls):
            if call.routed_experts is None:
                continue
            this = (call.routed_experts.shape[1:], call.routed_experts.dtype)
            if spec is None:
                spec, first = this, (i, j)
            elif this != spec:
                raise ValueError(
                    f"sessions[{i}].calls[{j}].routed_experts: expected [n, {spec[0][0]}, "
                    f"{spec[0][1]}] {spec[1]} like sessions[{first[0]}].calls[{first[1]}], "
                    f"got [n, {this[0][0]}, {this[0][1]}] {this[1]}"
                )
    return spec


def _routing(
    sessions: Sequence[Session], placed: _Placed, shape: tuple[int, int], dtype: np.dtype
) -> dict[str, np.ndarray]:
    experts = np.zeros((placed.rows, placed.width, *shape), dtype)
    routed = np.zeros((placed.rows, placed.width), np.bool_)
    for ((i, chain), r, o), skip in zip(placed, placed.skip, strict=True):
        for j in chain:  # later calls overwrite earlier ones where both cover an id
            record = sessions[i].calls[j].routed_experts
            if record is not None and record.shape[0] > skip:
                experts[r, o + skip : o + record.shape[0]] = record[skip:]
                routed[r, o + skip : o + record.shape[0]] = True
    for r, o, skip, k in placed.prefixes:  # a shared prompt: its first chain's routing
        i, chain = placed.chains[k]
        for j in chain:
            record = sessions[i].calls[j].routed_experts
            if record is not None:
                n = min(skip, record.shape[0])
                experts[r, o : o + n] = record[:n]
                routed[r, o : o + n] = True
    return {"routed_experts": experts, "routed": routed}


def _support(sessions: Sequence[Session], placed: _Placed, capacity: int) -> dict[str, np.ndarray]:
    support_ids = np.full((placed.rows, capacity), -1, np.int32)
    support_columns = np.full((placed.rows, capacity), -1, np.int32)
    per_row: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(placed.rows)]
    for (i, chain), r, o in placed:
        for j in chain:
            call = sessions[i].calls[j]
            if call.support is not None:
                start = o + call.prompt_ids.size
                per_row[r].extend((start + k, kept) for k, kept in enumerate(call.support))
    sizes = [sum(kept.size for _, kept in entries) for entries in per_row]
    if sizes and max(sizes) > capacity:
        worst = int(np.argmax(sizes))
        raise ValueError(
            f"support_capacity: row {worst} holds {sizes[worst]} support ids but "
            f"support_capacity={capacity}; this batch needs support_capacity >= {max(sizes)}"
        )
    for r, entries in enumerate(per_row):
        if not entries:
            continue
        entries.sort(key=lambda entry: entry[0])
        kept = np.concatenate([k for _, k in entries])
        columns = np.repeat([c for c, _ in entries], [k.size for _, k in entries])
        support_ids[r, : kept.size] = kept
        support_columns[r, : kept.size] = columns
    return {"support_ids": support_ids, "support_columns": support_columns}
