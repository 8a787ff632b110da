"""A character-level tokenizer: one id per character of a fixed alphabet, plus four specials.

Generated tasks with a small alphabet (arithmetic, say) learn much faster when every symbol is
one token: the digit at place ``k`` of an operand is then always one token, at a position the
model can find, instead of whatever chunk a BPE merge happened to make of it. The tokenizer is
built with ``tokenizers`` (a ``WordLevel`` model over single characters) and wrapped in
``transformers.PreTrainedTokenizerFast``, so it is a real tokenizer that ``Prompts``,
``ChatMessages`` and ``save_pretrained``/``AutoTokenizer.from_pretrained`` all accept.

Ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>`` (EOS), 3 ``<unk>``, then the alphabet in the order
given. A character outside the alphabet encodes to ``<unk>``; ``decode`` concatenates the
characters with no separator (special tokens come back as their text unless skipped).

The chat template (:data:`CHAT_TEMPLATE`) adds no markup at all: a user (or system) message is
its content, an assistant message is its content followed by ``</s>`` inside a
``{% generation %}`` block, and ``add_generation_prompt`` adds nothing. So a prompt rendered as
messages is the same ids as the prompt string, and an answer's assistant span is its characters
and the EOS token: the shortest layout, which matters for a model trained in minutes.

Example:
    >>> tok = build_char_tokenizer("0123456789+=")
    >>> tok.encode("12+3=")
    [5, 6, 14, 7, 15]
    >>> tok.decode([7, 2])
    '3</s>'
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_char_tokenizer"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  #: ids 0-3, before the alphabet

CHAT_TEMPLATE = """\
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- generation -%}{{- message.content -}}</s>{%- endgeneration -%}
    {%- else -%}
        {{- message.content -}}
    {%- endif -%}
{%- endfor -%}
"""


def _check_alphabet(alphabet: str) -> str:
    if not isinstance(alphabet, str):
        raise TypeError(f"alphabet is {type(alphabet).__name__}; expected a str of characters")
    if not alphabet:
        raise ValueError("alphabet is ''; expected at least one character")
    seen: set[str] = set()
    for index, char in enumerate(alphabet):
        if char in seen:
            raise ValueError(
                f"alphabet repeats {char!r} at index {index}; expected distinct characters"
            )
        if char.isspace() or char in "<>":
            raise ValueError(
                f"alphabet holds {char!r} at index {index}; expected no whitespace, '<' or '>' "
                "(they would be ambiguous next to the special tokens' text)"
            )
        seen.add(char)
    return alphabet


def build_char_tokenizer(
    alphabet: str, *, directory: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerFast:
    """Build a tokenizer with one id per character of ``alphabet``.

    Args:
        alphabet: the characters, each once, in id order (ids start at 4). Whitespace, ``<``
            and ``>`` are refused: the special tokens are spelled with angle brackets.
        directory: if given, ``save_pretrained`` there (created if missing).

    Returns:
        A ``PreTrainedTokenizerFast`` with pad/bos/eos/unk tokens and :data:`CHAT_TEMPLATE`.
        ``len(tokenizer)`` is ``4 + len(alphabet)``; ``encode`` adds no special tokens.

    Raises:
        TypeError: ``alphabet`` is not a str.
        ValueError: an empty alphabet, a repeated character, whitespace or an angle bracket.

    Example:
        >>> tok = build_char_tokenizer("ab")
        >>> len(tok), tok.eos_token_id, tok.decode(tok.encode("ba"))
        (6, 2, 'ba')
    """
    alphabet = _check_alphabet(alphabet)
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character is its own piece; the WordLevel model then maps each piece to its id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join the characters back with no separator
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(directory)
    return tokenizer
