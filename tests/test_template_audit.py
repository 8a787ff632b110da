"""The chat-template audit and the calls-per-chain audit, as functions and as ``dew-pipe audit``:
verdicts on templates built here (the spec's Qwen3 findings, an append-only template, one
that fails), splits sorted by cause on sessions a harness would record, and traces files
that are malformed (each error names the line)."""

from __future__ import annotations

import doctest
import json

import numpy as np
import pytest
from chat_templates import APPEND_ONLY, NO_TOOLS, QWEN3_LIKE, tokenizer_with

from dew_pipe.beam import session_to_json
from dew_pipe.cli import main
from dew_pipe.data import template_audit
from dew_pipe.data.template_audit import SHAPES, TurnShape, audit_template
from dew_pipe.data.tokenizer import build_tokenizer
from dew_pipe.objectives.rl import chain_audit
from dew_pipe.objectives.rl.chain_audit import audit_sessions, read_traces
from dew_pipe.objectives.rl.sessions import Call, Session, pack, session_metrics


@pytest.fixture(scope="module")
def qwen3_like():
    return tokenizer_with(QWEN3_LIKE)


def _by_shape(audit) -> dict[tuple, object]:
    return {(v.shape.reasoning, v.shape.call, v.shape.observation): v for v in audit.verdicts}


def test_the_qwen3_like_template_reproduces_the_spec_findings(qwen3_like):
    verdicts = _by_shape(audit_template(qwen3_like))
    assert len(verdicts) == len(SHAPES) == 10
    merges = [shape for shape, v in verdicts.items() if v.result == "merges"]
    assert merges == [(True, "string", "tool")]  # only reasoning + a tool-role observation
    for call in (None, "string", "object"):  # no reasoning: the empty think block
        v = verdicts[(False, call, "user")]
        assert v.result == "splits" and "empty '<think>\\n\\n</think>' block" in v.cause
        assert "<think>" in v.sampled and "<think>" not in v.history
    for call in (None, "string", "object"):  # a user-role observation drops the reasoning
        v = verdicts[(True, call, "user")]
        assert v.result == "splits" and v.cause == "reasoning dropped from history"
    json_split = verdicts[(True, "object", "tool")]  # compact JSON comes back with spaces
    assert json_split.result == "splits" and "re-serialized" in json_split.cause
    assert '{"city":"Paris"' in json_split.sampled and '{"city": "Paris"' in json_split.history


def test_an_append_only_template_merges_every_shape_and_a_failing_one_is_named():
    audit = audit_template(tokenizer_with(APPEND_ONLY))
    assert audit.append_only and {v.result for v in audit.verdicts} == {"merges"}
    assert "10 of 10 turn shapes" in audit.report()
    failing = _by_shape(audit_template(tokenizer_with(NO_TOOLS)))
    for (_, _, observation), v in failing.items():
        if observation == "tool":
            assert v.result == "fails" and "this model has no tool role" in v.cause
        else:
            assert v.result == "merges"


def test_the_split_is_where_the_ids_first_differ(qwen3_like):
    shape = TurnShape(reasoning=True, call="object", observation="tool")
    (v,) = audit_template(qwen3_like, [shape]).verdicts
    request = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    turn = {"role": "assistant", "content": "Let me look that up.",
            "reasoning_content": "The user wants the current weather; the weather tool can tell.",
            "tool_calls": [{"type": "function", "function": call}]}  # fmt: skip
    tool = {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'}
    tools = template_audit._TOOLS

    def ids(messages, prompt):
        text = qwen3_like.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt
        )
        return qwen3_like(text, add_special_tokens=False)["input_ids"]

    compact = dict(turn, tool_calls=[{"type": "function", "function": dict(
        call, arguments='{"city":"Paris","unit":"celsius"}')}])  # fmt: skip
    final, following = ids([*request, compact], False), ids([*request, turn, tool], True)
    first = next(i for i, (a, b) in enumerate(zip(final, following, strict=False)) if a != b)
    assert v.token == first
    assert qwen3_like.decode(following[first:]).startswith(" ")  # the space tojson adds


def test_audit_template_refuses_what_it_cannot_audit():
    plain = build_tokenizer(["a b c"] * 8, vocab_size=300)
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        audit_template(plain)
    with pytest.raises(TypeError, match="expected a Hub name, a local path"):
        audit_template(3)
    with pytest.raises(ValueError, match="shapes is empty"):
        audit_template(tokenizer_with(APPEND_ONLY), [])


