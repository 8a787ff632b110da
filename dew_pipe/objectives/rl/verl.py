"""verl's agent-loop rows and Dew's sessions, both ways: :func:`to_verl`, :func:`from_verl`.

A verl ``AgentLoopOutput`` holds one token sequence per trajectory: ``prompt_ids``, then
``response_ids`` with ``response_mask`` 1 on the ids the model sampled and 0 on everything in
between (tool responses, chat headers), ``response_logprobs`` aligned with the response,
``routed_experts`` by absolute position, ``reward_score``, and ``extra_fields`` (where verl's
rollout client puts ``min_global_steps`` and ``max_global_steps``, the policy versions the
trajectory was sampled across). A *row* here is that object as a mapping of plain values,
``AgentLoopOutput.model_dump()`` with lists for arrays, so it goes through JSON unchanged.

**Export.** :func:`to_verl` writes one row per strict chain of each session (the chains
:func:`~dew_pipe.objectives.rl.packing.pack` would place): the prompt of the chain's first
call, then every later id of the chain, mask 1 and the behavior log-probability on sampled
ids, 0 and 0.0 elsewhere; ``routed_experts`` when every call of the chain recorded routing
(later calls replace earlier ones where both cover an id, as in ``pack``); the minimum and
maximum call version as ``min_global_steps`` / ``max_global_steps``. ``extra_fields["dew"]``
records what verl has no field for, so an import restores the session exactly: its identity,
status, reward components and detail, and per call its place in the chain, finish reason,
version, raw log-probabilities, sampling support and the length of its routing record
(and the routing dtype). A
session without calls has no chain and writes no row.

**Import.** :func:`from_verl` reads rows back as :class:`VerlTrajectory` objects, each a
:class:`~dew_pipe.objectives.rl.sessions.Session` plus whatever verl fields Dew does not model,
kept so :func:`to_verl` writes the rows out again unchanged. A row Dew wrote comes back as the
session it came from. A native verl row becomes one COMPLETED session: each run of mask-1 ids
is one call whose prompt is every id before it, with the row's ``min_global_steps`` as its
version (a native row's own global steps are kept as they are); ids after the last run become
a last call that sampled nothing, so no id is dropped. verl repeats each prompt ``rollout.n``
times in a row, so ``samples=n`` makes rows ``k*n .. k*n + n - 1`` the samples of task ``k``.
Native calls have no finish reason; they read ``"unknown"``, or ``"stop"`` when ``eos`` is
given and the call ends on it.

Refused on import, each with an error naming the row and field: rows without behavior
log-probabilities, without a version (``min_global_steps``) or without a reward (a session
Dew recorded as never scored may lack one), log-probabilities on mask-0 ids, and rows with
media (``multi_modal_data``, ``mm_processor_kwargs``, ``mm_processor_output``): Dew's text
trainer would score their placeholder ids without the images or video, so ``media=True``
imports them only to carry them through and out again. Every call goes through the checks of
a live :class:`~dew_pipe.objectives.rl.sessions.Call` (a nonempty context, nonnegative integer
ids, aligned finite likelihoods) and, given ``eos``, :meth:`Call.check_eos` (no id after EOS; a
draw ending on EOS says ``"stop"``). Likelihoods are float32, as everywhere in Dew.

This module never imports verl or torch: rows are plain mappings (an object with
``model_dump``, such as an ``AgentLoopOutput``, is dumped first).

Example:
    >>> from dew_pipe.objectives.rl.sessions import Call, Session
    >>> first = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", version=2)
    >>> second = Call([1, 2, 3, 4, 9], [5], [-0.125], "stop", version=3)
    >>> session = Session(7, 0, 1, 0, [first, second], "COMPLETED", reward=1.0)
    >>> (row,) = to_verl([session])
    >>> row["prompt_ids"], row["response_ids"], row["response_mask"]
    ([1, 2], [3, 4, 9, 5], [1, 1, 0, 1])
    >>> row["response_logprobs"], row["extra_fields"]["max_global_steps"]
    ([-0.5, -0.25, 0.0, -0.125], 3)
    >>> from_verl([row])[0].session == session
    True
    >>> native = {"prompt_ids": [1, 2], "response_ids": [3, 9, 5], "response_mask": [1, 0, 1],
    ...           "response_logprobs": [-0.5, 0.0, -0.125], "reward_score": 1.0,
    ...           "extra_fields": {"min_global_steps": 4, "max_global_steps": 5}}
    >>> [call.prompt_ids.tolist() for call in from_verl([native], samples=1)[0].session.calls]
    [[1, 2], [1, 2, 3, 9]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.packing import session_chains
from dew_pipe.objectives.rl.session_records import Call, Session
from dew_pipe.objectives.rl.verl_rows import (
    DEW,
    FORMAT,
    MEDIA_FIELDS,
    TOKEN_FIELDS,
    VerlRow,
    check_eos,
    has_media,
    native_session,
    tagged_sessions,
)

__all__ = ["MEDIA_FIELDS", "VerlTrajectory", "from_verl", "to_verl"]

# AgentLoopOutput's fields in its own order; rows are written in this order.
_ROW_ORDER = (
    *TOKEN_FIELDS,
    "routed_experts",
    "multi_modal_data",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
    "mm_processor_kwargs",
    "mm_processor_output",
)
# AgentLoopMetrics' defaults: what verl writes before any timer ran.
_METRICS = {"generate_sequences": 0.0, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": -1}


@dataclasses.dataclass(frozen=True, eq=False)
class VerlTrajectory:
    """One session imported from verl rows, with what verl recorded beside its tokens.

    Args:
        session: the session the rows describe.
        extras: one mapping per row (per chain of ``session``, in chain order): the row's
            ``extra_fields`` without Dew's ``"dew"`` record, written out unchanged.
        fields: one mapping per row: its other fields Dew does not model (``num_turns``,
            ``metrics``, the media fields, anything else), written out unchanged.
        tagged: whether the rows carried Dew's record; :func:`to_verl` writes it again only
            then, so native rows go back out exactly as they came in.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: ``extras`` or ``fields`` not one per chain of the session.

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call, Session
        >>> s = Session(0, 0, 0, 0, [Call([1], [2], [-0.5], "stop", 0)], "COMPLETED", 1.0)
        >>> t = VerlTrajectory(s, ({"turn_scores": []},), ({"num_turns": 2},))
        >>> to_verl([t])[0]["extra_fields"]
        {'turn_scores': [], 'min_global_steps': 0, 'max_global_steps': 0}
    """

    session: Session
    extras: tuple[Mapping[str, Any], ...]
    fields: tuple[Mapping[str, Any], ...]
    tagged: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.session, Session):
            raise TypeError(
                f"VerlTrajectory.session: expected a Session, got {type(self.session).__name__}"
            )
        chains = len(session_chains(self.session.calls))
        for name in ("extras", "fields"):
            value = getattr(self, name)
            if isinstance(value, Mapping) or not isinstance(value, Sequence):
                raise TypeError(f"VerlTrajectory.{name}: expected a sequence of mappings")
            value = tuple(value)
            if len(value) != chains or not all(isinstance(v, Mapping) for v in value):
                raise ValueError(
                    f"VerlTrajectory.{name}: expected one mapping per chain of the session "
                    f"({chains}), got {len(value)} entries"
                )
            object.__setattr__(self, name, value)
        if not isinstance(self.tagged, bool):
            raise TypeError(f"VerlTrajectory.tagged: expected a bool, got {self.tagged!r}")

    @property
    def media(self) -> bool:
        """Whether any row carried media (imported with ``media=True``; never train on it)."""
        return any(has_media(f) for f in self.fields)


def to_verl(sessions: Sequence[Session | VerlTrajectory]) -> list[dict[str, Any]]:
    """verl ``AgentLoopOutput`` rows of sessions: one per strict chain of each session.

    Args:
        sessions: :class:`Session` or :class:`VerlTrajectory` objects (the latter write
            their extras and fields back unchanged).

    Returns:
        The rows, session by session and chain by chain; plain values (lists, ints,
        floats), so ``json.dumps`` writes each as one line and ``AgentLoopOutput(**row)``
        accepts it.

    Raises:
        TypeError: an element that is neither.
        ValueError: routing records of different shapes within a chain.

    Example:
        >>> from dew_pipe.objectives.rl.sessions import Call, Session
        >>> s = Session(0, 0, 0, 0, [Call([1], [2], [-0.5], "stop", 4)], "COMPLETED", 1.0)
        >>> row = to_verl([s])[0]
        >>> row["response_ids"], row["reward_score"], row["num_turns"]
        ([2], 1.0, 2)
    """
    if isinstance(sessions, Session | VerlTrajectory) or not isinstance(sessions, Sequence):
        raise TypeError(
            f"sessions: expected a sequence of Session or VerlTrajectory, got "
            f"{type(sessions).__name__}"
        )
    rows: list[dict[str, Any]] = []
    for i, item in enumerate(sessions):
        if isinstance(item, VerlTrajectory):
            session, extras, fields, tagged = item.session, item.extras, item.fields, item.tagged
        elif isinstance(item, Session):
            session, extras, fields, tagged = item, None, None, True
        else:
            raise TypeError(
                f"sessions[{i}]: expected a Session or VerlTrajectory, got {type(item).__name__}"
            )
        chains = session_chains(session.calls)
        for c, chain in enumerate(chains):
            extra = dict(extras[c]) if extras is not None else {}
            versions = [session.calls[j].version for j in chain]
            extra.setdefault("min_global_steps", min(versions))
            extra.setdefault("max_global_steps", max(versions))
            if tagged:
                extra[DEW] = _record(session, chain, c, len(chains))
            base = dict(fields[c]) if fields is not None else _fresh_fields(chain)
            row = {**base, **_chain_row(session, chain, f"sessions[{i}]"), "extra_fields": extra}
            rows.append(_ordered(row))
    return rows


def _chain_row(session: Session, chain: list[int], where: str) -> dict[str, Any]:
    """The token fields, routing and reward of one chain."""
    calls = [session.calls[j] for j in chain]
    last = calls[-1]
    ids = np.concatenate([last.prompt_ids, last.sampled_ids])
    start = calls[0].prompt_ids.size
    mask = np.zeros(ids.size - start, np.int64)
    logprobs = np.zeros(ids.size - start, np.float32)
    for call in calls:
        begin = call.prompt_ids.size - start
        mask[begin : begin + call.sampled_ids.size] = 1
        logprobs[begin : begin + call.sampled_ids.size] = call.behavior_log_probs
    row = {
        "prompt_ids": ids[:start].tolist(),
        "response_ids": ids[start:].tolist(),
        "response_mask": mask.tolist(),
        "response_logprobs": logprobs.tolist(),
        "reward_score": session.reward,
    }
    if all(call.routed_experts is not None for call in calls):
        row["routed_experts"] = _merged_routing(calls, chain, where).tolist()
    return row


def _fresh_fields(chain: list[int]) -> dict[str, Any]:
    """The fields verl's defaults give a row Dew writes from a session of its own."""
    return {
        "routed_experts": None,
        "multi_modal_data": None,
        "num_turns": 2 * len(chain),  # verl counts the user turn, each call and each reply
        "metrics": dict(_METRICS),
        "mm_processor_kwargs": None,
        "mm_processor_output": None,
    }


