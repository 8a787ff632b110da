"""The Arrow batches rollout reads and writes: tasks in, sessions out.

Two of the three kinds of batch that cross stage boundaries, go to Parquet files and to Beam
are defined here (the third, packed rows, is in :mod:`dew_pipe.batches`, which re-exports
every public name of this module but the column helpers):

* **tasks** (:data:`TASKS_SCHEMA`): one row per task a rollout should work on.
* **sessions** (:func:`sessions_schema`): one row per harness session, with its model calls
  as a nested list.

This module fixes the wire format and converts plain rows (dicts of ids, likelihoods and
text) to and from it, checking every field and naming the row that is wrong. The Python
records (``Session``, ``Call``, ``Task``) live one floor up, in
``dew_pipe.objectives.rl.sessions``; ``dew_pipe.objectives.rl.session_arrow`` maps them onto
these rows (``to_arrow``, ``from_arrow``, ``task_row``).

It also holds the column helpers every Arrow batch of dew_pipe is built with:
:func:`list_array` and :func:`lists_to_numpy` (variable-length list columns from and to
per-row NumPy arrays, in one concatenation / as views), :func:`fixed_list_type`,
:func:`numpy_dtype`, :func:`routing_spec`, :func:`shape_text`,
:func:`assemble_sessions` (already-checked session rows as a batch) and
:func:`check_sessions_batch` (a batch's schema, before a columnar read).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "SESSION_STATUSES",
    "TASKS_SCHEMA",
    "assemble_sessions",
    "check_sessions_batch",
    "fixed_list_type",
    "list_array",
    "lists_to_numpy",
    "numpy_dtype",
    "routing_spec",
    "sessions_from_arrow",
    "sessions_schema",
    "sessions_to_arrow",
    "shape_text",
    "tasks_from_arrow",
    "tasks_to_arrow",
]

# ----------------------------------------------------------------------------- columns


def numpy_dtype(t: pa.DataType) -> np.dtype:
    """The numpy dtype of a primitive Arrow type (without pyarrow's pandas shim)."""
    if pa.types.is_boolean(t):
        return np.dtype(np.bool_)
    if pa.types.is_signed_integer(t):
        return np.dtype(f"int{t.bit_width}")
    if pa.types.is_unsigned_integer(t):
        return np.dtype(f"uint{t.bit_width}")
    if pa.types.is_floating(t):
        return np.dtype(f"float{t.bit_width}")
    raise TypeError(f"no numpy dtype for Arrow type {t}")


def fixed_list_type(value_type: pa.DataType, dims: Sequence[int]) -> pa.DataType:
    """Nested FixedSizeList type for an array of trailing shape ``dims``."""
    for size in reversed(dims):
        value_type = pa.list_(value_type, size)
    return value_type


def routing_spec(routed_experts: tuple[int, int, Any]) -> tuple[int, int, np.dtype]:
    """``(layers, top_k, dtype)`` of a routing record, checked: the ``routed_experts=`` option.

    Raises:
      ValueError: not a triple, non-positive layers or top_k, or a non-integer dtype.

    Example:
      >>> routing_spec((2, 4, "uint8"))
      (2, 4, dtype('uint8'))
    """
    try:
        layers, top_k, dtype = routed_experts
        dtype = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"routed_experts={routed_experts!r}: expected (layers, top_k, integer dtype)"
        ) from e
    if not np.issubdtype(dtype, np.integer) or layers < 1 or top_k < 1:
        raise ValueError(
            f"routed_experts={routed_experts!r}: expected positive layers and top_k and an "
            "integer dtype"
        )
    return int(layers), int(top_k), dtype


def shape_text(a: np.ndarray) -> str:
    """An array's shape as error messages write it: ``[2, 3]``."""
    return "[" + ", ".join(str(d) for d in a.shape) + "]"