def test_cli_audit_template_reads_a_tokenizer_directory(tmp_path, capsys, qwen3_like):
    qwen3_like.save_pretrained(tmp_path / "tok")
    assert main(["audit", "template", "--tokenizer", str(tmp_path / "tok")]) == 0
    text = capsys.readouterr().out
    assert "1 of 10 turn shapes keep the history append-only" in text
    assert "reasoning, call as string, tool observation     merges" in text
    assert main(["audit", "template", "--tokenizer", str(tmp_path / "tok"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["append_only"] is False and len(report["verdicts"]) == 10
    assert [v["result"] for v in report["verdicts"]].count("merges") == 1


# ---------------------------------------------------------------- calls per chain


def _harness_session(tokenizer, shape: TurnShape, task: int, turns: int = 3) -> Session:
    """What a harness records: each call's prompt is the template's render of the history,
    its sampled ids what the template writes for the final assistant turn."""
    tools = template_audit._TOOLS
    history = [{"role": "user", "content": "What is the weather in Paris right now?"}]

    def ids(messages, prompt):
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    calls = []
    for _ in range(turns):
        prompt = ids(history, True)
        sampled = template_audit._assistant(shape, template_audit._COMPACT)
        full = ids([*history, sampled], False)
        drawn = full[len(prompt) :]
        calls.append(Call(prompt, drawn, [-0.5] * len(drawn), "stop", 0))
        back = template_audit._ARGUMENTS if shape.call == "object" else template_audit._COMPACT
        history += [template_audit._assistant(shape, back), template_audit._observation(shape)]
    return Session(task, 0, 0, 0, calls, "COMPLETED", 1.0)


def test_calls_per_chain_on_sessions_a_harness_records(qwen3_like):
    merging = TurnShape(reasoning=True, call="string", observation="tool")
    splitting = TurnShape(reasoning=False, call="string", observation="tool")
    sessions = [
        _harness_session(qwen3_like, merging, 0),
        _harness_session(qwen3_like, splitting, 1),
    ]
    audit = audit_sessions(sessions)
    # the first session is one chain of 3 calls, the second 3 chains of 1: 6 calls in 4 chains
    assert (audit.calls, audit.chains, audit.calls_per_chain) == (6, 4, 1.5)
    assert (audit.multi_call, audit.one_chain) == (2, 1)
    assert audit.splits == {"draw rewritten": 2, "history rewritten": 0, "prompt shorter": 0}
    assert audit.chain_sizes == {3: 1, 1: 3}
    metrics = session_metrics(sessions, pack(sessions, 2048))  # the packer agrees
    assert metrics["chains/calls_per_chain"] == audit.calls_per_chain


def test_every_split_cause_is_told_apart():
    first = Call([1, 2, 3], [4, 5], [-0.1, -0.1], "stop", 0)
    cases = {
        "draw rewritten": Call([1, 2, 3, 4, 6, 9], [7], [-0.1], "stop", 0),
        "history rewritten": Call([1, 8, 3, 4, 5, 9], [7], [-0.1], "stop", 0),
        "prompt shorter": Call([1, 2, 3, 4], [7], [-0.1], "stop", 0),
    }
    for cause, second in cases.items():
        audit = audit_sessions([Session(0, 0, 0, 0, [first, second], "COMPLETED", 0.0)])
        assert audit.splits[cause] == 1 and sum(audit.splits.values()) == 1, cause
        assert audit.calls_per_chain == 1.0
    extends = Call([1, 2, 3, 4, 5, 9], [7], [-0.1], "stop", 0)
    merged = audit_sessions([Session(0, 0, 0, 0, [first, extends], "COMPLETED", 0.0)])
    assert merged.calls_per_chain == 2.0 and sum(merged.splits.values()) == 0


def _traces(path, sessions, extra_lines=()):
    lines = [json.dumps(session_to_json(s)) for s in sessions] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_traces_round_trips_and_cli_reports(tmp_path, capsys, qwen3_like):
    shape = TurnShape(reasoning=True, call="string", observation="tool")
    sessions = [_harness_session(qwen3_like, shape, t, turns=2) for t in range(3)]
    path = _traces(tmp_path / "traces.jsonl", sessions)
    back = read_traces(path)
    assert [s.task for s in back] == [0, 1, 2]
    assert all(
        np.array_equal(a.prompt_ids, b.prompt_ids)
        for s, r in zip(sessions, back, strict=True)
        for a, b in zip(s.calls, r.calls, strict=True)
    )
    assert main(["audit", "sessions", str(path)]) == 0
    text = capsys.readouterr().out
    assert "3 sessions, 6 calls in 3 chains: 2.00 calls per chain" in text
    assert main(["audit", "sessions", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls_per_chain"] == 2.0


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 3 is not JSON"),
        ("[1, 2]", "line 3 is a JSON list; expected one JSON object per line"),
        ('{"task_id": 1, "calls": []}', "line 3: not a valid session: missing field 'group'"),
        ("CALLS_STR", "line 3: field 'calls' is str"),
        ("BAD_STATUS", "line 3: not a valid session: status='DONE'"),
    ],
)
def test_malformed_traces_name_the_line(tmp_path, line, message):
    good = Session(0, 0, 0, 0, [Call([1], [2], [-0.1], "stop", 0)], "COMPLETED", 1.0)
    row = session_to_json(good)
    line = {
        "CALLS_STR": json.dumps({**row, "calls": "x"}),
        "BAD_STATUS": json.dumps({**row, "status": "DONE"}),
    }.get(line, line)
    path = _traces(tmp_path / "t.jsonl", [good, good], [line])
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as error:
        read_traces(path)
    assert str(path) in str(error.value)


def test_read_traces_refuses_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no sessions"):
        read_traces(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_traces(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("module", [template_audit, chain_audit])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_the_spec_script_path_runs_the_same_audit(tmp_path):
    import subprocess
    import sys

    from fault_helpers import ROOT

    tokenizer_with(APPEND_ONLY).save_pretrained(tmp_path / "tok")
    script = ROOT / "tools" / "audit_template.py"
    command = [
        sys.executable,
        str(script),
        "template",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["append_only"] is True
