"""Prompts: every prompt layout, verl's parquet, left padding, UTF-8 metadata columns, errors."""

from __future__ import annotations

import copy
import doctest
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dew_pipe.data.prompt_rows
import dew_pipe.data.prompts
import dew_pipe.data.text_columns
from dew_pipe.data import Loading, Prompts, decode_text_column, encode_text_column
from dew_pipe.data.dataset import Partition

QUESTION = [{"role": "user", "content": "Once upon a time, there was a little"}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def _compact(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _padded(ids: list[list[int]], width: int, pad: int = 0) -> list[list[int]]:
    """Left padding written out the plain way: pad, then the last ``width`` ids."""
    return [[pad] * (width - len(x[-width:])) + list(x[-width:]) for x in ids]


@pytest.mark.parametrize(
    "module", [dew_pipe.data.prompts, dew_pipe.data.prompt_rows, dew_pipe.data.text_columns]
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# --- UTF-8 byte columns ---------------------------------------------------------------------


def test_text_column_bytes_by_hand_and_round_trip():
    values = ["dog", "naïve", "", "日本", "🐶!"]
    column = encode_text_column(values)
    expected = np.zeros((5, 6), np.int32)
    for row, value in enumerate(values):
        raw = np.frombuffer(value.encode("utf-8"), np.uint8)
        expected[row, : len(raw)] = raw
    assert column.dtype == np.int32 and column.shape == (5, 6)  # "naïve": ï takes two bytes
    np.testing.assert_array_equal(column, expected)
    assert column[1].tolist() == [110, 97, 195, 175, 118, 101]
    assert decode_text_column(column) == values
    assert decode_text_column(column.astype(np.uint8)) == values
    assert encode_text_column(["ab"], width=4).tolist() == [[97, 98, 0, 0]]
    assert encode_text_column(["", ""]).shape == (2, 0)
    assert decode_text_column(np.zeros((3, 0), np.int32)) == ["", "", ""]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))),
        max_size=6,
    )
)
def test_text_column_round_trip_any_text(values):
    column = encode_text_column(values)
    assert column.shape == (len(values), max([len(v.encode()) for v in values], default=0))
    assert decode_text_column(column) == values


def test_text_column_errors():
    with pytest.raises(ValueError, match=r"extra_info: row 1 is 4 UTF-8 bytes.*width 3"):
        encode_text_column(["ab", "abcd"], width=3, field="extra_info")
    with pytest.raises(ValueError, match=r"row 0 contains the NUL character at index 1"):
        encode_text_column(["a\0b"])
    with pytest.raises(ValueError, match=r"row 1 has no UTF-8 form \(surrogates not allowed"):
        encode_text_column(["a", "\ud800"])
    with pytest.raises(TypeError, match=r"row 1 is int"):
        encode_text_column(["a", 3])
    with pytest.raises(TypeError, match=r"values is a str"):
        encode_text_column("abc")
    with pytest.raises(ValueError, match=r"row 1 is not valid UTF-8"):
        decode_text_column([[97, 0], [0xC3, 0]], field="ground_truth")
    with pytest.raises(ValueError, match=r"row 0 holds 300 at byte 1"):
        decode_text_column([[97, 300]])
    with pytest.raises(ValueError, match=r"shape \(3,\); expected \[B, M\]"):
        decode_text_column(np.array([97, 98, 0]))
    with pytest.raises(TypeError, match=r"dtype float"):
        decode_text_column(np.ones((1, 2)))


# --- the spec's hand-built prompt batch --------------------------------------------------------


