"""Reading verl ``AgentLoopOutput`` rows into sessions: the checks and the two conversions.

:func:`dew_pipe.objectives.rl.verl.from_verl` is the public entry point and its module
docstring states the rules; this module holds the work. :class:`VerlRow` reads one row and
checks its fields; :func:`native_session` turns a native verl row into a session and
:func:`tagged_sessions` regroups rows Dew wrote (with their ``extra_fields["dew"]`` record)
into the sessions they came from. Both return ``(session, extras, fields)`` triples, one
entry of ``extras`` and ``fields`` per row of the session, in chain order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.objectives.rl.packing import session_chains
from dew_pipe.objectives.rl.session_records import Call, Session, Status

__all__ = [
    "DEW",
    "FORMAT",
    "MEDIA_FIELDS",
    "TOKEN_FIELDS",
    "VerlRow",
    "check_eos",
    "has_media",
    "native_session",
    "tagged_sessions",
]

MEDIA_FIELDS = ("multi_modal_data", "mm_processor_kwargs", "mm_processor_output")
"""Row fields that carry images, video or audio; a row with any of them set is media."""
TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs")
"""The row fields every import needs."""
DEW = "dew"
"""The ``extra_fields`` key of Dew's own record."""
FORMAT = 1
"""The layout of that record."""
# Fields a session determines; a row's other fields are kept as they are (routing too, when
# the row has none).
_DERIVED = (*TOKEN_FIELDS, "reward_score", "extra_fields")
_UNSCORED = (Status.TRUNCATED, Status.INFRA_ERROR, Status.CANCELLED)  # may lack a reward

Triple = tuple[Session, tuple[Mapping[str, Any], ...], tuple[Mapping[str, Any], ...]]


def check_eos(eos: Any) -> tuple[int, ...] | None:
    """``eos`` as a tuple of ids (one id or a nonempty sequence), or None."""
    if eos is None:
        return None
    values = [eos] if isinstance(eos, int | np.integer) else eos
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"eos is {eos!r}; expected an id or a nonempty sequence of ids")
    return tuple(check_int(f"eos[{i}]", v, minimum=0) for i, v in enumerate(values))


def has_media(fields: Mapping[str, Any]) -> bool:
    """Whether any media field of ``fields`` holds something (empty and None do not count)."""
    for name in MEDIA_FIELDS:
        value = fields.get(name)
        if value is None or (isinstance(value, Mapping | list | tuple) and not value):
            continue
        if isinstance(value, Mapping) and all(v is None for v in value.values()):
            continue
        return True
    return False


