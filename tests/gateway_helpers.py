"""A real rllm-model-gateway on loopback for the gateway and Harbor tests.

What it runs: rllm-model-gateway 0.1.0 (PyPI) from its own environment,
``benchmarks/agent_envs.sh`` builds it in ``.gateway-venv`` (``.ci/run`` calls it;
``DEW_PIPE_GATEWAY_PYTHON`` points at another interpreter), configured as the spec's
example is (memory store, traces stored before the reply) in front of worker URLs the test
gives, usually the shared vLLM engine of ``tests/vllm_helpers.py``::

    with start_gateway([vllm_engine.url + "/v1"], tmp_path) as gateway:
        Gateway(gateway.url).ready(60)

Harbor runs from ``.harbor-venv`` (``DEW_PIPE_HARBOR_PYTHON``), which needs Python 3.12.
Without an interpreter the tests skip saying why; under CI (``CI`` set) they fail instead,
so a CI run never passes without the real components.

Every step has a deadline: the gateway must answer ``/health`` within `READY_S`, and
stopping it sends SIGTERM, then SIGKILL after `STOP_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from vllm_helpers import free_port, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
HARBOR_PLUGINS = Path(__file__).resolve().parent / "harbor"
READY_S = 60.0
STOP_S = 10.0


def _interpreter(variable: str, folder: str) -> Path | None:
    named = os.environ.get(variable)
    path = Path(named) if named else ROOT / folder / "bin" / "python"
    return path if path.is_file() else None


def gateway_python() -> Path | None:
    """``$DEW_PIPE_GATEWAY_PYTHON`` or ``.gateway-venv/bin/python``."""
    return _interpreter("DEW_PIPE_GATEWAY_PYTHON", ".gateway-venv")


def stamping_gateway_python() -> Path | None:
    """``$DEW_PIPE_STAMPING_GATEWAY_PYTHON``: a gateway with ``/admin/weight_version``.

    PyPI has only rllm-model-gateway 0.1.0, which predates the route; a stamping gateway
    can only be installed from the rllm repository's rllm-model-gateway folder, so the
    tests that need one run only where this variable names its interpreter.
    """
    named = os.environ.get("DEW_PIPE_STAMPING_GATEWAY_PYTHON")
    return Path(named) if named and Path(named).is_file() else None


def harbor_python() -> Path | None:
    """``$DEW_PIPE_HARBOR_PYTHON`` or ``.harbor-venv/bin/python``."""
    return _interpreter("DEW_PIPE_HARBOR_PYTHON", ".harbor-venv")


def python312_present() -> bool:
    """Whether this machine has a Python 3.12 for Harbor (as benchmarks/agent_envs.sh looks)."""
    import glob
    import shutil

    named = [os.environ.get("PYTHON312"), shutil.which("python3.12")]
    named += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12.*/bin/python")))
    check = "import sys; sys.exit(sys.version_info[:2] != (3, 12))"
    for candidate in filter(None, named):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if (
                subprocess.run([candidate, "-c", check], capture_output=True, timeout=30).returncode
                == 0
            ):
                return True
    return False


def require(path: Path | None, what: str, *, present: bool = True) -> Path:
    """``path``, or skip saying what is missing and how to build it.

    Under CI (``CI`` set) a missing interpreter fails instead, unless ``present`` is False:
    the machine lacks what the component needs (Harbor's Python 3.12), which CI cannot fix.
    """
    if path is not None:
        return path
    if not present:
        pytest.skip(f"no {what}: this machine has no Python 3.12, which Harbor 0.25.0 needs")
    message = f"no {what} interpreter: run benchmarks/agent_envs.sh"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must run the real component)")
    pytest.skip(message)


@dataclasses.dataclass
class RunningGateway:
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def post(url: str, body: object, timeout: float = 60.0) -> tuple[int, bytes]:
    """POST JSON; (status, body) whatever the status."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def delete(url: str, timeout: float = 10.0) -> int:
    """DELETE; the status."""
    request = urllib.request.Request(url, method="DELETE")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


@contextlib.contextmanager
def start_gateway(
    workers: Sequence[str],
    workdir: Path,
    *,
    model: str = "tiny",
    health_check_interval: float = 1.0,
    python: Path | None = None,
) -> Iterator[RunningGateway]:
    """rllm-model-gateway on a free loopback port in front of ``workers``; stopped on exit.

    ``python``: another gateway's interpreter (default: the 0.1.0 environment).
    """
    python = python or require(gateway_python(), "rllm-model-gateway")
    port = free_port()
    config = workdir / f"gateway-{port}.yaml"
    lines = [
        "host: 127.0.0.1",
        f"port: {port}",
        "store_worker: memory",
        "sync_traces: true",
        f"health_check_interval: {health_check_interval}",
        "workers:",
    ]
    for url in workers:
        lines += [f"  - url: {url}", f"    model_name: {model}"]
    config.write_text("\n".join(lines) + "\n")
    log = workdir / f"gateway-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(python), "-m", "rllm_model_gateway", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    gateway = RunningGateway(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited with status {process.returncode}")
            try:
                with urllib.request.urlopen(gateway.url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway missed /health for {READY_S:.0f} s") from None
                time.sleep(0.2)
    except BaseException as error:
        stop_process_group(process)
        print(gateway.log_tail(), file=sys.stderr)
        raise RuntimeError(f"{error}; log tail:\n{gateway.log_tail()}") from error
    try:
        yield gateway
    finally:
        stop_process_group(process)


def dead_url() -> str:
    """A loopback URL nothing listens on (a worker that is down)."""
    return f"http://127.0.0.1:{free_port()}/v1"


def engine_log_probs(engine, prompt, sampled):
    """dew_pipe's own log-probabilities of ``sampled`` after ``prompt`` under the engine's
    launch weights at temperature 1: the independent check of what a trace recorded."""
    import jax
    import numpy as np

    ids = [*prompt, *sampled]
    tokens = np.asarray(ids, np.int32)[None]
    logits = jax.jit(engine.pretrained.model.apply)(engine.variables, tokens, np.ones_like(tokens))
    logits = np.asarray(logits, np.float64)[0]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(prompt) - 1, len(ids) - 1), sampled]
