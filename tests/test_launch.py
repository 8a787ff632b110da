"""The launcher on its own (dew_pipe/sandbox/launch.py): a kept-alive JSON-lines worker, and
the sweeps that do not depend on a fleet: the subreaper under the caller's uid, a leased uid
that must start clean."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from sandbox_helpers import DAEMONS, PY, ROOT, alive, py, shared_folder, wait_until

from dew_pipe.sandbox import SandboxLimits
from dew_pipe.sandbox.launch import Launched, lease_uid, run

shared_dir = pytest.fixture(shared_folder)


def test_daemons_are_swept_without_a_uid_of_their_own(tmp_path):
    """The caller's own uid (as when not root): only the subreaper finds the escapees."""
    program = py(DAEMONS)
    program.write(str(tmp_path))
    done = run(program.argv, cwd=str(tmp_path), limits=SandboxLimits(), uid=None)
    pids = [int(line) for line in done.stdout.split()]
    assert done.exit_code == 0 and len(pids) == 2
    assert not any(alive(pid) for pid in pids)


@pytest.mark.skipif(not ROOT, reason="job uids are leased only by root")
def test_a_leased_uid_starts_clean(shared_dir):
    """A stale process of the uid (its supervisor SIGKILLed) dies before the next program."""
    with lease_uid() as uid:
        stale = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"]
        )
        try:
            assert wait_until(lambda: Path(f"/proc/{stale.pid}").stat().st_uid == uid)
            done = run(["true"], cwd=str(shared_dir), limits=SandboxLimits(), uid=uid)
            assert done.exit_code == 0
            assert stale.wait(timeout=5) == -signal.SIGKILL
        finally:
            stale.kill()
            stale.wait()


JSON_WORKER = """
import json, os, sys, time
for line in sys.stdin:
    request = json.loads(line)
    if request.get("hang"):
        time.sleep(60)
    if request.get("huge"):
        print("x" * 100_000, flush=True)
        continue
    if request.get("quit"):
        sys.exit(0)
    print(json.dumps({"pid": os.getpid(), "twice": request["n"] * 2}), flush=True)
"""


def _worker(tmp_path) -> Launched:
    (tmp_path / "worker.py").write_text(JSON_WORKER)
    return Launched([PY, "worker.py"], cwd=str(tmp_path), limits=SandboxLimits())


def _ask(launched: Launched, request: dict) -> dict:
    launched.send(json.dumps(request).encode() + b"\n", timeout=5)
    return json.loads(launched.receive_line(timeout=5, limit=1000))


def test_launched_worker_talks_json_lines_and_outlives_its_starting_thread(tmp_path):
    box: list[Launched] = []
    thread = threading.Thread(target=lambda: box.append(_worker(tmp_path)))
    thread.start()
    thread.join()  # the launching thread has ended (a parent-death signal fires on that)
    time.sleep(0.3)
    with box[0] as launched:
        replies = [_ask(launched, {"n": n}) for n in (1, 2, 3)]
        assert [r["twice"] for r in replies] == [2, 4, 6]
        pid = replies[0]["pid"]
    assert not alive(pid)  # the context's exit stopped it
    assert launched.wait()["stopped"] is True


def test_launched_worker_failures_are_bounded(tmp_path):
    with _worker(tmp_path) as launched:
        pid = _ask(launched, {"n": 1})["pid"]
        launched.send(b'{"huge": true}\n', timeout=5)
        with pytest.raises(ValueError, match="longer than 1000 bytes"):
            launched.receive_line(timeout=5, limit=1000)
        launched.stop()  # a worker that broke the protocol is ended, never resynchronized
    assert not alive(pid)

    with _worker(tmp_path) as launched:
        launched.send(b'{"hang": true}\n', timeout=5)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no whole line within 0.5 s"):
            launched.receive_line(timeout=0.5, limit=1000)
        assert time.monotonic() - start < 2
        with pytest.raises(TimeoutError, match="read none"):  # it no longer reads its stdin
            launched.send(b"z" * (1 << 20), timeout=0.5)

    with _worker(tmp_path) as launched:
        launched.send(b'{"quit": true}\n', timeout=5)
        with pytest.raises(EOFError):
            launched.receive_line(timeout=5, limit=1000)
        assert launched.wait()["exit"] == 0


def test_an_owned_directory_stays_while_the_launcher_lives(tmp_path):
    """owns_cwd hands the directory over only for the launcher's death (test_sandbox kills
    one); a stop or an exit with the launcher alive leaves it to the caller."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "worker.py").write_text(JSON_WORKER)
    with Launched([PY, "worker.py"], cwd=str(work), limits=SandboxLimits(), owns_cwd=True) as w:
        assert _ask(w, {"n": 2})["twice"] == 4
    assert w.wait()["stopped"] is True
    assert (work / "worker.py").is_file()


def test_the_supervisor_tells_a_dying_launcher_by_its_closed_status_pipe():
    """_exec._launcher_gone: a launcher that is still the parent but whose status pipe has no
    reader left is gone (a SIGKILLed launcher closes its files before it is reaped); one
    whose reader is open is not, after the grace; another parent is gone at once."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "_exec_under_test",
        Path(__file__).resolve().parents[1] / "dew_pipe" / "sandbox" / "_exec.py",
    )
    exec_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exec_module)
    gone = exec_module._launcher_gone
    reader, writer = os.pipe()
    try:
        start = time.monotonic()
        assert not gone(os.getppid(), writer, 200)  # the reader is open: the launcher lives
        assert time.monotonic() - start >= 0.15  # it waited its grace for the pipe to close
        assert gone(os.getppid() + 1, writer, 0)  # not the parent any more
        os.close(reader)
        reader = None
        start = time.monotonic()
        assert gone(os.getppid(), writer, 5000)  # no reader left: gone, without the wait
        assert time.monotonic() - start < 1.0
    finally:
        os.close(writer)
        if reader is not None:
            os.close(reader)
