"""Damaged checkpoints: every failure names the step's directory and the way on.

A run saves steps 1 and 2 (``checkpoints/1``, ``checkpoints/2``); each test damages a copy
the way a crash, a full disk or a stray edit would, then resumes. The error must name the
directory and the step, say whether an older complete checkpoint exists (and that moving
the broken step aside resumes from it), and suggest a changed objective or optimizer only
when that is the cause. Following the advice must then work.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from trainer_helpers import MaskedRegression, cycling, make_batch

from dew_pipe import Trainer
from dew_pipe.training import CheckpointError, CheckpointMismatchError

BATCHES = [make_batch(seed) for seed in range(3)]
KEY = jax.random.key(3)
HINT = "objective, optimizer"


def trainer(run_dir: Path | None, **kwargs) -> Trainer:
    options = {"key": KEY, "progress": False, **kwargs}
    if run_dir is not None:
        options.update(run_dir=run_dir, checkpoint_every=1)
    return Trainer(MaskedRegression(), optax.adamw(0.05, weight_decay=0.1), **options)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run directory holding complete checkpoints of steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("saved")
    trainer(run_dir).fit(cycling(BATCHES), steps=2)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    return run_dir


@pytest.fixture
def run_dir(saved, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    path.write_text("{not json", encoding="utf-8")


def clear(path: Path) -> None:
    for child in path.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def truncate_arrays(step: Path) -> None:
    for data in (step / "state" / "d").iterdir():
        empty(data)


DAMAGE = {
    "garbage metadata": (lambda step: garbage(step / "meta" / "metadata"), "its metadata"),
    "empty metadata": (lambda step: empty(step / "meta" / "metadata"), "its metadata"),
    "metadata not an object": (
        lambda step: (step / "meta" / "metadata").write_text("null"),
        "its metadata is NoneType",
    ),
    "no metadata item": (lambda step: shutil.rmtree(step / "meta"), "its metadata"),
    "empty step directory": (clear, "its metadata"),
    "garbage array metadata": (
        lambda step: garbage(step / "state" / "_METADATA"),
        "its array metadata",
    ),
    "no state item": (lambda step: shutil.rmtree(step / "state"), "its array metadata"),
    "truncated array files": (truncate_arrays, "its arrays cannot be read"),
    "empty array manifest": (
        lambda step: empty(step / "state" / "manifest.ocdbt"),
        "its arrays cannot be read",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_newest_step_names_itself_and_the_older_step(run_dir, case):
    damage, what = DAMAGE[case]
    checkpoints = run_dir / "checkpoints"
    damage(checkpoints / "2")
    with pytest.raises(CheckpointError) as caught:
        trainer(run_dir).fit(cycling(BATCHES), steps=3)
    message = str(caught.value)
    assert not isinstance(caught.value, CheckpointMismatchError)
    assert f"checkpoint {checkpoints / '2'} (step 2) cannot be restored: {what}" in message
    assert f"an older complete checkpoint exists, step 1 ({checkpoints / '1'})" in message
    assert f"move {checkpoints / '2'} out of {checkpoints} and fit resumes from step 1" in message
    assert HINT not in message
    assert "\n" not in message


def test_no_older_complete_step_is_said_so(run_dir):
    checkpoints = run_dir / "checkpoints"
    garbage(checkpoints / "1" / "meta" / "metadata")  # the older one is damaged too
    clear(checkpoints / "2")
    with pytest.raises(CheckpointError) as caught:
        trainer(run_dir).fit(cycling(BATCHES), steps=3)
    message = str(caught.value)
    assert f"checkpoint {checkpoints / '2'} (step 2) cannot be restored" in message
    assert f"no older complete checkpoint exists in {checkpoints}" in message
    assert f"remove {checkpoints / '2'} to train from the start" in message
    assert HINT not in message


def test_following_the_advice_resumes_from_the_older_step(run_dir):
    checkpoints = run_dir / "checkpoints"
    clear(checkpoints / "2")
    with pytest.raises(CheckpointError):
        trainer(run_dir).fit(cycling(BATCHES), steps=3)
    shutil.move(checkpoints / "2", run_dir / "broken-2")
    resumed = trainer(run_dir).fit(cycling(BATCHES), steps=3)
    straight = trainer(None).fit(cycling(BATCHES), steps=3)
    assert int(resumed.step) == 3 and int(resumed.updates) == 3
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_changed_setup_hint_appears_when_that_is_the_cause(run_dir):
    changed = Trainer(
        MaskedRegression(ema_decay=0.9),
        optax.adamw(0.05, weight_decay=0.1),
        key=KEY,
        run_dir=run_dir,
        progress=False,
    )
    with pytest.raises(CheckpointMismatchError) as caught:
        changed.fit(cycling(BATCHES), steps=3)
    message = str(caught.value)
    assert f"checkpoint {run_dir / 'checkpoints' / '2'} (step 2) does not match" in message
    assert HINT in message
    assert "ema/params/w is missing from the checkpoint" in message
    other_optimizer = Trainer(
        MaskedRegression(), optax.sgd(0.1), key=KEY, run_dir=run_dir, progress=False
    )
    with pytest.raises(CheckpointMismatchError, match=f"{HINT}.*opt_state/0/count is in the"):
        other_optimizer.fit(cycling(BATCHES), steps=3)


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_faults_checkpoints import BATCHES, trainer
from trainer_helpers import cycling
from dew_pipe.training import CheckpointError
try:
    trainer({run_dir!r}).fit(cycling(BATCHES), steps=3)
except {error} as error:
    print("refused:", error)
else:
    print("resumed")
"""


