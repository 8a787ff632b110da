"""Arrow record batches that travel between stages: tasks, sessions and packed rows.

Three kinds of batch cross stage boundaries, go to Parquet files and to Beam:

* **tasks** (:data:`TASKS_SCHEMA`): one row per task a rollout should work on.
* **sessions** (:func:`sessions_schema`): one row per harness session, with its model calls
  as a nested list.
* **packed rows** (:func:`packed_schema`): a training batch of ``N`` rows ``W`` ids wide.
  Every ``[N, W]`` column is a ``FixedSizeList`` of width ``W`` so the width is part of the
  type, and a pipeline wired for ``W = 2048`` refuses a producer of ``W = 1024`` when it is
  built. Converting between ``{name: np.ndarray}`` and Arrow shares memory in both directions
  (the only exception is ``routed``: Arrow stores booleans as bits).

Packed-row columns (row-major, ``N`` rows, ``W`` = width, padding on the right of each row):

==================  ===========================  =============================================
column              dtype, shape                 meaning
==================  ===========================  =============================================
input_ids           int32 [N, W]                 token ids of the chains packed in the row
text_segment_ids    int32 [N, W]                 chain of each id, 1-based per row; 0 = padding
text_positions      int32 [N, W]                 position of the id in its chain (from 0)
response_mask       int32 [N, W]                 1 on sampled ids (EOS included), else 0
old_log_probs       float32 [N, W]               proximal/raw policy log-prob of each sampled id
behavior_log_probs  float32 [N, W]               log-prob the sampler actually used
advantages          float32 [N, W]               the chain's advantage, on every id of it
versions            int32 [N, W]                 policy version the id was sampled under
session_index       int32 [N, W]                 which session of the batch the id came from
call_index          int32 [N, W]                 which call of that session
session_weights     float32 [N, W]               per-session loss weight on each id
text_prefix_segments int32 [N, W]                (optional) segment of the shared prompt an id
                                                 continues; 0 elsewhere (share_prompts)
routed_experts      int [N, W, layers, top_k]    (optional) experts the engine routed each id to
routed              bool [N, W]                  (with routed_experts) a routing record covers it
support_ids         int32 [N, C]                 (optional) kept ids of each sampled id, -1 pad
support_columns     int32 [N, C]                 column of the sampled id each kept id is for
old_values          float32 [N, W]               (PPO) critic values recorded at rollout time
returns             float32 [N, W]               (PPO) value targets
==================  ===========================  =============================================

Tasks and sessions are defined in :mod:`dew_pipe.rollout_batches` (with the Arrow column
helpers every batch is built with) and re-exported here; this module defines packed rows and
the Parquet files all three are written to. The Python records (``Session``, ``Call``,
``Task``) live in ``dew_pipe.objectives.rl.sessions``, and
``dew_pipe.objectives.rl.session_arrow`` maps them onto the tasks and sessions rows.

``old_log_probs`` may be left out (``packed_schema(old_log_probs=False)``) when no raw policy
likelihood exists yet; objectives then fall back to the behavior likelihoods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dew_pipe.rollout_batches import (
    SESSION_STATUSES,
    TASKS_SCHEMA,
    fixed_list_type,
    numpy_dtype,
    routing_spec,
    sessions_from_arrow,
    sessions_schema,
    sessions_to_arrow,
    shape_text,
    tasks_from_arrow,
    tasks_to_arrow,
)

__all__ = [
    "PACKED_COLUMNS",
    "SESSION_STATUSES",
    "TASKS_SCHEMA",
    "packed_from_arrow",
    "packed_schema",
    "packed_to_arrow",
    "read_parquet",
    "sessions_from_arrow",
    "sessions_schema",
    "sessions_to_arrow",
    "tasks_from_arrow",
    "tasks_to_arrow",
    "validate_packed",
    "write_parquet",
]

# ----------------------------------------------------------------------------- packed rows

# Columns shaped [N, W]; name -> numpy dtype. Order is the schema's column order.
_ROW_COLUMNS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "text_segment_ids": np.dtype(np.int32),
    "text_positions": np.dtype(np.int32),
    "response_mask": np.dtype(np.int32),
    "old_log_probs": np.dtype(np.float32),
    "behavior_log_probs": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
    "session_index": np.dtype(np.int32),
    "call_index": np.dtype(np.int32),
    "session_weights": np.dtype(np.float32),
}
_SHARED_COLUMNS = {"text_prefix_segments": np.dtype(np.int32)}
_PPO_COLUMNS = {"old_values": np.dtype(np.float32), "returns": np.dtype(np.float32)}
_SUPPORT_COLUMNS = ("support_ids", "support_columns")
_ROUTING_COLUMNS = ("routed_experts", "routed")

#: Every packed-row column name, required ones first.
PACKED_COLUMNS: tuple[str, ...] = (
    *_ROW_COLUMNS,
    *_SHARED_COLUMNS,
    *_ROUTING_COLUMNS,
    *_SUPPORT_COLUMNS,
    *_PPO_COLUMNS,
)
_OPTIONAL = {
    "old_log_probs",
    *_SHARED_COLUMNS,
    *_ROUTING_COLUMNS,
    *_SUPPORT_COLUMNS,
    *_PPO_COLUMNS,
}


def packed_schema(
    width: int,
    *,
    routed_experts: tuple[int, int, Any] | None = None,
    support_capacity: int | None = None,
    ppo: bool = False,
    old_log_probs: bool = True,
    share_prompts: bool = False,
) -> pa.Schema:
    """The Arrow schema of packed rows ``width`` ids wide.

    Args:
      width: ``W``, ids per row.
      routed_experts: ``(layers, top_k, dtype)`` to add ``routed_experts`` and ``routed``.
      support_capacity: ``C`` to add ``support_ids`` and ``support_columns`` ``[N, C]``.
      ppo: add ``old_values`` and ``returns``.
      old_log_probs: include ``old_log_probs`` (leave out before any rescoring).
      share_prompts: add ``text_prefix_segments`` (rows packed with
        ``pack(..., share_prompts=True)``).

    Returns:
      A schema whose columns are non-nullable FixedSizeLists in :data:`PACKED_COLUMNS` order.

    Raises:
      ValueError: a non-positive width or capacity, or a malformed ``routed_experts``.

    Example:
      >>> packed_schema(8).field("input_ids").type
      FixedSizeListType(fixed_size_list<item: int32>[8])
    """
    if not isinstance(width, int | np.integer) or width < 1:
        raise ValueError(f"width={width!r}: expected a positive int")
    fields = []
    for name, dtype in _ROW_COLUMNS.items():
        if name == "old_log_probs" and not old_log_probs:
            continue
        fields.append(pa.field(name, fixed_list_type(pa.from_numpy_dtype(dtype), [width]), False))
    if share_prompts:
        field_type = fixed_list_type(pa.int32(), [width])
        fields.append(pa.field("text_prefix_segments", field_type, False))
    if routed_experts is not None:
        layers, top_k, dtype = routing_spec(routed_experts)
        value = pa.from_numpy_dtype(dtype)
        fields.append(
            pa.field("routed_experts", fixed_list_type(value, [width, layers, top_k]), False)
        )
        fields.append(pa.field("routed", fixed_list_type(pa.bool_(), [width]), False))
    if support_capacity is not None:
        if not isinstance(support_capacity, int | np.integer) or support_capacity < 1:
            raise ValueError(f"support_capacity={support_capacity!r}: expected a positive int")
        for name in _SUPPORT_COLUMNS:
            fields.append(pa.field(name, fixed_list_type(pa.int32(), [support_capacity]), False))
    if ppo:
        for name, dtype in _PPO_COLUMNS.items():
            fields.append(
                pa.field(name, fixed_list_type(pa.from_numpy_dtype(dtype), [width]), False)
            )
    return pa.schema(fields)


def _infer_options(batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Schema options implied by a dict batch; checks names, pairs and dimensions."""
    unknown = sorted(set(batch) - set(PACKED_COLUMNS))
    if unknown:
        raise ValueError(
            f"packed rows: unknown column {unknown[0]!r}; expected only {list(PACKED_COLUMNS)}"
        )
    for name in _ROW_COLUMNS:
        if name not in batch and name not in _OPTIONAL:
            raise ValueError(f"packed rows: missing column {name!r} ({_ROW_COLUMNS[name]} [N, W])")
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2:
        raise ValueError(
            f"packed rows: column 'input_ids' has shape {shape_text(ids)}, expected [N, W]"
        )
    for a, b in (("routed_experts", "routed"), ("support_ids", "support_columns")):
        if (a in batch) != (b in batch):
            have, lack = (a, b) if a in batch else (b, a)
            raise ValueError(f"packed rows: column {have!r} present without {lack!r}")
    if ("old_values" in batch) != ("returns" in batch):
        have, lack = (
            ("old_values", "returns") if "old_values" in batch else ("returns", "old_values")
        )
        raise ValueError(f"packed rows: column {have!r} present without {lack!r}")
    options: dict[str, Any] = {
        "width": int(ids.shape[1]),
        "ppo": "old_values" in batch,
        "old_log_probs": "old_log_probs" in batch,
        "share_prompts": "text_prefix_segments" in batch,
    }
    if "routed_experts" in batch:
        r = np.asarray(batch["routed_experts"])
        if r.ndim != 4 or not np.issubdtype(r.dtype, np.integer):
            raise ValueError(
                f"packed rows: column 'routed_experts' is {r.dtype} {shape_text(r)}, expected an "
                "integer array [N, W, layers, top_k]"
            )
        options["routed_experts"] = (int(r.shape[2]), int(r.shape[3]), r.dtype)
    if "support_ids" in batch:
        s = np.asarray(batch["support_ids"])
        if s.ndim != 2:
            raise ValueError(
                f"packed rows: column 'support_ids' has shape {shape_text(s)}, expected [N, C]"
            )
        options["support_capacity"] = int(s.shape[1])
    return options


