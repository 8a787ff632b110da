"""What the processes of a multi-process :class:`~dew_pipe.objectives.rl.EpisodeRollout`
agree on, and the byte messages they exchange to do it.

On several JAX processes each process opens and steps the environments of its own task rows
(its *slots*: process ``p`` of ``N`` holds global slots ``p * L`` to ``p * L + L - 1``, ``L``
its rows times ``groups``), while the model samples the slots of every process together:

1. Before anything opens, every process sends its settings, row count, clocks and key
   (:func:`agree`); any difference raises the same ``ValueError`` on every process.
2. Before each generation every process sends its standing (:func:`standing`): the context
   of each of its running slots, or the failure it hit since the last exchange (a reset, a
   tool call, an environment's ERROR or CANCELLED, a verifier). A failure anywhere ends the
   collection on every process, each releasing the environments it opened; otherwise every
   process calls ``policy.batch`` on the same global list of contexts (a finished slot
   holds the inert one-id prompt) with the same key and keeps its own block of the result.
   So a slot's draws are the ones a single process would make for that global row, and
   episodes with different turn counts never change the order of the collectives. The loop
   ends when no process has a running slot, after one last exchange that settles the last
   round's failures.
3. After the collection the episodes of every process are gathered (:func:`gather_episodes`)
   and every process projects the same global list and keeps its block of rows, so the
   Trainer assembles exactly the batch one process would have packed.

Messages travel as bytes through ``multihost_utils.process_allgather``: ids, likelihoods and
rewards arrive bit for bit. Only a process that is interrupted (``KeyboardInterrupt``,
``SystemExit``) leaves without the exchange; the others then wait in the next collective
until the distributed runtime's own timeout.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dew_pipe.objectives.rl.episodes import (
    Action,
    Episode,
    EpisodeCancelled,
    EpisodeFailure,
    EpisodeId,
    Observation,
    Origin,
    Transition,
    is_cancellation,
)

__all__ = ["Ranks", "agree", "describe_failure", "gather_episodes", "standing"]


class Ranks:
    """This process's place among the JAX processes, and the exchange of bytes between them."""

    def __init__(self) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()

    def exchange(self, payload: bytes) -> list[bytes]:
        """Every process's ``payload``, in process order (a collective: all must call it)."""
        data = np.frombuffer(payload, np.uint8)
        sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
        sizes = np.asarray(sizes, np.int64).reshape(-1)
        padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
        padded[: data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(padded), np.uint8)
        rows = rows.reshape(self.count, -1)
        return [rows[p, : int(sizes[p])].tobytes() for p in range(self.count)]


def agree(ranks: Ranks, settings: Mapping[str, Any]) -> None:
    """Checks that every process passes the same JSON ``settings``.

    Raises:
        ValueError: on every process, naming the first setting that differs and each
            process's value.
    """
    mine = json.dumps(_flat(settings), sort_keys=True)
    everyone = [json.loads(b) for b in ranks.exchange(mine.encode())]
    if all(json.dumps(s, sort_keys=True) == mine for s in everyone):
        return
    names = sorted(set().union(*everyone))
    name = next(n for n in names if len({json.dumps(s.get(n)) for s in everyone}) > 1)
    values = ", ".join(f"process {p}: {json.dumps(s.get(name))}" for p, s in enumerate(everyone))
    raise ValueError(
        f"EpisodeRollout on {ranks.count} processes: {name} differs ({values}); every process "
        "must pass the same settings, the same number of task rows and the same trainer "
        "state and key, and none opened an environment"
    )


