"""dew_pipe.beam: the offline pack job against in-process pack, the journal, errors, the CLI.

One module-scoped job (JSON lines + a journal written by JournalSessions, three batches)
carries the equality tests; each error path is a small job of its own.
"""

from __future__ import annotations

import doctest
import importlib
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.testing.util import assert_that, equal_to

from dew_pipe import batches
from dew_pipe.beam import (
    JournalSessions,
    ReadSessions,
    SessionDataError,
    read_manifest,
    read_packed,
    run_pack_job,
    score_group,
    session_to_json,
)
from dew_pipe.objectives.rl.sessions import Call, Session, Status, from_arrow, pack, to_arrow

WIDTH = 24
GROUPS_PER_BATCH = 5
OPTIONS = {"estimator": "rloo", "truncation": "score", "support_capacity": 64}
# Columns of a chain that do not depend on where it lands (segment numbers and support
# columns are row-relative; session_index is replaced by the session's identity).
CHAIN_COLUMNS = (
    "input_ids",
    "text_positions",
    "response_mask",
    "old_log_probs",
    "behavior_log_probs",
    "advantages",
    "versions",
    "call_index",
    "session_weights",
)


def _calls(rng: random.Random, task: int, sample: int) -> list[Call]:
    """Up to three calls: extensions that merge, fresh prompts that start new chains."""
    calls: list[Call] = []
    for _ in range(rng.choice([0, 1, 2, 2, 3, 3])):
        sampled = [rng.randrange(1, 50) for _ in range(rng.randint(0, 4))]
        if calls and rng.random() < 0.6:  # extends the chain so far: merges
            last = calls[-1]
            prompt = [*last.prompt_ids, *last.sampled_ids, rng.randrange(1, 50)]
        else:
            prompt = [50 + task, sample, *[rng.randrange(1, 50) for _ in range(rng.randint(0, 5))]]
        if len(prompt) + len(sampled) > WIDTH:
            break
        behavior = [-0.1 - 0.03 * rng.randrange(30) for _ in sampled]
        raw = [b - 0.01 for b in behavior] if rng.random() < 0.5 else None
        support = [[s, 60 + s] for s in sampled] if sampled and rng.random() < 0.3 else None
        calls.append(
            Call(
                prompt, sampled, behavior, "stop", rng.randrange(4), log_probs=raw, support=support
            )
        )
    return calls


def make_sessions(seed: int = 0) -> list[Session]:
    """Twelve (task, group) groups of 3-5 sessions, every status, one retried attempt."""
    rng = random.Random(seed)
    sessions = []
    statuses = ["COMPLETED"] * 6 + ["TRUNCATED", "AGENT_ERROR", "INFRA_ERROR", "CANCELLED"]
    for task in range(6):
        for group in range(2):
            for sample in range(rng.randint(3, 5)):
                status = rng.choice(statuses)
                reward = None if status in ("INFRA_ERROR", "CANCELLED") else rng.random()
                calls = _calls(rng, task, sample)
                sessions.append(
                    Session(task, group, sample, 0, calls, status, reward, {"ok": 1.0}, "d")
                )
                if status == "INFRA_ERROR":  # the retry of an infrastructure failure
                    calls = _calls(rng, task, sample)
                    sessions.append(Session(task, group, sample, 1, calls, "COMPLETED", 0.5))
    rng.shuffle(sessions)
    return sessions


def identity(session: Session) -> tuple[int, int, int, int]:
    return (session.task, session.group, session.sample, session.attempt)


def write_jsonl(path: Path, sessions: list[Session]) -> Path:
    path.write_text("".join(json.dumps(session_to_json(s)) + "\n" for s in sessions))
    return path


