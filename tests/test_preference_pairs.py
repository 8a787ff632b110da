"""PreferencePairs: reading JSON records, Parquet and JSONL into [B, 2, S] DPO batches."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dew_pipe.data import Dataset, Loading, Partition, PreferencePairs, digit_preferences
from dew_pipe.data.preference import read_pairs

ROWS = [
    {
        "chosen": [1, 2, 3, 5],
        "rejected": [1, 2, 4, 5],
        "chosen_mask": [0, 0, 1, 1],
        "rejected_mask": [0, 0, 1, 1],
    },
    {
        "chosen": [1, 6, 3],
        "rejected": [1, 6, 4, 4, 5],
        "chosen_mask": [0, 1, 1],
        "rejected_mask": [0, 1, 1, 1, 1],
    },
    {"chosen": [7, 3], "rejected": [7, 4, 5]},  # no masks: every token is completion
]


def records(rows=ROWS) -> tuple[str, ...]:
    return tuple(json.dumps(row) for row in rows)


def expected(rows, width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The layout written out by hand, row by row."""
    ids = np.full((len(rows), 2, width), pad_id, np.int32)
    mask = np.zeros((len(rows), 2, width), np.int32)
    for i, row in enumerate(rows):
        for k, side in enumerate(("chosen", "rejected")):
            n = len(row[side])
            ids[i, k, :n] = row[side]
            mask[i, k, :n] = row.get(f"{side}_mask") or [1] * n
    return ids, mask


def test_records_layout_padding_and_missing_masks():
    out = PreferencePairs(records=records(), seq_len=6, pad_id=9).pairs()
    ids, mask = expected(ROWS, 6, pad_id=9)
    assert out["input_ids"].dtype == np.int32 and out["completion_mask"].dtype == np.int32
    np.testing.assert_array_equal(out["input_ids"], ids)
    np.testing.assert_array_equal(out["completion_mask"], mask)


def test_null_mask_means_all_completion_and_extra_fields_are_ignored():
    rows = [
        {"chosen": [1, 2], "rejected": [1, 3], "chosen_mask": None, "prompt": "text", "score": 1.5}
    ]
    out = PreferencePairs(records=records(rows), seq_len=3).pairs()
    np.testing.assert_array_equal(out["completion_mask"], [[[1, 1, 0], [1, 1, 0]]])


def test_pretty_printed_json_records_read_the_same():
    pretty = tuple(json.dumps(row, indent=2) for row in ROWS)
    a = PreferencePairs(records=pretty, seq_len=5).pairs()
    b = PreferencePairs(records=records(), seq_len=5).pairs()
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_parquet_file_directory_and_jsonl_match_records(tmp_path):
    table = pa.Table.from_pylist(
        [
            dict(row, chosen_mask=row.get("chosen_mask"), rejected_mask=row.get("rejected_mask"))
            for row in ROWS
        ]
    )
    pq.write_table(table, tmp_path / "pairs.parquet")
    (tmp_path / "shards").mkdir()
    pq.write_table(table.slice(0, 2), tmp_path / "shards" / "a.parquet")
    pq.write_table(table.slice(2), tmp_path / "shards" / "b.parquet")
    (tmp_path / "pairs.jsonl").write_text("\n".join(records()) + "\n")
    want = PreferencePairs(records=records(), seq_len=5).pairs()
    for path in ("pairs.parquet", "shards", "pairs.jsonl"):
        got = PreferencePairs(path=tmp_path / path, seq_len=5, loading=Loading(threads=2)).pairs()
        for name in ("input_ids", "completion_mask"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=path)