def test_matches_the_spec_hand_built_batch(story_tokenizer):
    prompt = story_tokenizer.encode("Once upon a time, there was a little")
    prompt_batch = {  # the spec's GRPO example builds exactly this by hand
        "prompt": np.tile(np.array(prompt, dtype=np.int32), (8, 1)),
        "prompt_length": np.full(8, len(prompt), dtype=np.int32),
        "data_source": np.tile(
            np.frombuffer(b"tinystories", dtype=np.uint8).astype(np.int32), (8, 1)
        ),
        "ground_truth": np.tile(np.frombuffer(b"dog", dtype=np.uint8).astype(np.int32), (8, 1)),
        "extra_info": np.zeros((8, 0), dtype=np.int32),
    }
    row = {"prompt": "Once upon a time, there was a little", "data_source": "tinystories"}
    rows = [dict(row, ground_truth="dog") for _ in range(8)]
    data = Prompts(records=rows, tokenizer=story_tokenizer, max_prompt_len=len(prompt))
    batch = next(data.load(batch=8).train(Partition(0, 1)))
    for name, expected in prompt_batch.items():
        assert batch[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(batch[name], expected, err_msg=name)
    assert sorted(batch["task_id"].tolist()) == list(range(8))


# --- prompt layouts --------------------------------------------------------------------------


def test_id_prompts_left_padded_and_cut_at_the_start():
    ids = [[5, 6, 7], [8], [1, 2, 3, 4, 5, 6], [9, 9, 9, 9]]
    data = Prompts(records=[{"prompt": x} for x in ids], max_prompt_len=4, pad_id=3)
    arrays = data.arrays()
    assert arrays["prompt"].tolist() == [[3, 5, 6, 7], [3, 3, 3, 8], [3, 4, 5, 6], [9, 9, 9, 9]]
    assert arrays["prompt_length"].tolist() == [3, 1, 4, 4]
    assert arrays["prompt"].dtype == np.int32 and arrays["prompt_length"].dtype == np.int32
    assert arrays["task_id"].tolist() == [0, 1, 2, 3] and arrays["task_id"].dtype == np.int32
    assert data.truncated == 1
    assert data.stats["train"] == {
        "prompts": 4,
        "tokens": 14,
        "longest": 6,
        "truncated": 1,
        "kinds": {"ids": 4, "text": 0, "messages": 0},
        "ignored_columns": [],
    }
    for field in ("data_source", "ground_truth", "extra_info"):
        assert arrays[field].shape == (4, 0)


def test_id_prompts_default_pad_is_zero_and_never_load_a_tokenizer(tmp_path):
    missing = tmp_path / "no-tokenizer-here"  # loading it would fail
    data = Prompts(records=[{"prompt": np.array([4, 5])}], tokenizer=missing, max_prompt_len=3)
    assert data.arrays()["prompt"].tolist() == [[0, 4, 5]]
    assert data.pad_id == 0


def test_string_prompts_through_the_tokenizer(story_tokenizer):
    texts = ["Once upon a time, there was a little dog.", "A cat sat.", "Tom ran to the park."]
    expected = [story_tokenizer.encode(t) for t in texts]
    width = 8
    assert max(map(len, expected)) > width > min(map(len, expected))
    data = Prompts(
        records=[{"prompt": t} for t in texts], tokenizer=story_tokenizer, max_prompt_len=width
    )
    arrays = data.arrays()
    assert arrays["prompt"].tolist() == _padded(expected, width)
    assert arrays["prompt_length"].tolist() == [min(len(e), width) for e in expected]
    assert data.truncated == sum(len(e) > width for e in expected) > 0
    cut = next(i for i, e in enumerate(expected) if len(e) > width)
    assert story_tokenizer.decode(arrays["prompt"][cut]) == story_tokenizer.decode(
        expected[cut][-width:]
    )


def test_messages_prompts_use_the_chat_template_with_the_generation_header(story_tokenizer):
    two_turns = [{"role": "system", "content": "Tell stories."}, *QUESTION]
    rows = [{"prompt": QUESTION}, {"prompt": two_turns}]
    expected = [
        story_tokenizer.apply_chat_template(m["prompt"], add_generation_prompt=True)["input_ids"]
        for m in rows
    ]
    assert story_tokenizer.decode(expected[0]) == (
        "<|im_start|>user\nOnce upon a time, there was a little<|im_end|>\n<|im_start|>assistant\n"
    )
    width = max(map(len, expected)) + 2
    data = Prompts(records=rows, tokenizer=story_tokenizer, max_prompt_len=width)
    arrays = data.arrays()
    assert arrays["prompt"].tolist() == _padded(expected, width)
    assert arrays["prompt_length"].tolist() == [len(e) for e in expected]
    assert data.stats["train"]["kinds"] == {"ids": 0, "text": 0, "messages": 2}
    # Too long: the end (the question and the generation header) is kept.
    short = Prompts(records=rows, tokenizer=story_tokenizer, max_prompt_len=6).arrays()
    assert short["prompt"].tolist() == [e[-6:] for e in expected]
    assert story_tokenizer.decode(short["prompt"][0]).endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_reach_the_chat_template(story_tokenizer):
    tools = [{"type": "function", "function": {"name": "square", "parameters": {"type": "object"}}}]
    expected = story_tokenizer.apply_chat_template(
        QUESTION, tools=tools, add_generation_prompt=True
    )
    expected = expected["input_ids"]
    assert "<tools>" in story_tokenizer.decode(expected)
    for value in (tools, json.dumps(tools)):
        data = Prompts(
            records=[{"prompt": QUESTION, "tools": value}],
            tokenizer=story_tokenizer,
            max_prompt_len=len(expected),
        )
        assert data.arrays()["prompt"].tolist() == [expected]
    with pytest.raises(ValueError, match=r"records\[0\]: has tools but its prompt is ids"):
        Prompts(records=[{"prompt": [1, 2], "tools": tools}], max_prompt_len=4).arrays()


def test_mixed_kinds_in_one_jsonl_file_with_a_tokenizer_path(
    tmp_path, story_tokenizer_dir, story_tokenizer
):
    rows = [{"prompt": [7, 8, 9]}, {"prompt": "A cat sat."}, {"prompt": QUESTION}]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    expected = [
        [7, 8, 9],
        story_tokenizer.encode("A cat sat."),
        story_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"],
    ]
    data = Prompts(path, tokenizer=str(story_tokenizer_dir), max_prompt_len=40)
    assert data.arrays()["prompt"].tolist() == _padded(expected, 40)
    assert data.stats["train"]["kinds"] == {"ids": 1, "text": 1, "messages": 1}


def test_pad_id_comes_from_the_tokenizer(story_tokenizer):
    tokenizer = copy.deepcopy(story_tokenizer)
    tokenizer.pad_token = "</s>"
    assert tokenizer.pad_token_id == 2
    data = Prompts(records=[{"prompt": "A cat."}], tokenizer=tokenizer, max_prompt_len=8)
    expected = tokenizer.encode("A cat.")
    assert data.arrays()["prompt"].tolist() == [[2] * (8 - len(expected)) + expected]
    explicit = Prompts(
        records=[{"prompt": "A cat."}], tokenizer=tokenizer, max_prompt_len=8, pad_id=9
    )
    assert explicit.arrays()["prompt"][0, 0] == 9


# --- reward metadata -------------------------------------------------------------------------


def test_metadata_text_missing_fields_and_json_for_structures():
    rows = [
        {"prompt": [1], "data_source": "gsm8k", "ground_truth": "72", "extra_info": "as is"},
        {"prompt": [2]},
        {
            "prompt": [3],
            "ground_truth": 42,
            "extra_info": {"b": [1, 2.5], "a": {"z": None, "y": "é"}},
        },
        {"prompt": [4], "ground_truth": [{"stdin": "1", "stdout": "1"}], "extra_info": True},
        {
            "prompt": [5],
            "data_source": None,
            "extra_info": {"a": {"y": "é", "z": None}, "b": [1, 2.5]},
        },
    ]
    arrays = Prompts(records=rows, max_prompt_len=2).arrays()
    decoded = {
        f: decode_text_column(arrays[f]) for f in ("data_source", "ground_truth", "extra_info")
    }
    assert decoded["data_source"] == ["gsm8k", "", "", "", ""]
    assert decoded["ground_truth"] == ["72", "", "42", '[{"stdin":"1","stdout":"1"}]', ""]
    text = '{"a":{"y":"é","z":null},"b":[1,2.5]}'  # sorted keys: the order it came in is irrelevant
    assert decoded["extra_info"] == ["as is", "", text, "true", text]
    assert decoded["extra_info"][2] == _compact(rows[2]["extra_info"])
    assert arrays["extra_info"].shape == (5, len(text.encode("utf-8")))
    assert arrays["ground_truth"].shape == (5, len(decoded["ground_truth"][3]))


def test_metadata_width_limits():
    rows = [{"prompt": [1], "data_source": "abc", "ground_truth": "ab"}, {"prompt": [2]}]
    fixed = Prompts(records=rows, max_prompt_len=2, max_metadata_bytes=5).arrays()
    assert {
        f: fixed[f].shape[1] for f in ("data_source", "ground_truth", "extra_info")
    } == dict.fromkeys(("data_source", "ground_truth", "extra_info"), 5)
    assert decode_text_column(fixed["data_source"]) == ["abc", ""]
    mixed = Prompts(records=rows, max_prompt_len=2, max_metadata_bytes={"ground_truth": 4})
    assert mixed.metadata_bytes() == {"data_source": 3, "ground_truth": 4, "extra_info": 0}
    with pytest.raises(
        ValueError,
        match=r"records\[0\]: field 'data_source' is 3 UTF-8 bytes, over max_metadata_bytes 2",
    ):
        Prompts(records=rows, max_prompt_len=2, max_metadata_bytes={"data_source": 2}).arrays()
    with pytest.raises(ValueError, match=r"max_metadata_bytes has keys \['answer'\]"):
        Prompts(records=rows, max_prompt_len=2, max_metadata_bytes={"answer": 2})
    with pytest.raises(ValueError, match=r"max_metadata_bytes is -1"):
        Prompts(records=rows, max_prompt_len=2, max_metadata_bytes=-1)


def test_metadata_errors_name_the_row_and_field():
    with pytest.raises(
        ValueError, match=r"records\[1\]: field 'extra_info' is dict .*no JSON text"
    ):
        Prompts(
            records=[{"prompt": [1]}, {"prompt": [1], "extra_info": {"x": float("nan")}}],
            max_prompt_len=2,
        ).arrays()
    with pytest.raises(ValueError, match=r"records\[0\]: field 'ground_truth' is bytes"):
        Prompts(records=[{"prompt": [1], "ground_truth": b"x"}], max_prompt_len=2).arrays()
    with pytest.raises(
        ValueError,
        match=r"records\[0\]: ground_truth '1' differs from reward_model.ground_truth '2'",
    ):
        Prompts(
            records=[{"prompt": [1], "ground_truth": "1", "reward_model": {"ground_truth": "2"}}],
            max_prompt_len=2,
        ).arrays()
    with pytest.raises(ValueError, match=r"records\[0\]: field 'ground_truth' contains|NUL"):
        Prompts(records=[{"prompt": [1], "ground_truth": "a\0"}], max_prompt_len=2).arrays()


# --- verl's parquet layout ---------------------------------------------------------------------


def _verl_row(index: int, question: str, answer: str) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k_tool_agent_loop.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [
            {"role": "system", "content": "You are a math expert."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": "train",
            "index": index,
            "answer": f"{question} #### {answer}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
            "interaction_kwargs": {"query": question, "ground_truth": answer},
        },
    }


def test_verl_parquet_layout(tmp_path, story_tokenizer):
    rows = [
        _verl_row(0, "What is two plus two?", "4"),
        _verl_row(1, "Tom has 3 cats. How many?", "3"),
    ]
    rows[1]["extra_info"].pop("interaction_kwargs")  # the struct column fills it with null
    rows[1]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["execute_kwargs"] = {"timeout": 5}
    table = pa.Table.from_pylist(rows)
    assert pa.types.is_struct(table.schema.field("reward_model").type)
    assert pa.types.is_struct(table.schema.field("extra_info").type)
    pq.write_table(table, tmp_path / "train.parquet")

    data = Prompts(tmp_path / "train.parquet", tokenizer=story_tokenizer, max_prompt_len=64)
    arrays = data.arrays()
    assert set(arrays) == {
        "prompt",
        "prompt_length",
        "data_source",
        "ground_truth",
        "extra_info",
        "task_id",
    }
    assert decode_text_column(arrays["data_source"]) == ["openai/gsm8k"] * 2
    assert decode_text_column(arrays["ground_truth"]) == ["4", "3"]
    extra = decode_text_column(arrays["extra_info"])
    assert extra == [_compact(r["extra_info"]) for r in rows]  # null struct fields were dropped
    assert json.loads(extra[1])["tools_kwargs"] == {
        "calc_gsm8k_reward": {
            "create_kwargs": {"ground_truth": "3"},
            "execute_kwargs": {"timeout": 5},
        }
    }
    expected = [
        story_tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"]
        for r in rows
    ]
    assert arrays["prompt"].tolist() == _padded(expected, 64)
    assert data.stats["train"]["ignored_columns"] == []  # ability and agent_name are read


def test_parquet_id_prompts_directory_and_ignored_columns(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": [[1, 2], [3]], "score": [0.5, 1.0]}), folder / "a.parquet")
    pq.write_table(pa.table({"prompt": [[4, 5, 6]], "score": [0.0]}), folder / "b.parquet")
    data = Prompts(folder, max_prompt_len=3)
    assert data.arrays()["prompt"].tolist() == [[0, 1, 2], [0, 0, 3], [4, 5, 6]]
    assert data.stats["train"]["ignored_columns"] == ["score"]


def test_every_source_format_gives_the_same_arrays(tmp_path, story_tokenizer):
    rows = [
        {"prompt": "A cat sat.", "data_source": "s", "extra_info": {"k": [1, "é"]}},
        {"prompt": [4, 5], "ground_truth": "g"},
    ]
    reference = Prompts(records=rows, tokenizer=story_tokenizer, max_prompt_len=6).arrays()
    (tmp_path / "array.json").write_text(json.dumps(rows), "utf-8")
    sources = [
        {"path": _jsonl(tmp_path / "rows.jsonl", rows)},
        {"path": _jsonl(tmp_path / "rows.ndjson", rows)},
        {"path": _jsonl(tmp_path / "lines.json", rows)},
        {"path": tmp_path / "array.json"},
        {"records": [json.dumps(r) for r in rows]},
        {"records": tuple(rows)},
    ]
    for source in sources:
        arrays = Prompts(**source, tokenizer=story_tokenizer, max_prompt_len=6).arrays()
        for name, array in reference.items():
            np.testing.assert_array_equal(arrays[name], array, err_msg=f"{source}: {name}")


# --- datasets and batches --------------------------------------------------------------------


def test_load_epochs_shuffle_partitions_and_resume():
    rows = [{"prompt": [i + 1], "ground_truth": str(i)} for i in range(6)]
    data = Prompts(records=rows, max_prompt_len=2, seed=3).load(batch=2)
    assert data.records == 6 and data.batch == 2
    stream = data.train(Partition(0, 1))
    epoch = [next(stream) for _ in range(3)]
    ids = np.concatenate([b["task_id"] for b in epoch])
    assert sorted(ids.tolist()) == list(range(6))
    for b in epoch:  # every field stays aligned with task_id
        assert b["prompt"][:, 1].tolist() == (b["task_id"] + 1).tolist()
        assert decode_text_column(b["ground_truth"]) == [str(t) for t in b["task_id"]]
        assert b["prompt"].shape == (2, 2) and b["ground_truth"].shape == (2, 1)
    again = data.train(Partition(0, 1))
    assert [next(again)["task_id"].tolist() for _ in range(3)] == [
        b["task_id"].tolist() for b in epoch
    ]
    halves = [data.train(Partition(i, 2)) for i in range(2)]
    first = [next(h)["task_id"].tolist() for h in halves]
    assert first[0] + first[1] == epoch[0]["task_id"].tolist()
    resumed = data.train(Partition(0, 1))
    resumed.set_state({"next_batch": 2})
    assert next(resumed)["task_id"].tolist() == epoch[2]["task_id"].tolist()
    ordered = Prompts(records=rows, max_prompt_len=2, shuffle=False).load(batch=4)
    assert next(ordered.train(Partition(0, 1)))["task_id"].tolist() == [0, 1, 2, 3]


def test_validation_batches_filled_with_empty_rows_and_shared_widths():
    train = [{"prompt": [1, 2], "data_source": "a"}]
    val = [{"prompt": [3], "data_source": "longer"}, {"prompt": [4]}, {"prompt": [5, 6]}]
    prompts = Prompts(records=train, val_records=val, max_prompt_len=3, pad_id=7)
    data = prompts.load(batch=2)
    batches = data.val(Partition(0, 1))
    assert len(batches) == 2
    assert batches[1]["prompt"].tolist() == [[7, 5, 6], [7, 7, 7]]
    assert batches[1]["prompt_length"].tolist() == [2, 0]
    assert batches[1]["task_id"].tolist() == [2, -1]
    assert decode_text_column(batches[0]["data_source"]) == ["longer", ""]
    train_batch = next(data.train(Partition(0, 1)))
    assert train_batch["data_source"].shape == (2, 6)  # the validation value sets the width
    assert prompts.stats["val"]["prompts"] == 3
    halves = [data.val(Partition(i, 2))[1]["task_id"].tolist() for i in range(2)]
    assert halves == [[2], [-1]]


def test_threads_give_the_same_arrays(story_tokenizer):
    rows = [{"prompt": f"Tom saw {i} dogs."} for i in range(70)] + [{"prompt": QUESTION}] * 70
    one = Prompts(records=rows, tokenizer=story_tokenizer, max_prompt_len=24).arrays()
    many = Prompts(
        records=rows, tokenizer=story_tokenizer, max_prompt_len=24, loading=Loading(threads=2)
    )
    np.testing.assert_array_equal(many.arrays()["prompt"], one["prompt"])


# --- errors ----------------------------------------------------------------------------------


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="both of path and records"):
        Prompts(tmp_path / "x.jsonl", records=[{"prompt": [1]}], max_prompt_len=2)
    with pytest.raises(ValueError, match="neither of path and records"):
        Prompts(max_prompt_len=2)
    with pytest.raises(ValueError, match="both val_path and val_records"):
        Prompts(records=[{"prompt": [1]}], val_path="v.jsonl", val_records=[], max_prompt_len=2)
    with pytest.raises(ValueError, match="max_prompt_len is missing"):
        Prompts(records=[{"prompt": [1]}])
    with pytest.raises(ValueError, match=r"max_prompt_len is 0; expected an int >= 1"):
        Prompts(records=[{"prompt": [1]}], max_prompt_len=0)
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\n1\n")
    with pytest.raises(ValueError, match=r"has suffix '.csv'; expected .parquet"):
        Prompts(csv, max_prompt_len=2).arrays()
    with pytest.raises(FileNotFoundError, match="no such file"):
        Prompts(tmp_path / "absent.jsonl", max_prompt_len=2).arrays()
    with pytest.raises(ValueError, match=r"holds no rows"):
        Prompts(records=[], max_prompt_len=2).arrays()
    with pytest.raises(TypeError, match="records is a dict"):
        Prompts(records={"prompt": [1]}, max_prompt_len=2).arrays()
    with pytest.raises(ValueError, match=r"records\[1\]: not valid JSON"):
        Prompts(records=['{"prompt": [1]}', "{oops"], max_prompt_len=2).arrays()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read it as Parquet"):
        Prompts(broken, max_prompt_len=2).arrays()


def test_missing_prompt_column(tmp_path):
    pq.write_table(pa.table({"question": ["a"]}), tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"has no column 'prompt'; its columns are \['question'\]"):
        Prompts(tmp_path / "q.parquet", max_prompt_len=2).arrays()
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    with pytest.raises(ValueError, match=r"has no column 'prompt'"):
        Prompts(path, max_prompt_len=2).arrays()
    other = _jsonl(tmp_path / "other.jsonl", [{"question": [4, 5, 6]}])
    assert Prompts(other, column="question", max_prompt_len=2).arrays()["prompt"].tolist() == [
        [5, 6]
    ]
    with pytest.raises(ValueError, match=r"records\[1\] has no 'prompt'"):
        Prompts(records=[{"prompt": [1]}, {"data_source": "x"}], max_prompt_len=2).arrays()


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        (1.5, TypeError, r"records\[1\]: 'prompt' is float 1.5"),
        ({"role": "user"}, TypeError, r"records\[1\]: 'prompt' is dict"),
        (["a", "b"], TypeError, r"records\[1\]: 'prompt'\[0\] is str 'a'"),
        ([1, 2.0], TypeError, r"records\[1\]: 'prompt'\[1\] is float 2.0"),
        ([True, False], TypeError, r"records\[1\]: 'prompt'\[0\] is bool"),
        ([QUESTION[0], 3], TypeError, r"records\[1\]: 'prompt'\[1\] is int"),
        ([{"content": "hi"}], ValueError, r"records\[1\]: 'prompt'\[0\] has role None"),
        ([1, -2], ValueError, r"records\[1\]: 'prompt'\[1\] is -2; expected a token id"),
        ([], ValueError, r"records\[1\]: 'prompt' is an empty list"),
        ("", ValueError, r"records\[1\]: 'prompt' is an empty string"),
    ],
)
def test_bad_prompts_name_the_row_and_type(prompt, error, message):
    with pytest.raises(error, match=message):
        Prompts(records=[{"prompt": [1]}, {"prompt": prompt}], max_prompt_len=2).arrays()


