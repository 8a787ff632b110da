"""Preference pairs for DPO: a chosen and a rejected token sequence per prompt.

Each source row has four fields: ``chosen`` and ``rejected`` (token ids: the prompt followed
by that side's answer) and ``chosen_mask`` / ``rejected_mask`` (1 on answer tokens, 0 on
prompt tokens, one entry per id). A missing or null mask marks every token of its side as
completion; no boundary is guessed from the ids.

Rows are read columnar: JSON records with ``pyarrow.json`` (against a fixed schema, so a float
id or a string where a list belongs is refused rather than coerced), Parquet with
``pyarrow.parquet``. Laying the rows out is vectorized NumPy over the Arrow list offsets; no
Python loop runs per row. A batch is two ``[B, 2, S]`` int32 arrays (axis 1: 0 chosen,
1 rejected), right-padded with ``pad_id`` and mask 0.

Position 0 of a row is never scored, since no earlier token predicts it (the objective scores
``input_ids[:, :, 1:]`` by the mask of those targets). A side whose mask has no 1 after
position 0 would contribute nothing, so such a row is refused.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from dew_pipe._validate import check_int
from dew_pipe.data.dataset import Batch, Dataset, Loading, Partition
from dew_pipe.data.packing import RowBatches, padded_batches

__all__ = ["PreferencePairs", "read_pairs"]

SIDES = ("chosen", "rejected")
_IDS_TYPE = pa.list_(pa.int64())
_SCHEMA = pa.schema([(name, _IDS_TYPE) for name in (*SIDES, *(f"{s}_mask" for s in SIDES))])
_INT32_MAX = np.iinfo(np.int32).max
_PARQUET = (".parquet", ".pq")
_JSONL = (".jsonl", ".ndjson", ".json")
_RECORDS_PER_CHUNK = 4096  # JSON records parsed per call; chunks spread over Loading threads


# ---------------------------------------------------------------- reading


def _parse_options() -> pa_json.ParseOptions:
    return pa_json.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore")


def _parse_chunk(chunk: tuple[int, tuple[str, ...]]) -> pa.Table:
    """Parse JSON records ``chunk[1]``, numbered from ``chunk[0]`` (picklable worker entry)."""
    start, records = chunk
    # A JSON text has no raw newline inside a string, so newlines are only whitespace between
    # tokens: folding them into spaces keeps each record on the one line pyarrow expects.
    lines = [record.replace("\r", " ").replace("\n", " ") for record in records]
    data = "\n".join(lines).encode()
    try:
        return pa_json.read_json(io.BytesIO(data), parse_options=_parse_options())
    except pa.ArrowInvalid as error:
        # Find the first record that fails on its own, so the error names its row.
        for offset, line in enumerate(lines):
            try:
                pa_json.read_json(io.BytesIO(line.encode()), parse_options=_parse_options())
            except pa.ArrowInvalid as row_error:
                raise ValueError(
                    f"records[{start + offset}] is not a valid pair ({row_error}); expected a JSON "
                    "object with integer lists 'chosen', 'rejected' and optional "
                    "'chosen_mask', 'rejected_mask'"
                ) from row_error
        raise ValueError(
            f"records[{start}:{start + len(lines)}] cannot be read ({error})"
        ) from error


def _read_records(records: Sequence[str], loading: Loading) -> pa.Table:
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise TypeError(
            f"records is {type(records).__name__}; expected a tuple of JSON strings, one per pair"
        )
    if not records:
        raise ValueError("records is empty; expected at least one JSON pair")
    for index, record in enumerate(records):
        if not isinstance(record, str):
            raise TypeError(
                f"records[{index}] is {type(record).__name__}; expected a JSON string (json.dumps)"
            )
        if not record.strip():
            raise ValueError(f"records[{index}] is blank; expected a JSON object")
    chunks = [
        (start, tuple(records[start : start + _RECORDS_PER_CHUNK]))
        for start in range(0, len(records), _RECORDS_PER_CHUNK)
    ]
    with loading.map(_parse_chunk, chunks) as tables:
        return pa.concat_tables(list(tables))


def _read_path(path: str | os.PathLike[str], loading: Loading) -> pa.Table:
    local, text = Path(path), os.fspath(path)
    threads = loading.threads > 1 or loading.workers > 0
    if local.is_dir() or local.suffix.lower() in _PARQUET:
        if not local.exists():
            raise FileNotFoundError(f"path {text!r}: no such Parquet file or directory")
        try:
            schema = pq.read_schema(local) if local.is_file() else None
            names = None if schema is None else schema.names
            columns = None if names is None else [c for c in _SCHEMA.names if c in names]
            table = pq.read_table(local, columns=columns, use_threads=threads)
        except (pa.ArrowInvalid, OSError) as error:
            raise ValueError(f"path {text!r}: cannot read it as Parquet ({error})") from error
        return table
    if local.suffix.lower() in _JSONL:
        if not local.exists():
            raise FileNotFoundError(f"path {text!r}: no such JSONL file")
        try:
            return pa_json.read_json(
                local,
                read_options=pa_json.ReadOptions(use_threads=threads),
                parse_options=_parse_options(),
            )
        except pa.ArrowInvalid as error:
            raise ValueError(
                f"path {text!r}: cannot read it as JSON Lines pairs ({error})"
            ) from error
    if not local.exists():
        raise FileNotFoundError(f"path {text!r}: no such file")
    raise ValueError(
        f"path {text!r} has suffix {local.suffix!r}; expected .parquet, .pq, a directory of "
        "Parquet files, or .jsonl/.ndjson/.json (JSON Lines)"
    )


# ---------------------------------------------------------------- layout


def _list_column(table: pa.Table, name: str, where: str) -> pa.ListArray | None:
    """Column ``name`` as one ``list<int64>`` array, or None when the table lacks it."""
    if name not in table.column_names:
        return None
    column = table.column(name)
    if pa.types.is_null(column.type):  # an all-null column (Parquet writes this type for it)
        return pa.nulls(len(column), _IDS_TYPE)
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or not (
        pa.types.is_integer(column.type.value_type)
    ):
        raise ValueError(
            f"{where}: column {name!r} has type {column.type}; expected a list of integers"
        )
    return column.cast(_IDS_TYPE).combine_chunks()


def _first(flags: np.ndarray) -> int:
    return int(np.flatnonzero(flags)[0])


def _side(
    table: pa.Table, side: str, width: int, pad_id: int, where: str, out: dict[str, np.ndarray]
) -> None:
    """Write one side's ids and mask into ``out["input_ids"][:, k]`` and ``completion_mask``."""
    k = SIDES.index(side)
    ids = _list_column(table, side, where)
    if ids is None:
        raise ValueError(
            f"{where} has no field {side!r}; fields are {table.column_names}; expected "
            "'chosen' and 'rejected' token lists"
        )
    nulls = ids.is_null().to_numpy(zero_copy_only=False)
    if nulls.any():
        raise ValueError(f"{where}: row {_first(nulls)} has no {side!r} ids; expected a token list")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    for bad, expect in (
        (lengths == 0, "at least 1"),
        (lengths > width, f"at most seq_len={width}"),
    ):
        if bad.any():
            row = _first(bad)
            raise ValueError(
                f"{where}: row {row} has {side!r} of length {int(lengths[row])}; expected "
                f"{expect} tokens"
            )
    values = ids.flatten()
    if values.null_count:
        owner = np.repeat(np.arange(len(lengths)), lengths)
        row = int(owner[_first(values.is_null().to_numpy(zero_copy_only=False))])
        raise ValueError(f"{where}: row {row} has a null in {side!r}; expected token ids")
    flat = values.to_numpy()
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    bad = (flat < 0) | (flat > _INT32_MAX)
    if bad.any():
        at = _first(bad)
        raise ValueError(
            f"{where}: row {int(rows[at])} has {side!r} id {int(flat[at])}; expected ids in "
            f"[0, {_INT32_MAX}]"
        )
    out["input_ids"][:, k] = pad_id
    out["input_ids"][rows, k, cols] = flat
    mask = _list_column(table, f"{side}_mask", where)
    given = np.zeros(len(lengths), bool) if mask is None else ~mask.is_null().to_numpy(False)
    out["completion_mask"][rows, k, cols] = 1  # rows without a mask: every token is completion
    if given.any():
        mask_lengths = pc.list_value_length(mask).to_numpy(zero_copy_only=False)
        differ = given & (mask_lengths != lengths)
        if differ.any():
            row = _first(differ)
            raise ValueError(
                f"{where}: row {row} has {side}_mask of length {int(mask_lengths[row])} but "
                f"{side} of length {int(lengths[row])}; expected one mask entry per id"
            )
        bits = mask.filter(pa.array(given)).flatten()
        if bits.null_count:
            raise ValueError(f"{where}: {side}_mask holds a null; expected 0 or 1 per token")
        bits = bits.to_numpy()
        picked = np.repeat(given, lengths)
        bad = (bits != 0) & (bits != 1)
        if bad.any():
            row = int(rows[picked][_first(bad)])
            raise ValueError(
                f"{where}: row {row} has {side}_mask value {int(bits[_first(bad)])}; "
                "expected 0 (prompt) or 1 (completion)"
            )
        out["completion_mask"][rows[picked], k, cols[picked]] = bits
    scored = out["completion_mask"][:, k, 1:].any(axis=1)
    if not scored.all():
        row = _first(~scored)
        raise ValueError(
            f"{where}: row {row} has no {side} completion token after position 0; expected at "
            "least one (position 0 is never scored: no earlier token predicts it)"
        )