class VerlRow:
    """One verl row, read and checked: ids, mask, likelihoods, routing, reward, the rest."""

    def __init__(self, row: Any, where: str, media: bool) -> None:
        if hasattr(row, "model_dump") and not isinstance(row, Mapping):
            row = row.model_dump()
        if not isinstance(row, Mapping):
            raise TypeError(f"{where}: expected a mapping of AgentLoopOutput fields")
        self.where = where
        for name in TOKEN_FIELDS:
            if row.get(name) is None:
                what = "behavior log-probabilities" if name == "response_logprobs" else "a list"
                raise ValueError(f"{where}.{name}: is missing; expected {what}")
        self.prompt = self._ints("prompt_ids", row["prompt_ids"])
        if self.prompt.size == 0:
            raise ValueError(f"{where}.prompt_ids: is empty; expected the prompt's ids")
        self.response = self._ints("response_ids", row["response_ids"])
        self.mask = self._ints("response_mask", row["response_mask"])
        self.logprobs = np.asarray(row["response_logprobs"])
        n = self.response.size
        for name, value in (("response_mask", self.mask), ("response_logprobs", self.logprobs)):
            if value.shape != (n,):
                raise ValueError(
                    f"{where}.{name}: expected one entry per response id ({n}), got shape "
                    f"{value.shape}"
                )
        if not np.isin(self.mask, (0, 1)).all():
            raise ValueError(f"{where}.response_mask: expected 0 and 1 only")
        if self.logprobs.dtype == np.bool_ or not np.issubdtype(self.logprobs.dtype, np.number):
            raise TypeError(f"{where}.response_logprobs: expected real numbers")
        off = np.flatnonzero((self.mask == 0) & (self.logprobs != 0))
        if off.size:
            raise ValueError(
                f"{where}.response_logprobs[{off[0]}]: is {self.logprobs[off[0]]} on an id with "
                "response_mask 0; expected 0.0 (only sampled ids carry a likelihood)"
            )
        routing = row.get("routed_experts")
        self.routing = None if routing is None else np.asarray(routing)
        self.reward = row.get("reward_score")
        extras = row.get("extra_fields") or {}
        if not isinstance(extras, Mapping):
            raise TypeError(f"{where}.extra_fields: expected a mapping")
        self.dew = extras.get(DEW)
        self.extras = {k: v for k, v in extras.items() if k != DEW}
        self.fields = {k: v for k, v in row.items() if k not in _DERIVED}
        if self.routing is not None:
            del self.fields["routed_experts"]
        if not media and has_media(self.fields):
            names = [name for name in MEDIA_FIELDS if has_media({name: row.get(name)})]
            raise ValueError(
                f"{where}.{names[0]}: the row carries media, which Dew's text trainer would "
                "score as placeholder ids without the images or video; from_verl(..., "
                "media=True) imports it for a round trip only"
            )

    def _ints(self, name: str, value: Any) -> np.ndarray:
        array = np.asarray(value)
        if array.size == 0 and array.ndim == 1:
            return array.astype(np.int64)
        if array.ndim != 1 or array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{self.where}.{name}: expected a list of integers")
        return array

    @property
    def ids(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.response])

    def call(self, where: str, start: int, stop: int, **kw: Any) -> Call:
        """The call whose prompt is ids[:start] and whose draw is ids[start:stop]."""
        ids = self.ids
        offset = self.prompt.size
        behavior = self.logprobs[start - offset : stop - offset] if stop > start else []
        routing = kw.pop("routing", None)
        try:
            return Call(ids[:start], ids[start:stop], behavior, routed_experts=routing, **kw)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{self.where}: {where}: {error}") from error

    def routed(self, length: int, n: int | None = None) -> np.ndarray | None:
        """The row's routing cut to what one call covers (``n`` rows, at most ``length``)."""
        if self.routing is None:
            return None
        return self.routing[: min(self.routing.shape[0] if n is None else n, length)]