def _expected_arrays(batch: Mapping[str, np.ndarray], options: dict[str, Any]):
    """Yield (name, array, expected dtype, expected shape) for every column of the batch."""
    n, w = np.asarray(batch["input_ids"]).shape
    for name in PACKED_COLUMNS:
        if name not in batch:
            continue
        if name in _ROW_COLUMNS or name in _PPO_COLUMNS or name in _SHARED_COLUMNS:
            dtype = {**_ROW_COLUMNS, **_PPO_COLUMNS, **_SHARED_COLUMNS}[name]
            shape = (n, w)
        elif name == "routed_experts":
            layers, top_k, dtype = options["routed_experts"]
            shape = (n, w, layers, top_k)
        elif name == "routed":
            dtype, shape = np.dtype(np.bool_), (n, w)
        else:
            dtype, shape = np.dtype(np.int32), (n, options["support_capacity"])
        yield name, batch[name], dtype, shape


def _check_arrays(batch: Mapping[str, np.ndarray], options: dict[str, Any]) -> None:
    for name, value, dtype, shape in _expected_arrays(batch, options):
        if not isinstance(value, np.ndarray):
            raise TypeError(
                f"packed rows: column {name!r} is a {type(value).__name__}, expected a numpy "
                f"array {dtype} {list(shape)}"
            )
        if value.dtype != dtype or value.shape != shape:
            raise ValueError(
                f"packed rows: column {name!r} is {value.dtype} {shape_text(value)}, expected "
                f"{dtype} {list(shape)}"
            )


