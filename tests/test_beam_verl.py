"""The pack job on verl rows: native verl rows and rows Dew wrote, against in-process pack.

The native rows are verl 0.9.1's own tool-loop outputs (tests/parity/fixtures/verl_interop,
recorded by tests/parity/record_verl_interop.py).
"""

from __future__ import annotations

import copy
import doctest
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dew_pipe.beam.verl_source
from dew_pipe.beam import SessionDataError, read_manifest, read_packed, run_pack_job
from dew_pipe.beam.verl_source import ReadVerlRows, read_verl_file
from dew_pipe.objectives.rl.sessions import Call, Session, pack
from dew_pipe.objectives.rl.verl import to_verl

FIXTURES = Path(__file__).parent / "parity" / "fixtures" / "verl_interop"
RECORD = json.loads((FIXTURES / "agent_loop_outputs.json").read_text())
TOOL = [RECORD["outputs"][f"tool_loop_{k}"]["row"] for k in range(2)]
VIDEO = RECORD["outputs"]["video_turn"]["row"]
WIDTH = 512


def _lines(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _rewarded(row: dict, reward: float) -> dict:
    row = copy.deepcopy(row)
    row["reward_score"] = reward
    return row


def _dew_sessions() -> list[Session]:
    a = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", 2, log_probs=[-0.4, -0.2])
    b = Call([1, 2, 3, 4, 9], [5], [-0.125], "length", 3)
    other = Call([7, 8], [6], [-1.0], "stop", 4)
    return [
        Session(100, 0, 0, 0, [a, b, other], "COMPLETED", 1.0),
        Session(100, 0, 1, 0, [other], "COMPLETED", 0.0),
        Session(100, 0, 2, 0, [a], "TRUNCATED"),  # masked: in the manifest, not in the rows
    ]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verl")
    # rollout.n = 2: rows 0-1 are task 0, rows 2-3 task 1 of each native file
    native = [TOOL[0], TOOL[1], _rewarded(TOOL[1], 0.5), _rewarded(TOOL[0], 0.25)]
    files = [
        _lines(folder / "a.jsonl", native),
        _lines(folder / "b.jsonl", native[:2]),
        _lines(folder / "c.jsonl.gz", to_verl(_dew_sessions())),
    ]
    summary = run_pack_job(
        [str(folder / "*.jsonl"), str(folder / "*.jsonl.gz")],
        folder / "out",
        width=WIDTH,
        groups_per_batch=2,
        input_format="verl",
        samples=2,
    )
    sessions = {}
    for group, path in enumerate(files):
        for s in read_verl_file(str(path), group, samples=None if group == 2 else 2):
            sessions[(s.task, s.group, s.sample, s.attempt)] = s
    return {
        "folder": folder,
        "summary": summary,
        "manifest": read_manifest(folder / "out").to_pylist(),
        "packed": [read_packed(p) for p in summary.files],
        "sessions": sessions,
    }


def test_each_batch_is_pack_of_its_sessions(job):
    manifest, sessions = job["manifest"], job["sessions"]
    assert job["summary"].sessions == len(manifest) == 4 + 2 + 3
    keys = sorted({(m["task_id"], m["group"]) for m in manifest})
    assert keys == [(0, 0), (0, 1), (1, 0), (100, 0)]  # file a: tasks 0, 1; file b: group 1
    assert len(job["packed"]) == 2
    for b, batch in enumerate(job["packed"]):
        rows = [m for m in manifest if m["batch"] == b]
        members = [sessions[(m["task_id"], m["group"], m["sample"], m["attempt"])] for m in rows]
        expected = pack(members, WIDTH)
        assert batch.keys() == expected.keys()
        assert "routed_experts" in batch  # verl's routing travels into the rows
        for name, column in expected.items():
            assert batch[name].dtype == column.dtype, name
            np.testing.assert_array_equal(batch[name], column, err_msg=name)
    trained = {(m["task_id"], m["sample"]): m["trains"] for m in manifest if m["task_id"] == 100}
    assert trained == {(100, 0): True, (100, 1): True, (100, 2): False}


def test_cli_pack_format_verl_writes_the_same_batches(job, tmp_path):
    folder = job["folder"]
    result = _cli(
        "--format", "verl", "--samples", 2, "--input", folder / "*.jsonl",
        "--input", folder / "*.jsonl.gz",
        "--output", tmp_path / "out", "--width", WIDTH, "--groups-per-batch", 2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "packed 9 sessions of 4 groups" in result.stdout
    ours = sorted((tmp_path / "out").glob("packed-*.parquet"))
    for path, theirs in zip(ours, job["packed"], strict=True):
        for name, column in theirs.items():
            np.testing.assert_array_equal(read_packed(path)[name], column, err_msg=name)


def test_cli_media_row_fails_naming_the_file_and_line(tmp_path):
    path = _lines(tmp_path / "rows.jsonl", [TOOL[0], VIDEO])
    result = _cli(
        "--format", "verl", "--samples", 1, "--input", path, "--output", tmp_path / "out",
        "--width", WIDTH,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().startswith(
        f"dew-pipe: {path}: line 2.multi_modal_data: the row carries media"
    )
    assert not (tmp_path / "out").exists()


def test_bad_rows_and_arguments(tmp_path):
    native = _lines(tmp_path / "native.jsonl", ["", TOOL[0]])
    native.write_text("\n" + json.dumps(TOOL[0]) + "\n")  # a blank line, then the row
    with pytest.raises(
        SessionDataError, match=r"native.jsonl: samples is None, but the rows are native"
    ):
        run_pack_job(str(native), tmp_path / "o1", width=WIDTH, input_format="verl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(
        json.dumps(TOOL[0]) + "\n" + json.dumps({**TOOL[0], "reward_score": None}) + "\n"
    )
    with pytest.raises(SessionDataError, match=r"broken.jsonl: line 2\.reward_score: is None"):
        read_verl_file(str(broken), 0, samples=1)
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(SessionDataError, match=r"list.jsonl: line 1: expected one JSON object"):
        read_verl_file(str(tmp_path / "list.jsonl"), 0, samples=1)
    with pytest.raises(ValueError, match="verl rows are read from JSON-lines files"):
        ReadVerlRows(str(tmp_path / "rows.parquet"), samples=1)
    with pytest.raises(ValueError, match="no file matches"):
        ReadVerlRows(str(tmp_path / "none-*.jsonl"), samples=1)
    with pytest.raises(ValueError, match="samples: only verl rows are grouped by samples"):
        run_pack_job(str(native), tmp_path / "o2", width=WIDTH, samples=2)
    with pytest.raises(ValueError, match="input_format: expected 'sessions' or 'verl'"):
        run_pack_job(str(native), tmp_path / "o3", width=WIDTH, input_format="trl")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dew_pipe.cli", "pack", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_docstring_examples_run():
    result = doctest.testmod(dew_pipe.beam.verl_source)
    assert result.attempted > 0 and result.failed == 0