def read_pairs(table: pa.Table, seq_len: int, pad_id: int = 0, where: str = "pairs") -> Batch:
    """Lay out preference rows as ``input_ids`` and ``completion_mask`` arrays ``[N, 2, S]``.

    Args:
        table: rows with ``chosen``, ``rejected`` (integer lists) and optional
            ``chosen_mask``, ``rejected_mask`` (0/1 lists, null for "all completion").
        seq_len: the row width ``S``; shorter sides are right-padded to it.
        pad_id: the id written into padding.
        where: how errors name the source.

    Returns:
        ``{"input_ids": int32 [N, 2, S], "completion_mask": int32 [N, 2, S]}``, axis 1 being
        (chosen, rejected); padding has mask 0.

    Raises:
        ValueError: a missing or null side, an empty or too long side, a negative id, a mask
            whose length differs from its ids or holds a value other than 0/1, or a side
            with no scored completion token; each names the row.

    Example:
        >>> table = pa.table({"chosen": [[1, 2, 3]], "rejected": [[1, 4]],
        ...                   "chosen_mask": [[0, 1, 1]], "rejected_mask": [[0, 1]]})
        >>> out = read_pairs(table, seq_len=4)
        >>> out["input_ids"].tolist(), out["completion_mask"].tolist()
        ([[[1, 2, 3, 0], [1, 4, 0, 0]]], [[[0, 1, 1, 0], [0, 1, 0, 0]]])
    """
    count = table.num_rows
    if count == 0:
        raise ValueError(f"{where} holds no rows; expected at least one preference pair")
    out = {
        "input_ids": np.zeros((count, 2, seq_len), np.int32),
        "completion_mask": np.zeros((count, 2, seq_len), np.int32),
    }
    for side in SIDES:
        _side(table, side, seq_len, pad_id, where, out)
    return out


