"""The generated arithmetic task: data, splits, tokenizer, checker, reward, evaluation."""

from __future__ import annotations

import doctest
import importlib
import json
import re

import jax
import numpy as np
import pytest

from dew_pipe import models
from dew_pipe.data import Prompts, decode_text_column
from dew_pipe.data.chat import Role
from dew_pipe.sampling import Sampling
from dew_pipe.tasks import ArithmeticTask, build_char_tokenizer, reward
from dew_pipe.tasks.problems import (
    format_answer,
    held_out,
    is_correct,
    normalize_completion,
    sample_problems,
)

_PROBLEM = re.compile(r"(\d+)([-+*])(\d+)=")


def _exact(prompt: str) -> int:
    """The answer of a prompt text, by Python's own integer arithmetic."""
    left, op, right = _PROBLEM.fullmatch(prompt).groups()
    a, b = int(left), int(right)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _key(prompt: str) -> tuple[int, str, int]:
    left, op, right = _PROBLEM.fullmatch(prompt).groups()
    return int(left), op, int(right)


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(seed=3, digits=3, operations="+-*", test_size=300)


# --- generation and splits ----------------------------------------------------------------


def test_same_seed_same_data_and_other_seed_other_data(task):
    again = ArithmeticTask(seed=3, digits=3, operations="+-*", test_size=300)
    assert again.records("test") == task.records("test")
    assert again.records("train", 50) == task.records("train", 50)
    for name, value in task.sft_rows(7, 4, 40).items():
        np.testing.assert_array_equal(value, again.sft_rows(7, 4, 40)[name])
    other = ArithmeticTask(seed=4, digits=3, operations="+-*", test_size=300)
    assert other.records("test") != task.records("test")
    assert not np.array_equal(other.sft_rows(7, 4, 40)["text"], task.sft_rows(7, 4, 40)["text"])
    assert not np.array_equal(task.sft_rows(8, 4, 40)["text"], task.sft_rows(7, 4, 40)["text"])


def test_a_shorter_draw_is_a_prefix_of_a_longer_one(task):
    assert task.records("train", 40) == task.records("train", 2000)[:40]
    assert task.records("test", 10) == task.records("test")[:10]


def test_start_reads_the_same_sequence_further_on(task):
    """start=k gives problems k.. of the split's one sequence: after a pool of the first k,
    draws the pool did not make (what the embedded job's early stop reads); a problem
    recurs there only as in any sample of the distribution."""
    longer = task.problems("train", 1300)
    later = task.problems("train", 300, start=1000)
    assert later.prompts() == longer.prompts()[1000:]
    assert later.ground_truths() == longer.ground_truths()[1000:]
    pool = {_key(p) for p in longer.prompts()[:1000]}
    repeats = sum(_key(p) in pool for p in later.prompts())
    assert 0 < repeats < 30  # 12 of 300 here: small problems that any sample repeats
    assert task.problems("test", 5, start=295).prompts() == task.problems("test").prompts()[295:]
    prompts, lengths = task.prompt_arrays("train", 3, start=1000)
    whole, whole_lengths = task.prompt_arrays("train", 1003)
    np.testing.assert_array_equal(prompts, whole[1000:])
    np.testing.assert_array_equal(lengths, whole_lengths[1000:])
    # score() compares with the answers of the same range
    truths = later.ground_truths()[:2]
    right = [format_answer(int(t), "reversed") + "</s>" for t in truths]
    np.testing.assert_array_equal(task.score(right, "train", start=1000), [1.0, 1.0])
    assert task.score(right, "train", start=1002).tolist() != [1.0, 1.0]


def test_ground_truths_are_the_exact_answers(task):
    for record in task.records("test") + task.records("train", 300):
        assert record["ground_truth"] == str(_exact(record["prompt"]))
        assert record["data_source"] == "arithmetic/reversed"
    ops = {_key(r["prompt"])[1] for r in task.records("test")}
    assert ops == {"+", "-", "*"}
    assert any(int(r["ground_truth"]) < 0 for r in task.records("test"))  # 12-345 is negative