def list_array(seqs: Sequence[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """ListArray from per-row arrays (None = null row) in one concatenation.

    Example:
      >>> list_array([np.array([1, 2]), None, np.array([], np.int32)], pa.int32()).to_pylist()
      [[1, 2], None, []]
    """
    lengths = np.array([0 if s is None else len(s) for s in seqs], dtype=np.int32)
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    parts = [s for s in seqs if s is not None and len(s)]
    values = np.concatenate(parts) if parts else np.zeros(0, numpy_dtype(value_type))
    mask = np.array([s is None for s in seqs]) if any(s is None for s in seqs) else None
    return pa.ListArray.from_arrays(
        pa.array(offsets),
        pa.array(values, type=value_type),
        mask=None if mask is None else pa.array(mask),
    )


def lists_to_numpy(column: pa.ListArray) -> list[np.ndarray | None]:
    """Per-row numpy views of a list column (slices of its values, no copy for numbers).

    Offsets index the whole child array (``.values``), which also holds for sliced columns
    and for null rows backed by values.

    Example:
      >>> column = list_array([np.array([1, 2], np.int32), None], pa.int32())
      >>> lists_to_numpy(column)
      [array([1, 2], dtype=int32), None]
    """
    values = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(column))]


# ----------------------------------------------------------------------------- tasks

#: One row per task. ``prompt`` is null for tasks that carry only an id; ``extra_info`` is
#: JSON text (or empty).
TASKS_SCHEMA = pa.schema(
    [
        pa.field("task_id", pa.int64(), False),
        pa.field("prompt", pa.list_(pa.int32())),
        pa.field("data_source", pa.string(), False),
        pa.field("ground_truth", pa.string(), False),
        pa.field("extra_info", pa.string(), False),
    ]
)
_TASK_TEXT = ("data_source", "ground_truth", "extra_info")


def _int_ids(value: Any, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: expected a sequence of token ids, got {value!r}") from e
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"{where}: expected a 1-D sequence of ints, got {arr.dtype} {shape_text(arr)}"
        )
    if (arr < 0).any() or (arr > np.iinfo(np.int32).max).any():
        raise ValueError(
            f"{where}: holds {arr[(arr < 0) | (arr > 2**31 - 1)][0]}, expected ids in [0, 2**31)"
        )
    return arr.astype(np.int32, copy=False)


def tasks_to_arrow(rows: Iterable[Mapping[str, Any]]) -> pa.RecordBatch:
    """Tasks as a record batch of :data:`TASKS_SCHEMA`.

    Args:
      rows: mappings with ``task_id`` (int) and optionally ``prompt`` (token ids),
        ``data_source``, ``ground_truth`` and ``extra_info`` (str; missing ones become "").

    Returns:
      A record batch, one row per task, in order.

    Raises:
      ValueError, TypeError: naming the row and field that is wrong.

    Example:
      >>> tasks_to_arrow([{"task_id": 7, "prompt": [1, 2]}]).num_rows
      1
    """
    ids, prompts, text = [], [], {k: [] for k in _TASK_TEXT}
    for i, row in enumerate(rows):
        unknown = set(row) - {"task_id", "prompt", *_TASK_TEXT}
        if unknown:
            raise ValueError(
                f"task {i}: unknown field {sorted(unknown)[0]!r}; expected task_id, prompt, {', '.join(_TASK_TEXT)}"
            )
        if "task_id" not in row:
            raise ValueError(f"task {i}: missing field 'task_id' (int)")
        tid = row["task_id"]
        if isinstance(tid, bool) or not isinstance(tid, int | np.integer):
            raise TypeError(f"task {i}: task_id={tid!r}, expected an int")
        ids.append(int(tid))
        prompt = row.get("prompt")
        prompts.append(None if prompt is None else _int_ids(prompt, f"task {i}: prompt"))
        for key in _TASK_TEXT:
            value = row.get(key, "")
            if not isinstance(value, str):
                raise TypeError(f"task {i}: {key}={value!r}, expected a str")
            text[key].append(value)
    arrays = [pa.array(ids, pa.int64()), list_array(prompts, pa.int32())]
    arrays += [pa.array(text[k], pa.string()) for k in _TASK_TEXT]
    return pa.RecordBatch.from_arrays(arrays, schema=TASKS_SCHEMA)


def _require_schema(batch: pa.RecordBatch, schema: pa.Schema, what: str) -> None:
    if not isinstance(batch, pa.RecordBatch):
        raise TypeError(f"{what}: got a {type(batch).__name__}, expected a pyarrow.RecordBatch")
    for field in schema:
        if field.name not in batch.schema.names:
            raise ValueError(f"{what}: missing column {field.name!r} ({field.type})")
        actual = batch.schema.field(field.name).type
        if actual != field.type:
            raise ValueError(
                f"{what}: column {field.name!r} has type {actual}, expected {field.type}"
            )
    extra = [n for n in batch.schema.names if n not in schema.names]
    if extra:
        raise ValueError(f"{what}: unknown column {extra[0]!r}; expected {schema.names}")


