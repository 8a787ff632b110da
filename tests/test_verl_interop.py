"""verl rows <-> sessions: recorded verl agent-loop outputs, round trips, refusals, Prompts.

The fixtures come from verl 0.9.1 itself (``tests/parity/record_verl_interop.py``): two
samples of its ``ToolAgentLoop`` with routed experts, a video turn, their ``as_dict()``
tensors, and four rows of the ``gsm8k_tool_agent_loop`` parquet layout.
"""

from __future__ import annotations

import copy
import doctest
import json
from pathlib import Path

import numpy as np
import pytest

import dew_pipe.objectives.rl.verl
import dew_pipe.objectives.rl.verl_rows
from dew_pipe.data import Prompts, decode_text_column
from dew_pipe.objectives.rl.packing import pack, session_chains
from dew_pipe.objectives.rl.sessions import Call, Session
from dew_pipe.objectives.rl.verl import VerlTrajectory, from_verl, to_verl

FIXTURES = Path(__file__).parent / "parity" / "fixtures"
RECORD = json.loads((FIXTURES / "verl_interop" / "agent_loop_outputs.json").read_text())
TOOL = [RECORD["outputs"][f"tool_loop_{k}"] for k in range(2)]
VIDEO = RECORD["outputs"]["video_turn"]
EOS = RECORD["eos_ids"]


def _json(rows):
    """Rows as JSON carries them (what a file of rows gives back)."""
    return json.loads(json.dumps(rows))


def _tensor(entry) -> np.ndarray:
    return np.asarray(entry["values"], dtype=entry["dtype"])


@pytest.mark.parametrize("module", [dew_pipe.objectives.rl.verl, dew_pipe.objectives.rl.verl_rows])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.failed == 0
    assert result.attempted > 0 or module is dew_pipe.objectives.rl.verl_rows


# --- verl's own rows ------------------------------------------------------------------------


def test_tool_loop_rows_import_as_one_group_of_calls():
    rows = [t["row"] for t in TOOL]
    trajectories = from_verl(rows, samples=RECORD["rollout_n"], eos=EOS)
    assert [(t.session.task, t.session.group, t.session.sample) for t in trajectories] == [
        (0, 0, 0),
        (0, 0, 1),
    ]
    for t, row in zip(trajectories, rows, strict=True):
        s = t.session
        assert s.status.name == "COMPLETED" and s.reward == row["reward_score"]
        assert not t.tagged and not t.media
        assert t.extras == (row["extra_fields"],)
        # two assistant turns: a tool call, then the answer; each a run of mask-1 ids
        assert len(s.calls) == 2 and session_chains(s.calls) == [[0, 1]]
        ids = row["prompt_ids"] + row["response_ids"]
        mask = np.asarray(row["response_mask"])
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
        for call, start in zip(s.calls, starts, strict=True):
            p = len(row["prompt_ids"]) + start
            assert call.prompt_ids.tolist() == ids[:p]
            assert call.sampled_ids[-1] in EOS and call.finish_reason == "stop"
            assert call.version == row["extra_fields"]["min_global_steps"] == 3
            n = call.sampled_ids.size
            assert call.sampled_ids.tolist() == ids[p : p + n]
            np.testing.assert_array_equal(
                call.behavior_log_probs,
                np.asarray(row["response_logprobs"][start : start + n], np.float32),
            )
            assert call.log_probs is None
        # the row's routing (the last turn's, over its whole context) covers each call's ids
        routing = np.asarray(row["routed_experts"])
        assert routing.shape[0] == len(ids) - 1
        np.testing.assert_array_equal(s.calls[1].routed_experts, routing)
        np.testing.assert_array_equal(s.calls[0].routed_experts, routing[: s.calls[0].length])


def test_tool_loop_rows_export_back_unchanged():
    rows = [t["row"] for t in TOOL]
    again = to_verl(from_verl(rows, samples=2, eos=EOS))
    assert again == rows
    assert json.dumps(_json(again)) == json.dumps(rows)  # the same keys, in the same order