def _check_values(batch: Mapping[str, np.ndarray], width: int) -> None:
    mask = batch["response_mask"]
    if not np.isin(mask, (0, 1)).all():
        bad = mask[~np.isin(mask, (0, 1))][0]
        raise ValueError(f"packed rows: column 'response_mask' holds {bad}, expected only 0 or 1")
    names = ("text_segment_ids", "text_positions", "input_ids", "text_prefix_segments")
    for name in (n for n in names if n in batch):
        if (batch[name] < 0).any():
            raise ValueError(
                f"packed rows: column {name!r} holds {batch[name].min()}, expected values >= 0"
            )
    if (mask.astype(bool) & (batch["text_segment_ids"] == 0)).any():
        raise ValueError(
            "packed rows: column 'response_mask' is 1 on padding (text_segment_ids 0); "
            "expected sampled ids inside a chain"
        )
    for name, value in batch.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(f"packed rows: column {name!r} holds a non-finite value")
    if "support_columns" in batch:
        cols = batch["support_columns"]
        if ((cols < -1) | (cols >= width)).any():
            raise ValueError(
                f"packed rows: column 'support_columns' holds {cols[(cols < -1) | (cols >= width)][0]}, "
                f"expected -1 (padding) or a column in [0, {width})"
            )


def _check_schema(schema: pa.Schema) -> dict[str, Any]:
    """Options implied by an Arrow schema; raises naming the first column that disagrees."""
    names = schema.names
    unknown = [n for n in names if n not in PACKED_COLUMNS]
    if unknown:
        raise ValueError(
            f"packed rows: unknown column {unknown[0]!r}; expected only {list(PACKED_COLUMNS)}"
        )
    if "input_ids" not in names:
        raise ValueError("packed rows: missing column 'input_ids' (int32 [N, W])")
    ids_type = schema.field("input_ids").type
    if not pa.types.is_fixed_size_list(ids_type):
        raise ValueError(
            f"packed rows: column 'input_ids' has type {ids_type}, expected fixed_size_list<int32>[W]"
        )
    options: dict[str, Any] = {
        "width": ids_type.list_size,
        "ppo": "old_values" in names or "returns" in names,
        "old_log_probs": "old_log_probs" in names,
        "share_prompts": "text_prefix_segments" in names,
    }
    if "routed_experts" in names or "routed" in names:
        t = schema.field("routed_experts").type if "routed_experts" in names else None
        try:
            dims = [t.list_size, t.value_type.list_size, t.value_type.value_type.list_size]
            dtype = numpy_dtype(t.value_type.value_type.value_type)
            options["routed_experts"] = (dims[1], dims[2], dtype)
        except AttributeError as e:
            raise ValueError(
                f"packed rows: column 'routed_experts' has type {t}, expected "
                "fixed_size_list of [W, layers, top_k] integers, beside 'routed'"
            ) from e
    if "support_ids" in names or "support_columns" in names:
        name = "support_ids" if "support_ids" in names else "support_columns"
        t = schema.field(name).type
        if not pa.types.is_fixed_size_list(t):
            raise ValueError(
                f"packed rows: column {name!r} has type {t}, expected fixed_size_list<int32>[C]"
            )
        options["support_capacity"] = t.list_size
    try:
        expected = packed_schema(**options)
    except ValueError as e:
        raise ValueError(f"packed rows: {e}") from e
    for field in expected:
        if field.name not in names:
            raise ValueError(f"packed rows: missing column {field.name!r} ({field.type})")
        actual = schema.field(field.name).type
        if actual != field.type:
            raise ValueError(
                f"packed rows: column {field.name!r} has type {actual}, expected {field.type}"
            )
    return options


