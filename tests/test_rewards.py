"""Verifiable rewards: MathReward's exact answers and CodeReward's test cases.

Each reward is checked on a table of completions with the reward a reader expects, on the
errors a broken reference raises, and through `PromptSource` over the native server (a
tiny greedy model whose sampled ids ``decode`` turns into an answer), where the reward runs
on the source's scoring pool while the server generates.
"""

from __future__ import annotations

import doctest
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sampled_rollout
from serving_helpers import PROBES, bfloat16_model, greedy_references, tiny_model
from test_sampled_rollout import GREEDY, prompt_batch, state_at

from dew_pipe.inference import (
    NativeRolloutServer,
    PromptSource,
    SampledRollout,
    Server,
    ServeTask,
)
from dew_pipe.objectives.rl import GRPOObjective
from dew_pipe.objectives.rl.sessions import Status, Task
from dew_pipe.rewards import (
    CodeReward,
    MathReward,
    code_tests,
    last_boxed,
    last_python_block,
    math_answers,
    parse_rational,
)
from dew_pipe.rewards.code_tests import parse_cases, same_output
from dew_pipe.rewards.math_answers import MAX_ANSWER_CHARS
from dew_pipe.sampling import Sampling
from dew_pipe.sandbox import Outcome, Program, Verdict


@pytest.mark.parametrize("module", [math_answers, code_tests], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ MathReward

MATH_CASES = [
    # fractions: any spelling of the same rational agrees
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac12}", "1/2", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"\boxed{\tfrac{3}{2}}", "1.5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333", 0.0),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
    (r"\boxed{\frac{1}{3}}", "2/6", 1.0),
    # decimals are the number written, compared exactly
    (r"\boxed{0.50}", "1/2", 1.0),
    (r"\boxed{.5}", "1/2", 1.0),
    (r"\boxed{2.5}", r"\frac{5}{2}", 1.0),
    (r"\boxed{0.1234567890123456789}", "1234567890123456789/10000000000000000000", 1.0),
    (r"\boxed{0.1000000000000000001}", "0.1", 0.0),  # equal as floats, not as rationals
    (r"\boxed{0.1 + 0.2}", "0.3", 1.0),  # 0.30000000000000004 in floats
    # negatives
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{\frac{-1}{2}}", "-1/2", 1.0),
    (r"\boxed{3}", "-3", 0.0),
    (r"\boxed{-0}", "0", 1.0),
    # thousands separators: groups of three digits; anything else is a list
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{1,5}", "1.5", 0.0),
    # nested braces and exact arithmetic
    (r"\boxed{\frac{\frac{1}{2}}{2}}", "1/4", 1.0),
    (r"\boxed{2^{-1}}", "0.5", 1.0),
    (r"\boxed{\sqrt{\frac{9}{4}}}", "3/2", 1.0),
    (r"\boxed{\sqrt[3]{-27}}", "-3", 1.0),
    (r"\boxed{\left(\frac{1}{2}\right)}", "0.5", 1.0),
    (r"\boxed{a\{b\}}", "1", 0.0),  # escaped braces are literal, not groups
    # several boxes: the last one is the answer, even when an earlier one was right
    (r"first \boxed{1}, no: \boxed{2}", "2", 1.0),
    (r"first \boxed{1}, no: \boxed{2}", "1", 0.0),
    (r"\boxed{\boxed{7}}", "7", 1.0),
    (r"\boxed{2} and then \boxed{\frac{1}{2}", "2", 0.0),  # the last box never closes
    # no box
    ("The answer is 1/2.", "1/2", 0.0),
    ("", "1", 0.0),
    (r"\boxed 5", "5", 0.0),  # no braced argument
    (r"\boxedfive{5}", "5", 0.0),  # another command
    # malformed LaTeX and non-numbers score 0, never raise
    (r"\boxed{\frac{1}{}}", "1", 0.0),
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{1 +}", "1", 0.0),
    (r"\boxed{\frac{1}{0}}", "0", 0.0),
    (r"\boxed{)(}", "0", 0.0),
    (r"\boxed{\sqrt{2}}", "1.4142135623730951", 0.0),
    (r"\boxed{\pi}", "3.14159", 0.0),
    (r"\boxed{x}", "1", 0.0),
    (r"\boxed{\infty}", "1", 0.0),
    # answer conventions the parser normalizes
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{50\%}", "1/2", 1.0),
    (r"\boxed{\displaystyle \frac{6}{8}}", "0.75", 1.0),
    # a reference may itself be boxed or LaTeX
    (r"\boxed{4}", r"\boxed{4}", 1.0),
    (r"\boxed{0.25}", r"\dfrac{1}{4}", 1.0),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), MATH_CASES)