def test_pack_lays_rows_out_as_verl_as_dict_does():
    trajectories = from_verl([t["row"] for t in TOOL], samples=2, eos=EOS)
    width = max(len(t["row"]["prompt_ids"]) + len(t["row"]["response_ids"]) for t in TOOL)
    batch = pack([t.session for t in trajectories], width=width)
    assert batch["input_ids"].shape == (2, width)
    for k, fixture in enumerate(TOOL):
        tensors = fixture["as_dict"]
        row = int(np.flatnonzero((batch["session_index"] == k).any(axis=1))[0])
        prompts, responses = _tensor(tensors["prompts"]), _tensor(tensors["responses"])
        p, total = prompts.size, prompts.size + responses.size
        np.testing.assert_array_equal(
            batch["input_ids"][row, :total], np.concatenate([prompts, responses])
        )
        np.testing.assert_array_equal(batch["text_positions"][row, :total], np.arange(total))
        assert (batch["response_mask"][row, :p] == 0).all()
        np.testing.assert_array_equal(
            batch["response_mask"][row, p:total], _tensor(tensors["response_mask"])
        )
        np.testing.assert_array_equal(
            batch["behavior_log_probs"][row, p:total], _tensor(tensors["rollout_log_probs"])
        )
        routed = _tensor(tensors["routed_experts"])  # verl aligns it to the whole sequence
        assert routed.shape[0] == total
        np.testing.assert_array_equal(batch["routed_experts"][row, :total], routed)
        assert batch["routed"][row, : total - 1].all() and not batch["routed"][row, total - 1]
        scores = _tensor(tensors["rm_scores"])  # verl puts the reward on the last response id
        assert scores[-1] == trajectories[k].session.reward and scores[:-1].sum() == 0
        versions = batch["versions"][row, p:total]
        assert set(versions[batch["response_mask"][row, p:total] == 1].tolist()) == {3}
    # one group of two samples, rewards 1 and 0: (r - 0.5) / (unbiased std + verl's 1e-6)
    advantages = [batch["advantages"][batch["session_index"] == k][0] for k in range(2)]
    expected = np.array([0.5, -0.5]) / (np.std([1.0, 0.0], ddof=1) + 1e-6)
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)


def test_written_rows_have_verl_s_fields_and_types():
    s = from_verl([TOOL[0]["row"]], samples=1, eos=EOS)[0].session
    fresh = Session(s.task, s.group, s.sample, s.attempt, s.calls, s.status, s.reward)
    (row,) = to_verl([fresh])
    native = TOOL[0]["row"]
    assert list(row) == list(native)  # AgentLoopOutput's fields, in its order
    for name, value in native.items():
        if value is not None and row[name] is not None:
            assert type(row[name]) is type(value), name
    for name in ("prompt_ids", "response_ids", "response_mask", "routed_experts", "reward_score"):
        assert row[name] == native[name]
    assert row["response_logprobs"] == native["response_logprobs"]
    assert row["multi_modal_data"] is None and row["mm_processor_output"] is None
    assert row["extra_fields"]["min_global_steps"] == row["extra_fields"]["max_global_steps"] == 3
    assert row["extra_fields"]["dew"]["task"] == s.task
    assert row["num_turns"] == native["num_turns"] == 4  # the user turn, two calls, one reply


def test_video_rows_are_refused_unless_media():
    with pytest.raises(ValueError, match=r"rows\[0\]\.multi_modal_data: the row carries media"):
        from_verl([VIDEO["row"]], samples=1)
    for name in ("mm_processor_kwargs", "mm_processor_output"):
        row = {**VIDEO["row"], "multi_modal_data": {}}
        if name == "mm_processor_output":
            row["mm_processor_kwargs"] = {}
        with pytest.raises(ValueError, match=rf"rows\[0\]\.{name}: the row carries media"):
            from_verl([row], samples=1)
    (t,) = from_verl([VIDEO["row"]], samples=1, media=True)
    assert t.media and t.session.calls[0].sampled_ids.tolist() == VIDEO["row"]["response_ids"]
    assert to_verl([t]) == [VIDEO["row"]]  # the video and its payload go back out unchanged
    text_row = {**TOOL[0]["row"], "multi_modal_data": {}, "mm_processor_kwargs": {}}
    assert not from_verl([text_row], samples=1)[0].media  # empty media fields are not media


# --- Dew's sessions through verl rows ------------------------------------------------------


