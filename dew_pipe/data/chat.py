"""Chat conversations as packed, role-labelled token rows for supervised fine-tuning.

Roles come from the tokenizer's own chat template, rendered one prefix at a time: the tokens
that message ``k`` adds to the render of messages ``[:k]`` get message ``k``'s role. For an
assistant message the template is also rendered with ``add_generation_prompt=True``; the header
that adds (``<|im_start|>assistant\\n`` in ChatML) gets :attr:`Role.NONE`, so the assistant span
holds exactly what the model has to generate: content, tool calls and the end-of-turn tokens.
Anything a template writes before the first message (a BOS token, a tools block) belongs to
the first message's role.

Every prefix's token ids must be a prefix of the next render's ids; a template that rewrites
earlier turns (dropping past reasoning, say) or tokens that merge across a message boundary
make that false, and the conversation is refused with its row number rather than labelled
wrongly. Passing the check does not prove a template's roles right; look at
:meth:`ChatMessages.tokenized` for a few typical rows before a long run.

Message content must be text (a string, or a list of text parts, joined); None is kept only on
an assistant message with ``tool_calls``. Other content (a number, a dict, an image part) is
refused naming the message's index and role, since a template would render it as nothing or
as its repr and the tokens it should give would silently be lost.

Rendering costs two template calls per message and one batched tokenizer call per conversation
(prefix renders share it); ``Loading(workers=n)`` spreads conversations over processes.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.data.conversations import Conversation, read_conversations
from dew_pipe.data.dataset import Batch, Dataset, Loading, Partition
from dew_pipe.data.packing import pack_documents

__all__ = ["ChatMessages", "Role", "load_chat_tokenizer", "tokenize_conversation"]


class Role(enum.IntEnum):
    """Who wrote a token; stored as int8 in ``text_roles``.

    ``NONE`` marks padding and template tokens that belong to no message (the assistant
    generation header).

    Example:
        >>> Role.ASSISTANT == 3, Role["TOOL"]
        (True, <Role.TOOL: 4>)
    """

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4


_ROLE_NAMES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}
_ROLE_NAMES["tool"] = Role.TOOL


def _content(message: Mapping[str, Any], index: int, role: str, where: str) -> Any:
    """The content to render: a string, or None on an assistant turn that calls tools."""
    what = f"{where}: message {index} ({role})"
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return None  # OpenAI's format: an assistant turn made only of tool calls
        missing = "no content" if "content" not in message else "content None"
        raise ValueError(
            f"{what} has {missing}; expected a string (null content is allowed only on an "
            "assistant message with tool_calls)"
        )
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text":
                part = part.get("text")
            if not isinstance(part, str):
                raise ValueError(
                    f"{what}: content part {k} is {_describe(part)}; expected text parts only "
                    '(strings or {"type": "text", "text": ...})'
                )
            texts.append(part)
        return "".join(texts)
    raise ValueError(
        f"{what} has content {_describe(content)}; expected a string or a list of text parts "
        "(it would render as nothing, or as its Python repr, and its tokens would be lost)"
    )


def _describe(value: Any) -> str:
    if isinstance(value, Mapping) and "type" in value:
        return f"a {type(value).__name__} of type {value['type']!r}"
    return f"{type(value).__name__} {repr(value)[:40]}"


def _checked_messages(
    messages: Sequence[Any], where: str
) -> tuple[list[dict[str, Any]], list[Role]]:
    """Copies of ``messages`` with their content as the template should see it, and roles.

    Content is refused unless it is text: a string; a list of text parts (a string or
    ``{"type": "text", "text": ...}`` each), which becomes their concatenation, as this
    project's chat template and transformers' multimodal templates render consecutive text
    parts; or None (or absent) on an assistant message with ``tool_calls``, which OpenAI's
    format allows. Anything else (a number, a dict, an image part) would be rendered as
    nothing or as its repr by a template, and the tokens it should have given would be lost.
    """
    checked, roles = [], []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where}: message {index} is {type(message).__name__} {str(message)[:40]!r}; "
                "expected a mapping with 'role' and 'content'"
            )
        name = message.get("role")
        if name not in _ROLE_NAMES:
            raise ValueError(
                f"{where}: message {index} has role {name!r}; expected one of {sorted(_ROLE_NAMES)}"
            )
        copy = dict(message)
        copy["content"] = _content(message, index, name, where)
        if copy["content"] is None and "content" not in message:
            del copy["content"]  # as given: a template may test for the key
        checked.append(copy)
        roles.append(_ROLE_NAMES[name])
    if roles[0] not in (Role.SYSTEM, Role.USER):
        raise ValueError(
            f"{where} starts with a {checked[0]['role']!r} message; expected a conversation "
            "that starts with a system or user message"
        )
    return checked, roles


def _render(tokenizer: Any, messages: list, tools: list | None, prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt
        )
    except Exception as error:  # jinja2 TemplateError, TypeError, ... from the template
        raise ValueError(
            f"{where}: the chat template failed on messages[:{len(messages)}] "
            f"({type(error).__name__}: {error})"
        ) from error


def _check_prefix(shorter: list[int], longer: list[int], what: str, where: str) -> None:
    if longer[: len(shorter)] == shorter:
        return
    n = min(len(shorter), len(longer))
    at = next((i for i in range(n) if shorter[i] != longer[i]), n)
    raise ValueError(
        f"{where}: the chat template is not append-only: {what} changes token {at} (of "
        f"{len(shorter)} already rendered); expected each render to extend the previous one "
        "(the template rewrites earlier turns, or tokens merge across a message boundary)"
    )


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: list | None = None,
    *,
    where: str = "conversation",
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and per-token roles of one conversation, from the tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: the conversation; it must start with a system or user message, and roles
            are ``system``, ``user``, ``assistant`` or ``tool``. Content must be text: a
            string, or a list of text parts (rendered as their concatenation); None or absent
            only on an assistant message with ``tool_calls``.
        tools: tool schemas passed to the template as ``tools``, or None.
        where: how errors name the conversation (e.g. ``"row 3 of 'chat.jsonl'"``).

    Returns:
        ``(ids, roles)``: int32 token ids of the whole render and int8 :class:`Role` values.

    Raises:
        ValueError: a message that is not a mapping, an unknown role, content that is not
            text (each naming the message's index and role), a conversation that starts with
            an assistant or tool message, a template error, or a template that is not
            append-only.

    Example:
        >>> from dew_pipe.data.tokenizer import build_tokenizer
        >>> tok = build_tokenizer(["What is two plus two? Four."] * 10, vocab_size=300)
        >>> ids, roles = tokenize_conversation(tok, [{"role": "user", "content": "Hi"},
        ...                                          {"role": "assistant", "content": "Four."}])
        >>> tok.decode(ids[roles == Role.ASSISTANT])
        'Four.<|im_end|>\\n'
    """
    if not messages:
        raise ValueError(f"{where} has no messages; expected at least one")
    messages, message_roles = _checked_messages(messages, where)
    texts, header_of = [], {}
    for k, role in enumerate(message_roles):
        if role == Role.ASSISTANT:  # never k == 0: checked above
            header_of[k] = len(texts)
            texts.append(_render(tokenizer, messages[:k], tools, True, where))
        texts.append(_render(tokenizer, messages[: k + 1], tools, False, where))
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    roles: list[int] = []
    previous: list[int] = []
    cursor = 0
    for k, role in enumerate(message_roles):
        if role == Role.ASSISTANT:
            header = encoded[header_of[k]]
            _check_prefix(previous, header, f"the generation header after message {k - 1}", where)
            roles += [Role.NONE] * (len(header) - len(previous))
            previous = header
            cursor += 1
        current = encoded[cursor]
        _check_prefix(previous, current, f"message {k}", where)
        roles += [role] * (len(current) - len(previous))
        previous = current
        cursor += 1
    return np.asarray(previous, dtype=np.int32), np.asarray(roles, dtype=np.int8)