def test_parquet_with_int32_lists_and_no_mask_columns(tmp_path):
    table = pa.table(
        {
            "chosen": pa.array([[1, 2, 3]], pa.list_(pa.int32())),
            "rejected": pa.array([[1, 4]], pa.large_list(pa.int16())),
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    out = PreferencePairs(path=str(tmp_path / "p.parquet"), seq_len=3).pairs()
    np.testing.assert_array_equal(out["input_ids"], [[[1, 2, 3], [1, 4, 0]]])
    np.testing.assert_array_equal(out["completion_mask"], [[[1, 1, 1], [1, 1, 0]]])


def test_many_records_in_parallel_chunks_keep_order():
    rows = digit_preferences(5000, seed=3)
    one = PreferencePairs(records=records(rows), seq_len=14).pairs()
    many = PreferencePairs(records=records(rows), seq_len=14, loading=Loading(threads=2)).pairs()
    ids, mask = expected(rows, 14)
    np.testing.assert_array_equal(one["input_ids"], ids)
    np.testing.assert_array_equal(one["completion_mask"], mask)
    np.testing.assert_array_equal(many["input_ids"], ids)


def test_load_returns_a_dataset_of_batches():
    spec = PreferencePairs(records=records(ROWS * 2), seq_len=5, shuffle=False)
    data = spec.load(batch=4)
    assert isinstance(data, Dataset) and data.records == 6 and data.batch == 4 and data.val is None
    it = data.train(Partition(0, 1))
    first, second = next(it), next(it)
    ids, _ = expected(ROWS * 2, 5)
    assert first["input_ids"].shape == (4, 2, 5)
    np.testing.assert_array_equal(first["input_ids"], ids[:4])
    np.testing.assert_array_equal(second["input_ids"], ids[[4, 5, 0, 1]])  # wraps to epoch 2
    half = next(data.train(Partition(1, 2)))
    np.testing.assert_array_equal(half["input_ids"], ids[2:4])
    assert spec.stats["train"] == {"pairs": 6, "chosen_tokens": 10, "rejected_tokens": 16}


def test_shuffled_training_resumes_from_its_state():
    data = PreferencePairs(records=records(digit_preferences(10)), seq_len=14, seed=5).load(batch=4)
    run = data.train(Partition(0, 1))
    batches = [next(run)["input_ids"] for _ in range(5)]
    assert not all(np.array_equal(a, b) for a, b in zip(batches[:2], batches[2:4], strict=True))
    resumed = data.train(Partition(0, 1))
    resumed.set_state(run.get_state() | {"next_batch": 3})
    np.testing.assert_array_equal(next(resumed)["input_ids"], batches[3])


def test_validation_batches_are_padded_with_masked_pairs():
    spec = PreferencePairs(
        records=records(), seq_len=5, pad_id=7, val_records=records(ROWS[:2] * 2 + ROWS[:1])
    )
    batches = list(spec.load(batch=2).val(Partition(0, 1)))
    assert len(batches) == 3
    last = batches[-1]
    assert last["input_ids"].shape == (2, 2, 5)
    np.testing.assert_array_equal(last["input_ids"][1], np.full((2, 5), 7))
    assert not last["completion_mask"][1].any()
    assert spec.stats["val"]["pairs"] == 5


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"chosen": [1, 2, 3, 4, 5, 6], "rejected": [1, 2]},
            r"row 1 has 'chosen' of length 6; expected at most seq_len=5",
        ),
        (
            {"chosen": [1, 2], "rejected": [1, 2, 3, 4, 5, 6, 7]},
            r"row 1 has 'rejected' of length 7",
        ),
        (
            {"chosen": [1, 2], "rejected": [1, 3], "chosen_mask": [0]},
            r"row 1 has chosen_mask of length 1 but chosen of length 2",
        ),
        (
            {"chosen": [1, 2], "rejected": [1, 3], "rejected_mask": [0, 1, 1]},
            r"row 1 has rejected_mask of length 3 but rejected of length 2",
        ),
        (
            {"chosen": [1, 2], "rejected": [1, 3], "rejected_mask": [0, 2]},
            r"row 1 has rejected_mask value 2; expected 0 .* or 1",
        ),
        (
            {"chosen": [1, 2], "rejected": [1, 3], "chosen_mask": [1, 0]},
            r"row 1 has no chosen completion token after position 0",
        ),
        (
            {"chosen": [], "rejected": [1, 3]},
            r"row 1 has 'chosen' of length 0; expected at least 1",
        ),
        ({"rejected": [1, 3]}, r"row 1 has no 'chosen' ids"),
        ({"chosen": [1, -2], "rejected": [1, 3]}, r"row 1 has 'chosen' id -2"),
        ({"chosen": [1, None], "rejected": [1, 3]}, r"row 1 has a null in 'chosen'"),
        ({"chosen": [1, 2.5], "rejected": [1, 3]}, r"records\[1\] is not a valid pair"),
        ({"chosen": "1 2", "rejected": [1, 3]}, r"records\[1\] is not a valid pair"),
    ],
)
def test_bad_rows_are_named(row, match):
    with pytest.raises(ValueError, match=match):
        PreferencePairs(records=(json.dumps(ROWS[0]), json.dumps(row)), seq_len=5).pairs()


