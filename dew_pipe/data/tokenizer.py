"""Train a small byte-level BPE tokenizer and give it the project's chat template.

Tests, examples and the embedded job need a real tokenizer with a chat template, and nothing may
download. :func:`build_tokenizer` trains one with the ``tokenizers`` library in well under a
second on a few thousand short texts, wraps it in ``transformers.PreTrainedTokenizerFast`` and,
given a directory, saves it so that ``transformers.AutoTokenizer.from_pretrained(directory)``
loads it back like any Hub tokenizer.

The chat template (:data:`CHAT_TEMPLATE`) is ChatML-shaped: every message is
``<|im_start|>{role}\\n{content}<|im_end|>\\n``. It was written for two properties that
:class:`dew_pipe.data.ChatMessages` relies on:

* **Append-only.** Rendering a conversation one message longer only appends text, and the
  pre-tokenizer isolates every newline, so no token merges across a message boundary: the token
  ids of each prefix are a prefix of the ids of the whole conversation, for any message content.
* **Generation header outside the assistant span.** ``add_generation_prompt=True`` appends
  ``<|im_start|>assistant\\n``; an assistant message renders that header, then its content, tool
  calls, ``<|im_end|>`` and the newline inside a ``{% generation %}`` block, which is what
  transformers' ``return_assistant_tokens_mask=True`` reads.

Tool schemas passed as ``tools=`` go into the system block between ``<tools>`` and ``</tools>``,
one JSON object per line; assistant tool calls render as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; ``tool`` messages carry the results.

Example:
    >>> tokenizer = build_tokenizer(["Once upon a time, there was a little dog."] * 20,
    ...                             vocab_size=300)
    >>> ids = tokenizer.apply_chat_template(
    ...     [{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]
    >>> tokenizer.decode(ids)
    '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "IM_END",
    "IM_START",
    "PAD",
    "build_tokenizer",
    "chat_samples",
]

PAD = "<pad>"  #: padding; id 0, the id packed rows use for their padding slots
BOS = "<s>"  #: beginning of a document (not added automatically by ``encode``)
EOS = "</s>"  #: end of a document, e.g. of a story
IM_START = "<|im_start|>"  #: opens a chat message, followed by its role and a newline
IM_END = "<|im_end|>"  #: closes a chat message; an assistant turn ends with it
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
# Markup of the tool-use format: added tokens (never split by BPE) but not special, so
# ``decode(..., skip_special_tokens=True)`` keeps them in the text a reward function reads.
TOOL_TOKENS = ("<tools>", "</tools>", "<tool_call>", "</tool_call>")

# The byte-level alphabet has 256 symbols; a vocabulary must hold them and the added tokens.
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part.type == 'text' -%}{{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first = 0 -%}
{%- if tools or messages[0].role == 'system' -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages[0].role == 'system' -%}
        {%- set first = 1 -%}
        {{- text(messages[0].content) -}}
        {%- if tools -%}{{- '\\n\\n' -}}{%- endif -%}
    {%- endif -%}
    {%- if tools -%}
        {{- '# Tools\\nYou may call the functions below. Write each call as '
            '<tool_call>{"name": ..., "arguments": ...}</tool_call>.\\n<tools>' -}}
        {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
        {{- '\\n</tools>' -}}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[first:] -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- generation -%}
            {%- set content = text(message.content) -%}
            {{- content -}}
            {%- for tool_call in message.tool_calls or [] -%}
                {%- set fn = tool_call.function if tool_call.function is mapping else tool_call -%}
                {%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
                {{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
                {%- if fn.arguments is string -%}{{- fn.arguments -}}
                {%- else -%}{{- fn.arguments | tojson -}}
                {%- endif -%}
                {{- '}</tool_call>' -}}
            {%- endfor -%}
            {{- '<|im_end|>\\n' -}}
        {%- endgeneration -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def chat_samples() -> list[str]:
    """A few lines of chat-formatted text to add to a tokenizer's training texts.

    They give the role names and the tool-use markup tokens of their own, so rendered
    conversations are not spelled out byte by byte.

    Returns:
        A list of short strings.

    Example:
        >>> any("assistant" in line for line in chat_samples())
        True
    """
    lines = [
        "system\nYou are a helpful assistant.",
        "user\nWhat is two plus two?",
        "assistant\nFour.",
        "user\nTell me a story about a dog.",
        "assistant\nOnce upon a time, there was a little dog named Tom.",
        '# Tools\nYou may call the functions below. Write each call as <tool_call>{"name": ..., '
        '"arguments": ...}</tool_call>.',
        '{"type": "function", "function": {"name": "add", "description": "Add two numbers.", '
        '"parameters": {"type": "object", "properties": {"a": {"type": "number"}, '
        '"b": {"type": "number"}}, "required": ["a", "b"]}}}',
        'assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>',
        "tool\n4",
    ]
    return lines * 8  # above the BPE trainer's min_frequency, so the words merge


def _check_texts(texts: Iterable[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of strings, got a single str")
    checked = list(texts)
    for index, text in enumerate(checked):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be a str, got {type(text).__name__}")
    if not any(checked):
        raise ValueError(f"texts: got {len(checked)} texts with no characters; expected some text")
    return checked


def _train_bpe(texts: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Newlines are pre-tokens of their own, so a message boundary that ends in "\n" never merges
    # with the text after it; that keeps chat renders append-only at the token level.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def build_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 1024,
    min_frequency: int = 2,
    directory: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and attach the project's chat template.

    The result is deterministic: the same texts and settings give the same vocabulary and
    merges. Ids 0-4 are ``<pad>``, ``<s>``, ``</s>``, ``<|im_start|>``, ``<|im_end|>``; the tool
    markup tokens take the last ids. ``encode`` adds no special tokens, so
    ``encode(a) + encode(b)`` is the plain concatenation the spec's examples build.

    Args:
        texts: training texts (an iterable of str, not all empty).
        vocab_size: final vocabulary size, special and tool tokens included; at least 265.
            Training stops earlier when no pair occurs ``min_frequency`` times.
        min_frequency: how often a pair must occur to become a merge.
        directory: if given, ``save_pretrained`` there (created if missing), so that
            ``AutoTokenizer.from_pretrained(directory)`` reloads it.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad tokens, the chat markers as
        extra special tokens and :data:`CHAT_TEMPLATE` as its chat template.

    Raises:
        TypeError: ``texts`` is a str or holds a non-str, or a numeric setting is not an int.
        ValueError: no text, ``vocab_size`` below 265 or ``min_frequency`` below 1.

    Example:
        >>> tok = build_tokenizer(["a dog and a cat"] * 10, vocab_size=300)
        >>> tok.decode(tok.encode("a dog")), tok.pad_token_id
        ('a dog', 0)
    """
    for field, value in (("vocab_size", vocab_size), ("min_frequency", min_frequency)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB} (256 bytes plus the added tokens), "
            f"got {vocab_size}"
        )
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be at least 1, got {min_frequency}")
    backend = _train_bpe(_check_texts(texts), vocab_size, min_frequency)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(directory)
    return tokenizer