def run_script(run_dir: Path, error: str) -> subprocess.CompletedProcess:
    code = SCRIPT.format(tests=str(Path(__file__).parent), run_dir=str(run_dir), error=error)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_unreadable_arrays_print_no_event_loop_tracebacks(run_dir):
    # orbax closes its event loop while tensorstore still reads the other arrays; their
    # late reports used to print "RuntimeError: Event loop is closed" tracebacks.
    truncate_arrays(run_dir / "checkpoints" / "2")
    result = run_script(run_dir, "CheckpointError")
    assert result.returncode == 0, result.stderr
    assert "refused: checkpoint" in result.stdout and "(step 2)" in result.stdout
    assert "Event loop is closed" not in result.stderr
    assert "Traceback" not in result.stderr


def _failed_read(function: str, filename: str) -> tuple:
    """exc_info of an error raised inside ``function`` defined in ``filename``."""
    namespace: dict = {}
    source = f"async def {function}():\n    raise ValueError('truncated array')\n"
    exec(compile(source, filename, "exec"), namespace)
    coroutine = namespace[function]()
    try:
        coroutine.send(None)
    except ValueError:
        return sys.exc_info()
    raise AssertionError("the coroutine did not raise")


def test_unretrieved_orbax_reads_are_dropped_and_nothing_else():
    # The other flavour of the race above: asyncio logs a failed read task that nobody
    # awaited ("Task exception was never retrieved") when it is collected. Only records of
    # that message whose traceback runs through orbax's async_deserialize are dropped.
    from dew_pipe.training import checkpoints

    orbax_file = "/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    never = "Task exception was never retrieved\nfuture: <Task finished coro=<...>>"

    def record(message, exc_info):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)

    orbax_read = _failed_read("async_deserialize", orbax_file)
    dropped = record(never, orbax_read)
    kept = [
        record(never, _failed_read("async_deserialize", "/site-packages/mine/io.py")),
        record(never, _failed_read("async_serialize", orbax_file)),
        record("Exception in callback", orbax_read),
        record(never, None),
    ]
    assert checkpoints._is_unretrieved_orbax_read(dropped)
    assert not any(checkpoints._is_unretrieved_orbax_read(r) for r in kept)

    logger = logging.getLogger("asyncio")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        checkpoints._quiet_unretrieved_reads()
        checkpoints._quiet_unretrieved_reads()  # installed once
        quiet = [f for f in logger.filters if isinstance(f, checkpoints._QuietUnretrievedReads)]
        assert len(quiet) == 1
        logger.handle(dropped)
        assert stream.getvalue() == ""
        logger.handle(kept[0])
        assert "truncated array" in stream.getvalue()
    finally:
        logger.removeHandler(handler)


def test_a_file_where_the_checkpoints_go_is_refused_without_a_hang(run_dir):
    # orbax failed only in its background save thread, which then kept the process alive.
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints)
    checkpoints.write_text("not a directory")
    result = run_script(run_dir, "NotADirectoryError")
    assert result.returncode == 0, result.stderr
    assert f"refused: checkpoint directory {checkpoints}: {checkpoints} is a file" in result.stdout
    assert "Traceback" not in result.stderr