def _sft_problems(task: ArithmeticTask, batches: range, rows: int, width: int) -> list[str]:
    """Prompt texts of every problem packed in some SFT batches, read back from the ids."""
    prompts = []
    for index in batches:
        batch = task.sft_rows(index, rows, width)
        for row in range(rows):
            segments = batch["text_segment_ids"][row]
            for segment in range(1, segments.max() + 1):
                text = task.decode(batch["text"][row][segments == segment])
                prompts.append(text[: text.index("=") + 1])
    return prompts


def test_train_and_test_are_disjoint_by_problem(task):
    test = {_key(r["prompt"]) for r in task.records("test")}
    train = [r["prompt"] for r in task.records("train", 5000)]
    train += _sft_problems(task, range(20), 16, 40)
    assert len(train) > 6000
    assert not test & {_key(p) for p in train}
    # The rule is the hash: every test problem is held out, no training problem is.
    assert held_out(task.problems("test"), task.seed, task.holdout).all()
    assert not held_out(task.problems("train", 5000), task.seed, task.holdout).any()


def test_holdout_share_and_digit_ranges():
    rng = np.random.default_rng(0)
    problems = sample_problems(rng, 200_000, min_digits=2, max_digits=4, operations=("+",))
    assert 0.045 < held_out(problems, seed=1, holdout=0.05).mean() < 0.055
    for operand in (problems.left, problems.right):
        digits = np.char.str_len(operand.astype(str))
        assert set(np.unique(digits)) == {2, 3, 4}
        np.testing.assert_allclose(np.bincount(digits)[2:] / len(digits), 1 / 3, atol=0.01)


def test_one_digit_task_repeats_its_few_held_out_problems():
    task = ArithmeticTask(seed=0, digits=1, holdout=0.2, test_size=100)
    test = task.records("test")
    assert len(test) == 100 and len({r["prompt"] for r in test}) < 40
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in task.records("train", 500)}


@pytest.mark.parametrize("module", ["problems", "arithmetic", "char_tokenizer", "recipe"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"dew_pipe.tasks.{module}"))
    assert result.attempted > 0 and result.failed == 0


# --- answer formats, checker and reward ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "plain", "reversed_"),
    [
        (522, "522", "225"),
        (-448, "-448", "-844"),
        (100, "100", "001"),
        (0, "0", "0"),
        (7, "7", "7"),
    ],
)
def test_answer_formats(value, plain, reversed_):
    assert format_answer(value, "plain") == plain
    assert format_answer(value, "reversed") == reversed_
    assert normalize_completion(reversed_ + "</s>", "reversed") == str(value)


@pytest.mark.parametrize(
    ("completion", "truth", "answer_format", "expected"),
    [
        ("522", "522", "plain", True),
        ("522</s>", "522", "plain", True),
        ("  522 </s>", "522", "plain", True),
        ("522</s>99", "522", "plain", True),  # text after the first EOS is not the answer
        ("0522", "522", "plain", False),
        ("+522", "522", "plain", False),
        ("522<pad>", "522", "plain", False),
        ("52", "522", "plain", False),
        ("5222</s>", "522", "plain", False),
        ("", "0", "plain", False),
        ("225</s>", "522", "reversed", True),
        ("522</s>", "522", "reversed", False),
        ("-844</s>", "-448", "reversed", True),
        ("844-</s>", "-448", "reversed", False),
        ("001</s>", "100", "reversed", True),
        ("0010</s>", "100", "reversed", False),
        ("0</s>", "0", "reversed", True),
        ("-0</s>", "0", "reversed", False),
    ],
)
def test_exact_match_rule(completion, truth, answer_format, expected):
    assert is_correct(completion, truth, answer_format) is expected
    source = f"arithmetic/{answer_format}"
    assert reward(source, completion, truth, "{}") == float(expected)


