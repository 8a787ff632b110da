"""`HarborSource`: sessions that are Harbor trials, their calls read back from the gateway.

Each submitted sample runs one Harbor trial of the task's Harbor task directory: Harbor
starts the task's environment, runs the agent (the harness) and then the task's verifier,
whose ``reward`` is the session's reward. The agent reaches the model through
rllm-model-gateway at ``{sandbox_url}/sessions/{session}/v1`` (Harbor's ``agent.base_url``,
what ``harbor trials start --base-url`` sets), one gateway session per trial, so the
session's `Call` records are exactly the gateway's traces of that trial: the engine's
prompt ids, sampled ids and log-probabilities, never retokenized text.

Harbor (0.25.0) needs Python >= 3.12 and lives in its own environment; ``harbor`` is that
environment's interpreter, which runs ``harbor_runner.py`` beside this file, one process per
trial. Harbor classifies a failed trial itself (its ``FailureCause``), and the status
follows it:

- COMPLETED: no failure, and the verifier gave a reward.
- TRUNCATED: the agent ran out of its budget (time, context or output tokens); the reward
  is kept when Harbor counts it valid.
- AGENT_ERROR: the agent refused the task; trained on its reward.
- CANCELLED: `HarborSource.cancel`, or Harbor cancelled the trial.
- INFRA_ERROR: anything else (sandbox, model provider, verifier, Harbor itself, a trial
  process that died or outlived ``trial_timeout``, traces that could not be read); never
  trained, and schedulers retry it. A gateway whose worker went dead answers the agent's
  calls with a plain 500, so its trials land here.

Before the first submission the source waits for the gateway (`Gateway.ready`), so a
gateway without a healthy worker fails the run at once instead of turning every trial into
an INFRA_ERROR.

Security defaults: the gateway must be on loopback unless declared trusted (see `Gateway`);
harnesses that run inside the sandbox (installed agents) must reach the model only through
a path-restricted proxy given as ``sandbox_url``, with the task's agent phase restricted to
that proxy by Harbor's ``network_mode = "allowlist"`` (README, "Harbor trials").
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import json
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew_pipe._pool import WorkerPool
from dew_pipe._validate import check_float, check_int
from dew_pipe.objectives.rl.gateway import Gateway, GatewayError
from dew_pipe.objectives.rl.session_records import Call, Session, Status, Task

__all__ = ["Gateway", "GatewayError", "HarborSource"]

RUNNER = Path(__file__).with_name("harbor_runner.py")
_STDERR_TAIL = 4000  # characters of a failed trial process's stderr kept in the detail
_KILL_GRACE = 15.0  # seconds a cancelled trial gets to stop its environment before SIGKILL


def _task_path(task: Any) -> Path:
    if not isinstance(task, Task):
        raise TypeError(f"task is {type(task).__name__}; expected a sessions.Task")
    data = task.data
    if isinstance(data, Mapping):
        if "path" not in data:
            raise ValueError(
                f"task {task.id}: data has keys {sorted(map(str, data))}; expected 'path', "
                "a Harbor task directory"
            )
        data = data["path"]
    if not isinstance(data, str | os.PathLike):
        raise TypeError(
            f"task {task.id}: data is {type(data).__name__}; expected the path of a Harbor "
            "task directory (or {'path': ...})"
        )
    path = Path(data).resolve()
    if not (path / "task.toml").is_file():
        raise ValueError(f"task {task.id}: {path} is not a Harbor task (no task.toml)")
    return path


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``extra``, nested mappings merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _plugin(field: str, value: Any) -> dict[str, str]:
    """A Harbor agent/environment given by name or by ``module:Class`` import path."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{field}: expected a Harbor name or 'module:Class', got {value!r}")
    key = "import_path" if ":" in value else ("name" if field == "agent" else "type")
    return {key: value}


