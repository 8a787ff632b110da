"""Arrow batches: schemas, zero-copy conversion, Parquet round trips and validation errors."""

import doctest

import numpy as np
import pyarrow as pa
import pytest

import dew_pipe.rollout_batches
from dew_pipe import batches as B

N, W = 3, 8
ROUTING = (2, 3, np.uint8)


def _arrays(width=W, rows=N, *, routed=False, support=None, ppo=False, shared=False, seed=0):
    """A valid packed batch with every requested column, values in range."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, width), np.int32)
    segments[:, : width - 2] = 1
    segments[:, width - 2 : width - 1] = 2
    out = {
        "input_ids": rng.integers(0, 100, (rows, width)).astype(np.int32),
        "text_segment_ids": segments,
        "text_positions": np.tile(np.arange(width, dtype=np.int32), (rows, 1)),
        "response_mask": ((np.arange(width) % 2 == 1) & (segments > 0)).astype(np.int32),
        "old_log_probs": -rng.random((rows, width), np.float32),
        "behavior_log_probs": -rng.random((rows, width), np.float32),
        "advantages": rng.standard_normal((rows, width)).astype(np.float32),
        "versions": rng.integers(0, 5, (rows, width)).astype(np.int32),
        "session_index": rng.integers(0, 4, (rows, width)).astype(np.int32),
        "call_index": rng.integers(0, 2, (rows, width)).astype(np.int32),
        "session_weights": rng.random((rows, width), np.float32),
    }
    if shared:  # segment 2 continues segment 1 as a shared prompt
        out["text_prefix_segments"] = np.where(segments == 2, 1, 0).astype(np.int32)
    if routed:
        out["routed_experts"] = rng.integers(0, 8, (rows, width, 2, 3)).astype(np.uint8)
        out["routed"] = rng.random((rows, width)) < 0.5
    if support is not None:
        out["support_ids"] = rng.integers(0, 100, (rows, support)).astype(np.int32)
        out["support_columns"] = rng.integers(-1, width, (rows, support)).astype(np.int32)
    if ppo:
        out["old_values"] = rng.standard_normal((rows, width)).astype(np.float32)
        out["returns"] = rng.standard_normal((rows, width)).astype(np.float32)
    return out


def _values_address(column: pa.Array) -> int:
    """Address of the first value of a (nested) FixedSizeList column."""
    flat = column
    while pa.types.is_fixed_size_list(flat.type):
        flat = flat.flatten()
    return flat.buffers()[1].address + flat.offset * flat.type.bit_width // 8


def test_docstring_examples_run():
    for module in (B, dew_pipe.rollout_batches):
        failed, attempted = doctest.testmod(module, raise_on_error=False)
        assert attempted > 5 and failed == 0


def test_schema_has_every_contract_column_with_width_in_type():
    schema = B.packed_schema(
        W, routed_experts=ROUTING, support_capacity=5, ppo=True, share_prompts=True
    )
    assert schema.names == list(B.PACKED_COLUMNS)
    assert schema.field("text_prefix_segments").type == pa.list_(pa.int32(), W)
    assert schema.field("input_ids").type == pa.list_(pa.int32(), W)
    assert schema.field("advantages").type == pa.list_(pa.float32(), W)
    assert schema.field("routed_experts").type == pa.list_(pa.list_(pa.list_(pa.uint8(), 3), 2), W)
    assert schema.field("routed").type == pa.list_(pa.bool_(), W)
    assert schema.field("support_columns").type == pa.list_(pa.int32(), 5)
    assert "old_log_probs" not in B.packed_schema(W, old_log_probs=False).names
    assert B.packed_schema(W).names == list(B.PACKED_COLUMNS[:11])
    assert B.packed_schema(4) != B.packed_schema(5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"width": 0}, "width=0"),
        ({"width": 4, "support_capacity": 0}, "support_capacity=0"),
        ({"width": 4, "routed_experts": (2, 3, np.float32)}, "integer dtype"),
        ({"width": 4, "routed_experts": (2, 3)}, "expected \\(layers, top_k, integer dtype\\)"),
    ],
)
def test_schema_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        B.packed_schema(**kwargs)


def test_to_arrow_shares_every_numeric_buffer():
    arrays = _arrays(routed=True, support=5, ppo=True, shared=True)
    rb = B.packed_to_arrow(arrays)
    for name, value in arrays.items():
        if name == "routed":  # Arrow stores booleans as bits: the one documented copy
            continue
        assert _values_address(rb.column(name)) == value.ctypes.data, name


def test_from_arrow_views_every_numeric_buffer_and_round_trips():
    arrays = _arrays(routed=True, support=5, ppo=True, shared=True)
    rb = B.packed_to_arrow(arrays)
    back = B.packed_from_arrow(rb)
    assert list(back) == list(B.PACKED_COLUMNS)
    for name, value in arrays.items():
        np.testing.assert_array_equal(back[name], value)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        if name != "routed":
            assert back[name].ctypes.data == _values_address(rb.column(name)), name
            assert back[name].ctypes.data == value.ctypes.data, name


def test_from_arrow_of_a_slice_views_the_slice():
    arrays = _arrays(rows=5)
    rb = B.packed_to_arrow(arrays).slice(2, 2)
    back = B.packed_from_arrow(rb)
    np.testing.assert_array_equal(back["input_ids"], arrays["input_ids"][2:4])
    assert back["input_ids"].ctypes.data == arrays["input_ids"][2].ctypes.data


def test_non_contiguous_input_is_copied_once_and_correct():
    arrays = _arrays()
    arrays["advantages"] = np.asfortranarray(arrays["advantages"])
    back = B.packed_from_arrow(B.packed_to_arrow(arrays))
    np.testing.assert_array_equal(back["advantages"], arrays["advantages"])


def test_parquet_round_trip_with_every_column(tmp_path):
    first = B.packed_to_arrow(_arrays(routed=True, support=5, ppo=True, shared=True, seed=1))
    second = B.packed_to_arrow(_arrays(routed=True, support=5, ppo=True, shared=True, seed=2))
    path = B.write_parquet(tmp_path / "rows.parquet", [first, second])
    table = B.read_parquet(path, schema=first.schema)
    assert table.schema.equals(first.schema)
    got = B.packed_from_arrow(table.combine_chunks().to_batches()[0])
    want = {k: np.concatenate([B.packed_from_arrow(b)[k] for b in (first, second)]) for k in got}
    for name in B.PACKED_COLUMNS:
        np.testing.assert_array_equal(got[name], want[name])
    assert not list(tmp_path.glob("*.partial"))


def test_parquet_refuses_other_schema(tmp_path):
    path = B.write_parquet(tmp_path / "rows.parquet", B.packed_to_arrow(_arrays()))
    with pytest.raises(ValueError, match="columns .* expected"):
        B.read_parquet(path, schema=B.packed_schema(W, ppo=True))
    with pytest.raises(ValueError, match="column 'input_ids' has type"):
        B.read_parquet(path, schema=B.packed_schema(W + 1))
    with pytest.raises(ValueError, match="batch 1 has schema"):
        B.write_parquet(
            tmp_path / "mixed.parquet",
            [B.packed_to_arrow(_arrays()), B.packed_to_arrow(_arrays(width=4))],
        )
    with pytest.raises(ValueError, match="no schema given"):
        B.write_parquet(tmp_path / "empty.parquet", [])
    assert not (tmp_path / "mixed.parquet").exists()
    empty = B.write_parquet(tmp_path / "empty.parquet", [], schema=B.packed_schema(W))
    assert B.read_parquet(empty, schema=B.packed_schema(W)).num_rows == 0


def _without(d, name):
    return {k: v for k, v in d.items() if k != name}


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda d: _without(d, "advantages"), ValueError, "missing column 'advantages'"),
        (lambda d: {**d, "extra": d["advantages"]}, ValueError, "unknown column 'extra'"),
        (
            lambda d: {**d, "advantages": d["advantages"].astype(np.float64)},
            ValueError,
            "column 'advantages' is float64 \\[3, 8\\], expected float32 \\[3, 8\\]",
        ),
        (
            lambda d: {**d, "versions": d["versions"][:, :4]},
            ValueError,
            "column 'versions' is int32 \\[3, 4\\], expected int32 \\[3, 8\\]",
        ),
        (
            lambda d: {**d, "input_ids": d["input_ids"][0]},
            ValueError,
            "'input_ids' has shape \\[8\\], expected \\[N, W\\]",
        ),
        (
            lambda d: {**d, "advantages": d["advantages"].tolist()},
            TypeError,
            "column 'advantages' is a list, expected a numpy array float32",
        ),
        (
            lambda d: {**d, "old_values": d["advantages"]},
            ValueError,
            "'old_values' present without 'returns'",
        ),
        (
            lambda d: {**d, "routed": np.ones((N, W), bool)},
            ValueError,
            "'routed' present without 'routed_experts'",
        ),
        (
            lambda d: {**d, "support_ids": np.zeros((N, 2, 2), np.int32), "support_columns": 0},
            ValueError,
            "'support_ids' has shape \\[3, 2, 2\\], expected \\[N, C\\]",
        ),
        (
            lambda d: {
                **d,
                "routed_experts": np.zeros((N, W, 2, 3), np.float32),
                "routed": np.ones((N, W), bool),
            },
            ValueError,
            "'routed_experts' is float32 \\[3, 8, 2, 3\\], expected an integer array",
        ),
    ],
)
def test_dict_validation_names_column_expected_and_actual(mutate, error, match):
    with pytest.raises(error, match=match):
        B.validate_packed(mutate(_arrays()))
    with pytest.raises(error, match=match):
        B.packed_to_arrow(mutate(_arrays()))


@pytest.mark.parametrize(
    "column, value, match",
    [
        ("response_mask", 2, "'response_mask' holds 2, expected only 0 or 1"),
        ("text_positions", -1, "'text_positions' holds -1, expected values >= 0"),
        ("advantages", np.nan, "'advantages' holds a non-finite value"),
        ("support_columns", W, f"'support_columns' holds {W}, expected -1 .* \\[0, {W}\\)"),
    ],
)
def test_value_validation(column, value, match):
    arrays = _arrays(support=4)
    arrays[column] = arrays[column].copy()
    arrays[column][1, 1] = value
    with pytest.raises(ValueError, match=match):
        B.validate_packed(arrays)
    B.packed_to_arrow(arrays)  # structure is fine: conversion does not scan values
    B.validate_packed(arrays, values=False)


def test_response_on_padding_is_refused():
    arrays = _arrays()
    arrays["response_mask"][0, W - 1] = 1  # last column is padding (segment 0)
    with pytest.raises(ValueError, match="response_mask' is 1 on padding"):
        B.validate_packed(arrays)


def test_width_mismatch_is_named():
    with pytest.raises(ValueError, match="width .* is 8, expected 16"):
        B.validate_packed(_arrays(), width=16)
    with pytest.raises(ValueError, match="width .* is 8, expected 16"):
        B.validate_packed(B.packed_to_arrow(_arrays()), width=16)


def test_arrow_validation_names_column_and_types():
    rb = B.packed_to_arrow(_arrays())
    B.validate_packed(rb)
    bad = rb.set_column(6, "advantages", pa.array([[0.0] * W] * N, pa.list_(pa.float64(), W)))
    with pytest.raises(ValueError, match="'advantages' has type .*double.*expected .*float"):
        B.validate_packed(bad)
    with pytest.raises(ValueError, match="'advantages' has type"):
        B.packed_from_arrow(bad)
    with pytest.raises(ValueError, match="missing column 'versions'"):
        B.validate_packed(rb.drop_columns(["versions"]))
    with pytest.raises(ValueError, match="unknown column 'x'"):
        B.validate_packed(rb.append_column("x", pa.array([1] * N)))
    with pytest.raises(TypeError, match="got a Table, expected a pyarrow.RecordBatch"):
        B.packed_from_arrow(pa.Table.from_batches([rb]))
    nulls = pa.array([[1] * W, None, [1] * W], pa.list_(pa.int32(), W))
    with pytest.raises(ValueError, match="'versions' holds 1 nulls"):
        B.packed_from_arrow(rb.set_column(7, "versions", nulls))
    arrays = _arrays()
    arrays["advantages"][0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        B.validate_packed(B.packed_to_arrow(arrays))


# ----------------------------------------------------------------------------- tasks


def test_tasks_round_trip_and_errors():
    rows = [
        {"task_id": 5, "prompt": [3, 4], "data_source": "math", "ground_truth": "7"},
        {"task_id": 6, "extra_info": '{"a": 1}'},
    ]
    rb = B.tasks_to_arrow(rows)
    assert rb.schema.equals(B.TASKS_SCHEMA)
    back = B.tasks_from_arrow(rb)
    np.testing.assert_array_equal(back[0]["prompt"], [3, 4])
    assert back[0]["prompt"].dtype == np.int32
    assert back[1]["prompt"] is None
    assert back[1] | {"prompt": 0} == {
        "task_id": 6,
        "prompt": 0,
        "data_source": "",
        "ground_truth": "",
        "extra_info": '{"a": 1}',
    }
    assert B.tasks_from_arrow(rb.slice(1))[0]["task_id"] == 6
    with pytest.raises(ValueError, match="task 0: missing field 'task_id'"):
        B.tasks_to_arrow([{"prompt": [1]}])
    with pytest.raises(TypeError, match="task 0: task_id='a', expected an int"):
        B.tasks_to_arrow([{"task_id": "a"}])
    with pytest.raises(TypeError, match="task 1: extra_info=\\{'a': 1\\}, expected a str"):
        B.tasks_to_arrow([{"task_id": 1}, {"task_id": 2, "extra_info": {"a": 1}}])
    with pytest.raises(ValueError, match="task 0: prompt: holds -3"):
        B.tasks_to_arrow([{"task_id": 1, "prompt": [1, -3]}])
    with pytest.raises(ValueError, match="task 0: unknown field 'answer'"):
        B.tasks_to_arrow([{"task_id": 1, "answer": "x"}])
    with pytest.raises(ValueError, match="tasks: column 'task_id' has type string"):
        B.tasks_from_arrow(rb.set_column(0, "task_id", pa.array(["a", "b"])))


# ----------------------------------------------------------------------------- sessions


def _call(prompt, sampled, *, raw=True, support=False, routed=False, version=0):
    call = {
        "prompt_ids": prompt,
        "sampled_ids": sampled,
        "behavior_log_probs": [-0.25 * (i + 1) for i in range(len(sampled))],
        "finish_reason": "stop",
        "version": version,
    }
    if raw:
        call["raw_log_probs"] = [-0.5] * len(sampled)
    if support:
        call["support"] = [list(range(i + 1)) for i in range(len(sampled))]
    if routed:
        n = len(prompt) + len(sampled)
        call["routed_experts"] = np.arange(n * 6, dtype=np.uint8).reshape(n, 2, 3)
    return call


class _Status:  # stands in for the Status enum of objectives.rl.sessions
    name = "AGENT_ERROR"


def _sessions():
    return [
        {
            "task_id": 11,
            "group": 0,
            "sample": 1,
            "attempt": 2,
            "status": "COMPLETED",
            "reward": 1.5,
            "components": {"format": 0.5, "answer": 1.0},
            "detail": "ok",
            "calls": [
                _call([1, 2], [3, 4], support=True, routed=True),
                _call([1, 2, 3, 4, 9], [5], raw=False, version=1),
            ],
        },
        {
            "task_id": 12,
            "group": 1,
            "sample": 0,
            "attempt": 0,
            "status": _Status(),
            "reward": None,
            "calls": [],
        },
        {
            "task_id": 13,
            "group": 1,
            "sample": 1,
            "attempt": 0,
            "status": "TRUNCATED",
            "reward": 0.0,
            "calls": [_call([7], [], raw=False)],
        },
    ]


def test_sessions_round_trip_every_field(tmp_path):
    rows = _sessions()
    rb = B.sessions_to_arrow(rows)  # routing inferred from the first recorded call
    assert rb.schema.equals(B.sessions_schema(routed_experts=ROUTING))
    path = B.write_parquet(tmp_path / "s.parquet", rb)
    from_disk = B.read_parquet(path, schema=rb.schema).to_batches()[0]
    for batch in (rb, from_disk):
        back = B.sessions_from_arrow(batch)
        assert [s["status"] for s in back] == ["COMPLETED", "AGENT_ERROR", "TRUNCATED"]
        assert [s["reward"] for s in back] == [1.5, None, 0.0]
        assert back[0]["components"] == {"format": 0.5, "answer": 1.0}
        assert back[0]["detail"] == "ok" and back[1]["detail"] == ""
        assert (back[0]["attempt"], back[0]["sample"], back[1]["group"]) == (2, 1, 1)
        assert len(back[0]["calls"]) == 2 and back[1]["calls"] == []
        first, second = back[0]["calls"]
        want = rows[0]["calls"][0]
        np.testing.assert_array_equal(first["prompt_ids"], [1, 2])
        np.testing.assert_array_equal(first["sampled_ids"], [3, 4])
        np.testing.assert_array_equal(first["behavior_log_probs"], [-0.25, -0.5])
        np.testing.assert_array_equal(first["raw_log_probs"], [-0.5, -0.5])
        assert [s.tolist() for s in first["support"]] == [[0], [0, 1]]
        np.testing.assert_array_equal(first["routed_experts"], want["routed_experts"])
        assert second["raw_log_probs"] is None and second["support"] is None
        assert second["routed_experts"] is None and second["version"] == 1
        assert len(back[2]["calls"][0]["sampled_ids"]) == 0
    sliced = B.sessions_from_arrow(rb.slice(2, 1))
    assert sliced[0]["task_id"] == 13 and sliced[0]["calls"][0]["prompt_ids"].tolist() == [7]


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda s: s[0].pop("group"), ValueError, "session 0: missing field 'group'"),
        (
            lambda s: s[0].update(status="DONE"),
            ValueError,
            "session 0: status='DONE', expected one of",
        ),
        (
            lambda s: s[2].update(reward=float("nan")),
            ValueError,
            "session 2: reward=nan, expected a finite float or None",
        ),
        (
            lambda s: s[0]["calls"][1].update(behavior_log_probs=[-1.0, -2.0]),
            ValueError,
            "session 0: calls\\[1\\].behavior_log_probs: has shape \\[2\\], expected \\[1\\]",
        ),
        (
            lambda s: s[0]["calls"][0].update(support=[[1]]),
            ValueError,
            "calls\\[0\\].support: has 1 entries, expected 2",
        ),
        (
            lambda s: s[0]["calls"][0].update(routed_experts=np.zeros((9, 2, 3), np.uint8)),
            ValueError,
            "calls\\[0\\].routed_experts: has shape \\[9, 2, 3\\], expected \\[<= 4, 2, 3\\]",
        ),
        (
            lambda s: s[0]["calls"][1].pop("version"),
            ValueError,
            "calls\\[1\\]: missing field 'version'",
        ),
        (
            lambda s: s[0]["calls"][1].update(sampled_ids=[1.5]),
            TypeError,
            "calls\\[1\\].sampled_ids: expected a 1-D sequence of ints",
        ),
        (
            lambda s: s[1].update(components={"a": "x"}),
            TypeError,
            "session 1: components\\['a'\\]='x'",
        ),
    ],
)
def test_session_validation_names_session_call_and_field(mutate, error, match):
    rows = _sessions()
    mutate(rows)
    with pytest.raises(error, match=match):
        B.sessions_to_arrow(rows)


def test_malformed_routing_is_named():
    rows = _sessions()
    rows[0]["calls"][0]["routed_experts"] = np.zeros((4, 6), np.uint8)
    with pytest.raises(
        ValueError, match="calls\\[0\\].routed_experts: has shape \\[4, 6\\], expected"
    ):
        B.sessions_to_arrow(rows)
    rows[0]["calls"][0]["routed_experts"] = np.zeros((4, 2, 3), np.int16)
    with pytest.raises(ValueError, match="routed_experts: has dtype int16, expected uint8"):
        B.sessions_to_arrow(rows, routed_experts=ROUTING)


def test_sessions_from_arrow_refuses_other_batches():
    with pytest.raises(ValueError, match="sessions: missing column 'task_id'"):
        B.sessions_from_arrow(B.tasks_to_arrow([]).drop_columns(["task_id"]))
    with pytest.raises(TypeError, match="expected a pyarrow.RecordBatch"):
        B.sessions_from_arrow({"task_id": []})


def test_import_does_not_pull_jax():
    import subprocess
    import sys

    code = "import sys, dew_pipe.batches; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