def test_reward_refuses_bad_input():
    with pytest.raises(ValueError, match="data_source is 'gsm8k'"):
        reward("gsm8k", "1", "1", "")
    with pytest.raises(ValueError, match="data_source is 'arithmetic/upside'"):
        reward("arithmetic/upside", "1", "1", "")
    with pytest.raises(ValueError, match="ground_truth is '007'"):
        reward("arithmetic/plain", "7", "007", "")
    with pytest.raises(ValueError, match="ground_truth is '-0'"):
        reward("arithmetic/plain", "0", "-0", "")
    with pytest.raises(TypeError, match="completion is list"):
        reward("arithmetic/plain", [7], "7", "")
    with pytest.raises(TypeError, match="ground_truth is int"):
        reward("arithmetic/plain", "7", 7, "")


@pytest.mark.parametrize("answer_format", ["plain", "reversed"])
def test_the_reference_reply_is_what_sft_teaches_and_what_the_reward_pays(answer_format):
    task = ArithmeticTask(seed=1, operations="+-*", answer_format=answer_format, test_size=200)
    records = task.records("test")
    sft = task.sft_rows(0, 4, 64)  # the SFT documents: prompt, answer, EOS
    assert any(v < 0 for v in map(_exact, (r["prompt"] for r in records)))  # a minus sign too
    for record in records:
        ids = task.reference(record["data_source"], record["ground_truth"])
        assert ids.dtype == np.int32 and ids[-1] == task.eos_id
        text = task.decode(ids)
        assert text[:-4] == format_answer(_exact(record["prompt"]), answer_format)
        assert reward(record["data_source"], text, record["ground_truth"], "") == 1.0
    # the ids SFT trains on after each prompt (its ASSISTANT span)
    source, where = f"arithmetic/{answer_format}", sft["text_segment_ids"][0] == 1
    ids, roles = sft["text"][0][where], sft["text_roles"][0][where]
    prompt = task.decode(ids[roles == Role.USER])
    np.testing.assert_array_equal(
        task.reference(source, str(_exact(prompt))), ids[roles == Role.ASSISTANT]
    )


def test_the_reference_refuses_bad_fields():
    task = ArithmeticTask(seed=0)
    with pytest.raises(ValueError, match="data_source is 'gsm8k'"):
        task.reference("gsm8k", "7")
    with pytest.raises(ValueError, match="ground_truth is 'seven'; expected an integer"):
        task.reference("arithmetic/plain", "seven")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"digits": 0}, ValueError, "digits is 0"),
        ({"digits": 10}, ValueError, "digits is 10"),
        ({"digits": 2.0}, TypeError, "digits is 2.0"),
        ({"digits": 2, "min_digits": 3}, ValueError, "min_digits is 3"),
        ({"operations": "/"}, ValueError, "operations holds '/'"),
        ({"operations": ""}, ValueError, "operations is ''"),
        ({"operations": "++"}, ValueError, "each symbol once"),
        ({"operations": 3}, TypeError, "operations is 3"),
        ({"answer_format": "mirror"}, ValueError, "answer_format is 'mirror'"),
        ({"holdout": 0.0}, ValueError, "holdout is 0.0"),
        ({"holdout": 0.6}, ValueError, "holdout is 0.6"),
        ({"test_size": 0}, ValueError, "test_size is 0"),
        ({"seed": -1}, ValueError, "seed is -1"),
    ],
)
def test_task_settings_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        ArithmeticTask(**kwargs)


def test_task_calls_are_checked(task):
    with pytest.raises(ValueError, match="split is 'val'"):
        task.records("val")
    with pytest.raises(ValueError, match="n is 301"):
        task.problems("test", 301)
    with pytest.raises(ValueError, match="start is 296; expected an int >= 0 and <= 295"):
        task.problems("test", 5, start=296)  # past the 300 test problems
    with pytest.raises(ValueError, match="start is -1"):
        task.problems("train", 5, start=-1)
    with pytest.raises(TypeError, match="start"):
        task.problems("train", 5, start=1.5)
    with pytest.raises(ValueError, match="seq_len is 9; expected at least 14"):
        task.sft_dataset(batch=4, seq_len=9)
    with pytest.raises(ValueError, match="rows is 0"):
        task.sft_rows(0, 0, 40)
    with pytest.raises(ValueError, match="ids hold"):
        task.decode([5, 18])
    tiny = ArithmeticTask(seed=0, digits=1, holdout=0.001, test_size=5)
    with pytest.raises(ValueError, match="test split of digits=1"):
        tiny.records("test")


