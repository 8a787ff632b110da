"""The square tool as a real worker process, shared by the subprocess-episode tests
(test_sandbox, test_episode_recovery, test_faults_episodes).

``SQUARE_WORKER`` speaks the JSON-lines protocol of
:mod:`dew_pipe.objectives.rl.subprocess_environment` and plays the in-memory
``test_tool_episodes.Harness``: ``reset`` shows ``[USER, q(x)]`` (x = task % 4), a
``[CALL, EOS]`` turn returns the context extended by the turn, RESULT and d(x*x), any other
turn completes the episode with its ids (EOS dropped) as the detail. Its reset detail is its
pid, so a test can check that it is gone. Its state (episode, x, calls) is JSON in base64.

Environment variables select the rest:

* ``FAULT=<what>:<request>``: misbehave on the first request of that type (reset, step,
  get_state, set_state): ``hang``, ``memory`` (allocate 1 GiB), ``cpu`` (spin), ``crash``
  (SIGSEGV), ``garbage`` (a line that is not JSON), ``huge`` (a 100 kB line), ``error``
  (an error reply), ``extra`` (an unknown field), ``badcontext`` (ids that are not ints),
  ``noack`` (set_state answered without the acknowledgment), ``exit`` (exit 3, a message
  on stderr).
* ``AUDIT=<path>``: append one JSON line per completed square call (just before its reply).
* ``PAUSE=<path>`` with ``PAUSE_AT=<step>:<sample>``: on that episode's square call, create
  the file and sleep forever, unless the file exists already (so a restarted run passes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sandbox_helpers import PY, alive

from dew_pipe.objectives.rl import SubprocessEnvironment
from dew_pipe.sandbox import SandboxLimits

SQUARE_WORKER = r"""
import base64, json, os, signal, sys, time

USER, CALL, EOS, RESULT, Q0, D0 = 2, 3, 1, 4, 5, 9
what, _, on = os.environ.get("FAULT", "").partition(":")
audit, pause = os.environ.get("AUDIT"), os.environ.get("PAUSE")
pause_at = os.environ.get("PAUSE_AT", "")
state = {}


def send(reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def misbehave():
    global what
    fault, what = what, ""
    if fault == "hang":
        time.sleep(3600)
    if fault == "memory":
        hoard = bytearray(1 << 30)
    if fault == "cpu":
        while True:
            pass
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit":
        sys.stderr.write("the tool lost its database\n")
        sys.exit(3)
    if fault == "garbage":
        sys.stdout.write("this is not json\n")
    if fault == "huge":
        send({"context": [1] * 50000})
    if fault == "error":
        send({"error": "the tool is down"})
    if fault == "extra":
        send({"context": [2, 5], "contexts": [2, 5]})
    if fault == "badcontext":
        send({"context": [2.5, 5]})
    if fault == "noack":
        send({"restored": False})
    sys.stdout.flush()


for line in sys.stdin:
    request = json.loads(line)
    kind = request["type"]
    if kind == on and what:
        misbehave()
        continue
    if kind == "reset":
        episode = request["episode"]
        state = {"episode": episode, "x": episode["task"] % 4, "calls": 0}
        send({"context": [USER, Q0 + state["x"]], "detail": str(os.getpid())})
    elif kind == "step":
        tokens, context = request["tokens"], request["context"]
        if tokens != [CALL, EOS]:
            send({"status": "completed", "detail": " ".join(map(str, tokens[:-1]))})
            continue
        episode = state["episode"]
        if pause and pause_at == f"{episode['step']}:{episode['sample']}":
            if not os.path.exists(pause):
                open(pause, "w").close()
                time.sleep(3600)
        state["calls"] += 1
        if audit:
            with open(audit, "a") as log:
                record = {**episode, "call": state["calls"], "context": context}
                log.write(json.dumps(record) + "\n")
                log.flush()
                os.fsync(log.fileno())
        send({"context": [*context, *tokens, RESULT, D0 + state["x"] ** 2]})
    elif kind == "get_state":
        send({"state": base64.b64encode(json.dumps(state).encode()).decode()})
    elif kind == "set_state":
        state = json.loads(base64.b64decode(request["state"]))
        send({"restored": True})
"""

LIMITS = SandboxLimits(cpu_seconds=5, memory_bytes=256 * 2**20, wall_seconds=20)


def write_worker(folder: Path) -> Path:
    """Writes the square worker into ``folder``; returns its path."""
    path = Path(folder) / "square_worker.py"
    path.write_text(SQUARE_WORKER)
    return path


def square_environment(
    folder: Path, limits: SandboxLimits = LIMITS, **env: str
) -> SubprocessEnvironment:
    """A SubprocessEnvironment running the square worker with ``env`` (FAULT, AUDIT...)."""
    python = PY if Path(PY).exists() else sys.executable
    return SubprocessEnvironment([python, str(write_worker(folder))], limits, env=env)


def live_workers(folder: Path) -> list[int]:
    """Pids of the live square workers written into ``folder`` (their script is on their
    command line)."""
    script = str(Path(folder) / "square_worker.py").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if script in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