def tasks_from_arrow(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """Rows of a :data:`TASKS_SCHEMA` batch as dicts (``prompt`` an int32 array or None).

    Example:
      >>> tasks_from_arrow(tasks_to_arrow([{"task_id": 3}]))[0]["task_id"]
      3
    """
    _require_schema(batch, TASKS_SCHEMA, "tasks")
    ids = batch.column("task_id").to_pylist()
    prompts = lists_to_numpy(batch.column("prompt"))
    text = {k: batch.column(k).to_pylist() for k in _TASK_TEXT}
    return [
        {"task_id": ids[i], "prompt": prompts[i], **{k: text[k][i] for k in _TASK_TEXT}}
        for i in range(batch.num_rows)
    ]


# ----------------------------------------------------------------------------- sessions

#: Session outcomes, by name (the ``Status`` enum of ``objectives.rl.sessions`` uses these).
SESSION_STATUSES: tuple[str, ...] = (
    "COMPLETED",
    "TRUNCATED",
    "AGENT_ERROR",
    "INFRA_ERROR",
    "CANCELLED",
)
_SESSION_SCALARS = {
    "task_id": pa.int64(),
    "group": pa.int32(),
    "sample": pa.int32(),
    "attempt": pa.int32(),
}


def _call_type(routed_experts: tuple[int, int, Any] | None) -> pa.StructType:
    fields = [
        pa.field("prompt_ids", pa.list_(pa.int32()), False),  # ids the engine read
        pa.field("sampled_ids", pa.list_(pa.int32()), False),  # ids it drew, EOS included
        pa.field("behavior_log_probs", pa.list_(pa.float32()), False),  # one per sampled id
        pa.field("raw_log_probs", pa.list_(pa.float32())),  # null: the engine had none
        pa.field("finish_reason", pa.string(), False),
        pa.field("version", pa.int32(), False),  # policy version at submission
        pa.field("support", pa.list_(pa.list_(pa.int32()))),  # kept ids per sampled id, or null
    ]
    if routed_experts is not None:
        layers, top_k, dtype = routing_spec(routed_experts)
        # one [layers, top_k] record per id of prompt_ids + sampled_ids, from the first;
        # a shorter list leaves the tail unrecorded; null when the call recorded no routing
        value = fixed_list_type(pa.from_numpy_dtype(dtype), [layers, top_k])
        fields.append(pa.field("routed_experts", pa.list_(value)))
    return pa.struct(fields)


def sessions_schema(*, routed_experts: tuple[int, int, Any] | None = None) -> pa.Schema:
    """The Arrow schema of sessions: one row per session, its calls as a nested list.

    Columns: ``task_id`` int64, ``group``/``sample``/``attempt`` int32, ``status`` (one of
    :data:`SESSION_STATUSES`), ``reward`` float64 (null: never verified), ``components``
    map<str, float64>, ``detail`` str, and ``calls``: list of structs with ``prompt_ids``,
    ``sampled_ids``, ``behavior_log_probs``, ``raw_log_probs`` (nullable), ``finish_reason``,
    ``version``, ``support`` (nullable, kept ids per sampled id) and, when
    ``routed_experts=(layers, top_k, dtype)`` is given, ``routed_experts`` (nullable).

    Example:
      >>> sessions_schema().names[:4]
      ['task_id', 'group', 'sample', 'attempt']
    """
    fields = [pa.field(k, t, False) for k, t in _SESSION_SCALARS.items()]
    fields += [
        pa.field("status", pa.string(), False),
        pa.field("reward", pa.float64()),
        pa.field("components", pa.map_(pa.string(), pa.float64()), False),
        pa.field("detail", pa.string(), False),
        pa.field("calls", pa.list_(_call_type(routed_experts)), False),
    ]
    return pa.schema(fields)


def _floats(value: Any, where: str, length: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float32) if value is not None else None
    if arr is None or arr.ndim != 1 or len(arr) != length:
        got = "None" if arr is None else shape_text(arr)
        raise ValueError(f"{where}: has shape {got}, expected [{length}] (one per sampled id)")
    if not np.isfinite(arr).all():
        raise ValueError(f"{where}: holds a non-finite value")
    return arr


def _check_call(call: Mapping[str, Any], where: str, routing) -> dict[str, Any]:
    required = ("prompt_ids", "sampled_ids", "behavior_log_probs", "finish_reason", "version")
    for key in required:
        if key not in call:
            raise ValueError(f"{where}: missing field {key!r}")
    out = {k: _int_ids(call[k], f"{where}.{k}") for k in ("prompt_ids", "sampled_ids")}
    n = len(out["sampled_ids"])
    out["behavior_log_probs"] = _floats(
        call["behavior_log_probs"], f"{where}.behavior_log_probs", n
    )
    raw = call.get("raw_log_probs")
    out["raw_log_probs"] = None if raw is None else _floats(raw, f"{where}.raw_log_probs", n)
    if not isinstance(call["finish_reason"], str):
        raise TypeError(f"{where}.finish_reason={call['finish_reason']!r}, expected a str")
    out["finish_reason"] = call["finish_reason"]
    version = call["version"]
    if isinstance(version, bool) or not isinstance(version, int | np.integer):
        raise TypeError(f"{where}.version={version!r}, expected an int")
    out["version"] = int(version)
    support = call.get("support")
    if support is not None:
        if len(support) != n:
            raise ValueError(
                f"{where}.support: has {len(support)} entries, expected {n} (one per sampled id)"
            )
        support = [_int_ids(s, f"{where}.support[{j}]") for j, s in enumerate(support)]
    out["support"] = support
    routed = call.get("routed_experts")
    if routed is not None:
        routed = np.asarray(routed)
        if routing is None:
            raise ValueError(
                f"{where}.routed_experts: has shape {shape_text(routed)}, expected "
                "[ids, layers, top_k] integers (and routed_experts=(layers, top_k, dtype))"
            )
        layers, top_k, dtype = routing
        total = len(out["prompt_ids"]) + n
        if routed.ndim != 3 or routed.shape[1:] != (layers, top_k) or len(routed) > total:
            raise ValueError(
                f"{where}.routed_experts: has shape {shape_text(routed)}, expected [<= {total}, {layers}, {top_k}]"
            )
        if routed.dtype != dtype:
            raise ValueError(f"{where}.routed_experts: has dtype {routed.dtype}, expected {dtype}")
    out["routed_experts"] = routed
    return out


def _check_session(row: Mapping[str, Any], i: int, routing) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (*_SESSION_SCALARS, "status", "calls"):
        if key not in row:
            raise ValueError(f"session {i}: missing field {key!r}")
    for key in _SESSION_SCALARS:
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"session {i}: {key}={value!r}, expected an int")
        out[key] = int(value)
    status = getattr(row["status"], "name", row["status"])
    if status not in SESSION_STATUSES:
        raise ValueError(
            f"session {i}: status={row['status']!r}, expected one of {SESSION_STATUSES}"
        )
    out["status"] = status
    reward = row.get("reward")
    if reward is not None and (
        not isinstance(reward, int | float | np.floating) or not math.isfinite(reward)
    ):
        raise ValueError(f"session {i}: reward={reward!r}, expected a finite float or None")
    out["reward"] = None if reward is None else float(reward)
    components = dict(row.get("components") or {})
    for k, v in components.items():
        if not isinstance(k, str) or not isinstance(v, int | float | np.floating):
            raise TypeError(f"session {i}: components[{k!r}]={v!r}, expected str -> float")
    out["components"] = {k: float(v) for k, v in components.items()}
    detail = row.get("detail", "")
    if not isinstance(detail, str):
        raise TypeError(f"session {i}: detail={detail!r}, expected a str")
    out["detail"] = detail
    out["calls"] = [
        _check_call(c, f"session {i}: calls[{j}]", routing) for j, c in enumerate(row["calls"])
    ]
    return out