def test_tokenizer_errors(story_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"records\[1\] \(text prompt\): a tokenizer is needed"):
        Prompts(records=[{"prompt": [1]}, {"prompt": "hi"}], max_prompt_len=2).arrays()
    with pytest.raises(
        ValueError, match=r"records\[0\] \(messages prompt\): a tokenizer is needed"
    ):
        Prompts(records=[{"prompt": QUESTION}], max_prompt_len=2).arrays()
    plain = copy.deepcopy(story_tokenizer)
    plain.chat_template = None
    with pytest.raises(
        ValueError,
        match=r"records\[1\]: its prompt is messages but the tokenizer has no chat template",
    ):
        Prompts(
            records=[{"prompt": "a"}, {"prompt": QUESTION}], tokenizer=plain, max_prompt_len=2
        ).arrays()
    failing = copy.deepcopy(story_tokenizer)
    failing.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(
        ValueError, match=r"records\[0\]: the chat template failed .*roles must alternate"
    ):
        Prompts(records=[{"prompt": QUESTION}], tokenizer=failing, max_prompt_len=2).arrays()
    with pytest.raises(ValueError, match=r"cannot load it"):
        Prompts(
            records=[{"prompt": "hi"}], tokenizer=tmp_path / "absent", max_prompt_len=2
        ).arrays()
    with pytest.raises(TypeError, match="tokenizer is int"):
        Prompts(records=[{"prompt": [1]}], tokenizer=3, max_prompt_len=2)


def test_verl_field_errors():
    with pytest.raises(TypeError, match=r"records\[0\]: field 'ability' is int"):
        Prompts(records=[{"prompt": [1], "ability": 3}], max_prompt_len=2).arrays()
    with pytest.raises(TypeError, match=r"records\[0\]: field 'reward_model' is str"):
        Prompts(records=[{"prompt": [1], "reward_model": "4"}], max_prompt_len=2).arrays()
    with pytest.raises(ValueError, match=r"records\[0\] has 'images'; expected text-only prompts"):
        Prompts(
            records=[{"prompt": [1], "images": [{"image": "x.png"}]}], max_prompt_len=2
        ).arrays()
    same = Prompts(
        records=[{"prompt": [1], "ground_truth": "4", "reward_model": {"ground_truth": "4"}}],
        max_prompt_len=2,
    )
    assert decode_text_column(same.arrays()["ground_truth"]) == ["4"]