def chains(batch: dict[str, np.ndarray], identities: list) -> Counter:
    """The multiset of chains in a packed batch, each with its sessions' identities."""
    found: Counter = Counter()
    for r in range(batch["input_ids"].shape[0]):
        segments = batch["text_segment_ids"][r]
        for segment in range(1, int(segments.max(initial=0)) + 1):
            where = segments == segment
            owners = tuple(
                identities[i] if i >= 0 else None for i in batch["session_index"][r, where]
            )
            found[(owners, *(batch[c][r, where].tobytes() for c in CHAIN_COLUMNS))] += 1
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Half the sessions in a JSON-lines file, half journaled to Parquet; one pack job."""
    folder = tmp_path_factory.mktemp("beam")
    sessions = make_sessions()
    half = len(sessions) // 2
    write_jsonl(folder / "sessions.jsonl", sessions[:half])
    with beam.Pipeline("FnApiRunner") as p:
        _ = p | beam.Create(sessions[half:]) | JournalSessions(str(folder / "journal"))
    keys = sorted({(s.task, s.group) for s in sessions})
    cuts = [keys[i : i + GROUPS_PER_BATCH] for i in range(0, len(keys), GROUPS_PER_BATCH)]
    needed = [
        pack([s for s in sessions if (s.task, s.group) in set(cut)], WIDTH, **OPTIONS)[
            "input_ids"
        ].shape[0]
        for cut in cuts
    ]
    rows = max(needed) + 1  # every batch ends in at least one padding row
    summary = run_pack_job(
        [str(folder / "*.jsonl"), str(folder / "journal-*.parquet")],
        folder / "out",
        width=WIDTH,
        rows=rows,
        groups_per_batch=GROUPS_PER_BATCH,
        **OPTIONS,
    )
    manifest = read_manifest(folder / "out").to_pylist()
    packed = [read_packed(path) for path in summary.files]
    by_identity = {identity(s): s for s in sessions}
    return {
        "folder": folder,
        "sessions": sessions,
        "by_identity": by_identity,
        "summary": summary,
        "manifest": manifest,
        "packed": packed,
        "rows": rows,
        "batches": len(cuts),
    }


def batch_sessions(job, b: int) -> list[Session]:
    rows = [m for m in job["manifest"] if m["batch"] == b]
    assert [m["session_index"] for m in rows] == list(range(len(rows)))
    return [job["by_identity"][(m["task_id"], m["group"], m["sample"], m["attempt"])] for m in rows]


def test_each_batch_is_exactly_pack_of_its_sessions(job):
    summary = job["summary"]
    assert [Path(f).name for f in summary.files] == [
        f"packed-{b:05d}-of-{job['batches']:05d}.parquet" for b in range(job["batches"])
    ]
    for b, batch in enumerate(job["packed"]):
        expected = pack(batch_sessions(job, b), WIDTH, job["rows"], **OPTIONS)
        assert batch.keys() == expected.keys()
        assert "support_ids" in batch
        for name, column in expected.items():
            assert batch[name].dtype == column.dtype, name
            np.testing.assert_array_equal(batch[name], column, err_msg=name)
        assert batch["input_ids"].shape == (job["rows"], WIDTH)
        assert not batch["text_segment_ids"][-1].any()  # the padding row


def test_chains_equal_pack_in_input_order(job):
    everything: Counter = Counter()
    moved = 0  # batches whose layout the other order changes: the comparison has work to do
    for b, batch in enumerate(job["packed"]):
        members = batch_sessions(job, b)
        shuffled = members[::-1]  # another order: ties in first-fit decreasing break differently
        theirs = pack(shuffled, WIDTH, **OPTIONS)
        ours = chains(batch, [identity(s) for s in members])
        assert ours == chains(theirs, [identity(s) for s in shuffled])
        used = batch["text_segment_ids"].any(axis=1).sum()
        assert used == theirs["input_ids"].shape[0]  # the same number of rows
        moved += not np.array_equal(batch["input_ids"][:used], theirs["input_ids"])
        everything += ours
    assert moved >= 2
    sessions = job["sessions"]  # all at once, in input order: advantages are group-local
    assert everything == chains(pack(sessions, WIDTH, **OPTIONS), [identity(s) for s in sessions])


def test_manifest_and_summary_account_for_every_session(job):
    manifest, sessions, summary = job["manifest"], job["sessions"], job["summary"]
    keys = [(m["task_id"], m["group"], m["sample"], m["attempt"]) for m in manifest]
    assert sorted(keys) == sorted(identity(s) for s in sessions)
    trained = 0
    for m in manifest:
        batch = job["packed"][m["batch"]]
        mine = batch["session_index"] == m["session_index"]
        status = Status[m["status"]]
        assert m["trains"] == (status is not Status.INFRA_ERROR and status is not Status.CANCELLED)
        if m["trains"]:
            trained += 1
            assert m["advantage"] is not None
            np.testing.assert_array_equal(batch["advantages"][mine], np.float32(m["advantage"]))
        else:
            assert m["advantage"] is None and m["chains"] == 0 and not mine.any()
    tokens = sum(int(np.count_nonzero(b["text_segment_ids"])) for b in job["packed"])
    assert summary.sessions == len(sessions) and summary.trained == trained
    assert summary.groups == 12 and summary.batches == job["batches"]
    assert summary.rows == job["batches"] * job["rows"] and summary.tokens == tokens
    assert summary.chains == sum(m["chains"] for m in manifest)
    assert summary.fill == tokens / (summary.rows * WIDTH)


@pytest.mark.parametrize("truncation", ["mask", "score", "zero"])
def test_score_group_follows_pack_rules(truncation):
    call = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", 0)
    group = [
        Session(0, 0, s, 0, [call], status, None if status == "INFRA_ERROR" else 0.3 * s + 0.1)
        for s, status in enumerate(
            ["COMPLETED", "TRUNCATED", "AGENT_ERROR", "INFRA_ERROR", "CANCELLED", "COMPLETED"]
        )
    ]
    scored = score_group(group[::-1], width=8, estimator="group", truncation=truncation)
    assert [identity(s) for s in scored.sessions] == [identity(s) for s in group]
    batch = pack(group, 8, truncation=truncation)
    for i, advantage in enumerate(scored.advantages):
        mine = batch["session_index"] == i
        if advantage is None:
            assert not mine.any()
        else:
            np.testing.assert_array_equal(batch["advantages"][mine], np.float32(advantage))


def test_journal_round_trip_through_read_sessions(tmp_path):
    routed = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    sessions = make_sessions(seed=1)[:6] + [
        Session(9, 0, 0, 0, [Call([1, 2], [3], [-0.5], "length", 7, routed_experts=routed)],
                "TRUNCATED", 0.25, {"format": 1.0, "answer": 0.0}, "budget hit"),
    ]  # fmt: skip
    prefix = str(tmp_path / "journal")
    with beam.Pipeline("FnApiRunner") as p:
        _ = p | beam.Create(sessions) | JournalSessions(prefix, routed_experts=(2, 2, np.int16))
    files = sorted(tmp_path.glob("journal-*.parquet"))
    read = [s for f in files for b in batches.read_parquet(f).to_batches() for s in from_arrow(b)]
    assert sorted(read, key=identity) == sorted(sessions, key=identity)
    assert (
        read[[identity(s) for s in read].index((9, 0, 0, 0))].calls[0].routed_experts.dtype
        == np.int16
    )
    expected = [json.dumps(session_to_json(s), sort_keys=True) for s in sessions]
    write_jsonl(tmp_path / "more.jsonl", sessions[:3])
    with beam.Pipeline("FnApiRunner") as p:
        lines = (
            p
            | ReadSessions([f"{prefix}-*.parquet", str(tmp_path / "more.jsonl")])
            | beam.Map(lambda s: json.dumps(session_to_json(s), sort_keys=True))
        )
        assert_that(lines, equal_to(expected + expected[:3]))


def _bad_job(tmp_path, sessions, **kwargs):
    path = write_jsonl(tmp_path / "bad.jsonl", sessions)
    kwargs.setdefault("width", 8)
    return run_pack_job(str(path), tmp_path / "out", **kwargs)


def _one(call, task=7, sample=1, reward=1.0, status="COMPLETED", attempt=0):
    return Session(task, 0, sample, attempt, [call], status, reward)


SHORT = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", 0)
LONG = Call(list(range(1, 8)), [3, 4], [-0.5, -0.25], "stop", 0)


@pytest.mark.parametrize(
    "sessions, kwargs, message",
    [
        (
            [_one(SHORT, sample=0), _one(LONG)],
            {},
            "session (task 7, group 0, sample 1, attempt 0, COMPLETED): calls 0..0 form a chain "
            "of 9 ids, longer than width 8",
        ),
        (
            [_one(SHORT, task=t, sample=s) for t in range(2) for s in range(3)],
            {"rows": 2},
            "batch 0 (groups (0, 0)..(1, 0)): rows: the chains of 6 training sessions need 3 rows "
            "of width 8, but rows=2",
        ),
        (
            [_one(SHORT, sample=0), _one(SHORT, reward=None)],
            {},
            "session (task 7, group 0, sample 1, attempt 0, COMPLETED): reward is None",
        ),
        (
            [_one(SHORT), _one(SHORT, status="TRUNCATED")],
            {},
            "session (task 7, group 0, sample 1, attempt 0, TRUNCATED): appears twice",
        ),
    ],
    ids=["chain-longer-than-width", "rows-too-few", "no-reward", "duplicate"],
)
def test_bad_sessions_name_the_session(tmp_path, sessions, kwargs, message):
    with pytest.raises(SessionDataError) as info:
        _bad_job(tmp_path, sessions, **kwargs)
    text = str(info.value)
    assert message in text and "\n" not in text and "while running" not in text


def test_bad_files_name_the_file_and_session(tmp_path):
    table = to_arrow([_one(SHORT)])
    broken = pa.RecordBatch.from_arrays(table.columns[:-1], names=table.schema.names[:-1])
    batches.write_parquet(tmp_path / "no_calls.parquet", broken)
    with pytest.raises(
        SessionDataError, match=r"no_calls\.parquet: sessions: missing column 'calls'"
    ):
        run_pack_job(str(tmp_path / "no_calls.parquet"), tmp_path / "out", width=8)
    odd = Call([1, 2], [3], [-0.5], "stop", 0, support=[[3, 5]])
    rows = [session_to_json(_one(odd, task=4, sample=s)) for s in range(3)]
    rows[2]["calls"][0]["support"] = [[5]]  # the wire format keeps it; a Call refuses it
    batches.write_parquet(tmp_path / "odd.parquet", batches.sessions_to_arrow(rows))
    with pytest.raises(SessionDataError) as info:
        run_pack_job(str(tmp_path / "odd.parquet"), tmp_path / "out", width=8, overwrite=True)
    assert str(info.value).startswith(
        f"{tmp_path / 'odd.parquet'}: session (task 4, group 0, sample 2, attempt 0): "
        "Call.support[0]: the sampled id 3 is not in its support [5]"
    )
    row = session_to_json(_one(SHORT, task=4))
    row["calls"][0]["behavior_log_probs"] = [-0.5]
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SessionDataError) as info:
        run_pack_job(str(tmp_path / "bad.jsonl"), tmp_path / "out", width=8, overwrite=True)
    assert str(info.value).startswith(
        f"{tmp_path / 'bad.jsonl'}: session (task 4, group 0, sample 1, attempt 0): calls[0].behavior_log_probs"
    )


def test_arguments_are_checked_before_running(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [_one(SHORT)])
    with pytest.raises(ValueError, match="inputs: no file matches"):
        run_pack_job(str(tmp_path / "none-*.jsonl"), tmp_path / "out", width=8)
    with pytest.raises(ValueError, match="ends in neither"):
        run_pack_job(str(tmp_path / "s.csv"), tmp_path / "out", width=8)
    with pytest.raises(ValueError, match="width is 0; expected an int >= 1"):
        run_pack_job(str(path), tmp_path / "out", width=0)
    with pytest.raises(ValueError, match="estimator: expected one of"):
        run_pack_job(str(path), tmp_path / "out", width=8, estimator="ppo")
    with pytest.raises(ValueError, match="groups_per_batch is 0; expected None or an int >= 1"):
        run_pack_job(str(path), tmp_path / "out", width=8, groups_per_batch=0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "packed-00000-of-00001.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds 1 packed or manifest file"):
        run_pack_job(str(path), tmp_path / "out", width=8)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dew_pipe.cli", "pack", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_pack_writes_the_same_batches(job, tmp_path):
    folder = job["folder"]
    result = _cli(
        "--input", folder / "*.jsonl", "--input", folder / "journal-*.parquet",
        "--output", tmp_path / "out", "--width", WIDTH, "--rows", job["rows"],
        "--groups-per-batch", GROUPS_PER_BATCH, "--estimator", "rloo", "--truncation", "score",
        "--support-capacity", 64,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"packed {len(job['sessions'])} sessions" in result.stdout
    for path, theirs in zip(
        sorted((tmp_path / "out").glob("packed-*.parquet")), job["packed"], strict=True
    ):
        ours = read_packed(path)
        for name, column in theirs.items():
            np.testing.assert_array_equal(ours[name], column, err_msg=name)


def test_cli_pack_bad_data_on_two_workers_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [_one(SHORT, sample=0), _one(LONG)])
    result = _cli("--input", path, "--output", tmp_path / "out", "--width", 8, "--workers", 2)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "dew-pipe: session (task 7, group 0, sample 1, attempt 0, COMPLETED): calls 0..0 form a "
        "chain of 9 ids, longer than width 8"
    )


@pytest.mark.parametrize("module", ["sources", "packing", "journal", "job"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"dew_pipe.beam.{module}"))
    assert result.attempted > 0 and result.failed == 0
