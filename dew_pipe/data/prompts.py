"""Prompt batches for GRPO: left-padded prompt ids and their reward metadata as UTF-8 bytes.

:class:`Prompts` reads rows (see :mod:`dew_pipe.data.prompt_rows` for the accepted layouts,
verl's included), turns each prompt into token ids and lays every row out in fixed shapes, so a
compiled rollout sees one batch shape for the whole dataset:

==============  ===============  ===========================================================
field           dtype, shape     meaning
==============  ===============  ===========================================================
prompt          int32 [B, P]     prompt ids, left-padded with ``pad_id``; P = max_prompt_len
prompt_length   int32 [B]        real ids at the end of each row (0 on validation filler rows)
data_source     int32 [B, M1]    UTF-8 bytes of the row's data_source, zero-padded
ground_truth    int32 [B, M2]    UTF-8 bytes of the ground truth, zero-padded
extra_info      int32 [B, M3]    UTF-8 bytes of extra_info (JSON text for structures)
task_id         int32 [B]        the row's index in its source (-1 on validation filler rows)
==============  ===============  ===========================================================

Token ids are taken as they are and never load a tokenizer. A string is encoded with the
tokenizer (``add_special_tokens`` as the tokenizer's ``encode`` does by default); messages are
rendered with the chat template and ``add_generation_prompt=True``, then encoded without adding
special tokens again, since the template writes its own. A prompt longer than P keeps its last
P ids: the end of a prompt (the question, the generation header) is what the model answers. The
cut prompts are counted in :attr:`Prompts.truncated` and ``stats``.

Each metadata width M is fixed for the dataset: the longest value in bytes over the training
and validation rows, or the limit given in ``max_metadata_bytes`` (then a longer value is an
error naming its row). :func:`decode_text_column` turns a column back into strings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.data.dataset import Batch, Dataset, Loading, Partition
from dew_pipe.data.prompt_rows import METADATA_FIELDS, PromptRecord, parse_record, read_records
from dew_pipe.data.text_columns import decode_text_column, encode_text_column

__all__ = ["Prompts", "decode_text_column", "encode_text_column"]

_INT32_MAX = 2**31 - 1  # sizes and ids are stored as int32


def _metadata_limits(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        width = check_int("max_metadata_bytes", value, minimum=0, maximum=_INT32_MAX)
        return dict.fromkeys(METADATA_FIELDS, width)
    unknown = sorted(set(value) - set(METADATA_FIELDS))
    if unknown:
        raise ValueError(
            f"max_metadata_bytes has keys {unknown}; expected some of {list(METADATA_FIELDS)}"
        )
    return {
        k: check_int(f"max_metadata_bytes[{k!r}]", v, minimum=0, maximum=_INT32_MAX)
        for k, v in value.items()
    }


def _render(tokenizer: Any, record: PromptRecord) -> str:
    try:
        return tokenizer.apply_chat_template(
            record.prompt, tools=record.tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as error:  # jinja2 TemplateError, TypeError, ... from the template
        raise ValueError(
            f"{record.where}: the chat template failed on its messages "
            f"({type(error).__name__}: {error})"
        ) from error


def _encode_chunk(
    tokenizer: Any, add_special_tokens: bool, chunk: list[PromptRecord]
) -> list[list[int]]:
    """Token ids of a chunk of text and messages prompts (a worker entry point: picklable)."""
    texts = [r for r in chunk if r.kind == "text"]
    chats = [r for r in chunk if r.kind == "messages"]
    encoded: dict[int, list[int]] = {}
    if texts:
        ids = tokenizer([r.prompt for r in texts], add_special_tokens=add_special_tokens)
        encoded.update(zip(map(id, texts), ids["input_ids"], strict=True))
    if chats:
        rendered = [_render(tokenizer, r) for r in chats]
        ids = tokenizer(rendered, add_special_tokens=False)
        encoded.update(zip(map(id, chats), ids["input_ids"], strict=True))
    out = []
    for record in chunk:
        ids = list(encoded[id(record)])
        if not ids:
            raise ValueError(
                f"{record.where}: its {record.kind} prompt encodes to no tokens; expected a "
                "non-empty prompt"
            )
        out.append(ids)
    return out


def _left_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``[n, width]`` rows holding the last ``width`` ids of each prompt, padded on the left."""
    prompt = np.full((len(ids), width), pad_id, dtype=np.int32)
    lengths = np.zeros(len(ids), dtype=np.int32)
    for row, values in enumerate(ids):
        kept = values[-width:]
        prompt[row, width - len(kept) :] = kept
        lengths[row] = len(kept)
    return prompt, lengths