def test_malformed_json_names_the_record():
    with pytest.raises(ValueError, match=r"records\[2\] is not a valid pair"):
        PreferencePairs(records=(*records()[:2], '{"chosen": [1, 2]'), seq_len=5).pairs()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"records": ("{}",), "path": "x.parquet"}, ValueError, "got both of records and path"),
        ({}, ValueError, "got neither of records and path"),
        (
            {"records": ("{}",), "val_records": ("{}",), "val_path": "v.parquet"},
            ValueError,
            "both val_records and val_path",
        ),
        ({"records": ("{}",), "seq_len": 1}, ValueError, "seq_len is 1; expected an int >= 2"),
        ({"records": ("{}",), "seq_len": 4.0}, TypeError, "seq_len is 4.0; expected an int"),
        ({"records": ("{}",), "pad_id": -1}, ValueError, "pad_id is -1"),
        ({"records": ("{}",), "loading": {"threads": 2}}, TypeError, "loading is dict"),
        ({"path": 3}, TypeError, "path is int"),
    ],
)
def test_constructor_refuses(kwargs, error, match):
    kwargs = {"seq_len": 4, **kwargs}
    with pytest.raises(error, match=match):
        PreferencePairs(**kwargs)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ('{"chosen": [1]}', TypeError, "records is str; expected a tuple of JSON strings"),
        ((), ValueError, "records is empty"),
        (({"chosen": [1]},), TypeError, r"records\[0\] is dict; expected a JSON string"),
        (("  ",), ValueError, r"records\[0\] is blank"),
    ],
)
def test_bad_records_containers(value, error, match):
    with pytest.raises(error, match=match):
        PreferencePairs(records=value, seq_len=4).pairs()


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such Parquet file"):
        PreferencePairs(path=tmp_path / "missing.parquet", seq_len=4).pairs()
    (tmp_path / "pairs.csv").write_text("chosen,rejected\n")
    with pytest.raises(ValueError, match=r"suffix '.csv'; expected .parquet"):
        PreferencePairs(path=tmp_path / "pairs.csv", seq_len=4).pairs()
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read it as Parquet"):
        PreferencePairs(path=tmp_path / "broken.parquet", seq_len=4).pairs()
    pq.write_table(pa.table({"chosen": ["1 2"], "rejected": ["1 3"]}), tmp_path / "text.parquet")
    with pytest.raises(
        ValueError, match=r"column 'chosen' has type string; expected a list of integers"
    ):
        PreferencePairs(path=tmp_path / "text.parquet", seq_len=4).pairs()
    pq.write_table(pa.table({"prompt": [[1]]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="has no field 'chosen'"):
        PreferencePairs(path=tmp_path / "other.parquet", seq_len=4).pairs()
    (tmp_path / "bad.jsonl").write_text('{"chosen": [1, 2], "rejected": [1, 3]}\n{"chosen": 5}\n')
    with pytest.raises(ValueError, match="cannot read it as JSON Lines pairs"):
        PreferencePairs(path=tmp_path / "bad.jsonl", seq_len=4).pairs()


def test_val_split_needs_a_source_and_batch_is_checked():
    spec = PreferencePairs(records=records(), seq_len=5)
    with pytest.raises(ValueError, match="neither val_records nor val_path"):
        spec.pairs("val")
    with pytest.raises(ValueError, match="which is 'test'"):
        spec.pairs("test")
    with pytest.raises(ValueError, match="batch is 0"):
        spec.load(batch=0)


def test_read_pairs_refuses_an_empty_table():
    with pytest.raises(ValueError, match="holds no rows"):
        read_pairs(pa.table({"chosen": pa.array([], pa.list_(pa.int64()))}), seq_len=4)


def test_digit_preferences_rows():
    rows = digit_preferences(200, min_digits=2, max_digits=5, seed=4)
    assert rows == digit_preferences(200, min_digits=2, max_digits=5, seed=4)
    for row in rows:
        chosen, rejected, mask = row["chosen"], row["rejected"], row["chosen_mask"]
        split = mask.index(1)
        digits = np.array(chosen[: split - 1]) - 3
        assert chosen[split - 1] == 1 and chosen[-1] == 2 and len(chosen) == 2 * len(digits) + 2
        np.testing.assert_array_equal(np.array(chosen[split:-1]) - 3, np.sort(digits))
        assert (
            len(rejected) == len(chosen)
            and sum(a != b for a, b in zip(chosen, rejected, strict=True)) == 1
        )
        assert mask == row["rejected_mask"] == [0] * split + [1] * (len(digits) + 1)
    reverse = digit_preferences(1, max_digits=4, min_digits=4, kind="reverse", seed=0)[0]
    assert reverse["chosen"][5:9] == reverse["chosen"][:4][::-1]
    with pytest.raises(ValueError, match="kind is 'shuffle'"):
        digit_preferences(1, kind="shuffle")
    with pytest.raises(ValueError, match="min_digits=4, max_digits=2"):
        digit_preferences(1, min_digits=4, max_digits=2)
