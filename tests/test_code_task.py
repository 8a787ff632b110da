"""The generated code task: its programs pass their own cases in the sandbox, and its data.

The reference programs run for real under `BubblewrapRunner` (the runner the RLVR job uses)
through `CodeReward`; what they must print is computed here independently, by Python on the
parsed examples. Both readers of the warm-up data must pass a prompt's own examples, and
only the whitespace-splitting one the hidden cases. The examples of every drawn task must fit exactly one operation of its
family, the splits must be disjoint, and the SFT and GRPO batches must carry the prompts
and programs they claim to.
"""

from __future__ import annotations

import doctest
import json
from collections import Counter

import numpy as np
import pytest
from sandbox_helpers import bubblewrap_runner

from dew_pipe.data.chat import Role
from dew_pipe.objectives.rl import prompt_tasks
from dew_pipe.rewards import CodeReward
from dew_pipe.rewards.code_tests import parse_cases
from dew_pipe.sandbox import MemoFleet, SandboxFleet, SandboxLimits
from dew_pipe.tasks import code_task, programs
from dew_pipe.tasks.code_task import EOS_ID, CodeTask, encode
from dew_pipe.tasks.programs import OPERATIONS, READERS, check_operations, draw_task

# What each operation prints, written out again here (not read from programs.OPERATIONS).
EXPECTED = {
    "sum": lambda a: str(sum(a)),
    "max": lambda a: str(max(a)),
    "min": lambda a: str(min(a)),
    "len": lambda a: str(len(a)),
    "first": lambda a: str(a[0]),
    "last": lambda a: str(a[-1]),
    "sorted": lambda a: " ".join(map(str, sorted(a))),
    "reversed": lambda a: " ".join(map(str, reversed(a))),
    "range": lambda a: str(max(a) - min(a)),
    "double": lambda a: " ".join(str(2 * x) for x in a),
    "distinct": lambda a: str(len(set(a))),
    "evens": lambda a: " ".join(str(x) for x in a if x % 2 == 0),
}


@pytest.fixture(scope="module")
def task() -> CodeTask:
    return CodeTask(seed=5, test_size=60)


@pytest.fixture(scope="module")
def sandbox():
    """CodeReward on bubblewrap through a memo (each distinct program and case runs once)."""
    runner = bubblewrap_runner()
    limits = SandboxLimits(wall_seconds=10, cpu_seconds=2)
    with SandboxFleet(runner, limits, workers=2) as fleet:
        memo = MemoFleet(fleet)
        yield CodeReward(memo), memo


def _examples(prompt: str) -> list[tuple[list[int], str]]:
    lines = prompt.splitlines()
    return [([int(x) for x in line.split(">")[0].split()], line.split(">")[1]) for line in lines]