class Prompts:
    """GRPO prompts from Parquet, JSON or in-memory records, as fixed-shape prompt batches.

    Each row holds a prompt (token ids, a string, or ``{role, content}`` messages) and
    optionally ``data_source``, ``ground_truth`` and ``extra_info``; verl's layout (the ground
    truth in ``reward_model.ground_truth``, ``extra_info`` with its ``tools_kwargs``) is read
    too. See the module docstring for the batch layout and :mod:`dew_pipe.data.prompt_rows`
    for how rows are read.

    Args:
        path: a ``.parquet``/``.pq`` file or directory, a ``.jsonl``/``.ndjson`` file, or a
            ``.json`` file of JSON lines or one array. Give exactly one of path and records.
        records: a sequence of mappings or of JSON object strings.
        tokenizer: a transformers tokenizer, or a local directory / Hub name for
            ``AutoTokenizer.from_pretrained``. Needed for string and messages prompts (messages
            need its chat template); id prompts never need it.
        max_prompt_len: P, the width of ``prompt``; longer prompts keep their last P ids.
        column: the field holding each row's prompt.
        pad_id: the id written into the left padding. Default: the tokenizer's pad id when a
            tokenizer object was given or a tokenizer path was loaded to encode some prompt,
            else 0 (also when the tokenizer has no pad token). A path is never loaded just for
            this, so id prompts with a tokenizer path pad with 0 unless ``pad_id`` is given.
            Padding is never read as a token: ``prompt_length`` says where prompts start.
        max_metadata_bytes: fixes metadata widths: an int for all three fields, or a mapping
            from field name to width. A value longer than its limit is an error. Fields without
            a limit get the longest value's byte length.
        add_special_tokens: passed to the tokenizer for string prompts (a BOS token, for
            tokenizers that add one); rendered chat templates never get more special tokens.
        val_path: validation prompts, read like ``path``; None for none.
        val_records: validation prompts, read like ``records``.
        shuffle: visit the training rows in a new seeded order each epoch.
        seed: seed of that order.
        loading: how to tokenize (``workers`` processes or ``threads``); default ``Loading()``.

    Raises:
        TypeError: a setting of the wrong type.
        ValueError: both or neither of path and records, both val_path and val_records, or a
            setting out of range. Reading errors surface from :meth:`load` and :meth:`arrays`.

    Example:
        >>> data = Prompts(records=[{"prompt": [5, 6, 7], "ground_truth": "dog"},
        ...                         {"prompt": [8], "extra_info": {"index": 1}}],
        ...                max_prompt_len=4).load(batch=2)
        >>> batch = next(data.train((0, 1)))
        >>> sorted(batch)
        ['data_source', 'extra_info', 'ground_truth', 'prompt', 'prompt_length', 'task_id']
        >>> order = np.argsort(batch["task_id"])
        >>> batch["prompt"][order].tolist(), batch["prompt_length"][order].tolist()
        ([[0, 5, 6, 7], [0, 0, 0, 8]], [3, 1])
        >>> decode_text_column(batch["extra_info"][order])
        ['', '{"index":1}']
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        records: Any = None,
        tokenizer: Any = None,
        max_prompt_len: int | None = None,
        *,
        column: str = "prompt",
        pad_id: int | None = None,
        max_metadata_bytes: int | Mapping[str, int] | None = None,
        add_special_tokens: bool = True,
        val_path: str | os.PathLike[str] | None = None,
        val_records: Any = None,
        shuffle: bool = True,
        seed: int = 0,
        loading: Loading | None = None,
    ) -> None:
        if (path is None) == (records is None):
            given = "both" if path is not None else "neither"
            raise ValueError(f"Prompts got {given} of path and records; expected exactly one")
        if val_path is not None and val_records is not None:
            raise ValueError("Prompts got both val_path and val_records; expected at most one")
        if max_prompt_len is None:
            raise ValueError("max_prompt_len is missing; expected an int >= 1 (the width P)")
        self.max_prompt_len = check_int(
            "max_prompt_len", max_prompt_len, minimum=1, maximum=_INT32_MAX
        )
        if not isinstance(column, str) or not column:
            raise TypeError(f"column is {column!r}; expected a non-empty str")
        if loading is not None and not isinstance(loading, Loading):
            raise TypeError(f"loading is {type(loading).__name__}; expected a Loading")
        if not (
            tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) or callable(tokenizer)
        ):
            raise TypeError(
                f"tokenizer is {type(tokenizer).__name__}; expected a transformers tokenizer, "
                "a local tokenizer directory or a Hub name"
            )
        self._pad_id = (
            None if pad_id is None else check_int("pad_id", pad_id, minimum=0, maximum=_INT32_MAX)
        )
        self._limits = _metadata_limits(max_metadata_bytes)
        self._sources = {"train": (path, records), "val": (val_path, val_records)}
        self._tokenizer_spec = tokenizer
        self._tokenizer: Any = None if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        self.column = column
        self.add_special_tokens = bool(add_special_tokens)
        self.shuffle = bool(shuffle)
        self.seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1)
        self.loading = loading or Loading()
        self.stats: dict[str, dict[str, Any]] = {}
        self._parsed: dict[str, tuple[list[PromptRecord], list[list[int]]]] = {}
        self._arrays: dict[str, dict[str, np.ndarray]] = {}

    # --- tokenizer and padding ------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded from its path on first access), or None when none was given."""
        return None if self._tokenizer_spec is None else self._require_tokenizer("Prompts")

    def _require_tokenizer(self, needed_by: str) -> Any:
        """The tokenizer, loaded on first use; ``needed_by`` names the row that needs it.

        Raises:
            ValueError: no tokenizer was given, or its path cannot be loaded.
        """
        if self._tokenizer is None:
            if self._tokenizer_spec is None:
                raise ValueError(
                    f"{needed_by}: a tokenizer is needed to encode this prompt, but tokenizer is "
                    "None; expected tokenizer= (or token-id prompts)"
                )
            from transformers import AutoTokenizer

            name = os.fspath(self._tokenizer_spec)
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(name)
            except (OSError, ValueError) as error:
                raise ValueError(
                    f"tokenizer {name!r}: cannot load it ({error}); expected a local tokenizer "
                    "directory or a cached Hub name"
                ) from error
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        """The id of the left padding (see the ``pad_id`` argument); reads the prompts first."""
        if self._pad_id is None:
            for which in self._splits():  # a string or messages row may load the tokenizer
                self._source(which)
            tokenizer = self._tokenizer  # never loaded just for this: id prompts need none
            pad = None if tokenizer is None else getattr(tokenizer, "pad_token_id", None)
            self._pad_id = 0 if pad is None else int(pad)
        return self._pad_id

    # --- reading and tokenizing -----------------------------------------------------------

    def _source(self, which: str) -> tuple[list[PromptRecord], list[list[int]]]:
        """Parse and tokenize one split (cached): its records and their uncut token ids."""
        if which not in self._parsed:
            path, records = self._sources[which]
            source = read_records(path, records, column=self.column)
            parsed = [parse_record(row, self.column, where) for where, row in source.rows]
            ids = self._token_ids(parsed)
            lengths = np.array([len(x) for x in ids], dtype=np.int64)
            self.stats[which] = {
                "prompts": len(parsed),
                "tokens": int(lengths.sum()),
                "longest": int(lengths.max()),
                "truncated": int((lengths > self.max_prompt_len).sum()),
                "kinds": {k: sum(r.kind == k for r in parsed) for k in ("ids", "text", "messages")},
                "ignored_columns": list(source.ignored),
            }
            self._parsed[which] = (parsed, ids)
        return self._parsed[which]

    def _token_ids(self, parsed: list[PromptRecord]) -> list[list[int]]:
        encode = [r for r in parsed if r.kind != "ids"]
        encoded: dict[int, list[int]] = {}
        if encode:
            tokenizer = self._require_tokenizer(f"{encode[0].where} ({encode[0].kind} prompt)")
            chat = next((r for r in encode if r.kind == "messages"), None)
            if chat is not None and not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"{chat.where}: its prompt is messages but the tokenizer has no chat "
                    "template; expected a tokenizer with one (or string or id prompts)"
                )
            workers = max(self.loading.workers, self.loading.threads, 1)
            size = max(64, -(-len(encode) // (4 * workers)))  # a few chunks per worker
            chunks = [encode[i : i + size] for i in range(0, len(encode), size)]
            fn = functools.partial(_encode_chunk, tokenizer, self.add_special_tokens)
            with self.loading.map(fn, chunks) as results:
                done = [ids for chunk in results for ids in chunk]
            encoded = dict(zip(map(id, encode), done, strict=True))
        return [r.prompt if r.kind == "ids" else encoded[id(r)] for r in parsed]

    def metadata_bytes(self) -> dict[str, int]:
        """The width M of each metadata field: its limit, or the longest value in bytes.

        The longest value is taken over the training and validation rows together, so both
        splits give batches of the same shapes.

        Raises:
            ValueError: reading errors (see :meth:`arrays`).
        """
        widths = {}
        for field in METADATA_FIELDS:
            if field in self._limits:
                widths[field] = self._limits[field]
                continue
            widths[field] = max(
                len(getattr(r, field).encode("utf-8"))
                for which in self._splits()
                for r in self._source(which)[0]
            )
        return widths

    @property
    def has_val(self) -> bool:
        """Whether validation prompts were given."""
        return any(v is not None for v in self._sources["val"])

    def _splits(self) -> list[str]:
        return ["train", "val"] if self.has_val else ["train"]

    def arrays(self, which: str = "train") -> dict[str, np.ndarray]:
        """Every row of one split as arrays (the batch layout, with all rows on axis 0).

        Args:
            which: ``"train"`` or ``"val"``.

        Returns:
            ``prompt``, ``prompt_length``, ``data_source``, ``ground_truth``, ``extra_info``
            and ``task_id`` (see the module docstring).

        Raises:
            ValueError: a reading error naming the row (missing or empty prompt, a string or
                messages prompt without a tokenizer, metadata longer than its limit, ...), or
                ``which="val"`` without validation prompts.
            TypeError: a prompt or field of the wrong type, naming the row.
        """
        if which not in ("train", "val"):
            raise ValueError(f"which is {which!r}; expected 'train' or 'val'")
        if which == "val" and not self.has_val:
            raise ValueError("which is 'val' but no val_path or val_records was given")
        if which not in self._arrays:
            parsed, ids = self._source(which)
            widths = self.metadata_bytes()
            prompt, lengths = _left_pad(ids, self.max_prompt_len, self.pad_id)
            out = {"prompt": prompt, "prompt_length": lengths}
            for field in METADATA_FIELDS:
                values = [getattr(r, field) for r in parsed]
                sizes = np.array([len(v.encode("utf-8")) for v in values], dtype=np.int64)
                if sizes.max() > widths[field]:
                    row = int(np.argmax(sizes > widths[field]))
                    raise ValueError(
                        f"{parsed[row].where}: field {field!r} is {int(sizes[row])} UTF-8 bytes, "
                        f"over max_metadata_bytes {widths[field]}; expected at most that many"
                    )
                out[field] = encode_text_column(values, widths[field], field=field)
            out["task_id"] = np.arange(len(parsed), dtype=np.int32)
            self._arrays[which] = out
        return self._arrays[which]

    @property
    def truncated(self) -> int:
        """How many training prompts were longer than ``max_prompt_len`` and lost their start."""
        self.arrays("train")
        return self.stats["train"]["truncated"]

    # --- batches --------------------------------------------------------------------------

    def load(self, batch: int) -> Dataset:
        """Read and tokenize the prompts; return them as a :class:`Dataset` of prompt batches.

        Training batches run forever, epoch after epoch (in a new seeded order each epoch when
        ``shuffle``); the iterator has ``get_state``/``set_state`` so a resumed run continues
        exactly. Validation batches cover the validation rows once; the last batch is filled
        up with rows of ``prompt_length`` 0 and ``task_id`` -1, which hold no prompt
        transition. Each process of a :class:`Partition` gets its ``batch // count`` rows.

        Args:
            batch: rows per global batch.

        Returns:
            A Dataset whose ``records`` is the number of training prompts. ``stats`` then holds,
            per split, the number of prompts, their tokens before cutting, the longest, how
            many were cut, how many of each prompt kind, and the source columns not read.

        Raises:
            ValueError: ``batch`` below 1, and the reading errors of :meth:`arrays`.
        """
        from dew_pipe.data.packing import RowBatches

        batch = check_int("batch", batch, minimum=1, maximum=_INT32_MAX)
        train = self.arrays("train")
        val = self.arrays("val") if self.has_val else None

        def train_batches(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return RowBatches(train, batch, Partition(*partition), self.shuffle, self.seed)

        def val_batches(partition: Partition | tuple[int, int]) -> list[Batch]:
            return _val_batches(val, batch, Partition(*partition), self.pad_id)

        return Dataset(
            train=train_batches,
            val=None if val is None else val_batches,
            records=len(train["prompt"]),
            batch=batch,
        )


def _val_batches(
    rows: Mapping[str, np.ndarray], batch: int, partition: Partition, pad_id: int
) -> list[dict[str, np.ndarray]]:
    """Every row once, in order; the last batch filled up with empty prompt rows."""
    local = partition.local_batch(batch)
    count = len(rows["prompt"])
    fill = -count % batch
    full = {}
    for name, array in rows.items():
        value = {"prompt": pad_id, "task_id": -1}.get(name, 0)
        padding = np.full((fill, *array.shape[1:]), value, dtype=array.dtype)
        full[name] = np.concatenate([array, padding])
    out = []
    for start in range(0, count + fill, batch):
        low = start + partition.index * local
        out.append({name: array[low : low + local] for name, array in full.items()})
    return out
