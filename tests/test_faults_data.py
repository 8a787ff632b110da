"""Standing fault suite, part 2: data in and out — Beam pack jobs, packing, model loading,
chat conversations and the trainer (see test_faults.py for the flow runtime and the CLI).

What each case checks: the error names the thing (file, row, message, session, step), the
exit status of the command is the documented one, and nothing half-written is left where a
reader would take it for finished output.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import files_under, one_line, run_cli, run_python

from dew_pipe.beam import SessionDataError, read_manifest, run_pack_job, session_to_json
from dew_pipe.objectives.rl.sessions import Call, Session, pack

HF = Path(__file__).parent / "parity" / "fixtures" / "hf"

# ------------------------------------------------------------------ pack jobs: all or nothing
# (issue 11 item 6): a failed job leaves nothing that looks finished, and runs never mix.

CALL = Call([5, 6], [7, 2], [-0.2, -0.1], "stop", version=3)


def _sessions_file(folder: Path, name: str = "s.jsonl", bad: bool = False) -> Path:
    rows = [session_to_json(Session(0, 0, s, 0, [CALL], "COMPLETED", float(s))) for s in range(4)]
    if bad:
        rows[2]["calls"][0]["behavior_log_probs"] = [-0.5]  # one short of the sampled ids
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p: (folder / p).read_bytes() for p in files_under(folder) if (folder / p).is_file()}


def test_a_successful_job_publishes_with_a_marker_and_no_staging_left(tmp_path):
    summary = run_pack_job(str(_sessions_file(tmp_path)), tmp_path / "out", width=8)
    names = files_under(tmp_path / "out")
    assert names == ["_SUCCESS", "manifest-00000-of-00001.parquet", "packed-00000-of-00001.parquet"]
    marker = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert marker["files"] == ["packed-00000-of-00001.parquet"]
    assert marker["counters"]["sessions_read"] == 4
    assert [Path(f).name for f in summary.files] == marker["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.jsonl"]  # no staging
    assert read_manifest(tmp_path / "out").num_rows == 4


def test_a_failed_job_leaves_no_output_and_no_staging(tmp_path):
    path = _sessions_file(tmp_path, bad=True)
    with pytest.raises(SessionDataError, match="sample 2"):
        run_pack_job(str(path), tmp_path / "out", width=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_a_failed_overwrite_keeps_the_earlier_complete_output(tmp_path):
    good = _sessions_file(tmp_path)
    run_pack_job(str(good), tmp_path / "out", width=8)
    before = _snapshot(tmp_path / "out")
    bad = _sessions_file(tmp_path, "bad.jsonl", bad=True)
    with pytest.raises(SessionDataError):
        run_pack_job(str(bad), tmp_path / "out", width=8, overwrite=True)
    assert _snapshot(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out", "s.jsonl"]


def test_a_rerun_into_the_same_folder_is_refused_or_replaces_it_whole(tmp_path):
    path = _sessions_file(tmp_path)
    run_pack_job(str(path), tmp_path / "out", width=8)
    with pytest.raises(ValueError, match="already holds 3 packed or manifest file"):
        run_pack_job(str(path), tmp_path / "out", width=8)
    (tmp_path / "out" / "notes.txt").write_text("mine")  # not the job's: kept
    summary = run_pack_job(str(path), tmp_path / "out", width=4, rows=8, overwrite=True)
    assert files_under(tmp_path / "out") == [
        "_SUCCESS",
        "manifest-00000-of-00001.parquet",
        "notes.txt",
        "packed-00000-of-00001.parquet",
    ]
    assert summary.rows == 8
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["counters"]["rows"] == 8


def test_reading_a_folder_without_the_marker_is_refused(tmp_path):
    run_pack_job(str(_sessions_file(tmp_path)), tmp_path / "out", width=8)
    (tmp_path / "out" / "_SUCCESS").unlink()  # as a publication cut short would leave it
    with pytest.raises(ValueError, match=r"out has no _SUCCESS marker; the pack job .* not finish"):
        read_manifest(tmp_path / "out")
    assert read_manifest(tmp_path / "out", require_complete=False).num_rows == 4
    with pytest.raises(ValueError, match="already holds 2 packed or manifest"):
        run_pack_job(str(tmp_path / "s.jsonl"), tmp_path / "out", width=8)


def test_a_publication_cut_short_is_not_taken_for_finished_output(tmp_path, monkeypatch):
    from apache_beam.io.filesystems import FileSystems

    path = _sessions_file(tmp_path)
    run_pack_job(str(path), tmp_path / "out", width=8)
    rename = FileSystems.rename

    def first_only(sources, targets):  # publishing: the disk fills up after the first file
        if Path(targets[0]).parent != tmp_path / "out":
            return rename(sources, targets)  # Beam's own renames inside the staging folder
        rename(sources[:1], targets[:1])
        raise OSError("No space left on device")

    monkeypatch.setattr(FileSystems, "rename", first_only)
    with pytest.raises(OSError, match="No space left"):
        run_pack_job(str(path), tmp_path / "out", width=4, rows=8, overwrite=True)
    assert "_SUCCESS" not in files_under(tmp_path / "out")
    with pytest.raises(ValueError, match="no _SUCCESS marker"):
        read_manifest(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.jsonl"]  # staging removed


def test_a_job_killed_before_publishing_leaves_only_its_hidden_staging_folder(tmp_path):
    path = _sessions_file(tmp_path)
    code = """