def test_math_reward_table(completion, reference, expected):
    value = MathReward()("math", completion, reference, "")
    assert type(value) is float and value == expected


def test_hostile_answers_score_zero_quickly():
    reward = MathReward()
    started = time.perf_counter()
    assert reward("m", r"\boxed{10^{10^{10}}}", "1", "") == 0.0
    assert reward("m", r"\boxed{(\frac{3}{2})^{100000}}", "1", "") == 0.0
    assert reward("m", r"\boxed{100000000!}", "1", "") == 0.0
    long = "+".join(["1"] * MAX_ANSWER_CHARS)
    assert reward("m", rf"\boxed{{{long}}}", str(MAX_ANSWER_CHARS // 2 + 1), "") == 0.0
    assert time.perf_counter() - started < 5.0
    assert reward("m", r"\boxed{2^{64}}", str(2**64), "") == 1.0  # large but bounded


@pytest.mark.parametrize("reference", ["abc", r"\sqrt{2}", "", "1,5", r"\frac{1}{", "x"])
def test_a_reference_that_is_not_a_rational_is_named(reference):
    with pytest.raises(ValueError, match="ground_truth is .*expected a rational number") as info:
        MathReward()("math", r"\boxed{1}", reference, "")
    assert repr(reference) in str(info.value)


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match="ground_truth is int; expected a str"):
        MathReward()("math", r"\boxed{1}", 1, "")
    with pytest.raises(TypeError, match="answer is int"):
        parse_rational(3)


def test_exact_values_against_fractions():
    """Random rationals written three ways all parse to the same Fraction."""
    rng = random.Random(0)
    for _ in range(40):
        value = Fraction(rng.randint(-(10**6), 10**6), rng.choice([1, 2, 4, 5, 8, 10, 16, 125]))
        decimal = f"{float(value):.4f}"  # these denominators divide 10**4: exact
        assert Fraction(decimal) == value
        for text in (
            rf"\frac{{{value.numerator}}}{{{value.denominator}}}",
            f"{value.numerator}/{value.denominator}",
            decimal,
        ):
            assert parse_rational(text) == value, text
    assert parse_rational(r"\frac{1}{3}") == Fraction(1, 3) != parse_rational("0.3333333333")


def test_last_boxed_reads_nested_groups():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{4}}} c") == r"\frac{1}{\sqrt{4}}"
    assert last_boxed(r"\boxed {  7 }") == "7"
    assert last_boxed(r"\boxed{a\}b}") == r"a\}b"
    assert last_boxed(r"\boxed{1} \boxedx{2}") == "1"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{ }") is None
    assert last_boxed(r"\boxed{{1}") is None


def test_math_reward_is_safe_on_many_threads():
    reward = MathReward()
    cases = MATH_CASES * 4
    with ThreadPoolExecutor(8) as pool:
        values = list(pool.map(lambda case: reward("m", case[0], case[1], ""), cases))
    assert values == [expected for _, _, expected in cases]


# ------------------------------------------------------------------ through PromptSource

STEPS = 4  # sampled ids per draw: no EOS, so every draw ends TRUNCATED on its budget (scored)


@pytest.fixture(scope="module")
def greedy_server():
    """The native server, greedy in bfloat16, and each probe's first STEPS greedy ids."""
    model, variables = tiny_model(0)
    served = bfloat16_model(model)
    refs = greedy_references(served, jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables))
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, Sampling(temperature=0)),
            slots=2,
            capacity=16,
            dtype=jnp.bfloat16,
            steps_per_call=4,
        )
    )
    yield server, [ref[:STEPS] for ref in refs]
    server.close()