def _calls_array(calls: list[dict[str, Any]], call_type: pa.StructType, routing) -> pa.Array:
    arrays = []
    for field in call_type:
        name = field.name
        if name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "raw_log_probs"):
            arrays.append(list_array([c[name] for c in calls], field.type.value_type))
        elif name == "finish_reason":
            arrays.append(pa.array([c[name] for c in calls], pa.string()))
        elif name == "version":
            arrays.append(pa.array([c[name] for c in calls], pa.int32()))
        elif name == "support":
            inner = [c[name] for c in calls]
            flat = [s for per in inner if per is not None for s in per]
            lengths = [0 if per is None else len(per) for per in inner]
            offsets = np.zeros(len(calls) + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            mask = pa.array([per is None for per in inner], pa.bool_())
            arrays.append(
                pa.ListArray.from_arrays(pa.array(offsets), list_array(flat, pa.int32()), mask=mask)
            )
        else:  # routed_experts
            layers, top_k, dtype = routing
            records = [c[name] for c in calls]
            lengths = [0 if r is None else len(r) for r in records]
            offsets = np.zeros(len(calls) + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            parts = [r.reshape(-1) for r in records if r is not None]
            values = pa.array(np.concatenate(parts) if parts else np.zeros(0, dtype))
            values = pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(values, top_k), layers
            )
            mask = pa.array([r is None for r in records], pa.bool_())
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask))
    return pa.StructArray.from_arrays(arrays, fields=list(call_type))


