"""Does a chat template keep agent histories append-only? :func:`audit_template` answers per
turn shape.

An agent harness sends the model a new prompt after every tool call: the conversation so far,
rendered by the tokenizer's chat template. ``pack`` merges a call into the previous call's
chain only when the new prompt's ids start with the previous prompt and everything the model
sampled (:func:`~dew_pipe.objectives.rl.packing.session_chains`). Whether that happens is a
property of the template: many templates write a turn differently once it is history than
when the model wrote it, and each such turn then starts a new chain (more rows to train, and
a prefix scored again).

For each :class:`TurnShape` the audit renders, with the tokenizer's own template and tools:

1. the prompt of the first call: a user request, with the generation prompt;
2. the sampled turn: what the template writes for that conversation ending in the assistant
   turn *as the model wrote it* (its reasoning, its content, its tool call with the
   arguments as the compact JSON text a model emits), minus the prompt. So each family's own
   reasoning and tool-call syntax is what is checked;
3. the prompt of the next call: the history with that turn *as the harness sends it back*
   (arguments as the same string, or parsed into an object) and an observation, as a
   ``tool`` message or as a ``user`` message, with the generation prompt.

The shape **merges** when (3)'s ids start with (1)'s ids followed by (2)'s, and **splits**
otherwise; the verdict then names the first differing token, shows both texts there and
names the likely cause: the reasoning was dropped from history, an empty block the template
wrote into the sampled turn (such as ``<think></think>``) is missing from history, the
tool-call JSON was re-serialized, earlier tokens were rewritten, or the same text tokenizes
differently. A template that raises on a shape **fails** it (the error is the detail).

Example:
    >>> from dew_pipe.data.tokenizer import build_tokenizer
    >>> tok = build_tokenizer(["What is the weather in Paris? Sunny."] * 10, vocab_size=300)
    >>> audit = audit_template(tok)
    >>> [v.result for v in audit.verdicts][:3]
    ['merges', 'merges', 'merges']
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dew_pipe.data.chat import load_chat_tokenizer

__all__ = ["SHAPES", "TemplateAudit", "TurnShape", "Verdict", "audit_template"]

_REQUEST = "What is the weather in Paris right now?"
_REASONING = "The user wants the current weather; the weather tool can tell."
_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
_COMPACT = json.dumps(_ARGUMENTS, separators=(",", ":"))  # what a model writes
_RESULT = json.dumps({"temperature": 21, "sky": "clear"})
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
_EMPTY_BLOCK = re.compile(r"<(\w+)>\s*</\1>")
_CONTEXT = 24  # characters of text shown on each side of a difference


@dataclass(frozen=True)
class TurnShape:
    """One kind of assistant turn and the observation that follows it.

    Attributes:
        reasoning: the turn carries reasoning (``reasoning_content``).
        call: ``None`` (no tool call), ``"string"`` (arguments sent back as the JSON string
            the model wrote) or ``"object"`` (arguments parsed into an object).
        observation: ``"tool"`` (a tool-role message) or ``"user"`` (a user-role message).
    """

    reasoning: bool
    call: str | None
    observation: str

    @property
    def name(self) -> str:
        """E.g. ``"reasoning, call as string, tool observation"``."""
        turn = "reasoning" if self.reasoning else "no reasoning"
        call = "no call" if self.call is None else f"call as {self.call}"
        return f"{turn}, {call}, {self.observation} observation"


SHAPES: tuple[TurnShape, ...] = tuple(
    TurnShape(reasoning, call, observation)
    for reasoning in (False, True)
    for call in (None, "string", "object")
    for observation in ("user", "tool")
    if call is not None or observation == "user"  # a tool result needs a tool call
)
"""Every shape the audit checks: with and without reasoning; no call, arguments as a string,
arguments as an object; the observation as a user or a tool message (tool only after a call)."""


@dataclass(frozen=True)
class Verdict:
    """What a template does with one :class:`TurnShape`.

    Attributes:
        shape: the shape.
        result: ``"merges"``, ``"splits"`` or ``"fails"``.
        token: for a split, the index in the next prompt of the first id that differs (or
            where it ends); None otherwise.
        cause: for a split, the likely cause; for a failure, the template's error.
        sampled: for a split, the sampled turn's text around the difference.
        history: for a split, the next prompt's text at the same place.
    """

    shape: TurnShape
    result: str
    token: int | None = None
    cause: str | None = None
    sampled: str | None = None
    history: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A plain mapping: the shape's fields, then the verdict's."""
        shape = {"reasoning": self.shape.reasoning, "call": self.shape.call}
        shape["observation"] = self.shape.observation
        fields = ("result", "token", "cause", "sampled", "history")
        return {"shape": self.shape.name, **shape, **{k: getattr(self, k) for k in fields}}