def _merged_routing(calls: list[Call], chain: list[int], where: str) -> np.ndarray:
    shapes = {(c.routed_experts.shape[1:], c.routed_experts.dtype) for c in calls}
    if len(shapes) > 1:
        raise ValueError(
            f"{where}.calls[{chain[0]}..{chain[-1]}].routed_experts: expected one "
            f"[n, layers, top_k] shape and dtype within a chain, got {sorted(map(str, shapes))}"
        )
    first = calls[0].routed_experts
    length = max(c.routed_experts.shape[0] for c in calls)
    merged = np.zeros((length, *first.shape[1:]), first.dtype)
    for call in calls:  # later calls replace earlier ones where both cover an id, as in pack
        merged[: call.routed_experts.shape[0]] = call.routed_experts
    return merged


def _record(session: Session, chain: list[int], index: int, chains: int) -> dict[str, Any]:
    """Dew's ``extra_fields["dew"]``: what the row has no field for."""
    calls = []
    for j in chain:
        call = session.calls[j]
        calls.append(
            {
                "index": j,
                "prompt": int(call.prompt_ids.size),
                "sampled": int(call.sampled_ids.size),
                "finish_reason": call.finish_reason,
                "version": call.version,
                "log_probs": None if call.log_probs is None else call.log_probs.tolist(),
                "support": None if call.support is None else [s.tolist() for s in call.support],
                "routed": None if call.routed_experts is None else call.routed_experts.shape[0],
            }
        )
    return {
        "format": FORMAT,
        "task": session.task,
        "group": session.group,
        "sample": session.sample,
        "attempt": session.attempt,
        "status": session.status.name,
        "components": dict(session.components),
        "detail": session.detail,
        "chain": index,
        "chains": chains,
        "calls": calls,
        # JSON has no integer widths: the engine's routing dtype, restored on import
        "routing_dtype": _routing_dtype(session, chain),
    }