def status_of(outcome: Mapping[str, Any]) -> tuple[Status, float | None, str]:
    """The session status, reward and detail of one trial outcome (``harbor_runner``'s line).

    Example:
        >>> status_of({"cause": None, "reward": 1.0})
        (<Status.COMPLETED: 'completed'>, 1.0, '')
        >>> status_of({"cause": "sandbox_failed", "reward": None, "exception": "HealthcheckError",
        ...            "message": "no shell"})[:2]
        (<Status.INFRA_ERROR: 'infra_error'>, None)
    """
    cause, reward = outcome.get("cause"), outcome.get("reward")
    detail = ""
    if outcome.get("exception"):
        detail = f"{cause}: {outcome['exception']}: {outcome.get('message') or ''}".strip()
    valid = bool(outcome.get("reward_valid", cause is None))
    if cause is None:
        if reward is None:
            return Status.INFRA_ERROR, None, "the verifier reported no 'reward'"
        return Status.COMPLETED, float(reward), detail
    if cause == "agent_exhausted_budget":
        return Status.TRUNCATED, (float(reward) if valid and reward is not None else None), detail
    if cause == "agent_refused_task" and reward is not None:
        return Status.AGENT_ERROR, float(reward), detail
    if cause == "cancelled":
        return Status.CANCELLED, None, detail
    return Status.INFRA_ERROR, None, detail or f"harbor reported {cause}"


class _Trial:
    __slots__ = ("attempt", "future", "group", "name", "process", "sample", "stop", "task")

    def __init__(self, task: Task, group: int, sample: int, attempt: int) -> None:
        self.task, self.group, self.sample, self.attempt = task, group, sample, attempt
        self.name = f"dew-t{task.id}-g{group}-s{sample}-a{attempt}-{uuid.uuid4().hex[:8]}"
        self.future: cf.Future[Session] = cf.Future()
        self.process: subprocess.Popen | None = None
        self.stop = threading.Event()

    def session(self, status: Status, calls=(), reward=None, detail: str = "") -> Session:
        return Session(
            self.task.id, self.group, self.sample, self.attempt, calls, status, reward,
            detail=f"trial {self.name}: {detail}" if detail else f"trial {self.name}",
        )  # fmt: skip