def sessions_to_arrow(
    rows: Iterable[Mapping[str, Any]],
    *,
    routed_experts: tuple[int, int, Any] | None = None,
) -> pa.RecordBatch:
    """Sessions (dicts) as a record batch of :func:`sessions_schema`.

    Args:
      rows: mappings with ``task_id``, ``group``, ``sample``, ``attempt`` (ints), ``status``
        (a name in :data:`SESSION_STATUSES` or an enum member with that name), ``reward``
        (float or None), ``components`` (str -> float), ``detail`` (str) and ``calls``: a list
        of mappings with ``prompt_ids``, ``sampled_ids``, ``behavior_log_probs``,
        ``finish_reason``, ``version`` and optionally ``raw_log_probs``, ``support`` and
        ``routed_experts``.
      routed_experts: ``(layers, top_k, dtype)`` when calls record routing; by default
        inferred from the first call that recorded one.

    Returns:
      One row per session, in order.

    Raises:
      ValueError, TypeError: naming the session, the call and the field.

    Example:
      >>> call = {"prompt_ids": [1], "sampled_ids": [2, 3], "behavior_log_probs": [-1.0, -0.5],
      ...         "finish_reason": "stop", "version": 0}
      >>> sessions_to_arrow([{"task_id": 0, "group": 0, "sample": 0, "attempt": 0,
      ...                     "status": "COMPLETED", "reward": 1.0, "calls": [call]}]).num_rows
      1
    """
    rows = list(rows)
    if routed_experts is None:  # infer from the first call that recorded routing
        recorded = (c.get("routed_experts") for r in rows for c in r.get("calls", ()))
        first = next((np.asarray(r) for r in recorded if r is not None), None)
        if first is not None and first.ndim == 3:
            routed_experts = (first.shape[1], first.shape[2], first.dtype)
    routing = None if routed_experts is None else routing_spec(routed_experts)
    return assemble_sessions(
        [_check_session(row, i, routing) for i, row in enumerate(rows)], routing
    )


def assemble_sessions(
    sessions: Sequence[Mapping[str, Any]], routing: tuple[int, int, np.dtype] | None
) -> pa.RecordBatch:
    """Checked session rows as a record batch of :func:`sessions_schema`, without checks.

    The assembly half of :func:`sessions_to_arrow`, for rows whose every field already
    holds what that function's checks would return: ``status`` a name, ``reward`` a finite
    float or None, ``components`` str -> float, and per call int32 id arrays, float32
    likelihood arrays of one entry per sampled id, ``support`` None or a list of int32
    arrays, ``routed_experts`` None or an array of ``routing``'s ``[n, layers, top_k]`` and
    dtype. ``dew_pipe.objectives.rl.session_arrow.to_arrow`` writes Session records (which
    checked all that when they were made) through it.

    Args:
      sessions: the rows.
      routing: ``(layers, top_k, dtype)`` (as :func:`routing_spec` returns it) when calls
        record routing, else None.

    Raises:
      pyarrow.ArrowInvalid: an int beyond its column's type (a group beyond int32).
    """
    schema = sessions_schema(routed_experts=routing)
    arrays = [pa.array([s[k] for s in sessions], t) for k, t in _SESSION_SCALARS.items()]
    arrays.append(pa.array([s["status"] for s in sessions], pa.string()))
    arrays.append(pa.array([s["reward"] for s in sessions], pa.float64()))
    arrays.append(
        pa.array([list(s["components"].items()) for s in sessions], schema.field("components").type)
    )
    arrays.append(pa.array([s["detail"] for s in sessions], pa.string()))
    calls = [c for s in sessions for c in s["calls"]]
    offsets = np.zeros(len(sessions) + 1, np.int32)
    np.cumsum([len(s["calls"]) for s in sessions], out=offsets[1:])
    call_type = schema.field("calls").type.value_type
    struct = _calls_array(calls, call_type, routing)
    arrays.append(
        pa.ListArray.from_arrays(pa.array(offsets), struct, type=schema.field("calls").type)
    )
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _routing_of(schema: pa.Schema) -> tuple[int, int, np.dtype] | None:
    """(layers, top_k, dtype) of a sessions schema's routed_experts field, if it has one."""
    try:
        struct = schema.field("calls").type.value_type
        t = struct.field("routed_experts").type.value_type
        return t.list_size, t.value_type.list_size, numpy_dtype(t.value_type.value_type)
    except (KeyError, AttributeError, TypeError):
        return None  # no routing, or a malformed one that _require_schema will name