def _tasks(ground_truths: list[str]) -> list[Task]:
    return [
        Task(i, {"prompt": np.array(PROBES[i], np.int32), "ground_truth": truth})
        for i, truth in enumerate(ground_truths)
    ]


def _score_through_source(server, reward, decode, tasks: list[Task]):
    threads = []

    def recording(*args):
        threads.append(threading.current_thread().name)
        return reward(*args)

    with PromptSource(server, recording, decode=decode, max_new_tokens=STEPS) as source:
        futures = [source.submit(t, group=t.id, sample=0, attempt=0) for t in tasks]
        sessions = [f.result(timeout=120) for f in futures]
    assert threads and all(name.startswith("prompt-reward") for name in threads)
    return sessions


@pytest.mark.slow  # compiles the server's (or generate's) steps
def test_math_reward_through_prompt_source(greedy_server):
    server, expected_ids = greedy_server

    def decode(ids) -> str:  # the sampled ids as a sum the reward must evaluate exactly
        return "The total is \\boxed{" + "+".join(str(int(i)) for i in ids) + "}."

    sums = [sum(ids) for ids in expected_ids[:4]]
    truths = [
        rf"\frac{{{2 * sums[0]}}}{{2}}",  # right, spelled as a fraction
        f"{sums[1]}.0",  # right, as a decimal
        str(sums[2] + 1),  # wrong
        "not a number",  # a broken reference: INFRA_ERROR naming it
    ]
    sessions = _score_through_source(server, MathReward(), decode, _tasks(truths))
    for session, ids in zip(sessions, expected_ids, strict=False):
        assert session.calls[0].sampled_ids.tolist() == ids
    assert [s.status for s in sessions[:3]] == [Status.TRUNCATED] * 3
    assert [s.reward for s in sessions[:3]] == [1.0, 1.0, 0.0]
    assert sessions[3].status is Status.INFRA_ERROR
    assert "ground_truth is 'not a number'" in sessions[3].detail


# ------------------------------------------------------------------ CodeReward


def _fence(code: str, tag: str = "python") -> str:
    return f"```{tag}\n{code}\n```"


DOUBLE = json.dumps(
    [{"stdin": s, "stdout": o} for s, o in [("2", "4"), ("5", "10\n"), ("-3", "-6")]]
)
RIGHT = "print(int(input()) * 2)"
PLUS_TWO = "print(int(input()) + 2)"  # right on the first case only (2 + 2 == 2 * 2)

CODE_CASES = [
    ("right", "Here:\n" + _fence(RIGHT), 1.0),
    ("one of three", _fence(PLUS_TWO), 1 / 3),
    ("several blocks, the last is right", _fence(PLUS_TWO) + "\nfixed:\n" + _fence(RIGHT), 1.0),
    ("several blocks, the last is wrong", _fence(RIGHT) + "\n" + _fence(PLUS_TWO, "py"), 1 / 3),
    ("a later untagged block is not code", _fence(RIGHT) + "\n" + _fence(PLUS_TWO, ""), 1.0),
    ("tag spelled python3, any case", _fence(RIGHT, "Python3"), 1.0),
    ("no block", "print(int(input()) * 2)", 0.0),
    ("untagged block only", _fence(RIGHT, ""), 0.0),
    ("another language", _fence(RIGHT, "js"), 0.0),
    ("cut off inside the block", "```python\n" + RIGHT, 0.0),
    ("indented block", "1. the code:\n   ```python\n   " + RIGHT + "\n   ```\n", 1.0),
    (
        "trailing spaces and blank lines are ignored",
        _fence("print(str(int(input()) * 2) + '  \\t')\nprint()\nprint()"),
        1.0,
    ),
    ("leading spaces matter", _fence("print(' ' + str(int(input()) * 2))"), 0.0),
    ("a blank line inside matters", _fence("print()\n" + RIGHT), 0.0),
    ("right output but exit 1", _fence(RIGHT + "\nraise SystemExit(1)"), 0.0),
    ("raises on one case", _fence("n = int(input())\nassert n > 0\nprint(n * 2)"), 2 / 3),
    (
        "hangs on one case",
        _fence("import time\nn = int(input())\nif n < 0:\n    time.sleep(60)\nprint(n * 2)"),
        2 / 3,
    ),
    (
        "floods on one case",
        _fence("n = int(input())\nif n == 5:\n    print('x' * 10**7)\nprint(n * 2)"),
        2 / 3,
    ),
    (
        "segfaults on one case",
        _fence(
            "import ctypes\nn = int(input())\nif n == 5:\n    ctypes.string_at(0)\nprint(n * 2)"
        ),
        2 / 3,
    ),
    ("syntax error", _fence("print(int(input()) * 2"), 0.0),
]