import os, signal, sys
from dew_pipe.beam import job
job._publish = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # dies with all staged
job.run_pack_job(sys.argv[1], sys.argv[2], width=8)
"""
    result = run_python(code, str(path), str(tmp_path / "out"), deadline=60)
    assert result.returncode == -9
    assert not (tmp_path / "out").exists()
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.staging-")]
    assert "_SUCCESS" in files_under(staging)  # complete, but never published
    run_pack_job(str(path), tmp_path / "out", width=8)  # a rerun is not confused by it
    assert read_manifest(tmp_path / "out").num_rows == 4


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("s.jsonl", "{not json\n", r"s\.jsonl"),
        ("s.parquet", "not parquet", r"s\.parquet: not a readable Parquet file"),
        ("s.jsonl", '{"task": 1}\n', r"s\.jsonl"),
    ],
    ids=["jsonl_garbage", "parquet_garbage", "jsonl_missing_fields"],
)
def test_unreadable_session_files_are_named_and_leave_nothing(name, text, message, tmp_path):
    (tmp_path / name).write_text(text)
    with pytest.raises((SessionDataError, ValueError), match=message):
        run_pack_job(str(tmp_path / name), tmp_path / "out", width=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ValueError, match=r"out is a file; expected a folder"):
        run_pack_job(str(_sessions_file(tmp_path)), tmp_path / "out", width=8)
    assert (tmp_path / "out").read_text() == "x"


def test_the_same_session_twice_in_a_job_is_named(tmp_path):
    path = _sessions_file(tmp_path)
    shutil.copy(path, tmp_path / "t.jsonl")
    with pytest.raises(SessionDataError, match="sample 0"):
        run_pack_job(str(tmp_path / "*.jsonl"), tmp_path / "out", width=8)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case, args, code, message",
    [
        ("bad_data", ["--width", 8], 1, "sample 2"),
        ("output_is_file", ["--width", 8], 2, "is a file"),
        ("no_input", ["--width", 8], 2, "no file matches"),
        ("width", ["--width", 0], 2, "width"),
        ("estimator", ["--width", 8, "--estimator", "ppo"], 2, "estimator"),
    ],
)
def test_cli_pack_errors_are_one_line_and_leave_nothing(case, args, code, message, tmp_path):
    inputs = _sessions_file(tmp_path, bad=case == "bad_data")
    if case == "no_input":
        inputs = tmp_path / "none-*.jsonl"
    if case == "output_is_file":
        (tmp_path / "out").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli("pack", "--input", inputs, "--output", tmp_path / "out", *args, deadline=60)
    assert result.returncode == code, result.stderr
    assert message in one_line(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ------------------------------------------------------------------ pack(): bad sessions


def _session(sample, calls=(CALL,), reward=1.0, status="COMPLETED"):
    return Session(0, 0, sample, 0, list(calls), status, reward)


@pytest.mark.parametrize(
    "sessions, kwargs, error, message",
    [
        (
            [_session(0), _session(1), _session(0)],
            {},
            ValueError,
            r"sessions\[2\] .* sessions\[0\]",
        ),
        ([_session(0)], {"width": 3}, ValueError, "width"),
        ([_session(s) for s in range(4)], {"rows": 1}, ValueError, "need 2 rows"),
        ([_session(0, reward=None)], {}, ValueError, "reward"),
        (["not a session"], {}, TypeError, "Session"),
        ([_session(0)], {"estimator": "ppo"}, ValueError, "estimator"),
    ],
    ids=["duplicate", "too_wide", "too_few_rows", "no_reward", "not_a_session", "estimator"],
)
def test_pack_refuses_bad_sessions_naming_them(sessions, kwargs, error, message):
    kwargs = {"width": 8, **kwargs}
    with pytest.raises(error, match=message):
        pack(sessions, **kwargs)


# ------------------------------------------------------------------ model loading (item 8)


def _copy(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(HF / name, target)
    return target


def _truncate(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


@pytest.mark.parametrize(
    "keep",
    [lambda n: 0, lambda n: 5, lambda n: 100, lambda n: n // 2, lambda n: n - 1],
    ids=["empty", "in_length", "in_header", "half", "last_byte"],
)
def test_a_truncated_safetensors_file_is_named(keep, tmp_path):
    from dew_pipe.models import load_pretrained

    directory = _copy("llama_gqa_untied", tmp_path)
    _truncate(directory / "model.safetensors", keep)
    with pytest.raises(ValueError, match="looks truncated or corrupt") as info:
        load_pretrained(directory)
    assert str(directory / "model.safetensors") in str(info.value)


def test_a_corrupt_shard_of_a_sharded_checkpoint_is_named(tmp_path):
    from dew_pipe.models import load_pretrained

    directory = _copy("qwen3_untied_sharded", tmp_path)
    (directory / "model-00002-of-00003.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors \(64 bytes\)"):
        load_pretrained(directory)


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda d: (d / "config.json").write_text("{not json"), ValueError, "config.json is not"),
        (lambda d: (d / "config.json").unlink(), FileNotFoundError, "has no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "neither"),
    ],
    ids=["config_not_json", "no_config", "no_weights"],
)
def test_broken_checkpoint_files_are_named(edit, error, message, tmp_path):
    from dew_pipe.models import load_pretrained

    directory = _copy("llama_gqa_untied", tmp_path)
    edit(directory)
    with pytest.raises(error, match=message):
        load_pretrained(directory)


# ------------------------------------------------------------------ chat conversations (item 9)


@pytest.fixture(scope="module")
def tokenizer():
    from dew_pipe.data.tokenizer import build_tokenizer

    return build_tokenizer(["What is two plus two? Four. Hi"] * 10, vocab_size=300)


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize(
    "message, expected",
    [
        ({"role": "assistant", "content": 4}, r"message 1 \(assistant\) has content int 4"),
        ({"role": "assistant", "content": {"text": "Four"}}, r"message 1 \(assistant\) .*dict"),
        ({"role": "assistant", "content": True}, r"message 1 \(assistant\) has content bool"),
        ({"role": "assistant", "content": None}, r"message 1 \(assistant\) has content None"),
        ({"role": "assistant"}, r"message 1 \(assistant\) has no content"),
        ({"role": "user", "content": None, "tool_calls": [{}]}, r"message 1 \(user\)"),
        (
            {"role": "assistant", "content": [{"type": "image_url", "image_url": "x.png"}]},
            r"message 1 \(assistant\): content part 0 is a dict of type 'image_url'",
        ),
        ({"role": "tool", "content": ["ok", 3]}, r"message 1 \(tool\): content part 1 is int"),
        ("Four.", r"message 1 is str 'Four.'; expected a mapping"),
        (None, r"message 1 is NoneType"),
    ],
    ids=[
        "number",
        "dict",
        "bool",
        "none",
        "missing",
        "none_on_user_with_tool_calls",
        "image_part",
        "list_with_number",
        "string_message",
        "none_message",
    ],
)
def test_chat_content_that_is_not_text_is_refused_naming_message_and_role(
    message, expected, tokenizer
):
    from dew_pipe.data.chat import tokenize_conversation

    with pytest.raises(ValueError, match=expected) as info:
        tokenize_conversation(tokenizer, [USER, message], where="row 7 of 'chat.jsonl'")
    assert str(info.value).startswith("row 7 of 'chat.jsonl': ")


def test_chat_content_that_templates_define_is_kept(tokenizer):
    from dew_pipe.data.chat import Role, tokenize_conversation

    plain = tokenize_conversation(tokenizer, [USER, {"role": "assistant", "content": "Four."}])
    parts = [{"type": "text", "text": "Fo"}, "ur."]
    listed = tokenize_conversation(tokenizer, [USER, {"role": "assistant", "content": parts}])
    np.testing.assert_array_equal(plain[0], listed[0])
    np.testing.assert_array_equal(plain[1], listed[1])
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    for content in ({"content": None}, {}):
        message = {"role": "assistant", "tool_calls": [call], **content}
        ids, roles = tokenize_conversation(tokenizer, [USER, message])
        assert "<tool_call>" in tokenizer.decode(ids[roles == Role.ASSISTANT])


def _chat_file(tmp_path, rows):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_ROW = {"messages": [USER, {"role": "assistant", "content": "Four."}]}


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"messages": [USER, {"role": "assistant", "content": 4}]},
            r"row 1 of .*chat.jsonl' \(line 2\): message 1 \(assistant\) has content int 4",
        ),
        ({"messages": [USER, 4]}, r"row 1 \(line 2\).*messages\[1\] is int"),
        ("{not json", r"line 2: not valid JSON"),
        ({"text": "no messages"}, r"row 1 \(line 2\).* has no 'messages'"),
        ({"messages": []}, r"row 1 \(line 2\).*non-empty list"),
        ({"messages": [{"role": "assistant", "content": "Four."}]}, r"starts with a 'assistant'"),
        ({"messages": [{"role": "narrator", "content": "x"}]}, r"role 'narrator'"),
    ],
    ids=["content", "message", "json", "no_column", "empty", "assistant_first", "role"],
)
def test_chat_file_errors_name_the_row(bad, message, tokenizer, tmp_path):
    from dew_pipe.data.chat import ChatMessages

    path = _chat_file(tmp_path, [GOOD_ROW, bad])
    with pytest.raises(ValueError, match=message):
        ChatMessages(tokenizer, path, seq_len=63).load(batch=2)


def test_chat_over_long_conversation_and_tokenizer_without_template(tokenizer, tmp_path):
    from dew_pipe.data.chat import ChatMessages

    long = {"messages": [USER, {"role": "assistant", "content": "Four. " * 40}]}
    path = _chat_file(tmp_path, [GOOD_ROW, long])
    with pytest.raises(ValueError, match=r"row 1 .* tokens, longer than seq_len \+ 1 = 32"):
        ChatMessages(tokenizer, path, seq_len=31).load(batch=2)
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        ChatMessages(plain, path, seq_len=15)


# ------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def regression():
    import jax
    import optax
    from trainer_helpers import MaskedRegression, make_batch

    from dew_pipe import Trainer

    return Trainer, MaskedRegression, make_batch, optax, jax.random.key(0)


def test_train_step_on_zero_rows_is_refused_and_changes_nothing(regression):
    Trainer, MaskedRegression, make_batch, optax, key = regression
    trainer = Trainer(MaskedRegression(), optax.adamw(0.1, weight_decay=0.5), key=key)
    state = trainer.initial_state()
    empty = {k: v[:0] for k, v in make_batch(0).items()}
    with pytest.raises(ValueError, match="has 0 rows"):
        trainer.train_step(state, empty)
    assert int(state.updates) == 0  # not donated: still readable


def test_a_nan_loss_stops_training_naming_the_step(regression):
    from dew_pipe import Dataset
    from dew_pipe.training import NonFiniteError

    Trainer, MaskedRegression, make_batch, optax, key = regression
    bad = make_batch(2)
    bad["y"][0, 0], bad["mask"] = np.nan, np.ones_like(bad["mask"])
    batches = [make_batch(0), bad]
    data = Dataset(train=lambda p: itertools.cycle(batches), batch=8)
    with pytest.raises(NonFiniteError, match="at step 2") as info:
        Trainer(MaskedRegression(), optax.sgd(0.1), key=key).fit(data, steps=3)
    assert int(info.value.state.step) == 1


def test_a_batch_of_the_wrong_size_names_the_field(regression):
    from dew_pipe import Dataset

    Trainer, MaskedRegression, make_batch, optax, key = regression
    data = Dataset(train=lambda p: itertools.repeat(make_batch(0, rows=4)), batch=8)
    with pytest.raises(ValueError, match=r"training batch 1 has 4 rows \(field 'x'\)"):
        Trainer(MaskedRegression(), optax.sgd(0.1), key=key).fit(data, steps=1)


def test_a_run_dir_that_is_a_file_is_refused(regression, tmp_path):
    from dew_pipe import Dataset

    Trainer, MaskedRegression, make_batch, optax, key = regression
    (tmp_path / "run").write_text("x")
    data = Dataset(train=lambda p: itertools.repeat(make_batch(0)), batch=8)
    with pytest.raises((ValueError, OSError), match=re.escape(str(tmp_path / "run"))):
        trainer = Trainer(
            MaskedRegression(), optax.sgd(0.1), key=key, run_dir=tmp_path / "run",
            checkpoint_every=1,
        )  # fmt: skip
        trainer.fit(data, steps=1)
    assert (tmp_path / "run").read_text() == "x"