@pytest.mark.parametrize("module", [programs, code_task], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_every_reference_program_passes_its_cases_and_fails_every_other(sandbox):
    """All 12 programs against all 12 ground truths, on the battery, in bubblewrap."""
    reward, memo = sandbox
    task = CodeTask(seed=2, operations=tuple(OPERATIONS), cases=4)
    for name, expected in EXPECTED.items():  # the cases say what Python says
        cases = parse_cases(task.ground_truth(name))
        assert [c.stdin for c in cases] == [" ".join(map(str, x)) + "\n" for x in task.battery]
        assert [c.stdout for c in cases] == [expected(list(x)) + "\n" for x in task.battery]
    runs = memo.runs
    for program in OPERATIONS:
        completion = task.completion(program)
        for truth in OPERATIONS:
            score = reward("code", completion, task.ground_truth(truth), "")
            if program == truth:
                assert score == 1.0, program
            else:
                assert score < 1.0, (program, truth)  # the battery tells every pair apart
    # 12 programs x 4 battery inputs ran; the other 11 ground truths reused those runs.
    assert memo.runs - runs == len(OPERATIONS) * 4


def _example_cases(prompt: str) -> str:
    return json.dumps(
        [
            {"stdin": " ".join(map(str, x)) + "\n", "stdout": out + "\n"}
            for x, out in _examples(prompt)
        ]
    )


def test_both_readers_pass_the_examples_and_only_split_the_hidden_cases(sandbox, task):
    reward, _ = sandbox
    assert all(max(x) >= 10 for x in task.battery)  # the examples' numbers have one digit
    for record in task.records("test", 8):
        name = record["extra_info"]["operation"]
        shown = _example_cases(record["prompt"])
        for reader in READERS:
            assert reward("code", task.completion(name, reader), shown, "") == 1.0, reader
        assert reward("code", task.completion(name, "split"), record["ground_truth"], "") == 1.0
        assert reward("code", task.completion(name, "digits"), record["ground_truth"], "") == 0.0


def test_a_drawn_task_fits_exactly_one_operation(task):
    family = task.operations
    for record in task.records("train", 300):
        examples = _examples(record["prompt"])
        assert len(examples) == 3 and all(2 <= len(x) <= 5 for x, _ in examples)
        fits = [n for n in family if all(EXPECTED[n](x) == out for x, out in examples)]
        assert fits == [record["extra_info"]["operation"]]
    counts = Counter(r["extra_info"]["operation"] for r in task.records("train", 800))
    assert set(counts) == set(family) and min(counts.values()) > 60  # uniform: 100 each


def test_prompts_fit_the_declared_lengths(task):
    prompts = [r["prompt"] for r in task.records("train", 500)]
    assert max(map(len, prompts)) <= task.max_prompt_len
    completions = [task.completion(n, r) for n in task.operations for r in READERS]
    assert max(map(len, completions)) + 1 <= task.max_new_tokens
    longest = CodeTask(operations="sorted,double", max_length=5)
    nines = "9 9 9 9 9>18 18 18 18 18\n"
    assert longest.max_prompt_len == 3 * len(nines)


def test_splits_are_disjoint_and_seeded(task):
    test = {r["prompt"] for r in task.records("test")}
    assert len(test) == 60
    train = {r["prompt"] for r in task.records("train", 2000)}
    assert not test & train
    rows = task.sft_rows(0, 8, 256)
    documents = _documents(task, rows)
    assert documents and not {prompt for prompt, _ in documents} & test
    again = CodeTask(seed=5, test_size=60)
    assert again.records("test") == task.records("test")
    np.testing.assert_array_equal(
        again.sft_rows(3, 4, 256)["text"], task.sft_rows(3, 4, 256)["text"]
    )
    other = CodeTask(seed=6, test_size=60)
    assert other.records("test") != task.records("test") and other.battery != task.battery


def _documents(task: CodeTask, rows: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    """(prompt, answer) text of every segment, checking roles and positions on the way."""
    found = []
    for text, roles, segments, positions in zip(
        rows["text"], rows["text_roles"], rows["text_segment_ids"], rows["text_positions"],
        strict=True,
    ):  # fmt: skip
        for segment in np.unique(segments[segments > 0]):
            where = np.flatnonzero(segments == segment)
            assert np.array_equal(positions[where], np.arange(len(where)))
            ids, role = text[where], roles[where]
            user = role == Role.USER
            assert user[0] and np.all(role[user.sum() :] == Role.ASSISTANT) and ids[-1] == EOS_ID
            found.append((task.decode(ids[user]), task.decode(ids[~user][:-1])))
        assert np.all(text[segments == 0] == task.pad_id)
    return found


def _reader_of(task: CodeTask, answer: str) -> tuple[str, str]:
    (found,) = [(n, r) for n in task.operations for r in READERS if answer == task.completion(n, r)]
    return found


def test_sft_rows_hold_prompts_and_their_reference_programs(task):
    rows = task.sft_rows(4, 6, 256)
    assert {k: v.shape for k, v in rows.items()} == dict.fromkeys(rows, (6, 256))
    documents = _documents(task, rows)
    assert len(documents) >= 6 * 2  # documents of at most 147 ids: at least one per row
    for prompt, answer in documents:
        name, _ = _reader_of(task, answer)
        assert all(EXPECTED[name](x) == out for x, out in _examples(prompt))
    with pytest.raises(ValueError, match="seq_len is 99; expected at least"):
        task.sft_dataset(8, 99)


@pytest.mark.parametrize(
    ("share", "low", "high"), [(0.5, 0.35, 0.65), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)]
)
def test_the_digit_reader_takes_its_share_of_the_warm_up(share, low, high):
    task = CodeTask(seed=1, digits_share=share)
    documents = _documents(task, task.sft_rows(0, 64, 256))
    readers = [_reader_of(task, answer)[1] for _, answer in documents]
    assert len(readers) > 100 and low <= readers.count("digits") / len(readers) <= high


def test_sft_batches_resume_exactly(task):
    data = task.sft_dataset(4, 255)
    first = data.open_train((0, 1))
    batches = [next(first)["text"] for _ in range(3)]
    resumed = data.open_train((0, 1))
    resumed.set_state(first.get_state() | {"next_batch": 2})
    np.testing.assert_array_equal(next(resumed)["text"], batches[2])


def test_prompt_batches_become_tasks_with_cases(task):
    batch = task.prompt_batch(3, 5)
    tasks = prompt_tasks(batch)
    assert [t.id for t in tasks] == [15, 16, 17, 18, 19]
    for t in tasks:
        info = json.loads(t.data["extra_info"])
        assert t.data["data_source"] == "code/by-example" and info["split"] == "train"
        assert t.data["ground_truth"] == task.ground_truth(info["operation"])
        prompt = task.decode(t.data["prompt"])
        assert np.array_equal(encode(prompt), t.data["prompt"])
        assert all(EXPECTED[info["operation"]](x) == out for x, out in _examples(prompt))
    np.testing.assert_array_equal(task.prompt_batch(3, 5)["prompt"], batch["prompt"])
    assert not np.array_equal(task.prompt_batch(4, 5)["prompt"], batch["prompt"])


def test_score_runs_completions_in_the_sandbox(sandbox, task):
    reward, _ = sandbox
    records = task.records("test", 4)
    names = [r["extra_info"]["operation"] for r in records]
    wrong = next(n for n in task.operations if n != names[1])
    completions = [
        task.completion(names[0]),  # right
        task.completion(wrong),  # another operation: not every case
        "no code at all",  # no block: 0
        task.completion(names[3])[:-3],  # never closed: not a block, 0
    ]
    scores = task.score(reward, completions, "test")
    assert scores.rewards[0] == 1.0 and scores.rewards[1] < 1.0
    assert scores.rewards[2:].tolist() == [0.0, 0.0]
    assert scores.pass_rate == 0.25 and scores.mean_reward == pytest.approx(np.mean(scores.rewards))
    digits = [task.completion(n, "digits") for n in names]
    assert task.score(reward, digits, "test").rewards.tolist() == [0.0] * 4
    assert task.score(reward, digits, "test", cases="examples").rewards.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="cases is 'all'; expected 'hidden' or 'examples'"):
        task.score(reward, digits, "test", cases="all")


