"""The tool-use task (dew_pipe.tasks.tool_calc) and its calculator worker program.

The worker runs as a real process through ``SubprocessEnvironment`` and must answer every
request as the in-process ``LocalCalculator`` does; the SFT transcripts, the sizes and the
verifier are checked against hand-written expectations; ``success`` runs episodes of
scripted servers (one that uses the tool right, one that never does) through the workers.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from dew_pipe.data.chat import Role
from dew_pipe.inference import Draw
from dew_pipe.objectives.rl import Action, Episode, EpisodeId, Observation
from dew_pipe.objectives.rl.sessions import Task
from dew_pipe.objectives.rl.subprocess_environment import WorkerError
from dew_pipe.tasks import tool_calc_worker as tool
from dew_pipe.tasks.tool_calc import ToolCalcTask

TASK = ToolCalcTask(seed=0, test_size=20)
EOS = tool.EOS


def turn(text: str) -> list[int]:
    return tool.encode(text) + [EOS]


def act(context, tokens, stopped=True) -> Action:
    n = len(tokens)
    return Action(context, tokens, [-0.5] * n, [-0.4] * n, stopped=stopped, policy_step=0)


def problem_task(text: str, answer: str = "0", task_id: int = 0) -> Task:
    return Task(task_id, {"prompt": np.asarray(tool.encode(text), np.int32),
                          "ground_truth": answer})  # fmt: skip


# ------------------------------------------------------------------ the tool


def test_the_calculator_reads_expressions_and_refuses_the_rest():
    assert [tool.calculate(e) for e in ("37*48", "7-9", "12+0", "999999999*999999999")] == [
        "1776", "-2", "12", str(999999999 * 999999999),
    ]  # fmt: skip
    assert [tool.calculate(e) for e in ("", "3**4", "1234567890*2", "-3*4", "3*4=")] == ["?"] * 5
    assert tool.decode(tool.encode("12*3=#@A?")) == "12*3=#@A?"
    with pytest.raises(ValueError, match="holds 'x'"):
        tool.encode("3x4")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tool.decode([22])
    with pytest.raises(ValueError, match="expected '<digits><op><digits>='"):
        tool.Calculator("3*4")


def test_the_worker_process_answers_as_the_in_process_tool_does():
    task = problem_task("37*48=", "1776")
    script = [turn("#37*48"), turn("#1776+0"), turn("A1776")]
    observations = {}
    for name, opened in (("worker", TASK.environment()(task, EpisodeId(0, 0, 0, 1))),
                         ("local", TASK.local_environment(task))):  # fmt: skip
        with opened as env:
            seen = [env.reset()]
            for tokens in script:
                seen.append(env.step(act(seen[-1].context, tokens)))
                if tokens == script[0]:
                    state = env.get_state()
            env.set_state(state)  # back to after the first call
            seen.append(env.step(act(seen[1].context, script[2])))
        observations[name] = seen
    assert observations["worker"] == observations["local"]
    first, called, again, answered, restored = observations["worker"]
    assert tool.decode(first.context.tolist()) == "37*48="
    assert tool.decode(called.context.tolist()) == "37*48=#37*48</s>@1776"
    assert tool.decode(again.context.tolist()).endswith("@1776#1776+0</s>@1776")
    assert (answered.status.value, answered.detail) == ("completed", "1776")
    assert restored == answered


def test_other_turns_complete_unscorable_and_unstopped_turns_are_errors():
    with TASK.local_environment(problem_task("3*4=")) as env:
        first = env.reset()
        unreadable = env.step(act(first.context, turn("#3*")))
        other = env.step(act(first.context, turn("12")))
        cut = env.step(act(first.context, tool.encode("#3*4"), stopped=False))
    assert tool.decode(unreadable.context.tolist()) == "3*4=#3*</s>@?" and unreadable.running
    assert other.status.value == "completed" and other.detail == "not a call or an answer: '12'"
    assert cut.status.value == "error" and cut.detail == "a turn must end on EOS"


def test_a_worker_given_a_bad_problem_fails_its_episode_with_a_clear_error():
    bad = Task(0, {"prompt": np.asarray(tool.encode("12="), np.int32), "ground_truth": "1"})
    expected = r"ended before replying to reset.*problem is '12='"
    with (
        TASK.environment()(bad, EpisodeId(0, 0, 0, 1)) as env,
        pytest.raises(WorkerError, match=expected),
    ):
        env.reset()
    with pytest.raises(ValueError, match="expected the payload"):
        TASK.problem_text(Task(3))


# ------------------------------------------------------------------ sizes, transcripts


def test_sizes_fit_two_calls_and_an_answer_of_the_longest_problem():
    longest = "9" * TASK.digits + "*" + "9" * TASK.digits + "="
    context = tool.encode(longest)
    for _ in range(TASK.max_turns - 1):
        call = turn("#" + longest[:-1])
        assert len(call) <= TASK.max_new_tokens
        context += call + tool.encode("@" + tool.calculate(longest[:-1]))
    assert len(context) == TASK.max_prompt_tokens  # room for exactly max_turns - 1 calls
    assert len(turn("A" + tool.calculate(longest[:-1]))) <= TASK.max_new_tokens
    assert TASK.width == TASK.max_prompt_tokens + TASK.max_new_tokens
    assert TASK.vocab_size == len(TASK.tokenizer()) == 22
    assert TASK.tokenizer().encode("37*48=#@A") == tool.encode("37*48=#@A")


def test_transcripts_train_on_the_model_turns_only():
    ids, roles = TASK.transcript("37*48=", "1776", use_tool=True)
    assert TASK.decode(ids) == "37*48=#37*48</s>@1776A1776</s>"
    spans = [(Role(r), TASK.decode([i])) for r, i in zip(roles, ids, strict=True)]
    assistant = "".join(text for role, text in spans if role is Role.ASSISTANT)
    assert assistant == "#37*48</s>A1776</s>"  # the problem and the tool's result are USER
    direct, _ = TASK.transcript("37*48=", "1776", use_tool=False)
    assert TASK.decode(direct) == "37*48=A1776</s>"


def test_sft_rows_mix_the_tool_share_and_repeat_exactly():
    task = ToolCalcTask(seed=3, tool_share=0.3)
    rows = task.sft_rows(5, 64, 64)
    assert rows["text"].shape == (64, 64)
    for name, value in task.sft_rows(5, 64, 64).items():
        np.testing.assert_array_equal(value, rows[name])
    assert not np.array_equal(task.sft_rows(6, 64, 64)["text"], rows["text"])
    documents = []
    for r in range(64):
        for s in range(1, rows["text_segment_ids"][r].max() + 1):
            where = rows["text_segment_ids"][r] == s
            np.testing.assert_array_equal(rows["text_positions"][r][where], np.arange(where.sum()))
            documents.append(task.decode(rows["text"][r][where].tolist()))
    called = np.mean(["#" in d for d in documents])
    assert len(documents) > 150 and abs(called - 0.3) < 0.1  # binomial: 4+ standard errors
    for d in documents:  # every transcript answers right, with or without the tool
        problem, answer = d.split("=", 1)[0], d.rsplit("A", 1)[1].removesuffix("</s>")
        assert answer == tool.calculate(problem)
    with pytest.raises(ValueError, match="expected at least"):
        task.sft_rows(0, 2, 20)
    with pytest.raises(ValueError, match="val is True"):
        task.sft_dataset(8, 63, val=True)
    batch = next(task.sft_dataset(8, 63).open_train((0, 1)))
    assert batch["text"].shape == (8, 64)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="tool_share is 1.5"):
        ToolCalcTask(tool_share=1.5)
    with pytest.raises(ValueError, match="max_turns is 1; expected an int >= 2"):
        ToolCalcTask(max_turns=1)
    with pytest.raises(ValueError, match="digits"):
        ToolCalcTask(digits=0)


# ------------------------------------------------------------------ the verifier and success


def test_the_verifier_rewards_a_completed_exact_answer_only():
    task = problem_task("3*4=", "12")
    first = Observation(tool.encode("3*4="))
    episode = lambda status, detail: Episode(EpisodeId(0, 0, 0, 1), first, (), status, detail)  # noqa: E731
    assert TASK.verify(task, episode("completed", "12")) == 1.0
    assert TASK.verify(task, episode("completed", "13")) == 0.0
    assert TASK.verify(task, episode("truncated", "12")) == 0.0


class ScriptedServer:
    """Answers every turn at once: a tool call first (or never), then the tool's result."""

    version = 0

    def __init__(self, use_tool: bool) -> None:
        self.use_tool = use_tool

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        text = tool.decode([int(i) for i in prompt_ids])
        if "@" in text:
            ids = turn("A" + text.rsplit("@", 1)[1])
        elif self.use_tool:
            ids = turn("#" + text[:-1])
        else:
            ids = turn("A42")
        future = cf.Future()
        n = len(ids)
        future.set_result(Draw(prompt_ids, ids, [-0.1] * n, "stop", 0, 0, log_probs=[-0.2] * n))
        return future


def test_success_runs_one_episode_per_problem_through_the_workers():
    episodes = []
    right = TASK.success(ScriptedServer(True), "test", 6, workers=3,
                         record=lambda t, e: episodes.append(e))  # fmt: skip
    assert right == 1.0 and len(episodes) == 6
    assert all(TASK.called_tool(e) and len(e.actions) == 2 for e in episodes)
    assert TASK.success(ScriptedServer(False), "test", 6, workers=3) == 0.0
    tasks = TASK.tasks("test", 6)
    assert [t.id for t in tasks] == list(range(6))
    assert all(t.data["ground_truth"] == tool.calculate(TASK.problem_text(t)[:-1]) for t in tasks)
    held_out = set(TASK.problems("test").prompts())
    assert not held_out & set(TASK.problems("train", 2000).prompts())


@pytest.mark.parametrize("module", ["dew_pipe.tasks.tool_calc", "dew_pipe.tasks.tool_calc_worker"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
