"""Read prompt rows for GRPO from Parquet, JSON or in-memory records, and normalize each one.

A row holds a prompt and the reward metadata a reward function reads back:

* ``prompt`` (or the column the caller names): token ids (a list of ints), a string, or a list
  of ``{"role", "content", ...}`` messages. A string is always text, even when it looks like
  JSON.
* ``data_source``, ``ground_truth``, ``extra_info``: strings. A missing or null value becomes
  ``""``; any other non-string value becomes its JSON text with sorted keys and compact
  separators (``{"a":1,"b":[2,3]}``), so the same record gives the same bytes whichever format
  or key order it came in.
* verl's layout: ``ground_truth`` may sit in ``reward_model.ground_truth`` (the rest of
  ``reward_model``, its ``style``, is not carried); ``extra_info`` is kept whole, with its
  ``tools_kwargs``; ``ability`` and ``agent_name`` are checked to be strings and dropped.
  Rows carrying ``images`` or ``videos`` are refused: the prompt loader is text only.
* ``tools`` (optional): tool schemas, or their JSON text, passed to the chat template with a
  messages prompt.

Parquet is read with pyarrow, only the columns used. Parquet cannot tell a missing struct field
from a null one (a struct column holds every key any row had), so keys whose value is null are
dropped from mappings read from Parquet; JSON keeps an explicit ``null``. JSON files are parsed
with the standard ``json`` module, not a columnar reader: prompts of different kinds (ids in
one row, messages in the next) do not share one column type.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METADATA_FIELDS", "PromptRecord", "metadata_text", "parse_record", "read_records"]

METADATA_FIELDS = ("data_source", "ground_truth", "extra_info")
_READ = (*METADATA_FIELDS, "reward_model", "ability", "agent_name", "tools", "images", "videos")
_PARQUET = (".parquet", ".pq")
_JSON_LINES = (".jsonl", ".ndjson")
_ID_LIMIT = 2**31


@dataclass(frozen=True)
class PromptRecord:
    """One normalized row.

    Attributes:
        where: how errors name the row (``"row 3 of 'train.parquet'"``).
        kind: ``"ids"``, ``"text"`` or ``"messages"``.
        prompt: a list of ints, a str, or a list of message dicts, according to ``kind``.
        tools: tool schemas for the chat template, or None.
        data_source: the reward metadata, as text.
        ground_truth: the reward metadata, as text.
        extra_info: the reward metadata, as text.
    """

    where: str
    kind: str
    prompt: Any
    tools: list[Any] | None
    data_source: str
    ground_truth: str
    extra_info: str


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} has no JSON form")


def metadata_text(value: Any, field: str, where: str) -> str:
    """Reward metadata as text: a str unchanged, None as ``""``, anything else as JSON.

    Raises:
        ValueError: a value with no JSON form (bytes, a datetime, NaN, ...), naming the row.

    Example:
        >>> metadata_text({"b": [1, 2.5], "a": "é"}, "extra_info", "row 0")
        '{"a":"é","b":[1,2.5]}'
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(
            value,
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
            allow_nan=False,
            default=_json_default,
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{where}: field {field!r} is {type(value).__name__} {repr(value)[:60]}, which has no "
            f"JSON text ({error}); expected a string, or numbers, booleans, lists and mappings"
        ) from error


def _is_id(item: Any) -> bool:
    return isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_))