def native_session(
    row: VerlRow, identity: tuple[int, int, int], eos: tuple[int, ...] | None
) -> Triple:
    """A native verl row as one COMPLETED session of ``identity`` (task, group, sample).

    Each run of mask-1 ids is one call; ids before the first run (after the prompt) and after
    the last one become calls that drew nothing, so the row's prompt and every id keep their
    place. Every call has the row's ``min_global_steps`` as its version and the prefix of the
    row's routing that it covers.
    """
    version = row.extras.get("min_global_steps")
    if version is None:
        raise ValueError(
            f"{row.where}.extra_fields.min_global_steps: is missing; expected the policy "
            "version the row was sampled under"
        )
    version = check_int(f"{row.where}.extra_fields.min_global_steps", version, minimum=0)
    _check_reward(row, Status.COMPLETED)
    offset = row.prompt.size
    padded = np.concatenate([[0], row.mask, [0]])
    edges = np.flatnonzero(np.diff(padded))
    runs = [(offset + a, offset + b) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    total = offset + row.response.size
    spans = []
    if not runs or runs[0][0] > offset:  # the prompt ends where the first draw starts
        spans.append((offset, offset))
    spans.extend(runs)
    if not runs or runs[-1][1] < total:  # ids after the last draw: a call that drew nothing
        spans.append((total, total))
    calls = []
    for j, (start, stop) in enumerate(spans):
        ends_on_eos = eos is not None and stop > start and int(row.ids[stop - 1]) in eos
        calls.append(
            row.call(
                f"call {j}",
                start,
                stop,
                finish_reason="stop" if ends_on_eos else "unknown",
                version=version,
                routing=row.routed(stop),
            )
        )
    session = _session(row, (*identity, 0), calls, Status.COMPLETED, eos)
    return session, (row.extras,), (row.fields,)


def _check_reward(row: VerlRow, status: Status) -> None:
    """A finite reward, or None where ``status`` says the session was never scored."""
    if row.reward is None and status not in _UNSCORED:
        raise ValueError(
            f"{row.where}.reward_score: is None; expected the verifier's reward (a row that "
            "was never scored cannot train)"
        )
    if row.reward is not None and (
        isinstance(row.reward, bool)
        or not isinstance(row.reward, int | float | np.integer | np.floating)
        or not math.isfinite(row.reward)
    ):
        raise ValueError(f"{row.where}.reward_score: is {row.reward!r}; expected a finite number")


def _session(
    row: VerlRow,
    identity: tuple[int, int, int, int],
    calls: list[Call],
    status: Status,
    eos: tuple[int, ...] | None,
    components: Mapping[str, Any] | None = None,
    detail: str = "",
) -> Session:
    """The session, every call checked against ``eos`` when given; errors name ``row``."""
    if eos is not None:
        for j, call in enumerate(calls):
            try:
                call.check_eos(eos)
            except ValueError as error:
                raise ValueError(f"{row.where}: call {j}: {error}") from error
    try:
        return Session(*identity, calls, status, row.reward, components or {}, detail)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{row.where}: {error}") from error


def tagged_sessions(rows: Sequence[VerlRow], eos: tuple[int, ...] | None) -> list[Triple]:
    """Rows Dew wrote, regrouped into their sessions (in the order of their first rows)."""
    groups: dict[tuple[int, int, int, int], list[tuple[VerlRow, dict[str, Any]]]] = {}
    for row in rows:
        record = _record(row)
        key = tuple(record[k] for k in ("task", "group", "sample", "attempt"))
        groups.setdefault(key, []).append((row, record))
    return [_tagged(key, members, eos) for key, members in groups.items()]


def _tagged(key, members, eos) -> Triple:
    first, record = members[0]
    chains = record["chains"]
    order = sorted(members, key=lambda m: m[1]["chain"])
    found = [m[1]["chain"] for m in order]
    if found != list(range(chains)) or any(m[1]["chains"] != chains for m in members):
        raise ValueError(
            f"{first.where}.extra_fields.dew: the session (task {key[0]}, group {key[1]}, "
            f"sample {key[2]}, attempt {key[3]}) has {chains} chains, but its rows hold chains "
            f"{found}; expected each chain once"
        )
    for row, rec in members:
        for name in ("status", "components", "detail"):
            if rec[name] != record[name]:
                raise ValueError(
                    f"{row.where}.extra_fields.dew.{name}: is {rec[name]!r}, but "
                    f"{first.where} of the same session says {record[name]!r}"
                )
        if row.reward != first.reward:
            raise ValueError(
                f"{row.where}.reward_score: is {row.reward!r}, but {first.where} of the same "
                f"session says {first.reward!r}"
            )
    status = Status.parse(record["status"])
    _check_reward(first, status)
    calls: dict[int, Call] = {}
    for row, rec in order:
        for j, call in _chain_calls(row, rec):
            if j in calls:
                raise ValueError(f"{row.where}.extra_fields.dew: call {j} appears twice")
            calls[j] = call
    if sorted(calls) != list(range(len(calls))):
        raise ValueError(
            f"{first.where}.extra_fields.dew: the session's calls are {sorted(calls)}; "
            f"expected 0..{len(calls) - 1}"
        )
    ordered = [calls[j] for j in range(len(calls))]
    session = _session(first, key, ordered, status, eos, record["components"], record["detail"])
    expected = [[c["index"] for c in rec["calls"]] for _, rec in order]
    if session_chains(session.calls) != expected:
        raise ValueError(
            f"{first.where}.extra_fields.dew: the calls form chains "
            f"{session_chains(session.calls)}, but the rows say {expected}"
        )
    return session, tuple(r.extras for r, _ in order), tuple(r.fields for r, _ in order)


def _chain_calls(row: VerlRow, record: Mapping[str, Any]) -> list[tuple[int, Call]]:
    """The calls of one row Dew wrote, each at the place its record gives."""
    offset, total = row.prompt.size, row.prompt.size + row.response.size
    where = f"{row.where}.extra_fields.dew.calls"
    entries = record["calls"]
    if entries[0]["prompt"] != offset:
        raise ValueError(
            f"{where}[0].prompt: is {entries[0]['prompt']}, but the row's prompt holds {offset} "
            "ids; expected the chain's first call to read exactly the prompt"
        )
    mask = np.zeros(row.response.size, np.int64)
    if row.routing is not None and record["routing_dtype"] is not None:
        row.routing = _cast_routing(row, record["routing_dtype"])
    out = []
    for k, entry in enumerate(entries):
        start, stop = entry["prompt"], entry["prompt"] + entry["sampled"]
        if not offset <= start <= stop <= total:
            raise ValueError(
                f"{where}[{k}]: draws ids {start}..{stop}, outside the row's {offset}..{total}"
            )
        mask[start - offset : stop - offset] = 1
        support = entry["support"]
        call = row.call(
            f"call {entry['index']}",
            start,
            stop,
            finish_reason=entry["finish_reason"],
            version=entry["version"],
            log_probs=entry["log_probs"],
            support=None if support is None else [np.asarray(s) for s in support],
            routing=row.routed(stop, entry["routed"]),
        )
        out.append((entry["index"], call))
    if stop != total:
        raise ValueError(
            f"{where}: the chain ends at id {stop}, but the row holds {total}; expected the "
            "last call to draw the row's last ids"
        )
    if not np.array_equal(mask, row.mask):
        bad = int(np.flatnonzero(mask != row.mask)[0])
        raise ValueError(
            f"{row.where}.response_mask[{bad}]: is {row.mask[bad]}, but Dew's record puts "
            f"{'a' if mask[bad] else 'no'} sampled id there"
        )
    return out


def _cast_routing(row: VerlRow, name: str) -> np.ndarray:
    where = f"{row.where}.extra_fields.dew.routing_dtype"
    try:
        dtype = np.dtype(name)
    except TypeError as error:
        raise ValueError(f"{where}: is {name!r}; expected a NumPy integer dtype") from error
    if not np.issubdtype(dtype, np.integer) or not np.issubdtype(row.routing.dtype, np.integer):
        raise ValueError(f"{where}: is {name!r}; expected integer routing and an integer dtype")
    info = np.iinfo(dtype)
    if row.routing.size and (row.routing.min() < info.min or row.routing.max() > info.max):
        raise ValueError(f"{where}: the row's expert ids do not fit {name}")
    return row.routing.astype(dtype)


_RECORD = {
    "format": int,
    "task": int,
    "group": int,
    "sample": int,
    "attempt": int,
    "status": str,
    "components": Mapping,
    "detail": str,
    "chain": int,
    "chains": int,
    "calls": list,
}
_CALL = {"index": int, "prompt": int, "sampled": int, "finish_reason": str, "version": int}
_OPTIONAL = {"log_probs": list, "support": list, "routed": int}
_RECORD_OPTIONAL = {"routing_dtype": str}


def _record(row: VerlRow) -> dict[str, Any]:
    """Dew's record of a row, every field of the layout checked for its type."""
    where = f"{row.where}.extra_fields.dew"
    record = _fields(row.dew, _RECORD, _RECORD_OPTIONAL, where)
    if record["format"] != FORMAT:
        raise ValueError(f"{where}.format: is {record['format']}; expected {FORMAT}")
    if not record["calls"]:
        raise ValueError(f"{where}.calls: is empty; expected the chain's calls")
    record["calls"] = [
        _fields(c, _CALL, _OPTIONAL, f"{where}.calls[{k}]") for k, c in enumerate(record["calls"])
    ]
    if not 0 <= record["chain"] < record["chains"]:
        raise ValueError(f"{where}.chain: is {record['chain']}; expected 0..{record['chains'] - 1}")
    return record


def _fields(value: Any, required: dict, optional: dict, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: expected a mapping, got {type(value).__name__}")
    out = {}
    for name, kind in (*required.items(), *optional.items()):
        item = value.get(name)
        if item is None and name in optional:
            out[name] = None
            continue
        if name not in value:
            raise ValueError(f"{where}.{name}: is missing")
        ok = isinstance(item, kind) and not (kind is int and isinstance(item, bool))
        if not ok:
            raise TypeError(f"{where}.{name}: is {item!r}; expected {kind.__name__}")
        out[name] = item
    return out