def validate_packed(
    batch: Mapping[str, np.ndarray] | pa.RecordBatch,
    *,
    width: int | None = None,
    values: bool = True,
) -> None:
    """Check a packed-rows batch: columns, dtypes, shapes and (optionally) value ranges.

    Args:
      batch: ``{name: np.ndarray}`` or an Arrow record batch.
      width: the row width the caller expects, or None to accept any.
      values: also check values: ``response_mask`` in {0, 1} and only on chain ids,
        non-negative ids, segments and positions, finite floats, ``support_columns`` in range.

    Raises:
      ValueError: naming the column, what it holds and what was expected.
      TypeError: a column that is not a numpy array.

    Example:
      >>> validate_packed({"input_ids": np.zeros((2, 3), np.int16)})
      Traceback (most recent call last):
      ...
      ValueError: packed rows: missing column 'text_segment_ids' (int32 [N, W])
    """
    if isinstance(batch, pa.RecordBatch):
        options = _check_schema(batch.schema)
        arrays = packed_from_arrow(batch, validate=False) if values else None
    else:
        options = _infer_options(batch)
        _check_arrays(batch, options)
        arrays = batch
    if width is not None and options["width"] != width:
        raise ValueError(
            f"packed rows: width (columns of input_ids) is {options['width']}, expected {width}"
        )
    if values:
        _check_values(arrays, options["width"])