def _per_call(struct: pa.StructArray, routing) -> dict[str, list]:
    """Per-call values of a calls struct array: numpy views for arrays, Python scalars."""
    children = dict(zip([f.name for f in struct.type], struct.flatten(), strict=True))
    out: dict[str, list] = {}
    for name in ("prompt_ids", "sampled_ids", "behavior_log_probs", "raw_log_probs"):
        out[name] = lists_to_numpy(children[name])
    out["finish_reason"] = children["finish_reason"].to_pylist()
    out["version"] = children["version"].to_pylist()
    support = children["support"]
    inner = lists_to_numpy(support.values)
    offsets, valid = support.offsets.to_numpy(), support.is_valid().to_numpy(zero_copy_only=False)
    out["support"] = [
        inner[offsets[j] : offsets[j + 1]] if valid[j] else None for j in range(len(support))
    ]
    if routing is not None:
        layers, top_k, _ = routing
        routed = children["routed_experts"]
        flat = routed.values.flatten().flatten().to_numpy(zero_copy_only=False)
        flat = flat.reshape(-1, layers, top_k)
        offsets, valid = routed.offsets.to_numpy(), routed.is_valid().to_numpy(zero_copy_only=False)
        out["routed_experts"] = [
            flat[offsets[j] : offsets[j + 1]] if valid[j] else None for j in range(len(routed))
        ]
    return out


def check_sessions_batch(batch: pa.RecordBatch) -> tuple[int, int, np.dtype] | None:
    """Checks that ``batch`` is a sessions batch; returns its routing ``(layers, top_k, dtype)``.

    Only the schema is checked (the columns, their types), not the values.

    Raises:
      TypeError: not a record batch.
      ValueError: a missing, mistyped or unknown column, naming it.

    Example:
      >>> check_sessions_batch(sessions_to_arrow([])) is None
      True
    """
    if not isinstance(batch, pa.RecordBatch):
        raise TypeError(f"sessions: got a {type(batch).__name__}, expected a pyarrow.RecordBatch")
    routing = _routing_of(batch.schema)
    _require_schema(batch, sessions_schema(routed_experts=routing), "sessions")
    return routing


def sessions_from_arrow(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """Rows of a sessions batch as dicts; per-call arrays are read-only numpy views.

    Returns:
      One dict per session with the fields :func:`sessions_to_arrow` takes (``status`` as its
      name, ``reward`` None when null) and ``calls`` as a list of dicts.

    Raises:
      ValueError, TypeError: a batch that is not of :func:`sessions_schema`.

    Example:
      >>> sessions_from_arrow(sessions_to_arrow([]))
      []
    """
    routing = check_sessions_batch(batch)
    keys = (*_SESSION_SCALARS, "status", "reward", "detail", "components")
    scalars = {k: batch.column(k).to_pylist() for k in keys}
    calls = batch.column("calls")
    offsets = calls.offsets.to_numpy()
    per_call = _per_call(calls.values, routing)
    out = []
    for i in range(batch.num_rows):
        row = {k: v[i] for k, v in scalars.items()}
        row["components"] = dict(row["components"])
        calls_i = range(offsets[i], offsets[i + 1])
        row["calls"] = [{k: v[j] for k, v in per_call.items()} for j in calls_i]
        out.append(row)
    return out