# --- tokenizer, SFT rows and prompt batches -----------------------------------------------


def test_tokenizer_matches_the_task_ids_and_round_trips(task, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = task.tokenizer()
    assert len(tokenizer) == task.vocab_size == 18
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (task.eos_id, task.pad_id)
    prompts, lengths = task.prompt_arrays("test", 50)
    for record, row, length in zip(task.records("test", 50), prompts, lengths, strict=True):
        ids = tokenizer.encode(record["prompt"])
        assert row[len(row) - length :].tolist() == ids
        assert task.decode(ids) == tokenizer.decode(ids) == record["prompt"]
    assert tokenizer.decode([7, 6, 2, 0]) == task.decode([7, 6, 2, 0]) == "32</s><pad>"
    assert tokenizer.encode("1 x") == [5, 3, 3]  # outside the alphabet: <unk>
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("12+3=") == tokenizer.encode("12+3=")


def test_chat_template_marks_the_answer_and_eos_as_the_assistant_span(task):
    rendered = task.tokenizer().apply_chat_template(
        [{"role": "user", "content": "9+11="}, {"role": "assistant", "content": "02"}],
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert task.decode(rendered["input_ids"]) == "9+11=02</s>"
    assert rendered["assistant_masks"] == [0] * 5 + [1] * 3
    generation = task.tokenizer().apply_chat_template(
        [{"role": "user", "content": "9+11="}], add_generation_prompt=True
    )
    assert generation["input_ids"] == task.tokenizer().encode("9+11=")


def test_char_tokenizer_refuses_bad_alphabets():
    with pytest.raises(ValueError, match="repeats '1' at index 2"):
        build_char_tokenizer("121")
    with pytest.raises(ValueError, match="holds ' '"):
        build_char_tokenizer("1 2")
    with pytest.raises(ValueError, match="holds '<'"):
        build_char_tokenizer("1<")
    with pytest.raises(TypeError, match="alphabet is list"):
        build_char_tokenizer(["1"])


def test_sft_rows_hold_problems_answer_roles_and_packing(task):
    rows, width = 6, 48
    batch = task.sft_rows(0, rows, width)
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(batch, (rows, width))
    count = 0
    for row in range(rows):
        segments, roles = batch["text_segment_ids"][row], batch["text_roles"][row]
        real = segments > 0
        # Segments are 1, 2, ... from the left, padding only at the end.
        assert real[: real.sum()].all() and not real[real.sum() :].any()
        assert (roles[~real] == Role.NONE).all() and (batch["text"][row][~real] == 0).all()
        for segment in range(1, segments.max() + 1):
            where = segments == segment
            ids, role = batch["text"][row][where], roles[where]
            np.testing.assert_array_equal(batch["text_positions"][row][where], np.arange(len(ids)))
            text = task.decode(ids)
            prompt, answer = text[: text.index("=") + 1], text[text.index("=") + 1 :]
            assert answer == format_answer(_exact(prompt), "reversed") + "</s>"
            np.testing.assert_array_equal(role[: len(prompt)], Role.USER)
            np.testing.assert_array_equal(role[len(prompt) :], Role.ASSISTANT)
            count += 1
        # Next-fit: the row's free tail is shorter than the longest problem.
        assert width - real.sum() < task.max_prompt_len + task.max_new_tokens
    assert count >= rows * 3


def test_sft_dataset_resumes_and_splits_over_processes(task):
    data = task.sft_dataset(batch=4, seq_len=39)
    first = data.open_train((0, 1))
    batches = [next(first) for _ in range(3)]
    resumed = data.open_train((0, 1))
    resumed.set_state(first.get_state())
    np.testing.assert_array_equal(next(resumed)["text"], task.sft_rows(3, 4, 40)["text"])
    low, high = data.open_train((0, 2)), data.open_train((1, 2))
    whole = batches[0]["text"]
    np.testing.assert_array_equal(np.concatenate([next(low)["text"], next(high)["text"]]), whole)
    with pytest.raises(ValueError, match="state is"):
        resumed.set_state({"next_batch": -1})
    val = list(data.open_val((0, 1)))
    answers = (np.concatenate([b["text_roles"] for b in val]) == Role.ASSISTANT).sum()
    expected = sum(len(t) + 1 for t in task.problems("test").targets("reversed"))
    assert answers == expected  # every test problem once, answer and EOS


def test_prompts_batches_carry_the_reward_metadata(task):
    prompts = task.prompts("test", 8, shuffle=False)
    assert isinstance(prompts, Prompts)
    batch = next(prompts.load(batch=8).train((0, 1)))
    records = task.records("test", 8)
    assert decode_text_column(batch["ground_truth"]) == [r["ground_truth"] for r in records]
    assert set(decode_text_column(batch["data_source"])) == {"arithmetic/reversed"}
    info = [json.loads(x) for x in decode_text_column(batch["extra_info"])]
    assert info == [{"split": "test", "index": i} for i in range(8)]
    expected, lengths = task.prompt_arrays("test", 8)
    np.testing.assert_array_equal(batch["prompt"], expected)
    np.testing.assert_array_equal(batch["prompt_length"], lengths)


# --- completions and evaluation -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    model = models.build(
        "causal_transformer",
        vocab_size=18,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=16,
    )
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 4), np.int32))
    return model, variables