def standing(
    ranks: Ranks, failure: tuple[str, bool] | None, contexts: Sequence[np.ndarray | None]
) -> tuple[list[tuple[int, str, bool]], list[np.ndarray | None]]:
    """Exchanges each process's failure (or the contexts of its running slots).

    Args:
        ranks: the processes.
        failure: ``(message, cancelled)`` of what this process hit since the last exchange,
            or None.
        contexts: one entry per local slot: its context while it runs, else None.

    Returns:
        ``(failures, contexts)``: the other processes' failures as ``(process, message,
        cancelled)``, and the global list of contexts in slot order (None for a finished
        slot, and for every slot when any process failed).
    """
    header: dict[str, Any] = {"failure": None, "lengths": []}
    ids: list[np.ndarray] = []
    if failure is not None:
        header["failure"] = {"message": failure[0], "cancelled": bool(failure[1])}
    else:
        for context in contexts:
            header["lengths"].append(-1 if context is None else int(context.size))
            if context is not None:
                ids.append(np.asarray(context, "<i4"))
    body = json.dumps(header).encode()
    payload = len(body).to_bytes(4, "little") + body + b"".join(a.tobytes() for a in ids)
    failures: list[tuple[int, str, bool]] = []
    everyone: list[np.ndarray | None] = []
    for p, data in enumerate(ranks.exchange(payload)):
        size = int.from_bytes(data[:4], "little")
        got = json.loads(data[4 : 4 + size])
        if got["failure"] is not None:
            if p != ranks.index:
                failures.append((p, got["failure"]["message"], got["failure"]["cancelled"]))
            continue
        flat = np.frombuffer(data[4 + size :], "<i4").astype(np.int32)
        start = 0
        for length in got["lengths"]:
            if length < 0:
                everyone.append(None)
            else:
                everyone.append(flat[start : start + length])
                start += length
    if failures or failure is not None:
        everyone = [None] * len(contexts) * ranks.count
    return failures, everyone


def describe_failure(error: BaseException, culprit: Episode | None) -> tuple[str, bool]:
    """``(message, cancelled)`` for `standing`: what failed, in which episode."""
    cancelled = is_cancellation(error) or isinstance(error, EpisodeCancelled)
    if isinstance(error, EpisodeFailure):
        return str(error), cancelled
    where = "the collection" if culprit is None else culprit.describe()
    return f"{where} failed: {error!r}", cancelled


def gather_episodes(ranks: Ranks, episodes: Sequence[Episode], origin: Origin) -> list[Episode]:
    """Every process's episodes in process order, rebuilt with ``origin`` (one projection)."""
    return [
        episode
        for data in ranks.exchange(episodes_to_bytes(episodes))
        for episode in episodes_from_bytes(data, origin)
    ]


def episodes_to_bytes(episodes: Sequence[Episode]) -> bytes:
    """Episodes as one ``.npz`` buffer: their records exactly, without their origin."""
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, episode in enumerate(episodes):
        turns = []
        _put(arrays, f"{i}f", episode.first.context)
        for j, (action, observation) in enumerate(
            (t.action, t.observation) for t in episode.transitions
        ):
            arrays[f"{i}.{j}c"] = action.context
            arrays[f"{i}.{j}t"] = action.tokens
            arrays[f"{i}.{j}l"] = action.log_probs
            arrays[f"{i}.{j}b"] = action.behavior_log_probs
            _put(arrays, f"{i}.{j}o", observation.context)
            turns.append([bool(action.stopped), int(action.policy_step), *_said(observation)])
        identity = episode.id
        meta.append(
            {
                "id": [identity.task, identity.step, identity.sample, identity.seed],
                "first": _said(episode.first),
                "turns": turns,
                "status": episode.status.value,
                "detail": episode.detail,
                "reward": episode.reward,
            }
        )
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buffer.getvalue()


def episodes_from_bytes(data: bytes, origin: Origin) -> list[Episode]:
    """The episodes `episodes_to_bytes` wrote, each action and episode bound to ``origin``."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        stored = {name: arrays[name] for name in arrays.files}
    out = []
    for i, record in enumerate(json.loads(stored.pop("meta").tobytes())):
        transitions = []
        for j, (stopped, step, status, detail) in enumerate(record["turns"]):
            action = Action(
                stored[f"{i}.{j}c"],
                stored[f"{i}.{j}t"],
                stored[f"{i}.{j}l"],
                stored[f"{i}.{j}b"],
                stopped,
                step,
                origin=origin,
            )
            observation = Observation(stored.get(f"{i}.{j}o"), status, detail)
            transitions.append(Transition(action, observation))
        status, detail = record["first"]
        out.append(
            Episode(
                EpisodeId(*record["id"]),
                Observation(stored.get(f"{i}f"), status, detail),
                transitions,
                record["status"],
                record["detail"],
                record["reward"],
                origin=origin,
            )
        )
    return out


def _flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as one level of dotted names (so a difference names its leaf)."""
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def _put(arrays: dict[str, np.ndarray], name: str, context: np.ndarray | None) -> None:
    if context is not None:
        arrays[name] = context


def _said(observation: Observation) -> list[str]:
    return [observation.status.value, observation.detail]