def _tokenize_chunk(
    tokenizer: Any, width: int, truncate: bool, chunk: list[tuple[str, Conversation]]
) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """Tokenize a chunk of conversations (a worker-process entry point: picklable)."""
    out = []
    for where, conversation in chunk:
        ids, roles = tokenize_conversation(
            tokenizer, conversation.messages, conversation.tools, where=where
        )
        cut = len(ids) > width
        if cut and not truncate:
            raise ValueError(
                f"{where} is {len(ids)} tokens, longer than seq_len + 1 = {width}; expected at "
                "most that many (raise seq_len, shorten it, or pass truncate=True to cut it)"
            )
        out.append((ids[:width], roles[:width], cut))
    return out


def load_chat_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer with a chat template, from itself or a path or Hub name.

    Args:
        tokenizer: a tokenizer object (anything with ``apply_chat_template``), or a local
            directory / Hub name for ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: a path that cannot be loaded, or a tokenizer without a chat template.
        TypeError: anything else.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        try:
            loaded = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        except (OSError, ValueError) as error:
            raise ValueError(
                f"tokenizer {os.fspath(tokenizer)!r}: cannot load it ({error}); expected a local "
                "tokenizer directory or a Hub name"
            ) from error
        name = os.fspath(tokenizer)
    elif callable(getattr(tokenizer, "apply_chat_template", None)):
        loaded, name = tokenizer, getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    else:
        raise TypeError(
            f"tokenizer is {type(tokenizer).__name__}; expected a Hub name, a local path or a "
            "transformers tokenizer"
        )
    if not getattr(loaded, "chat_template", None):
        raise ValueError(
            f"tokenizer {name!r} has no chat template; expected one (set tokenizer.chat_template "
            "or use a chat model's tokenizer)"
        )
    return loaded