def _plain_greedy(forward, variables, prompt: list[int], budget: int) -> list[int]:
    """Greedy ids after ``prompt``, the model run as a plain LM (``forward``: its jitted
    apply) on the unpadded sequence, right-filled to a fixed width (the causal mask keeps
    the fill from the column read)."""
    sequence, out = list(prompt), []
    for _ in range(budget):
        window = np.zeros((1, 16), np.int32)
        window[0, : len(sequence)] = sequence
        token = int(np.argmax(forward(variables, window)[0, len(sequence) - 1]))
        out.append(token)
        sequence.append(token)
        if token == 2:
            break
    return out


def test_completions_match_a_plain_greedy_loop(task, tiny_model):
    model, variables = tiny_model
    first = task.completions(model, variables, "test", 8, batch=3)
    # An untrained model hardly ever says </s>: give id 2 the output column of the id it says
    # most, so greedy picks </s> (the lower id wins the exact tie) wherever it would say that.
    counts = np.bincount(np.concatenate([_task_ids(t) for t in first]), minlength=18)
    head = np.array(variables["params"]["lm_head"])
    head[:, 2] = head[:, int(np.argmax(counts))]
    stops = {"params": {**variables["params"], "lm_head": head}}
    texts = task.completions(model, stops, "test", 8, batch=3)  # 3 calls, the last padded
    assert any(len(_task_ids(t)) < task.max_new_tokens for t in texts)
    prompts, lengths = task.prompt_arrays("test", 8)
    forward = jax.jit(model.apply)
    for text, row, length in zip(texts, prompts, lengths, strict=True):
        ids = _plain_greedy(forward, stops, row[len(row) - length :].tolist(), task.max_new_tokens)
        assert text == task.decode(ids)


def test_completions_and_evaluate_read_the_range_from_start(task, tiny_model):
    model, variables = tiny_model
    texts = task.completions(model, variables, "train", 3, start=1000, batch=3)
    prompts, lengths = task.prompt_arrays("train", 3, start=1000)
    forward = jax.jit(model.apply)
    for text, row, length in zip(texts, prompts, lengths, strict=True):
        ids = _plain_greedy(
            forward, variables, row[len(row) - length :].tolist(), task.max_new_tokens
        )
        assert text == task.decode(ids)
    scored = task.score(texts, "train", start=1000).mean()
    assert task.evaluate(model, variables, "train", 3, batch=3, start=1000) == scored


def _task_ids(text: str) -> np.ndarray:
    ids = [2] if text.endswith("</s>") else []
    body = text.removesuffix("</s>")
    return np.array([4 + "0123456789+-*=".index(c) for c in body] + ids, np.int64)