@dataclass(frozen=True)
class TemplateAudit:
    """The verdicts of one tokenizer's template.

    Attributes:
        tokenizer: the tokenizer's name or path.
        verdicts: one per shape, in the order audited.
    """

    tokenizer: str
    verdicts: tuple[Verdict, ...]

    @property
    def append_only(self) -> bool:
        """Whether every shape merges."""
        return all(v.result == "merges" for v in self.verdicts)

    def report(self) -> str:
        """The verdicts as text, one line per shape and the detail of each split."""
        merged = sum(v.result == "merges" for v in self.verdicts)
        lines = [
            f"chat template of {self.tokenizer}: {merged} of {len(self.verdicts)} turn shapes "
            "keep the history append-only"
        ]
        width = max(len(v.shape.name) for v in self.verdicts)
        for v in self.verdicts:
            line = f"  {v.shape.name:<{width}}  {v.result}"
            if v.cause:
                line += f": {v.cause}"
            lines.append(line)
            if v.result == "splits":
                lines.append(f"      at token {v.token}, sampled turn: {v.sampled!r}")
                lines.append(f"      {'':>{len(str(v.token)) + 9}} history: {v.history!r}")
        return "\n".join(lines)


def _assistant(shape: TurnShape, arguments: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    message["content"] = "Let me look that up." if shape.call else "It is sunny in Paris."
    if shape.reasoning:
        message["reasoning_content"] = _REASONING
    if shape.call:
        function = {"name": "get_weather", "arguments": arguments}
        message["tool_calls"] = [{"id": "call_0", "type": "function", "function": function}]
    return message


def _observation(shape: TurnShape) -> dict[str, Any]:
    if shape.observation == "tool":
        return {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": _RESULT}
    return {"role": "user", "content": f"Observation: {_RESULT}"}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, Any]], prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=_TOOLS, tokenize=False, add_generation_prompt=prompt
    )


def _window(tokenizer: Any, ids: list[int], at: int) -> str:
    before = tokenizer.decode(ids[:at])[-_CONTEXT:]
    return before + tokenizer.decode(ids[at:])[:_CONTEXT]


def _cause(shape: TurnShape, sampled: str, history: str, at: int, prompt_len: int) -> str:
    """The likely reason why ``history`` does not continue with the ``sampled`` turn."""
    if at < prompt_len:
        return "the next prompt rewrites the earlier prompt"
    if shape.reasoning and _REASONING in sampled and _REASONING not in history:
        return "reasoning dropped from history"
    empty = [m.group(0) for m in _EMPTY_BLOCK.finditer(sampled)]
    if any(block not in history for block in empty):
        return f"empty {empty[0]!r} block of the sampled turn dropped from history"
    if shape.call == "object" and _COMPACT in sampled and _COMPACT not in history:
        return "tool-call JSON re-serialized (the compact arguments come back reformatted)"
    if history.startswith(sampled):
        return "same text, other tokens: ids merge across the end of the sampled turn"
    return "history writes the turn differently"


def _verdict(tokenizer: Any, shape: TurnShape) -> Verdict:
    request = [{"role": "user", "content": _REQUEST}]
    try:
        prompt_text = _render(tokenizer, request, True)
        final_text = _render(tokenizer, [*request, _assistant(shape, _COMPACT)], False)
        arguments = _ARGUMENTS if shape.call == "object" else _COMPACT
        history = [*request, _assistant(shape, arguments), _observation(shape)]
        next_text = _render(tokenizer, history, True)
    except Exception as error:  # jinja2's TemplateError, TypeError... raised by the template
        return Verdict(shape, "fails", cause=f"{type(error).__name__}: {error}")
    prompt, final, following = (_ids(tokenizer, t) for t in (prompt_text, final_text, next_text))
    if final[: len(prompt)] != prompt:
        at = next(i for i, (a, b) in enumerate(zip(prompt, final, strict=False)) if a != b)
        cause = "the final assistant turn does not extend the generation prompt"
        return Verdict(shape, "splits", at, cause, _window(tokenizer, final, at),
                       _window(tokenizer, prompt, at))  # fmt: skip
    if following[: len(final)] == final:
        return Verdict(shape, "merges")
    at = next(
        (i for i, (a, b) in enumerate(zip(final, following, strict=False)) if a != b),
        min(len(final), len(following)),
    )
    sampled_text = tokenizer.decode(final[len(prompt) :])
    history_text = tokenizer.decode(following[len(prompt) :])
    cause = _cause(shape, sampled_text, history_text, at, len(prompt))
    return Verdict(shape, "splits", at, cause, _window(tokenizer, final, at),
                   _window(tokenizer, following, at))  # fmt: skip


def audit_template(tokenizer: Any, shapes: Sequence[TurnShape] = SHAPES) -> TemplateAudit:
    """Audit a tokenizer's chat template for append-only histories, shape by shape.

    Args:
        tokenizer: a transformers tokenizer with a chat template, or a local directory / Hub
            name (read from the local cache; nothing is downloaded).
        shapes: the turn shapes to check; default :data:`SHAPES`.

    Returns:
        A :class:`TemplateAudit` with one :class:`Verdict` per shape.

    Raises:
        ValueError: a tokenizer that cannot be loaded or has no chat template, or no shapes.
        TypeError: a tokenizer that is none of the above, or a shape that is not a TurnShape.
    """
    loaded = load_chat_tokenizer(tokenizer)
    shapes = tuple(shapes)
    if not shapes:
        raise ValueError("shapes is empty; expected at least one TurnShape")
    for shape in shapes:
        if not isinstance(shape, TurnShape):
            raise TypeError(f"shapes holds {shape!r}; expected TurnShape values")
    name = tokenizer if isinstance(tokenizer, str) else getattr(loaded, "name_or_path", "")
    name = str(name) or type(loaded).__name__
    return TemplateAudit(name, tuple(_verdict(loaded, shape) for shape in shapes))