def _sessions() -> list[Session]:
    routing = np.arange(4 * 2 * 1, dtype=np.int16).reshape(4, 2, 1)
    routing_more = np.concatenate([routing, [[[20], [21]], [[22], [23]]]]).astype(np.int16)
    a = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", 2, log_probs=[-0.4, -0.2])
    b = Call([1, 2, 3, 4, 9], [5], [-0.125], "length", 3, support=[[5, 6]])
    aborted = Call([1, 2, 3, 4, 9, 5], [], [], "abort", 3)  # sampled nothing: keeps its place
    other = Call([7, 8], [6], [-1.0], "stop", 4)  # a new chain: does not extend b
    routed = Call([1, 2, 3], [4, 5], [-0.5, -0.5], "stop", 0, routed_experts=routing)
    routed_more = Call([1, 2, 3, 4, 5, 8], [9], [-0.25], "stop", 1, routed_experts=routing_more)
    return [
        Session(3, 1, 0, 0, [a, b, aborted, other], "COMPLETED", 1.0, {"format": 0.5}, "ok"),
        Session(3, 1, 1, 2, [routed, routed_more], "AGENT_ERROR", -1.0),
        Session(4, 0, 0, 0, [other], "TRUNCATED"),  # never scored: may lack a reward
        Session(5, 0, 0, 0, [], "CANCELLED"),  # no calls: no chain, no row
    ]


def test_sessions_round_trip_exactly_through_json_rows():
    sessions = _sessions()
    rows = _json(to_verl(sessions))
    assert len(rows) == 2 + 1 + 1  # chains: 2, 1, 1, 0
    assert [r["extra_fields"]["dew"]["chain"] for r in rows] == [0, 1, 0, 0]
    first = rows[0]
    assert first["prompt_ids"] == [1, 2] and first["response_ids"] == [3, 4, 9, 5]
    assert first["response_mask"] == [1, 1, 0, 1]
    assert (
        first["extra_fields"]["min_global_steps"],
        first["extra_fields"]["max_global_steps"],
    ) == (2, 3)
    assert rows[2]["routed_experts"] is not None and rows[0]["routed_experts"] is None
    back = from_verl(rows[::-1])  # any order: rows carry their session and chain
    assert all(t.tagged for t in back)
    by_identity = {(t.session.task, t.session.sample): t.session for t in back}
    for s in sessions[:3]:
        assert by_identity[(s.task, s.sample)] == s
    again = to_verl([t for t in back])
    assert sorted(map(json.dumps, _json(again))) == sorted(map(json.dumps, rows))


def test_packing_is_the_same_after_a_round_trip():
    sessions = _sessions()[:2]
    back = {t.session.sample: t.session for t in from_verl(_json(to_verl(sessions)))}
    restored = [back[s.sample] for s in sessions]
    one, two = (
        pack(sessions, width=8, support_capacity=4),
        pack(restored, width=8, support_capacity=4),
    )
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], two[name], err_msg=name)


def test_routing_of_calls_that_disagree_is_the_chain_s_last_word():
    # the second call re-routed id 0: the row keeps the later record, as pack does
    a = Call([1], [2], [-0.5], "stop", 0, routed_experts=[[[1]]])
    b = Call([1, 2, 3], [4], [-0.5], "stop", 0, routed_experts=[[[7]], [[8]], [[9]]])
    s = Session(0, 0, 0, 0, [a, b], "COMPLETED", 1.0)
    (row,) = to_verl([s])
    assert row["routed_experts"] == [[[7]], [[8]], [[9]]]
    restored = from_verl(_json([row]))[0].session
    assert restored.calls[0].routed_experts.tolist() == [[[7]]]  # the prefix the row holds
    for name, value in pack([s], width=4).items():
        np.testing.assert_array_equal(pack([restored], width=4)[name], value, err_msg=name)
    half = Session(0, 0, 0, 0, [Call([1], [2], [-0.5], "stop", 0), b], "COMPLETED", 1.0)
    assert to_verl([half])[0]["routed_experts"] is None  # not every call recorded routing


def test_native_rows_keep_ids_around_the_draws_and_their_global_steps():
    row = {
        "prompt_ids": [1, 2],
        "response_ids": [8, 3, 4, 9, 5, 6],  # a mask-0 id first and ids after the last draw
        "response_mask": [0, 1, 1, 0, 0, 0],
        "response_logprobs": [0.0, -0.5, -0.25, 0.0, 0.0, 0.0],
        "reward_score": 1,
        "extra_fields": {"min_global_steps": 4, "max_global_steps": 7, "turn_scores": [0.5]},
        "num_turns": 3,
    }
    (t,) = from_verl([row], samples=1)
    calls = t.session.calls
    assert [c.sampled_ids.tolist() for c in calls] == [[], [3, 4], []]
    assert [c.prompt_ids.size for c in calls] == [2, 3, 8]
    assert {c.version for c in calls} == {4} and {c.finish_reason for c in calls} == {"unknown"}
    assert t.fields == ({"num_turns": 3},)
    assert to_verl([t]) == [row]  # global steps 4..7 kept, nothing Dew added
    assert pack([t.session], width=8)["input_ids"].tolist() == [[1, 2, 8, 3, 4, 9, 5, 6]]