def test_decode_spells_every_id_and_refuses_others(task):
    assert task.decode(encode("print(1)\n")) == "print(1)\n"
    assert task.decode([0, 1, 2, 3]) == "<pad><s></s><unk>"
    assert encode("é\t").tolist() == [code_task.UNK_ID] * 2  # one id per character
    with pytest.raises(ValueError, match=r"ids hold 0\.\.100; expected ids in \[0, 100\)"):
        task.decode([0, 100])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"operations": "sum,cube"}, ValueError, "operations holds 'cube'; expected names"),
        ({"operations": "sum,sum"}, ValueError, "expected each name once"),
        ({"operations": "sum"}, ValueError, "expected at least two"),
        ({"operations": 3}, TypeError, "operations is 3"),
        ({"examples": 0}, ValueError, "examples is 0; expected an int >= 1"),
        ({"min_length": 1, "max_length": 1}, ValueError, "no battery of 4 inputs"),
        ({"cases": 0}, ValueError, "cases is 0; expected an int >= 1"),
        ({"digits_share": 1.5}, ValueError, "digits_share is 1.5"),
        ({"holdout": 0.7}, ValueError, "holdout is 0.7"),
        ({"min_length": 6}, ValueError, "min_length is 6"),
    ],
)
def test_bad_settings_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        task = CodeTask(**kwargs)
        task.records("train", 50)


def test_operations_and_draws_refuse_bad_input():
    assert check_operations(["max", "min"]) == ("max", "min")
    assert check_operations(" sum , len") == ("sum", "len")
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="told 'first' apart"):
        draw_task(rng, "first", ("first", "max"), examples=2, lengths=(1, 1))
    with pytest.raises(ValueError, match="split is 'dev'"):
        CodeTask().tasks("dev")


def test_greedy_completions_in_chunks_match_one_call(task):
    """CodeTask.completions (generate_in_chunks, 2 prompts a call, the last chunk padded)
    against generate on all prompts at once: greedy rows do not depend on their batch."""
    import jax

    from dew_pipe import models
    from dew_pipe.inference.generation import generate
    from dew_pipe.sampling import Sampling

    model = models.build(
        "causal_transformer", vocab_size=task.vocab_size, emb_features=16, num_layers=1,
        num_heads=2, mlp_features=32, max_seq_len=task.max_prompt_len + task.max_new_tokens,
    )  # fmt: skip
    variables = model.init(jax.random.key(3), np.zeros((1, 8), np.int32))
    texts = task.completions(model, variables, "test", 5, batch=2)
    prompts, lengths = task.prompt_arrays(task.tasks("test", 5))
    out = generate(
        model, variables, prompts, lengths, task.max_new_tokens, jax.random.key(0),
        Sampling(temperature=0.0, eos_id=EOS_ID),
    )  # fmt: skip
    ids, used = np.asarray(out.ids), np.asarray(out.lengths)
    expected = []
    for row, k in zip(ids, used, strict=True):
        row = row[:k]
        expected.append(task.decode(row[:-1] if row[-1] == EOS_ID else row))
    assert texts == expected and len(texts) == 5
