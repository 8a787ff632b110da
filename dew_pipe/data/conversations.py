"""Read conversation rows from Parquet, JSONL or a locally cached Hub dataset.

Each row yields one :class:`Conversation`: its list of messages and, where the row has them,
its tool schemas. The messages come from the column the caller names (``messages`` by default)
or, in verl's layout, from a ``prompt`` column. Values may be lists or JSON strings.

Parquet is read with pyarrow, only the columns needed. JSONL is parsed line by line with the
standard ``json`` module rather than a columnar reader: messages are free-form JSON (optional
``tool_calls``, arguments given as objects in one row and strings in the next), and a columnar
reader would have to unify them into one schema, inventing null fields. Parquet cannot tell a
missing struct field from a null one, so keys whose value is null are dropped from dictionaries
read from Parquet; store tool schemas or tool-call arguments as JSON strings to keep explicit
nulls.

A Hub dataset id is read with the optional ``datasets`` package, offline: only what an earlier
``datasets.load_dataset`` call left in the local cache is used, nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["Conversation", "read_conversations"]

PROMPT_COLUMN = "prompt"  # verl keeps its chat messages here
TOOLS_COLUMN = "tools"
_PARQUET = (".parquet", ".pq")
_JSONL = (".jsonl", ".ndjson", ".json")  # .json: JSON Lines, as datasets reads it
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Conversation:
    """One row: the messages to render and the tool schemas to pass to the chat template.

    Attributes:
        messages: the row's messages, each a dict with at least ``role``.
        tools: tool schemas (JSON-schema dicts) for the template's ``tools`` argument, or None.
        line: the row's line number in a JSONL file (1-based), for error messages; None for
            other sources.
    """

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    line: int | None = dataclasses.field(default=None, compare=False)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _decode(value: Any, field: str, where: str) -> Any:
    """JSON-decode ``value`` when it is a string; other values pass through."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: field {field!r} is a string that is not valid JSON ({error.msg} at "
            f"char {error.pos}); expected a list or its JSON text"
        ) from error


def _conversation(
    row: Mapping[str, Any], column: str, where: str, line: int | None = None
) -> Conversation:
    """Build a Conversation from one row (a mapping of field to value)."""
    if row.get(column) is not None:
        field = column
    elif row.get(PROMPT_COLUMN) is not None:
        field = PROMPT_COLUMN
    else:
        raise ValueError(
            f"{where} has no {column!r} value (nor verl's {PROMPT_COLUMN!r}); its fields are "
            f"{sorted(row)}; expected a list of messages in {column!r}"
        )
    messages = _decode(row[field], field, where)
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: field {field!r} is {type(messages).__name__} {str(messages)[:60]!r}; "
            "expected a non-empty list of messages"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where}: {field}[{index}] is {type(message).__name__}; expected a mapping "
                "with 'role' and 'content'"
            )
    tools = _decode(row.get(TOOLS_COLUMN), TOOLS_COLUMN, where)
    if tools is not None and not isinstance(tools, list):
        raise ValueError(
            f"{where}: field {TOOLS_COLUMN!r} is {type(tools).__name__}; expected a list of tool "
            "schemas, their JSON text, or null"
        )
    return Conversation([dict(m) for m in messages], tools or None, line)


def _missing_column(path: str, column: str, names: Sequence[str]) -> ValueError:
    return ValueError(
        f"path {path!r}: no column {column!r} (nor verl's {PROMPT_COLUMN!r}); columns are "
        f"{list(names)}; expected conversations in {column!r}"
    )


def _from_table(table: pa.Table, path: str, column: str) -> list[Conversation]:
    names = table.column_names
    if column not in names and PROMPT_COLUMN not in names:
        raise _missing_column(path, column, names)
    keep = [n for n in (column, PROMPT_COLUMN, TOOLS_COLUMN) if n in names]
    rows = table.select(keep).to_pylist()
    return [
        _conversation(_drop_nulls(r), column, f"row {i} of {path!r}") for i, r in enumerate(rows)
    ]


def _read_parquet(path: Path, column: str) -> list[Conversation]:
    schema = pq.read_schema(path) if path.is_file() else None
    names = schema.names if schema is not None else None
    if names is not None and column not in names and PROMPT_COLUMN not in names:
        raise _missing_column(str(path), column, names)
    wanted = [c for c in (column, PROMPT_COLUMN, TOOLS_COLUMN) if names is None or c in names]
    try:
        table = pq.read_table(path, columns=wanted if names is not None else None)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"path {str(path)!r}: cannot read it as Parquet ({error})") from error
    return _from_table(table, str(path), column)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"path {str(path)!r} line {number}: not valid JSON ({error.msg} at char "
                    f"{error.pos}); expected one JSON object per line"
                ) from error
            if not isinstance(row, dict):
                raise ValueError(
                    f"path {str(path)!r} line {number}: a JSON {type(row).__name__}; expected "
                    "one JSON object per line"
                )
            yield number, row


