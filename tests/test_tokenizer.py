"""The project's BPE tokenizer, its chat template, and the generated story corpus."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
from transformers import AutoTokenizer

from dew_pipe.data.chat import Role, tokenize_conversation
from dew_pipe.data.stories import DOG_PROMPT, dog_rate, generate_stories
from dew_pipe.data.tokenizer import CHAT_TEMPLATE, TOOL_TOKENS, build_tokenizer, chat_samples

TEXTS = generate_stories(300, seed=5) + chat_samples()
SAMPLES = [
    "Once upon a time, there was a little dog named Tom.",
    " He kicked it to his dog.",
    "Unicode: café, naïve, 😀 and\n\nnewlines\ttabs  spaces",
    "<|im_start|>user\nHi<|im_end|>\n<tool_call>{}</tool_call>",
]


def test_training_is_deterministic():
    a = build_tokenizer(TEXTS, vocab_size=600)
    b = build_tokenizer(list(TEXTS), vocab_size=600)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    c = build_tokenizer(TEXTS[:100], vocab_size=600)
    assert a.backend_tokenizer.to_str() != c.backend_tokenizer.to_str()


def test_save_and_reload_with_auto_tokenizer(tmp_path):
    built = build_tokenizer(TEXTS, vocab_size=600, directory=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(loaded) == len(built) <= 600
    assert loaded.chat_template == built.chat_template == CHAT_TEMPLATE
    expected_ids = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    assert loaded.convert_tokens_to_ids(list(expected_ids)) == list(expected_ids.values())
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.convert_tokens_to_ids(list(TOOL_TOKENS)) == list(
        range(len(built) - 4, len(built))
    )
    for text in SAMPLES:
        ids = loaded.encode(text)
        assert ids == built.encode(text)
        assert loaded.decode(ids) == text  # byte-level: lossless, no special tokens added
    tool_ids = loaded.encode("<tool_call>x</tool_call>")
    assert loaded.decode(tool_ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"
    assert loaded.decode(loaded.encode("<|im_end|>x"), skip_special_tokens=True) == "x"


def test_story_words_are_single_tokens(story_tokenizer):
    # The spec's SFT example concatenates encode(prompt) + encode(response).
    prompt = story_tokenizer.encode("Tom had a red ball.")
    response = story_tokenizer.encode(" He kicked it to his dog.")
    assert (
        story_tokenizer.decode(prompt + response) == "Tom had a red ball. He kicked it to his dog."
    )
    assert [story_tokenizer.decode([i]) for i in response] == [
        " He", " kicked", " it", " to", " his", " dog", "."
    ]  # fmt: skip


def test_template_renders_chatml_with_tools_and_generation_prompt(story_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"},
    ]  # fmt: skip
    text = story_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\nYou may call the functions below. Write each "
        'call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\n<tools>\n'
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n'
        "</tools><|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    )
    out = story_tokenizer.apply_chat_template(
        messages[1:] + [{"role": "assistant", "content": "Four."}],
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = np.array(out["input_ids"]), np.array(out["assistant_masks"], bool)
    # Both assistant turns are masked from their content on; the headers before them are not.
    decoded = [
        story_tokenizer.decode(ids[mask & (np.cumsum(~mask) == k)])
        for k in np.unique(np.cumsum(~mask)[mask])
    ]
    assert decoded == [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>\n',
        "Four.<|im_end|>\n",
    ]


@pytest.mark.parametrize(
    "content",
    ["\n\nstarts with newlines", "  leading spaces", "\ttab", "ends with newline\n\n", "", "😀"],
)
def test_template_is_append_only_for_awkward_content(story_tokenizer, content):
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": content},
        {"role": "user", "content": content},
        {"role": "assistant", "content": content},
    ]
    ids, roles = tokenize_conversation(story_tokenizer, messages)  # raises if not append-only
    assert ids.tolist() == story_tokenizer.apply_chat_template(messages)["input_ids"]
    header = story_tokenizer.encode("<|im_start|>assistant\n")
    none_runs = np.flatnonzero(roles == Role.NONE)
    assert len(none_runs) == 2 * len(header)
    assert ids[none_runs].tolist() == header * 2


def test_bad_arguments():
    with pytest.raises(TypeError, match="texts must be an iterable of strings, got a single str"):
        build_tokenizer("a dog")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        build_tokenizer(["a", 3])
    with pytest.raises(ValueError, match="texts: got 2 texts with no characters"):
        build_tokenizer(["", ""])
    with pytest.raises(ValueError, match="vocab_size must be at least 265"):
        build_tokenizer(TEXTS, vocab_size=100)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        build_tokenizer(TEXTS, vocab_size=512.0)
    with pytest.raises(ValueError, match="min_frequency must be at least 1, got 0"):
        build_tokenizer(TEXTS, min_frequency=0)


# --- the story corpus -----------------------------------------------------------------------------


def test_stories_are_deterministic_and_varied():
    a, b = generate_stories(500, seed=1), generate_stories(500, seed=1)
    assert a == b and a != generate_stories(500, seed=2)
    assert len(set(a)) == 500
    share = sum(s.startswith(DOG_PROMPT) for s in a) / len(a)
    assert 0.5 <= share <= 0.7  # most stories open with the GRPO prompt
    words = [len(s.split()) for s in a]
    assert min(words) >= 40 and max(words) <= 110
    with pytest.raises(ValueError, match="count must be at least 1, got 0"):
        generate_stories(0)
    with pytest.raises(TypeError, match="seed must be an int"):
        generate_stories(3, seed="x")


def test_dog_is_a_minority_of_eight_token_continuations(story_tokenizer):
    stories = [s for s in generate_stories(3000) if s.startswith(DOG_PROMPT)]
    hits = 0
    for story in stories:
        continuation = story_tokenizer.encode(story[len(DOG_PROMPT) :])[:8]
        hits += "dog" in story_tokenizer.decode(continuation)
    rate = hits / len(stories)
    assert 0.05 <= rate <= 0.15, rate
    assert rate == pytest.approx(dog_rate(generate_stories(3000)), abs=0.01)
    prompt = story_tokenizer.encode(DOG_PROMPT)
    assert story_tokenizer.decode(prompt) == DOG_PROMPT and len(prompt) == 9


def test_story_tokenizer_covers_the_corpus_compactly(story_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(story_tokenizer_dir)
    stories = generate_stories(200, seed=9)
    tokens = sum(len(tokenizer.encode(s)) for s in stories)
    words = sum(len(s.split()) for s in stories)
    assert tokens / words < 1.4  # whole words, plus punctuation
    assert 600 <= len(tokenizer) <= 1024  # the corpus runs out of frequent pairs before 1024


@pytest.mark.parametrize("module", ["tokenizer", "stories"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"dew_pipe.data.{module}"))
    assert result.attempted > 0 and result.failed == 0