# The hanging case waits out wall_seconds; shorter deadlines fail right programs on a loaded
# 2-core machine (a sandboxed python start can take over a second there).
LIMITS = dict(wall_seconds=4.0, cpu_seconds=2.0, output_bytes=64 * 1024, memory_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def fleet():
    from dew_pipe.sandbox import ProcessRunner, SandboxFleet, SandboxLimits

    with SandboxFleet(ProcessRunner(), SandboxLimits(**LIMITS), workers=4) as fleet:
        yield fleet


@pytest.mark.parametrize(
    ("completion", "expected"), [c[1:] for c in CODE_CASES], ids=[c[0] for c in CODE_CASES]
)
def test_code_reward_table(fleet, completion, expected):
    fraction, strict = CodeReward(fleet), CodeReward(fleet, all_or_nothing=True)
    with ThreadPoolExecutor(2) as pool:  # both at once: a hanging case waits out one deadline
        value, strict_value = pool.map(
            lambda r: r("code", completion, DOUBLE, ""), (fraction, strict)
        )
    assert type(value) is float and value == pytest.approx(expected, abs=1e-12)
    assert strict_value == (1.0 if expected == 1.0 else 0.0)


def test_each_case_ends_as_its_verdict(fleet):
    named = {name: last_python_block(completion) for name, completion, _ in CODE_CASES}
    programs = ["hangs on one case", "floods on one case", "segfaults on one case"]
    with ThreadPoolExecutor(3) as pool:
        hang, flood, crash = pool.map(
            lambda name: {
                r.case.stdin: (r.outcome.verdict, r.passed)
                for r in CodeReward(fleet).check(named[name], parse_cases(DOUBLE))
            },
            programs,
        )
    passed = (Verdict.COMPLETED, True)
    assert hang == {"2": passed, "5": passed, "-3": (Verdict.TIMEOUT, False)}
    assert flood == {"2": passed, "5": (Verdict.OUTPUT_LIMIT, False), "-3": passed}
    assert crash == {"2": passed, "5": (Verdict.CRASHED, False), "-3": passed}


BAD_CASES = [
    ("not json", r"ground_truth is not JSON \(.*\): 'not json'; expected a JSON list"),
    ("{}", r"ground_truth is \{\}; expected a JSON list of .* at least one"),
    ("[]", r"ground_truth is \[\]; expected .* at least one"),
    ("[5]", r"ground_truth\[0\] is 5; expected an object"),
    ('[{"stdin": "1", "stdout": "2"}, {"stdin": "1"}]', r"ground_truth\[1\] has no 'stdout'"),
    (
        '[{"stdin": "1", "stdout": "2", "input": "x"}]',
        r"ground_truth\[0\] has unknown field 'input'",
    ),
    ('[{"stdin": 1, "stdout": "2"}]', r"ground_truth\[0\]\['stdin'\] is 1; expected a string"),
]


@pytest.mark.parametrize(("ground_truth", "message"), BAD_CASES)
def test_a_bad_ground_truth_is_named(ground_truth, message):
    fleet = ScriptedFleet(lambda program: _outcome(b""))
    with pytest.raises(ValueError, match=message):
        CodeReward(fleet)("code", _fence(RIGHT), ground_truth, "")
    with pytest.raises(ValueError, match=message):  # checked before looking for a block
        CodeReward(fleet)("code", "no block", ground_truth, "")
    assert fleet.programs == []


def test_constructor_refuses_what_is_not_a_fleet_or_flag():
    with pytest.raises(TypeError, match="fleet is .*expected a SandboxFleet"):
        CodeReward(object())
    with pytest.raises(TypeError, match="all_or_nothing is 1; expected a bool"):
        CodeReward(ScriptedFleet(None), all_or_nothing=1)
    with pytest.raises(TypeError, match="python is ''"):
        CodeReward(ScriptedFleet(None), python="")
    with pytest.raises(TypeError, match="ground_truth is int"):
        CodeReward(ScriptedFleet(None))("code", "", 3, "")


# A fleet-shaped seam: programs run on one scripted worker thread, in submission order.


def _outcome(stdout: bytes, verdict=None) -> Outcome:
    verdict = Verdict.COMPLETED if verdict is None else verdict
    return Outcome(verdict, 0 if verdict is Verdict.COMPLETED else 1, stdout, b"", 0.0)


class ScriptedFleet:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.programs: list[Program] = []
        self.pool = ThreadPoolExecutor(1)

    def submit(self, program):
        self.programs.append(program)
        return self.pool.submit(self.answer, program)


def test_what_each_case_submits_and_all_or_nothing_stopping_early():
    release = threading.Event()
    started: list[bytes] = []

    def answer(program):  # one worker: case 0 passes, case 1 fails, the rest wait
        started.append(program.stdin)
        if program.stdin not in (b"0", b"1"):
            release.wait(10)
        return _outcome(b"0\n" if program.stdin == b"0" else b"wrong\n")

    fleet = ScriptedFleet(answer)
    reward = CodeReward(fleet, all_or_nothing=True, python="python3.12")
    cases = json.dumps([{"stdin": str(i), "stdout": str(2 * i)} for i in range(6)])
    try:
        assert reward("code", _fence(RIGHT), cases, "") == 0.0
    finally:
        release.set()
        fleet.pool.shutdown(wait=True)
    assert [p.stdin for p in fleet.programs] == [str(i).encode() for i in range(6)]
    program = fleet.programs[0]
    assert dict(program.files) == {"main.py": RIGHT + "\n"}
    assert program.argv == ("python3.12", "main.py")
    # After case 1 failed, the cases still queued were cancelled (case 2 may have started).
    assert started[:2] == [b"0", b"1"] and len(started) <= 3

    fleet = ScriptedFleet(lambda program: _outcome(b"0" if program.stdin == b"0" else b"x"))
    assert CodeReward(fleet)("code", _fence(RIGHT), cases, "") == 1 / 6
    assert len(fleet.programs) == 6


def test_block_and_line_rules():
    assert same_output("4\r\n5\r\n", "4\n5")
    assert same_output("", "\n\n")
    assert not same_output("4\n5", "4 5")
    assert not same_output("A", "a")
    assert last_python_block("```python\n```") == ""
    assert last_python_block("```python\r\nprint(1)\r\n```\r\n") == "print(1)\n"
    assert last_python_block("```python title='a.py'\nprint(1)\n```") == "print(1)\n"
    # fences pair up: a python fence inside an untagged block is that block's text, and a
    # bare fence after a closed block opens a new (untagged, here unclosed) one
    assert last_python_block("```\n```python\nprint(1)\n```") is None
    assert last_python_block("```py\nx = 1\n```\nmore\n```\n```python\ny = 2\n") == "x = 1\n"
    started = time.perf_counter()  # one pass, however many fences never close
    assert last_python_block("```python\n" * 50_000) is None
    assert time.perf_counter() - started < 1.0


@pytest.mark.slow  # compiles the server's (or generate's) steps
def test_code_reward_through_prompt_source(greedy_server, fleet):
    server, expected_ids = greedy_server

    def decode(ids) -> str:  # a program printing the sum of the sampled ids
        return "```python\nprint(" + " + ".join(str(int(i)) for i in ids) + ")\n```"

    sums = [sum(ids) for ids in expected_ids[:4]]
    truths = [
        json.dumps([{"stdin": "", "stdout": f"{sums[0]}\n"}]),
        json.dumps([{"stdin": "", "stdout": str(sums[1])}, {"stdin": "x", "stdout": "0"}]),
        json.dumps([{"stdin": "", "stdout": str(sums[2] + 1)}]),
        "[{}]",
    ]
    sessions = _score_through_source(server, CodeReward(fleet), decode, _tasks(truths))
    assert [s.status for s in sessions[:3]] == [Status.TRUNCATED] * 3
    assert [s.reward for s in sessions[:3]] == [1.0, 0.5, 0.0]
    assert sessions[3].status is Status.INFRA_ERROR
    assert "ground_truth[0] has no 'stdin'" in sessions[3].detail


# ------------------------------------------------------------------ through SampledRollout

# The decoder whose greedy continuation is known by construction (test_sampled_rollout.py).
known = test_sampled_rollout.known


def _sampled_rewards(known, reward, decode, ground_truths):
    """Rewards of a greedy SampledRollout on the known decoder: prompt [1, 2] continues
    3, 4, 5, 6 (budget), prompt [3, 4, 5] continues 6 then EOS; two samples each."""
    rollout = SampledRollout(
        GRPOObjective(known.model, seq_len=6), reward, 2, 4, GREEDY, decode=decode
    )
    batch = prompt_batch([[1, 2], [3, 4, 5]], 3, ground_truth=ground_truths)
    rollout(state_at(known.variables, 0), batch, jax.random.key(0))
    return [s.reward for s in rollout.last_sessions]


@pytest.mark.slow  # compiles the server's (or generate's) steps
def test_math_reward_through_sampled_rollout(known):
    def decode(ids) -> str:
        return r"\boxed{" + "+".join(str(int(i)) for i in ids) + "}"

    rewards = _sampled_rewards(known, MathReward(), decode, [r"\frac{36}{2}", "6.5"])
    assert rewards == [1.0, 1.0, 0.0, 0.0]  # 3+4+5+6 = 18 = 36/2; 6 is not 6.5


@pytest.mark.slow  # compiles the server's (or generate's) steps
def test_code_reward_through_sampled_rollout(known, fleet):
    def decode(ids) -> str:
        return "```python\nprint(" + " * ".join(str(int(i)) for i in ids) + ")\n```"

    truths = [json.dumps([{"stdin": "", "stdout": "360"}]), '[{"stdin": "", "stdout": "7"}]']
    rewards = _sampled_rewards(known, CodeReward(fleet), decode, truths)
    assert rewards == [1.0, 1.0, 0.0, 0.0]  # 3*4*5*6 = 360; 6 is not 7


# ------------------------------------------------------------------ on the isolating runner


WRITE = "open('note.txt', 'w').write('x')\n"  # beside main.py, in the job directory


def test_code_reward_on_bubblewrap(fleet):
    """The runner the RLVR pipeline uses: right code passes; code that needs the network or
    writes beside itself fails there, while it passes under ProcessRunner."""
    import socket

    from sandbox_helpers import bubblewrap_runner

    from dew_pipe.sandbox import SandboxFleet, SandboxLimits

    runner = bubblewrap_runner()
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:  # the host's loopback
        port = server.getsockname()[1]
        network = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2).close()\n"
        completions = [_fence(RIGHT), _fence(network + RIGHT), _fence(WRITE + RIGHT)]
        with SandboxFleet(runner, SandboxLimits(**LIMITS), workers=2) as isolated:
            isolated_rewards = [CodeReward(isolated)("c", c, DOUBLE, "") for c in completions]
        process_rewards = [CodeReward(fleet)("c", c, DOUBLE, "") for c in completions]
    assert isolated_rewards == [1.0, 0.0, 0.0]
    assert process_rewards == [1.0, 1.0, 1.0]