class HarborSource:
    """A `SessionSource` whose sessions are Harbor trials reaching the model via a gateway.

    Args:
        gateway: the `Gateway` the harness's calls go through (its ``sandbox_url`` is what
            the harness is given).
        harbor: the Python interpreter of the environment Harbor is installed in.
        model: the model name the agent asks for (the gateway worker's model name).
        trials: the directory Harbor writes each trial's folder into (created).
        agent: Harbor's agent: a name (``"terminus-2"``) or an import path
            (``"package.module:AgentClass"``).
        environment: Harbor's environment: a type (``"docker"``) or an import path.
        config: further Harbor ``TrialConfig`` fields, merged into what the source writes
            (``{"agent": {"kwargs": {...}}, "timeout_multiplier": 2.0}``...).
        env: variables added to each Harbor process's environment (``PYTHONPATH`` for
            plugins, credentials the harness needs). Harbor's usage telemetry is off
            (``HARBOR_TELEMETRY=0``) unless the environment sets it.
        workers: trials running at once.
        weights: the scheduler's publisher (anything with an int ``version``); calls whose
            trace carries no version (a gateway that does not stamp, such as
            rllm-model-gateway 0.1.0) get the version it served at submission. None: every
            trace must carry its own.
        ready_timeout: seconds `Gateway.ready` may wait before the first submission.
        trial_timeout: seconds one trial process may run before it is killed (an
            INFRA_ERROR); Harbor's own agent and verifier timeouts normally end it sooner.

    Raises:
        TypeError / ValueError: a bad argument (naming it).

    Example:
        >>> source = HarborSource(Gateway("http://127.0.0.1:9090"), harbor=".harbor-venv/bin/python",
        ...     model="Qwen/Qwen3-0.6B", trials="runs/trials", agent="terminus-2")  # doctest: +SKIP
        >>> source.submit(Task(0, "tasks/hello"), group=0, sample=0, attempt=0).result()  # doctest: +SKIP
    """

    def __init__(
        self,
        gateway: Gateway,
        *,
        harbor: str | os.PathLike[str],
        model: str,
        trials: str | os.PathLike[str],
        agent: str,
        environment: str = "docker",
        config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        workers: int = 4,
        weights: Any = None,
        ready_timeout: float = 300.0,
        trial_timeout: float = 3600.0,
    ) -> None:
        if not isinstance(gateway, Gateway):
            raise TypeError(f"gateway is {type(gateway).__name__}; expected a Gateway")
        self.gateway = gateway
        self.harbor = Path(harbor)
        if not (self.harbor.is_file() and os.access(self.harbor, os.X_OK)):
            raise ValueError(
                f"harbor: {str(harbor)!r} is not an executable file; expected the Python "
                "interpreter of the environment Harbor is installed in"
            )
        if not isinstance(model, str) or not model:
            raise TypeError(f"model: expected a nonempty str, got {model!r}")
        self.model = model
        self.trials = Path(trials).resolve()
        self.trials.mkdir(parents=True, exist_ok=True)
        self._agent = _plugin("agent", agent)
        self._environment = _plugin("environment", environment)
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config: expected a mapping of TrialConfig fields, got {config!r}")
        self.config = dict(config or {})
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()
        ):
            raise TypeError(f"env: expected a mapping of str to str, got {env!r}")
        self.env = dict(env or {})
        if weights is not None:
            check_int("weights.version", getattr(weights, "version", None), minimum=0)
        self.weights = weights
        self.workers = check_int("workers", workers, minimum=1)
        self.ready_timeout = check_float("ready_timeout", ready_timeout, minimum=0.0)
        self.trial_timeout = check_float("trial_timeout", trial_timeout, above=0.0)
        self._pool = WorkerPool(self.workers, name="harbor-trial")
        self._lock = threading.Lock()
        self._pending: dict[cf.Future, _Trial] = {}
        self._ready = False
        self._closed = False

    # ------------------------------------------------------------------ SessionSource

    def submit(self, task: Task, *, group: int, sample: int, attempt: int) -> cf.Future[Session]:
        """Starts one trial of ``task`` (its data: a Harbor task directory); returns at once.

        Raises:
            TypeError / ValueError: a task that is not a Harbor task directory, bad identity.
            GatewayError: the first submission found the gateway not ready.
            RuntimeError: the source is closed.
        """
        path = _task_path(task)
        trial = _Trial(
            task,
            check_int("group", group),
            check_int("sample", sample, minimum=0),
            check_int("attempt", attempt, minimum=0),
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the HarborSource is closed")
            if not self._ready:  # under the lock: one readiness wait, later submits queue
                self.gateway.ready(self.ready_timeout)
                self._ready = True
            self._pending[trial.future] = trial
        version = None if self.weights is None else int(self.weights.version)
        self._pool.submit(self._run, trial, path, version)
        return trial.future

    def cancel(self, future: cf.Future[Session]) -> None:
        """Stops the trial behind ``future``; it resolves CANCELLED at once.

        The trial's process gets SIGTERM (Harbor then stops the environment) and SIGKILL
        after a grace period. Unknown or finished futures are left alone.
        """
        with self._lock:
            trial = self._pending.pop(future, None)
        if trial is None:
            return
        trial.stop.set()
        _terminate(trial.process)
        self._set(trial, trial.session(Status.CANCELLED, detail="cancelled by the caller"))

    def close(self) -> None:
        """Cancels unfinished trials and waits for their threads; the gateway stays up."""
        with self._lock:
            self._closed = True
            futures = list(self._pending)
        for future in futures:
            self.cancel(future)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> HarborSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one trial

    def trial_config(self, trial_name: str, task_path: Path) -> dict[str, Any]:
        """The Harbor ``TrialConfig`` (as JSON data) of one trial."""
        config = {
            "task": {"path": str(task_path)},
            "trial_name": trial_name,
            "trials_dir": str(self.trials),
            "agent": {
                **self._agent,
                "model_name": self.model,
                "base_url": self.gateway.session_url(trial_name),
            },
            "environment": dict(self._environment),
        }
        return _merge(config, self.config)

    def _run(self, trial: _Trial, path: Path, version: int | None) -> None:
        try:
            session = self._trial(trial, path, version)
        except BaseException as error:  # a bug here breaks the source: say so to the caller
            with self._lock:
                self._pending.pop(trial.future, None)
            with contextlib.suppress(cf.InvalidStateError):
                trial.future.set_exception(error)
            return
        with self._lock:
            self._pending.pop(trial.future, None)
        self._set(trial, session)

    def _trial(self, trial: _Trial, path: Path, version: int | None) -> Session:
        config_file = self.trials / f"{trial.name}.config.json"
        config_file.write_text(json.dumps(self.trial_config(trial.name, path), indent=2))
        if trial.stop.is_set():
            return trial.session(Status.CANCELLED, detail="cancelled before it started")
        outcome, failure = self._process(trial, config_file)
        if trial.stop.is_set():
            with contextlib.suppress(GatewayError):
                self.gateway.delete(trial.name)
            return trial.session(Status.CANCELLED, detail="cancelled by the caller")
        try:
            calls: tuple[Call, ...] = self.gateway.calls(trial.name, version=version)
        except GatewayError as error:
            return trial.session(Status.INFRA_ERROR, detail=f"reading its calls: {error}")
        with contextlib.suppress(GatewayError):  # the calls are read; a stale session is harmless
            self.gateway.delete(trial.name)
        if failure:
            return trial.session(Status.INFRA_ERROR, calls, detail=failure)
        status, reward, detail = status_of(outcome)
        return trial.session(status, calls, reward, detail)

    def _process(self, trial: _Trial, config_file: Path) -> tuple[dict[str, Any], str]:
        """Runs the trial process; (its outcome line, "") or ({}, what went wrong)."""
        # -P: not the runner's own folder on sys.path, where this module would shadow harbor
        command = [str(self.harbor), "-P", str(RUNNER), str(config_file)]
        env = {"HARBOR_TELEMETRY": "0", **os.environ, **self.env}  # no usage reports unless asked
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.trials,
            start_new_session=True,  # its own group: cancel and timeouts kill all of it
        )
        trial.process = process
        if trial.stop.is_set():
            _terminate(process)
        try:
            out, err = process.communicate(timeout=self.trial_timeout)
        except subprocess.TimeoutExpired:
            _kill(process)
            out, err = process.communicate()
            return {}, f"the trial process outlived trial_timeout={self.trial_timeout:g} s"
        lines = out.decode(errors="replace").strip().splitlines()
        tail = err.decode(errors="replace")[-_STDERR_TAIL:]
        try:
            outcome = json.loads(lines[-1]) if lines else None
        except ValueError:
            outcome = None
        if process.returncode != 0 or not isinstance(outcome, dict):
            return {}, (
                f"the trial process exited with status {process.returncode} without an "
                f"outcome; stderr: {tail}"
            )
        return outcome, ""

    @staticmethod
    def _set(trial: _Trial, session: Session) -> None:
        with contextlib.suppress(cf.InvalidStateError):  # cancelled meanwhile
            trial.future.set_result(session)


def _kill(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _terminate(process: subprocess.Popen | None) -> None:
    """SIGTERM to the trial's group now, SIGKILL after the grace period if still running."""
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    timer = threading.Timer(_KILL_GRACE, _kill, args=(process,))
    timer.daemon = True
    timer.start()
