"""Record reference chat token ids and assistant masks from transformers and TRL.

Run in the reference environment (transformers + TRL, no JAX; ``benchmarks/reference_env.sh``
builds it as ``.reference-venv/``), from the repository root:

    .reference-venv/bin/python tests/parity/record_chat.py

It trains the project's story tokenizer (dew_pipe.data.stories.story_tokenizer, which needs only
`tokenizers` and `transformers`), saves it under tests/parity/fixtures/chat_tokenizer/, and for a
set of conversations records what transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` returns - the call TRL's SFTTrainer makes for
`assistant_only_loss=True` - under two templates: the project's ChatML template and a plain-text
one written here (a BOS token, multi-token text headers, the end of turn inside the generation
block). It also records TRL's own verdicts on each template (generation markers, prefix
preservation, tool-call support, end-of-turn token trained). tests/test_chat_messages.py checks
that ChatMessages produces exactly these ids and that its ASSISTANT roles equal these masks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tokenizers  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.chat_template_utils import (  # noqa: E402
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)

from dew_pipe.data.stories import story_tokenizer  # noqa: E402

FIXTURES = ROOT / "tests" / "parity" / "fixtures"
TOKENIZER_DIR = FIXTURES / "chat_tokenizer"

# A second template: plain-text headers, a BOS token, and everything an assistant turn adds
# after its header inside the generation block (so prefix roles and generation masks agree).
PLAIN_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '### Assistant:\\n' -}}"
    "{%- generation -%}{{- message.content + eos_token + '\\n\\n' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '### ' + message.role | capitalize + ':\\n' + message.content + '\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Assistant:\\n' -}}{%- endif -%}"
)

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(name: str, arguments: object) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str, **extra: object) -> dict:
    return {"role": "assistant", "content": text, **extra}


CHATML_CASES = [
    {"messages": [_u("What is two plus two?"), _a("Four.")]},
    {
        "messages": [
            {"role": "system", "content": "You tell short stories."},
            _u("Tell me about a dog."),
            _a("Once upon a time, there was a little dog named Tom."),
            _u("And then?"),
            _a("Tom found a red ball in the park. The end."),
        ]
    },
    {
        "tools": [ADD],
        "messages": [
            {"role": "system", "content": "Use tools when they help."},
            _u("What is 2 + 3?"),
            _a("", tool_calls=[_call("add", {"a": 2, "b": 3})]),
            {"role": "tool", "content": "5"},
            _a("2 + 3 is 5."),
        ],
    },
    {
        "tools": [ADD, WEATHER],
        "messages": [
            _u("Add 1 and 2, and tell me the weather in Oslo."),
            _a(
                "Calling two tools.",
                tool_calls=[_call("add", '{"a": 1, "b": 2}'), _call("weather", {"city": "Oslo"})],
            ),
            {"role": "tool", "content": "3"},
            {"role": "tool", "content": "Snow, -2 C"},
            _a("1 + 2 = 3; Oslo has snow."),
        ],
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        ]
    },
    {"messages": [_u("One."), _a("Two."), _u("Three?")]},
    {"messages": [_u("Unicode: café, naïve, 😀?"), _a("Oui — très bien 😀.")]},
    {"messages": [_u("Indent this."), _a("  \n\n    indented\n\n\ttab")]},
]
PLAIN_CASES = [
    {"messages": [_u("What is two plus two?"), _a("Four.")]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            _u("Hi"),
            _a("Hello."),
            _u("Bye"),
            _a("Goodbye.\n"),
        ]
    },
    {"messages": [_u("A dog?"), _a(" Yes, a dog.")]},
]


def _trl_checks(tokenizer) -> dict[str, bool]:
    return {
        "has_generation_markers": has_generation_markers(tokenizer.chat_template),
        "prefix_preserving": is_chat_template_prefix_preserving(tokenizer),
        "supports_tool_calling": supports_tool_calling(tokenizer),
        "stop_token_trained": is_chat_template_stop_token_trained(tokenizer),
        "needs_training_template": get_training_chat_template(tokenizer) is not None,
    }


def _record(tokenizer, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        encoded = tokenizer.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        mask = list(encoded["assistant_masks"])
        assert any(mask), f"no assistant tokens in {case}"
        out.append({**case, "ids": list(encoded["input_ids"]), "assistant_masks": mask})
    return out


def main() -> None:
    story_tokenizer(directory=TOKENIZER_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    chatml = {"checks": _trl_checks(tokenizer), "cases": _record(tokenizer, CHATML_CASES)}
    tokenizer.chat_template = PLAIN_TEMPLATE
    plain = {
        "chat_template": PLAIN_TEMPLATE,
        "checks": _trl_checks(tokenizer),
        "cases": _record(tokenizer, PLAIN_CASES),
    }
    fixture = {
        "tokenizer": TOKENIZER_DIR.name,
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "trl": trl.__version__,
        },
        "chatml": chatml,
        "plain": plain,
    }
    path = FIXTURES / "chat_masks.json"
    path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size} bytes) and {TOKENIZER_DIR}")
    print("TRL checks:", json.dumps({"chatml": chatml["checks"], "plain": plain["checks"]}))


if __name__ == "__main__":
    main()