def _read_jsonl(path: Path, column: str) -> list[Conversation]:
    rows = list(_jsonl_rows(path))
    if rows and not any(column in r or PROMPT_COLUMN in r for _, r in rows):
        names = sorted({k for _, r in rows for k in r})
        raise _missing_column(str(path), column, names)
    return [
        _conversation(row, column, f"row {i} (line {number}) of {str(path)!r}", number)
        for i, (number, row) in enumerate(rows)
    ]


@contextlib.contextmanager
def _offline(datasets_module: Any) -> Iterator[None]:
    """Force offline mode for ``datasets`` and ``huggingface_hub`` during the block.

    Both libraries read the environment once, at import, so their module flags are set too.
    """
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    config = getattr(datasets_module, "config", None)
    saved = (getattr(config, "HF_HUB_OFFLINE", None), hub_constants.HF_HUB_OFFLINE)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if config is not None:
        config.HF_HUB_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if config is not None:
            config.HF_HUB_OFFLINE = saved[0]
        hub_constants.HF_HUB_OFFLINE = saved[1]


def _hub_kwargs(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        options = {k: v for k, v in dataclasses.asdict(options).items() if v is not None}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options is {type(options).__name__}; expected a mapping (or dataclass) of "
            "datasets.load_dataset keyword arguments"
        )
    for key in ("path", "split", "streaming"):
        if key in options:
            raise ValueError(
                f"options[{key!r}] is set; expected it absent ({key} is "
                + ("given by ChatMessages.split" if key == "split" else "fixed by the loader")
                + ")"
            )
    return dict(options)


def _read_hub(dataset_id: str, split: str | None, options: Any, column: str) -> list[Conversation]:
    kwargs = _hub_kwargs(options)
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"path {dataset_id!r} is not a local file, so it is read as a Hub dataset id, which "
            "needs the optional 'datasets' package (pip install 'dew-pipe[hub]'); expected a "
            ".parquet or .jsonl file otherwise"
        ) from error
    with _offline(datasets):
        try:
            loaded = datasets.load_dataset(dataset_id, split=split, **kwargs)
        except Exception as error:  # datasets raises several types for "not cached"
            raise ValueError(
                f"path {dataset_id!r} (split {split!r}): not readable from the local Hub cache "
                f"({type(error).__name__}: {error}); dew_pipe reads Hub datasets offline, so "
                "load it once with datasets.load_dataset while online"
            ) from error
    if isinstance(loaded, Mapping):  # a DatasetDict: no split was named
        splits = sorted(loaded)
        if len(splits) != 1:
            raise ValueError(
                f"split is None but Hub dataset {dataset_id!r} has splits {splits}; expected "
                "split= naming one of them"
            )
        loaded = loaded[splits[0]]
    table = loaded.with_format("arrow")[:]
    return _from_table(table, f"{dataset_id}:{split or 'only split'}", column)


def read_conversations(
    path: str | os.PathLike[str],
    *,
    column: str = "messages",
    split: str | None = None,
    options: Any = None,
) -> list[Conversation]:
    """Read every row of ``path`` as a :class:`Conversation`.

    Args:
        path: a ``.parquet`` file or a directory of Parquet files, a ``.jsonl`` file, or a Hub
            dataset id (``owner/name``) already in the local ``datasets`` cache.
        column: the field holding each row's list of messages; rows without it are read from
            verl's ``prompt`` field.
        split: for a Hub dataset, the split to read (None: the only split there is).
        options: for a Hub dataset, more ``datasets.load_dataset`` keyword arguments
            (``name``, ``revision``, ``data_files``, ...), as a mapping or a dataclass.

    Returns:
        The conversations, in file order.

    Raises:
        ValueError: a missing column, an empty file, a malformed row or line (named by index),
            a file of another kind, or a Hub dataset that is not cached.
        FileNotFoundError: ``path`` looks like a file path but does not exist.
        ImportError: ``path`` is a Hub id and ``datasets`` is not installed.

    Example:
        >>> import json, tempfile, pathlib
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "chat.jsonl"
        >>> _ = file.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
        >>> read_conversations(file)[0].messages
        [{'role': 'user', 'content': 'Hi'}]
    """
    local = Path(path)
    text = os.fspath(path)
    if local.is_dir() or local.suffix.lower() in _PARQUET:
        if not local.exists():
            raise FileNotFoundError(f"path {text!r}: no such Parquet file or directory")
        conversations = _read_parquet(local, column)
    elif local.suffix.lower() in _JSONL:
        if not local.exists():
            raise FileNotFoundError(f"path {text!r}: no such JSONL file")
        conversations = _read_jsonl(local, column)
    elif local.exists():
        raise ValueError(
            f"path {text!r} has suffix {local.suffix!r}; expected .parquet, .pq, .jsonl, .json, "
            ".ndjson, a directory of Parquet files, or a Hub dataset id"
        )
    elif _HUB_ID.match(text) and not text.startswith((".", "/")):
        conversations = _read_hub(text, split, options, column)
    else:
        raise FileNotFoundError(f"path {text!r}: no such file, and not a Hub dataset id")
    if not conversations:
        raise ValueError(f"path {text!r} holds no conversations; expected at least one row")
    return conversations