def _prompt_kind(value: Any, column: str, where: str) -> tuple[str, Any]:
    """Classify a prompt value as ids, text or messages; refuse anything else."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iuO":
        value = value.tolist()  # ids, or messages held in an object array
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: {column!r} is an empty string; expected a non-empty prompt")
        return "text", value
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{where}: {column!r} is {type(value).__name__} {repr(value)[:60]}; expected token ids "
            "(a list of ints), a string, or a list of {role, content} messages"
        )
    if not value:
        raise ValueError(f"{where}: {column!r} is an empty list; expected a non-empty prompt")
    if isinstance(value[0], Mapping):
        for index, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise TypeError(
                    f"{where}: {column!r}[{index}] is {type(message).__name__}; expected every "
                    "item of a messages prompt to be a {role, content} mapping"
                )
            if not isinstance(message.get("role"), str):
                raise ValueError(
                    f"{where}: {column!r}[{index}] has role {message.get('role')!r}; expected a "
                    "message with a string 'role'"
                )
        return "messages", [dict(m) for m in value]
    for index, item in enumerate(value):
        if not _is_id(item):
            raise TypeError(
                f"{where}: {column!r}[{index}] is {type(item).__name__} {item!r}; expected token "
                "ids (all ints) or messages (all {role, content} mappings)"
            )
        if not 0 <= item < _ID_LIMIT:
            raise ValueError(
                f"{where}: {column!r}[{index}] is {item}; expected a token id in [0, 2**31)"
            )
    return "ids", [int(i) for i in value]


def _tools(row: Mapping[str, Any], kind: str, where: str) -> list[Any] | None:
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}: field 'tools' is a string that is not valid JSON ({error.msg} at char "
                f"{error.pos}); expected a list of tool schemas or its JSON text"
            ) from error
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise TypeError(
            f"{where}: field 'tools' is {type(tools).__name__}; expected a list of tool schemas"
        )
    if tools and kind != "messages":
        raise ValueError(
            f"{where}: has tools but its prompt is {kind}; expected a messages prompt, since tool "
            "schemas reach the model only through the chat template"
        )
    return list(tools) or None


def _ground_truth(row: Mapping[str, Any], where: str) -> str:
    direct = metadata_text(row.get("ground_truth"), "ground_truth", where)
    reward_model = row.get("reward_model")
    if reward_model is None:
        return direct
    if not isinstance(reward_model, Mapping):
        raise TypeError(
            f"{where}: field 'reward_model' is {type(reward_model).__name__}; expected a mapping "
            "with 'ground_truth' (verl's layout)"
        )
    nested = metadata_text(reward_model.get("ground_truth"), "reward_model.ground_truth", where)
    if direct and nested and direct != nested:
        raise ValueError(
            f"{where}: ground_truth {direct[:40]!r} differs from reward_model.ground_truth "
            f"{nested[:40]!r}; expected one of them, or the same value in both"
        )
    return direct or nested


def parse_record(row: Any, column: str, where: str) -> PromptRecord:
    """Normalize one row (a mapping) into a :class:`PromptRecord`.

    Raises:
        TypeError: a row that is not a mapping, a prompt of the wrong type, ``ability`` or
            ``agent_name`` not a string, ``reward_model`` or ``tools`` of the wrong type.
        ValueError: a missing or empty prompt, ids out of range, media columns, metadata with
            no JSON form, or two different ground truths.

    Example:
        >>> row = {"prompt": [{"role": "user", "content": "2+2?"}], "ability": "math",
        ...        "reward_model": {"style": "rule", "ground_truth": "4"}}
        >>> record = parse_record(row, "prompt", "row 0")
        >>> record.kind, record.ground_truth, record.extra_info
        ('messages', '4', '')
    """
    if not isinstance(row, Mapping):
        raise TypeError(f"{where} is {type(row).__name__}; expected a mapping of fields")
    if row.get(column) is None:
        raise ValueError(f"{where} has no {column!r}; its fields are {sorted(map(str, row))}")
    kind, prompt = _prompt_kind(row[column], column, where)
    for field in ("ability", "agent_name"):  # verl's; read, checked, then dropped
        if row.get(field) is not None and not isinstance(row[field], str):
            raise TypeError(
                f"{where}: field {field!r} is {type(row[field]).__name__}; expected a string "
                "(verl's layout) or null"
            )
    for field in ("images", "videos"):
        media = row.get(field)
        if media is not None and not (isinstance(media, (list, tuple, dict)) and not media):
            raise ValueError(
                f"{where} has {field!r}; expected text-only prompts (the prompt loader would "
                "score image or video placeholder ids without the media)"
            )
    return PromptRecord(
        where=where,
        kind=kind,
        prompt=prompt,
        tools=_tools(row, kind, where),
        data_source=metadata_text(row.get("data_source"), "data_source", where),
        ground_truth=_ground_truth(row, where),
        extra_info=metadata_text(row.get("extra_info"), "extra_info", where),
    )


@dataclass(frozen=True)
class RecordSource:
    """Raw rows of one source, before normalization.

    Attributes:
        label: how errors name the source (a path, or ``"records"``).
        rows: ``(where, row)`` pairs in source order.
        ignored: columns present in the source that the prompt loader does not read.
    """

    label: str
    rows: list[tuple[str, Any]]
    ignored: tuple[str, ...]


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _missing_column(label: str, column: str, names: Iterable[str]) -> ValueError:
    return ValueError(
        f"{label!r} has no column {column!r}; its columns are {sorted(names)}; expected the "
        f"prompts in {column!r}"
    )


def _read_parquet(path: Path, column: str) -> RecordSource:
    import pyarrow as pa
    import pyarrow.dataset as pads

    label = os.fspath(path)
    try:
        dataset = pads.dataset(path, format="parquet")
        names = dataset.schema.names
        if column not in names:
            raise _missing_column(label, column, names)
        wanted = [n for n in (column, *_READ) if n in names]
        table = dataset.to_table(columns=wanted)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"path {label!r}: cannot read it as Parquet ({error})") from error
    rows = [_drop_nulls(r) for r in table.to_pylist(maps_as_pydicts="strict")]
    ignored = tuple(sorted(set(names) - {column, *_READ}))
    return RecordSource(label, [(f"row {i} of {label!r}", r) for i, r in enumerate(rows)], ignored)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: not valid JSON ({error.msg} at char {error.pos}); expected a JSON object"
        ) from error


def _read_json(path: Path) -> list[tuple[str, Any]]:
    label = os.fspath(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        rows = _parse_json(text, f"path {label!r}")
        return [(f"row {i} of {label!r}", r) for i, r in enumerate(rows)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():  # blank lines (a trailing newline, say) are not rows
            where = f"row {len(out)} (line {number}) of {label!r}"
            out.append((where, _parse_json(line, where)))
    return out


def _fields(rows: list[tuple[str, Any]]) -> set[str]:
    return {str(k) for _, r in rows if isinstance(r, Mapping) for k in r}


def _from_json_rows(label: str, rows: list[tuple[str, Any]], column: str) -> RecordSource:
    fields = _fields(rows)
    if rows and column not in fields:
        raise _missing_column(label, column, fields)
    return RecordSource(label, rows, tuple(sorted(fields - {column, *_READ})))


def read_records(path: Any = None, records: Any = None, *, column: str = "prompt") -> RecordSource:
    """Read the raw rows of exactly one of ``path`` and ``records``.

    Args:
        path: a ``.parquet``/``.pq`` file or a directory of them, a ``.jsonl``/``.ndjson`` file
            (one JSON object per line), or a ``.json`` file (JSON lines, or one array of
            objects).
        records: a sequence of mappings or of JSON object strings.
        column: the prompt column; the source must have it.

    Returns:
        A :class:`RecordSource`.

    Raises:
        ValueError: both or neither source given, an unknown file type, a missing prompt
            column, malformed JSON, an unreadable Parquet file, or no rows at all.
        FileNotFoundError: ``path`` does not exist.
        TypeError: ``records`` is not a sequence of mappings or strings.

    Example:
        >>> source = read_records(records=['{"prompt": [1, 2], "score": 1}'])
        >>> source.rows, source.ignored
        ([('records[0]', {'prompt': [1, 2], 'score': 1})], ('score',))
    """
    if (path is None) == (records is None):
        given = "both" if path is not None else "neither"
        raise ValueError(f"Prompts got {given} of path and records; expected exactly one")
    if records is not None:
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
            raise TypeError(
                f"records is a {type(records).__name__}; expected a sequence of mappings or "
                "JSON object strings"
            )
        rows = []
        for i, record in enumerate(records):
            where = f"records[{i}]"
            rows.append((where, _parse_json(record, where) if isinstance(record, str) else record))
        source = _from_json_rows("records", rows, column)
    else:
        local = Path(path)
        label = os.fspath(path)
        suffix = local.suffix.lower()
        if not local.exists():
            raise FileNotFoundError(f"path {label!r}: no such file or directory")
        if local.is_dir() or suffix in _PARQUET:
            source = _read_parquet(local, column)
        elif suffix in (*_JSON_LINES, ".json"):
            source = _from_json_rows(label, _read_json(local), column)
        else:
            raise ValueError(
                f"path {label!r} has suffix {suffix!r}; expected .parquet, .pq, .jsonl, .ndjson, "
                ".json or a directory of Parquet files"
            )
    if not source.rows:
        raise ValueError(f"{source.label!r} holds no rows; expected at least one prompt")
    return source