def _routing_dtype(session: Session, chain: list[int]) -> str | None:
    routing = [session.calls[j].routed_experts for j in chain]
    return None if any(r is None for r in routing) else str(routing[0].dtype)


def _ordered(row: Mapping[str, Any]) -> dict[str, Any]:
    """AgentLoopOutput's field order, then any field it does not know."""
    out = {name: row[name] for name in _ROW_ORDER if name in row}
    out.update((k, v) for k, v in row.items() if k not in out)
    return out


def from_verl(
    rows: Sequence[Mapping[str, Any]],
    samples: int | None = None,
    media: bool = False,
    *,
    eos: int | Sequence[int] | None = None,
    group: int = 0,
) -> list[VerlTrajectory]:
    """Sessions from verl ``AgentLoopOutput`` rows (see the module docstring for the rules).

    Args:
        rows: mappings in ``AgentLoopOutput.model_dump()`` layout (lists or arrays), or
            objects with ``model_dump``. Either every row carries Dew's ``extra_fields["dew"]``
            record or none does.
        samples: verl's ``rollout.n``: native rows ``k*n .. k*n + n - 1`` are the samples of
            task ``k``. Required for native rows; rows Dew wrote carry their identity.
        media: import rows that carry media (for a round trip; never train on them).
        eos: the model's EOS id(s); when given, every call is checked against it and a
            native call that ends on it reads finish reason ``"stop"``.
        group: the group id native rows get (rows Dew wrote keep theirs).

    Returns:
        One :class:`VerlTrajectory` per session, in the order of their first rows.

    Raises:
        TypeError: a row or field of the wrong type.
        ValueError: a rule of the module docstring broken; names the row and the field.

    Example:
        >>> row = {"prompt_ids": [1, 2], "response_ids": [3], "response_mask": [1],
        ...        "response_logprobs": [-0.5], "reward_score": 0.0,
        ...        "extra_fields": {"min_global_steps": 4}}
        >>> [t.session.sample for t in from_verl([row, row], samples=2)]
        [0, 1]
        >>> from_verl([{**row, "reward_score": None}], samples=1)
        Traceback (most recent call last):
        ...
        ValueError: rows[0].reward_score: is None; expected the verifier's reward (a row that was never scored cannot train)
    """
    if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
        raise TypeError(f"rows: expected a sequence of verl rows, got {type(rows).__name__}")
    samples = check_int("samples", samples, minimum=1, allow_none=True)
    group = check_int("group", group)
    if not isinstance(media, bool):
        raise TypeError(f"media is {media!r}; expected a bool")
    eos_ids = check_eos(eos)
    parsed = [VerlRow(row, f"rows[{i}]", media) for i, row in enumerate(rows)]
    tagged = [row.dew is not None for row in parsed]
    if any(tagged) and not all(tagged):
        odd = parsed[tagged.index(not tagged[0])]
        raise ValueError(
            f"{odd.where}.extra_fields: {'has' if not tagged[0] else 'lacks'} Dew's 'dew' record "
            f"unlike {parsed[0].where}; expected rows Dew wrote or native verl rows, not both"
        )
    if parsed and all(tagged):
        return [VerlTrajectory(*triple, tagged=True) for triple in tagged_sessions(parsed, eos_ids)]
    if parsed and samples is None:
        raise ValueError(
            "samples is None, but the rows are native verl rows; pass samples=verl's rollout.n "
            "so the rows of one prompt form one group"
        )
    if samples is not None and len(parsed) % samples:
        raise ValueError(
            f"rows: {len(parsed)} native rows do not divide into groups of samples={samples}"
        )
    return [
        VerlTrajectory(*native_session(row, (k // samples, group, k % samples), eos_ids))
        for k, row in enumerate(parsed)
    ]