class ChatMessages:
    """Conversations from a file or a cached Hub dataset, packed into role-labelled rows.

    Each row of the source holds one conversation: a list of ``{"role", "content", ...}``
    messages in ``column`` (or in verl's ``prompt`` column), optionally with tool schemas in a
    ``tools`` column. Messages may carry ``tool_calls``; ``tool`` messages carry results. Every
    conversation is rendered with the tokenizer's chat template (see :func:`tokenize_conversation`)
    and the conversations are packed first-fit into rows of ``seq_len + 1`` tokens.

    A conversation longer than ``seq_len + 1`` tokens is refused with an error naming its row
    and length, because cutting it silently would train on a conversation that ends mid-turn.
    With ``truncate=True`` it is cut to ``seq_len + 1`` tokens instead, and counted in
    ``stats["truncated"]``.

    Args:
        tokenizer: a Hub name or local directory for ``AutoTokenizer.from_pretrained``, or a
            transformers tokenizer object. It must have a chat template.
        path: a ``.parquet`` file (or a directory of them), a ``.jsonl`` file, or a Hub dataset
            id read offline from the local ``datasets`` cache.
        seq_len: the prediction length L; rows are L + 1 tokens wide.
        column: the field holding each row's messages.
        split: for a Hub dataset, the split to read (None: its only split).
        options: for a Hub dataset, more ``datasets.load_dataset`` keyword arguments.
        val_path: conversations for validation, read like ``path``; None for no validation.
        truncate: cut over-long conversations to ``seq_len + 1`` tokens instead of refusing.
        shuffle: visit the packed training rows in a new seeded order each epoch.
        seed: seed of that order.
        loading: how to tokenize (``workers`` processes or ``threads``); default ``Loading()``.
        val_split: for a Hub ``val_path``, its split (default: ``split``).

    Raises:
        TypeError: a setting of the wrong type, or a tokenizer that is none of the above.
        ValueError: a tokenizer without a chat template, or ``seq_len`` below 1.

    Example:
        >>> import json, tempfile, pathlib
        >>> from dew_pipe.data.tokenizer import build_tokenizer
        >>> tok = build_tokenizer(["What is two plus two? Four."] * 10, vocab_size=300)
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "chat.jsonl"
        >>> row = {"messages": [{"role": "user", "content": "What is two plus two?"},
        ...                     {"role": "assistant", "content": "Four."}]}
        >>> _ = file.write_text(json.dumps(row) + "\\n")
        >>> data = ChatMessages(tok, file, seq_len=31).load(batch=2)
        >>> batch = next(data.train((0, 1)))
        >>> batch["text"].shape, batch["text_roles"].dtype
        ((2, 32), dtype('int8'))
    """

    def __init__(
        self,
        tokenizer: Any,
        path: str | os.PathLike[str],
        seq_len: int,
        column: str = "messages",
        split: str | None = None,
        options: Any = None,
        val_path: str | os.PathLike[str] | None = None,
        *,
        truncate: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        loading: Loading | None = None,
        val_split: str | None = None,
    ) -> None:
        seq_len = check_int("seq_len", seq_len, minimum=1)
        if not isinstance(column, str) or not column:
            raise TypeError(f"column is {column!r}; expected a non-empty str")
        if loading is not None and not isinstance(loading, Loading):
            raise TypeError(f"loading is {type(loading).__name__}; expected a Loading")
        self.tokenizer = load_chat_tokenizer(tokenizer)
        self.path, self.val_path = path, val_path
        self.seq_len = int(seq_len)
        self.column, self.split, self.options = column, split, options
        self.val_split = split if val_split is None else val_split
        self.truncate, self.shuffle, self.seed = bool(truncate), bool(shuffle), int(seed)
        self.loading = loading or Loading()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = 0 if pad is None else int(pad)
        self.stats: dict[str, dict[str, float]] = {}
        self._cache: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def tokenized(self, which: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
        """The ``(ids, roles)`` of every conversation, in file order, before packing.

        Use it to look at how a template labels typical rows before a real run.

        Args:
            which: ``"train"`` (``path``) or ``"val"`` (``val_path``).

        Returns:
            One ``(int32 ids, int8 roles)`` pair per conversation (cut when ``truncate``).

        Raises:
            ValueError: any reading or rendering error, naming the row; ``which="val"``
                without a ``val_path``.
        """
        if which not in ("train", "val"):
            raise ValueError(f"which is {which!r}; expected 'train' or 'val'")
        if which not in self._cache:
            path, split = (
                (self.path, self.split) if which == "train" else (self.val_path, self.val_split)
            )
            if path is None:
                raise ValueError("which is 'val' but val_path is None; expected a val_path")
            self._cache[which] = self._tokenize(path, split, which)
        return self._cache[which]

    def _tokenize(
        self, path: Any, split: str | None, which: str
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        conversations = read_conversations(
            path, column=self.column, split=split, options=self.options
        )
        label = os.fspath(path)
        items = [
            (f"row {i} of {label!r}" + (f" (line {c.line})" if c.line else ""), c)
            for i, c in enumerate(conversations)
        ]
        workers = max(self.loading.workers, self.loading.threads, 1)
        size = max(16, -(-len(items) // (4 * workers)))  # a few chunks per worker
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        fn = functools.partial(_tokenize_chunk, self.tokenizer, self.seq_len + 1, self.truncate)
        with self.loading.map(fn, chunks) as results:
            done = [doc for chunk in results for doc in chunk]
        ids = [d[0] for d in done]
        self.stats[which] = {
            "conversations": len(done),
            "tokens": int(sum(len(x) for x in ids)),
            "truncated": int(sum(d[2] for d in done)),
            "without_assistant": int(sum(not np.any(d[1] == Role.ASSISTANT) for d in done)),
        }
        return [(d[0], d[1]) for d in done]

    def _packed(self, which: str) -> dict[str, np.ndarray]:
        docs = self.tokenized(which)
        rows = pack_documents(
            [d[0] for d in docs], [d[1] for d in docs], self.seq_len + 1, pad_id=self.pad_id
        )
        stats = self.stats[which]
        stats["rows"] = len(rows["text"])
        stats["fill"] = stats["tokens"] / max(1, rows["text"].size)
        return rows

    def load(self, batch: int) -> Dataset:
        """Read, tokenize and pack the conversations; return them as a :class:`Dataset`.

        Training batches run forever, epoch after epoch (rows reshuffled each epoch when
        ``shuffle``); validation batches cover ``val_path`` once, the last one filled up with
        padding rows (segment 0, role NONE). Each process of a :class:`Partition` gets its
        ``batch // count`` rows of every global batch. The training iterator has
        ``get_state``/``set_state`` so the trainer can resume it exactly.

        Args:
            batch: rows per global batch.

        Returns:
            A Dataset of ``text`` (int32), ``text_roles`` (int8), ``text_segment_ids`` and
            ``text_positions`` (int32), each ``[batch // processes, seq_len + 1]``; ``records``
            is the number of packed training rows. ``stats`` then holds, per split, counts of
            conversations, tokens, truncated conversations, conversations without assistant
            tokens, rows, and the share of row slots holding tokens (``fill``).

        Raises:
            ValueError: reading and rendering errors naming the row (see the class docstring),
                or ``batch`` below 1.
            TypeError: ``batch`` is not an int.
        """
        from dew_pipe.data.packing import RowBatches, padded_batches

        batch = check_int("batch", batch, minimum=1)
        train = self._packed("train")
        val = self._packed("val") if self.val_path is not None else None

        def train_batches(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return RowBatches(train, int(batch), Partition(*partition), self.shuffle, self.seed)

        def val_batches(partition: Partition | tuple[int, int]) -> Iterator[Batch]:
            return padded_batches(val, int(batch), Partition(*partition), pad_id=self.pad_id)

        return Dataset(
            train=train_batches,
            val=None if val is None else val_batches,
            records=len(train["text"]),
            batch=int(batch),
        )