def test_samples_group_native_rows_and_group_names_them():
    row = copy.deepcopy(TOOL[1]["row"])
    trajectories = from_verl([row] * 6, samples=3, group=9)
    assert [(t.session.task, t.session.group, t.session.sample) for t in trajectories] == [
        (k // 3, 9, k % 3) for k in range(6)
    ]
    with pytest.raises(ValueError, match="samples is None, but the rows are native"):
        from_verl([row])
    with pytest.raises(ValueError, match="5 native rows do not divide into groups of samples=2"):
        from_verl([row] * 5, samples=2)


# --- refusals -------------------------------------------------------------------------------


def _native(**change):
    row = copy.deepcopy(TOOL[0]["row"])
    for name, value in change.items():
        if value is KeyError:
            row.pop(name)
        else:
            row[name] = value
    return row


@pytest.mark.parametrize(
    ("row", "error", "message"),
    [
        (
            _native(response_logprobs=None),
            ValueError,
            r"rows\[0\]\.response_logprobs: is missing; expected behavior log-prob",
        ),
        (_native(response_logprobs=KeyError), ValueError, r"response_logprobs: is missing"),
        (
            _native(reward_score=None),
            ValueError,
            r"rows\[0\]\.reward_score: is None; expected the verifier's reward",
        ),
        (
            _native(reward_score=float("nan")),
            ValueError,
            r"reward_score: is nan; expected a finite number",
        ),
        (
            _native(extra_fields={"turn_scores": []}),
            ValueError,
            r"extra_fields\.min_global_steps: is missing; expected the policy version",
        ),
        (
            _native(extra_fields={"min_global_steps": None}),
            ValueError,
            r"min_global_steps: is missing",
        ),
        (
            _native(extra_fields={"min_global_steps": -1}),
            ValueError,
            r"min_global_steps is -1; expected an int >= 0",
        ),
        (_native(prompt_ids=[]), ValueError, r"rows\[0\]\.prompt_ids: is empty"),
        (
            _native(prompt_ids=[1.5, 2.0]),
            TypeError,
            r"rows\[0\]\.prompt_ids: expected a list of integers",
        ),
        (_native(response_mask=[2] * 81), ValueError, r"response_mask: expected 0 and 1 only"),
        (
            _native(response_mask=[1] * 3),
            ValueError,
            r"response_mask: expected one entry per response id \(81\)",
        ),
        (
            _native(response_logprobs=[float("nan")] + [0.0] * 80),
            ValueError,
            r"rows\[0\]: call 0: Call\.behavior_log_probs: expected finite",
        ),
        (
            _native(routed_experts=[[[-1, 0]]]),
            ValueError,
            r"rows\[0\]: call 0: Call\.routed_experts: expected nonnegative",
        ),
        ("not a row", TypeError, r"rows\[0\]: expected a mapping of AgentLoopOutput fields"),
    ],
)
def test_bad_native_rows_are_refused_naming_the_row(row, error, message):
    with pytest.raises(error, match=message):
        from_verl([row], samples=1, eos=EOS)


def test_log_probs_off_the_draws_and_ids_after_eos_are_refused():
    row = _native()
    first_zero = row["response_mask"].index(0)
    row["response_logprobs"][first_zero] = -0.5
    with pytest.raises(
        ValueError,
        match=rf"response_logprobs\[{first_zero}\]: is -0.5 on an id with response_mask 0",
    ):
        from_verl([row], samples=1)
    row = _native()
    row["response_ids"][0] = EOS[0]  # EOS, then more sampled ids in the same draw
    with pytest.raises(
        ValueError, match=r"rows\[0\]: call 0: Call\.sampled_ids: \d+ id\(s\) follow EOS"
    ):
        from_verl([row], samples=1, eos=EOS)
    assert from_verl([row], samples=1)[0].session.calls[0].finish_reason == "unknown"  # no eos


def test_bad_dew_records_and_mixed_rows_are_refused():
    rows = _json(to_verl(_sessions()[:1]))
    with pytest.raises(ValueError, match=r"rows\[1\]\.extra_fields: lacks Dew's 'dew' record"):
        from_verl([rows[0], TOOL[0]["row"]], samples=1)
    with pytest.raises(ValueError, match=r"has 2 chains, but its rows hold chains \[1\]"):
        from_verl(rows[1:])
    with pytest.raises(ValueError, match=r"has 2 chains, but its rows hold chains \[0, 0\]"):
        from_verl([rows[0], rows[0]])
    tampered = copy.deepcopy(rows)
    tampered[0]["response_mask"][2] = 1
    tampered[0]["response_logprobs"][2] = 0.0
    with pytest.raises(
        ValueError,
        match=r"rows\[0\]\.response_mask\[2\]: is 1, but Dew's record puts no sampled id",
    ):
        from_verl(tampered)
    tampered = copy.deepcopy(rows)
    tampered[0]["extra_fields"]["dew"]["calls"][0]["version"] = "two"
    with pytest.raises(TypeError, match=r"dew\.calls\[0\]\.version: is 'two'; expected int"):
        from_verl(tampered)
    tampered = copy.deepcopy(rows)
    tampered[1]["reward_score"] = 0.0
    with pytest.raises(
        ValueError,
        match=r"rows\[1\]\.reward_score: is 0.0, but rows\[0\] of the same session says 1.0",
    ):
        from_verl(tampered)
    tampered = copy.deepcopy(rows)
    tampered[0]["extra_fields"]["dew"]["format"] = 2
    with pytest.raises(ValueError, match=r"dew\.format: is 2; expected 1"):
        from_verl(tampered)
    unscored = _json(
        to_verl([Session(0, 0, 0, 0, [Call([1], [2], [-1.0], "stop", 0)], "COMPLETED", 1.0)])
    )
    unscored[0]["reward_score"] = None
    with pytest.raises(ValueError, match="reward_score: is None"):
        from_verl(unscored)


def test_bad_arguments():
    with pytest.raises(TypeError, match="rows: expected a sequence of verl rows"):
        from_verl(TOOL[0]["row"], samples=1)
    with pytest.raises(ValueError, match="samples is 0; expected None or an int >= 1"):
        from_verl([TOOL[0]["row"]], samples=0)
    with pytest.raises(TypeError, match="eos is 'x'"):
        from_verl([TOOL[0]["row"]], samples=1, eos="x")
    with pytest.raises(TypeError, match=r"sessions\[1\]: expected a Session or VerlTrajectory"):
        to_verl([_sessions()[0], {"prompt_ids": [1]}])
    s = _sessions()[0]
    with pytest.raises(
        ValueError,
        match=r"VerlTrajectory\.extras: expected one mapping per chain of the session \(2\)",
    ):
        VerlTrajectory(s, ({},), ({}, {}))


# --- the GSM8K tool-agent parquet -----------------------------------------------------------


def test_prompts_read_the_gsm8k_tool_agent_parquet():
    import pyarrow.parquet as pq

    path = FIXTURES / "verl_interop" / "gsm8k_tool_agent_loop.parquet"
    rows = pq.read_table(path).to_pylist()
    data = Prompts(path, tokenizer=FIXTURES / "chat_tokenizer", max_prompt_len=512)
    arrays = data.arrays()
    assert decode_text_column(arrays["ground_truth"]) == ["72", "225", "1019", "850"]
    assert decode_text_column(arrays["data_source"]) == ["openai/gsm8k"] * 4
    extra = [json.loads(text) for text in decode_text_column(arrays["extra_info"])]
    assert [e["tools_kwargs"] for e in extra] == [r["extra_info"]["tools_kwargs"] for r in rows]
    assert extra[0]["tools_kwargs"] == {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}
    }
    assert all("ability" not in e and "agent_name" not in e for e in extra)
    assert data.stats["train"]["ignored_columns"] == []  # ability and agent_name read, dropped
    # with the tool schemas verl rendered, Prompts' ids are verl's tool-loop prompt exactly
    first = {**rows[0], "tools": RECORD["tool_schemas"]}
    ids = Prompts(records=[first], tokenizer=FIXTURES / "chat_tokenizer", max_prompt_len=512)
    prompt = ids.arrays()
    length = int(prompt["prompt_length"][0])
    assert prompt["prompt"][0, -length:].tolist() == TOOL[0]["row"]["prompt_ids"]


def test_rows_may_hold_arrays_or_be_agent_loop_output_objects():
    row = TOOL[0]["row"]
    arrays = {k: np.asarray(v) if isinstance(v, list) else v for k, v in row.items()}

    class Dumped:  # what a pydantic AgentLoopOutput offers
        def model_dump(self):
            return arrays

    want = from_verl([row], samples=1, eos=EOS)[0].session
    for given in (arrays, Dumped()):
        assert from_verl([given], samples=1, eos=EOS)[0].session == want