def test_sampled_completions_follow_the_key(task, tiny_model):
    model, variables = tiny_model
    hot = Sampling(temperature=1.0)
    one = task.completions(model, variables, "test", 20, sampling=hot, key=jax.random.key(1))
    again = task.completions(model, variables, "test", 20, sampling=hot, key=jax.random.key(1))
    other = task.completions(model, variables, "test", 20, sampling=hot, key=jax.random.key(2))
    assert one == again and one != other
    with pytest.raises(TypeError, match="sampling is 0.5"):
        task.completions(model, variables, "test", 2, sampling=0.5)


def test_completions_refuse_a_model_too_short(task):
    short = models.build(
        "causal_transformer",
        vocab_size=18,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=8,
    )
    variables = jax.eval_shape(short.init, jax.random.key(0), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        task.completions(short, variables, "test", 2)


def test_score_reads_completions_with_the_exact_match_rule(task):
    truths = task.problems("test", 3).ground_truths()
    right = [format_answer(int(t), "reversed") + "</s>" for t in truths]
    wrong = [format_answer(int(t), "plain") + "9</s>" for t in truths]
    np.testing.assert_array_equal(task.score(right), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(task.score([right[0], wrong[1], right[2]]), [1.0, 0.0, 1.0])


@pytest.mark.slow
def test_sft_learns_two_digit_addition_held_out():
    from dew_pipe.tasks.recipe import SFTRecipe, train_sft

    task = ArithmeticTask(seed=0, digits=2, test_size=200)
    recipe = SFTRecipe(
        emb_features=64,
        num_layers=2,
        num_heads=4,
        mlp_features=256,
        seq_len=31,
        batch=32,
        steps=500,
        learning_rate=5e-3,
        warmup=30,
    )
    model = recipe.model(task)
    before = task.evaluate(model, model.init(jax.random.key(0), np.zeros((1, 4), np.int32)))
    _, state = train_sft(task, recipe, key=jax.random.key(0), progress=False)
    after = task.evaluate(model, state.params)
    # Measured: 0.98 (0.905 from init key 1; 0.955 after 400 steps). Accuracy rises in one
    # steep step whose place moves with any change of numerics, hence the margin.
    assert before < 0.05
    assert after > 0.8


@pytest.mark.slow
@pytest.mark.parametrize("split", ["test", "train"])
def test_sft_until_stops_at_the_first_check_past_the_share(split):
    from dew_pipe.tasks.recipe import SFTRecipe, train_sft

    task = ArithmeticTask(seed=0, digits=2, test_size=200)
    recipe = SFTRecipe(seq_len=31, steps=500, warmup=30)
    model = recipe.model(task)
    checks: dict[int, float] = {}

    def probe(state, batch, key):  # sees the state after every step, before the next
        step = int(state.step)
        if step and step % 20 == 0:
            checks[step] = task.evaluate(model, state.params, split, task.test_size)
        return batch

    _, state = train_sft(
        task, recipe, key=jax.random.key(0), rollout=probe, until=0.5, check_every=20,
        check_split=split,
    )  # fmt: skip
    stop = int(state.step)
    final = task.evaluate(model, state.params, split, task.test_size)
    assert stop % 20 == 0 and stop < recipe.steps and final >= 0.5
    assert all(checks[k] < 0.5 for k in range(20, stop, 20))  # no earlier check passed


@pytest.mark.parametrize(
    "options, match",
    [
        ({"until": 0.0}, "until is 0.0"),
        ({"until": 1.5}, "until is 1.5"),
        ({"until": 0.5, "check_every": 0}, "check_every is 0"),
        ({"until": 0.5, "check_split": "val"}, "check_split is 'val'; expected 'test' or 'train'"),
        ({"check_split": "val"}, "check_split is 'val'; expected 'test' or 'train'"),
    ],
)
def test_sft_until_refuses_bad_settings(options, match):
    from dew_pipe.tasks.recipe import SFTRecipe, train_sft

    task = ArithmeticTask(seed=0, digits=2, test_size=20)
    with pytest.raises(ValueError, match=match):
        train_sft(task, SFTRecipe(seq_len=31, steps=20, warmup=2), key=jax.random.key(0), **options)