# ---------------------------------------------------------------- the loader


class PreferencePairs:
    """Preference pairs from JSON records or a file, as fixed-width DPO batches.

    Give exactly one of ``records`` (a tuple of JSON strings, one pair each) and ``path``
    (a Parquet file or directory, or a JSON Lines file). Every row holds ``chosen`` and
    ``rejected`` token lists, each the prompt followed by that answer, and optionally
    ``chosen_mask`` / ``rejected_mask`` marking the answer tokens with 1. Other fields are
    ignored.

    Args:
        records: the pairs as JSON text, e.g. ``tuple(json.dumps(row) for row in rows)``.
        path: a ``.parquet``/``.pq`` file or directory of them, or a ``.jsonl`` file.
        seq_len: the full row width ``S``, prompt included; train with
            ``DPOObjective(model, seq_len=S - 1)`` (one position is lost to the next-token
            shift). A side longer than ``S`` is refused, never cut.
        pad_id: id written into the right padding (mask 0 there).
        loading: how JSON records are parsed (``threads``/``workers`` over chunks of 4096
            records) and whether Parquet is read with threads; default ``Loading()``.
        val_records: validation pairs as JSON text, or None.
        val_path: validation pairs from a file, or None (at most one of the two).
        shuffle: visit the training pairs in a new seeded order every epoch.
        seed: the seed of that order.

    Raises:
        ValueError: both or neither of ``records``/``path`` (or both validation sources),
            ``seq_len`` below 2, or a negative ``pad_id``.
        TypeError: a setting of the wrong type.

    Example:
        >>> import json
        >>> row = {"chosen": [1, 2, 3], "rejected": [1, 2, 4, 4],
        ...        "chosen_mask": [0, 0, 1], "rejected_mask": [0, 0, 1, 1]}
        >>> data = PreferencePairs(records=(json.dumps(row),) * 2, seq_len=5).load(batch=2)
        >>> batch = next(data.train(Partition(0, 1)))
        >>> batch["input_ids"].shape, batch["input_ids"][0].tolist()
        ((2, 2, 5), [[1, 2, 3, 0, 0], [1, 2, 4, 4, 0]])
    """

    def __init__(
        self,
        records: Sequence[str] | None = None,
        path: str | os.PathLike[str] | None = None,
        *,
        seq_len: int,
        pad_id: int = 0,
        loading: Loading | None = None,
        val_records: Sequence[str] | None = None,
        val_path: str | os.PathLike[str] | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if (records is None) == (path is None):
            given = "both" if records is not None else "neither"
            raise ValueError(
                f"PreferencePairs got {given} of records and path; expected exactly one "
                "(a tuple of JSON strings, or a Parquet/JSONL path)"
            )
        if val_records is not None and val_path is not None:
            raise ValueError(
                "PreferencePairs got both val_records and val_path; expected at most one"
            )
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path is {type(path).__name__}; expected a str or os.PathLike")
        if loading is not None and not isinstance(loading, Loading):
            raise TypeError(f"loading is {type(loading).__name__}; expected a dew_pipe.Loading")
        self.records, self.path = records, path
        self.val_records, self.val_path = val_records, val_path
        self.seq_len = check_int("seq_len", seq_len, minimum=2)
        self.pad_id = check_int("pad_id", pad_id, minimum=0, maximum=_INT32_MAX)
        self.loading = loading or Loading()
        self.shuffle, self.seed = bool(shuffle), check_int("seed", seed, minimum=0)
        self.stats: dict[str, dict[str, float]] = {}
        self._cache: dict[str, Batch] = {}

    def pairs(self, which: str = "train") -> Batch:
        """All pairs of one split as ``{"input_ids", "completion_mask"}`` arrays ``[N, 2, S]``.

        Args:
            which: ``"train"`` or ``"val"``.

        Raises:
            ValueError: an unknown split, ``"val"`` without a validation source, or any
                reading or layout error (naming the row).
        """
        if which not in ("train", "val"):
            raise ValueError(f"which is {which!r}; expected 'train' or 'val'")
        if which not in self._cache:
            records, path = (
                (self.records, self.path) if which == "train" else (self.val_records, self.val_path)
            )
            if records is None and path is None:
                raise ValueError("which is 'val' but neither val_records nor val_path was given")
            if records is not None:
                table, where = _read_records(records, self.loading), f"{which} records"
            else:
                table, where = _read_path(path, self.loading), f"path {os.fspath(path)!r}"
            arrays = read_pairs(table, self.seq_len, self.pad_id, where)
            self._cache[which] = arrays
            mask = arrays["completion_mask"][:, :, 1:]
            self.stats[which] = {
                "pairs": len(mask),
                "chosen_tokens": int(mask[:, 0].sum()),
                "rejected_tokens": int(mask[:, 1].sum()),
            }
        return self._cache[which]

    def load(self, batch: int) -> Dataset:
        """Read the pairs and return them as a :class:`Dataset` of ``batch`` pairs per step.

        Training batches run forever, epoch after epoch (reshuffled each epoch when
        ``shuffle``), and the iterator can be resumed by the Trainer. Validation batches
        cover the validation pairs once; the last is filled with all-padding pairs (mask 0),
        which count toward nothing.

        Args:
            batch: pairs per global batch; each process of a :class:`Partition` gets
                ``batch // count`` of them.

        Returns:
            A Dataset whose batches hold ``input_ids`` and ``completion_mask``, int32
            ``[batch // processes, 2, seq_len]``; ``records`` is the number of training pairs.
            ``stats`` then counts, per split, pairs and scored completion tokens per side.

        Raises:
            ValueError: ``batch`` below 1, or a reading or layout error naming the row.
        """
        batch = check_int("batch", batch, minimum=1)
        train = self.pairs("train")
        has_val = self.val_records is not None or self.val_path is not None
        val = self.pairs("val") if has_val else None

        def train_batches(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return RowBatches(train, batch, Partition(*partition), self.shuffle, self.seed)

        def val_batches(partition: Partition | tuple[int, int]) -> list[Batch]:
            out = padded_batches(val, batch, Partition(*partition))
            count = len(val["input_ids"])
            for index, item in enumerate(out):  # padding pairs get pad_id, like padded sides
                local = len(item["input_ids"])
                start = index * batch + Partition(*partition).index * local
                pad = np.arange(start, start + local) >= count
                item["input_ids"][pad] = self.pad_id
            return out

        return Dataset(
            train=train_batches,
            val=None if val is None else val_batches,
            records=len(train["input_ids"]),
            batch=batch,
        )