def packed_to_arrow(batch: Mapping[str, np.ndarray]) -> pa.RecordBatch:
    """Wrap a packed-rows dict as an Arrow record batch without copying its arrays.

    The batch shares memory with the arrays (except ``routed``, which Arrow stores as bits),
    so do not write to them afterwards. A non-contiguous array is copied once.

    Args:
      batch: ``{name: np.ndarray}`` with the columns of :func:`packed_schema`.

    Returns:
      A record batch with the schema :func:`packed_schema` infers from the arrays.

    Raises:
      ValueError, TypeError: as :func:`validate_packed` (structure only, values unchecked).

    Example:
      >>> cols = {n: np.zeros((2, 4), np.float32 if "prob" in n or n in ("advantages",
      ...         "session_weights") else np.int32) for n in packed_schema(4).names}
      >>> packed_to_arrow(cols).num_rows
      2
    """
    options = _infer_options(batch)
    _check_arrays(batch, options)
    schema = packed_schema(**options)
    arrays = []
    for field in schema:
        value = np.ascontiguousarray(batch[field.name])
        flat: pa.Array = pa.array(value.reshape(-1))
        for size in reversed(value.shape[1:]):
            flat = pa.FixedSizeListArray.from_arrays(flat, size)
        arrays.append(flat)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def packed_from_arrow(batch: pa.RecordBatch, *, validate: bool = True) -> dict[str, np.ndarray]:
    """View a packed-rows record batch as ``{name: np.ndarray}`` without copying.

    The arrays are read-only views of the batch's buffers (``routed`` is unpacked from bits,
    the one copy). Sliced batches work; their views start at the slice.

    Args:
      batch: an Arrow record batch with a packed-rows schema.
      validate: check the schema first (skip only when the caller already did).

    Returns:
      ``{name: array}`` shaped ``[N, W]`` (``[N, W, layers, top_k]``, ``[N, C]``).

    Raises:
      ValueError: a schema that is not packed rows, or a column holding nulls.
      TypeError: something other than a RecordBatch.

    Example:
      >>> rb = packed_to_arrow({n: np.zeros((1, 2), np.float32 if "prob" in n or n in
      ...     ("advantages", "session_weights") else np.int32) for n in packed_schema(2).names})
      >>> packed_from_arrow(rb)["input_ids"].shape
      (1, 2)
    """
    if not isinstance(batch, pa.RecordBatch):
        raise TypeError(
            f"packed rows: got a {type(batch).__name__}, expected a pyarrow.RecordBatch"
        )
    if validate:
        _check_schema(batch.schema)
    out = {}
    n = batch.num_rows
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        dims = []
        flat = column
        while pa.types.is_fixed_size_list(flat.type):
            if flat.null_count:
                raise ValueError(f"packed rows: column {name!r} holds {flat.null_count} nulls")
            dims.append(flat.type.list_size)
            flat = flat.flatten()
        if flat.null_count:
            raise ValueError(f"packed rows: column {name!r} holds {flat.null_count} null values")
        is_bool = pa.types.is_boolean(flat.type)
        out[name] = flat.to_numpy(zero_copy_only=not is_bool).reshape(n, *dims)
    return out


# ----------------------------------------------------------------------------- parquet


def write_parquet(
    path: str | Path,
    batches: pa.RecordBatch | pa.Table | Iterable[pa.RecordBatch],
    *,
    schema: pa.Schema | None = None,
) -> Path:
    """Write record batches to one Parquet file (written to a temporary name, then renamed).

    Args:
      path: the file to write; its folder must exist.
      batches: a batch, a table, or an iterable of batches sharing one schema.
      schema: the schema to write; defaults to the first batch's. Needed for an empty iterable.

    Returns:
      The path written.

    Raises:
      ValueError: an empty input without ``schema``, or a batch of another schema.

    Example:
      >>> import tempfile, os
      >>> p = write_parquet(os.path.join(tempfile.mkdtemp(), "t.parquet"), tasks_to_arrow([]))
    """
    path = Path(path)
    if isinstance(batches, pa.RecordBatch | pa.Table):
        batches = [batches]
    tmp = path.with_name(path.name + ".partial")
    writer = None
    try:
        for i, batch in enumerate(batches):
            if writer is None:
                schema = schema or batch.schema
                writer = pq.ParquetWriter(tmp, schema)
            if not batch.schema.equals(schema):
                raise ValueError(f"{path}: batch {i} has schema {batch.schema}, expected {schema}")
            writer.write(batch)
        if writer is None:
            if schema is None:
                raise ValueError(f"{path}: nothing to write and no schema given")
            writer = pq.ParquetWriter(tmp, schema)
        writer.close()
        writer = None
        tmp.replace(path)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return path


def read_parquet(path: str | Path, *, schema: pa.Schema | None = None) -> pa.Table:
    """Read a Parquet file, checking its schema against ``schema`` when given.

    Returns:
      A table; ``table.to_batches()`` gives record batches for :func:`packed_from_arrow`.

    Raises:
      ValueError: the file's columns or types differ from ``schema``, naming the column.

    Example:
      >>> import tempfile, os
      >>> p = write_parquet(os.path.join(tempfile.mkdtemp(), "t.parquet"), tasks_to_arrow([]))
      >>> read_parquet(p, schema=TASKS_SCHEMA).num_rows
      0
    """
    table = pq.read_table(path)
    if schema is not None:
        if table.schema.names != schema.names:
            raise ValueError(f"{path}: columns {table.schema.names}, expected {schema.names}")
        for field in schema:
            actual = table.schema.field(field.name).type
            if actual != field.type:
                raise ValueError(
                    f"{path}: column {field.name!r} has type {actual}, expected {field.type}"
                )
        table = table.cast(schema)
    return table
