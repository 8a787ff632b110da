"""Weight pushes into a real vLLM, and GRPO with vLLM rollouts against the native server.

    .venv/bin/python benchmarks/engine_push.py [--sizes 0.1,3,25] [--steps 12]

Needs the vLLM environment (``benchmarks/vllm_env.sh``). Two measurements:

1. **SafetensorsReload push time against model size.** For each size (millions of
   parameters, approximately) a Qwen3-layout decoder is written with
   ``SafetensorsReload.write``, vLLM is started on it, and three pushes of other weights are
   timed (the write into the checkpoint, and the replica sequence: pause, reload, reset,
   version, resume). Baseline, same run: ``Pretrained.save`` of the same weights alone, the
   disk part of the push; the ratio says what the engine's side adds.
2. **GRPO steps/s**: ``pipelines/grpo_vllm.py`` on the first size's checkpoint, once with
   vLLM drawing the rollouts (and a push after every update) and once with the native
   in-process server (baseline, same run, same model, settings and seed), both after two
   warm-up updates that include the compiles.

Prints the machine line first and each figure with the ratio to its baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import describe  # noqa: E402

from dew_pipe import models  # noqa: E402
from dew_pipe.cli import main as dew_pipe  # noqa: E402
from dew_pipe.inference import JSONClient, SafetensorsReload  # noqa: E402
from dew_pipe.inference.servers.http_json import EngineError  # noqa: E402
from dew_pipe.models.hf import Pretrained  # noqa: E402
from dew_pipe.tasks import ArithmeticTask  # noqa: E402

PIPELINE = ROOT / "pipelines" / "grpo_vllm.py"
# size (M params, about) -> decoder settings; head_dim 32 or more (vLLM's CPU attention)
SIZES = {
    "0.1": dict(emb_features=64, num_layers=2, num_heads=2, num_kv_heads=1, mlp_features=128),
    "3": dict(emb_features=256, num_layers=4, num_heads=4, num_kv_heads=2, mlp_features=1024),
    "25": dict(emb_features=512, num_layers=8, num_heads=8, num_kv_heads=4, mlp_features=2048),
    "100": dict(emb_features=1024, num_layers=8, num_heads=16, num_kv_heads=8, mlp_features=4096),
}


def _pipeline_module():
    """pipelines/grpo_vllm.py as a module (registered first: its dataclasses need it)."""
    if "grpo_vllm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grpo_vllm", PIPELINE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["grpo_vllm"] = module
        spec.loader.exec_module(module)
    return sys.modules["grpo_vllm"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Engine:
    """vLLM serving ``checkpoint`` (the pipeline's launch command), stopped by ``stop``."""

    def __init__(self, python: Path, checkpoint: Path, log: Path, ready_s: float = 600) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = _pipeline_module().launch_command(checkpoint, self.port).split()
        env = dict(os.environ)
        while "=" in command[0]:
            key, value = command.pop(0).split("=", 1)
            env[key] = value
        command[0] = str(python)
        start = time.monotonic()
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        client = JSONClient(self.url, timeout=5)
        while True:
            if self.process.poll() is not None or time.monotonic() - start > ready_s:
                self.stop()
                tail = log.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError("vLLM did not start:\n" + "\n".join(tail))
            try:
                client.get("/health")
                break
            except EngineError:
                time.sleep(1)
        self.startup_s = time.monotonic() - start
        JSONClient(self.url, timeout=300).post(
            "/v1/completions", {"model": "grpo", "prompt": [3, 4], "max_tokens": 2}
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def _pretrained(size: str, task: ArithmeticTask):
    config = dict(SIZES[size], max_seq_len=64, qk_norm=True, tie_embeddings=False)
    model = models.build("causal_transformer", vocab_size=task.vocab_size, **config)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    pretrained = Pretrained.from_model(
        model, variables, eos_token_id=task.eos_id, pad_token_id=task.pad_id
    )
    params = sum(x.size for x in jax.tree.leaves(variables))
    return pretrained, variables, params


def push_times(python: Path, size: str, workdir: Path) -> dict[str, float]:
    """Median seconds of ``Pretrained.save`` and of three pushes into vLLM, for one size."""
    task = ArithmeticTask()
    pretrained, variables, params = _pretrained(size, task)
    checkpoint = workdir / f"model-{size}"
    push = SafetensorsReload(pretrained, checkpoint, ["http://127.0.0.1:1"], "vllm")
    push.write(variables)
    task.tokenizer().save_pretrained(checkpoint)
    moved = jax.tree.map(lambda x: 1.1 * x, variables)
    saves = []
    for i in range(3):
        start = time.monotonic()
        pretrained.save(moved, workdir / f"save-{size}-{i}", dtype=jnp.bfloat16)
        saves.append(time.monotonic() - start)
    engine = Engine(python, checkpoint, workdir / f"vllm-{size}.log")
    push = SafetensorsReload(pretrained, checkpoint, [engine.url], "vllm", timeout=600)
    pushes, writes, publishes = [], [], []
    try:
        for version in (1, 2, 3):
            start = time.monotonic()
            push(moved if version % 2 else variables, version)
            pushes.append(time.monotonic() - start)
            writes.append(push.timings["write"])
            publishes.append(push.timings["publish"])
    finally:
        engine.stop()
    nbytes = sum(t.nbytes for t in pretrained.export(variables, dtype=jnp.bfloat16).values())
    return {
        "params_m": params / 1e6,
        "bf16_mb": nbytes / 2**20,
        "startup_s": engine.startup_s,
        "save_s": statistics.median(saves),
        "push_s": statistics.median(pushes),
        "write_s": statistics.median(writes),
        "publish_s": statistics.median(publishes),
    }


def grpo_rate(python: Path, size: str, workdir: Path, steps: int) -> dict[str, float]:
    """Updates/s of pipelines/grpo_vllm.py with vLLM and with the native server."""
    checkpoint = workdir / f"model-{size}"
    rates = {}
    engine = Engine(python, checkpoint, workdir / "vllm-grpo.log")
    try:
        for server in ("vllm", "native"):
            run_dir = workdir / f"grpo-{server}"
            code = dew_pipe([
                "run", str(PIPELINE), "--run-dir", str(run_dir),
                "--set", f"engine={engine.url}", "--set", f"checkpoint={checkpoint}",
                "--set", f"server={server}", "--set", f"steps={steps}",
                "--set", "prompts=8", "--set", "groups=8", "--set", "digits=3",
                "--set", "eval_every=0", "--set", "test_size=20",
            ])  # fmt: skip
            if code != 0:
                raise RuntimeError(f"grpo_vllm.py with server={server} exited with {code}")
            curve = json.loads((run_dir / "summary.json").read_text())["curve"]
            timed = curve[1:]  # after the first two updates (compiles, first push)
            seconds = timed[-1]["seconds"] - curve[1]["seconds"]
            rates[server] = (len(timed) - 1) / seconds
    finally:
        engine.stop()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1,3,25", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--steps", type=int, default=12, help="GRPO updates per server")
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv" / "bin" / "python"))
    args = parser.parse_args()
    python = Path(args.vllm_python)
    if not python.is_file():
        raise SystemExit(f"no vLLM interpreter at {python}: run benchmarks/vllm_env.sh")
    sizes = args.sizes.split(",")
    print(describe())
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="engine-push-") as tmp:
        workdir = Path(tmp)
        print("| params (M) | bf16 MB | save s (baseline) | push s | write s | publish s | "
              "push / save |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for size in sizes:
            t = push_times(python, size, workdir)
            print(
                f"| {t['params_m']:.2f} | {t['bf16_mb']:.1f} | {t['save_s']:.3f} | "
                f"{t['push_s']:.3f} | {t['write_s']:.3f} | {t['publish_s']:.3f} | "
                f"{t['push_s'] / t['save_s']:.1f}x |",
                flush=True,
            )
        rates = grpo_rate(python, sizes[0], workdir, args.steps)
        print(
            f"GRPO updates/s ({args.steps} updates of 8 x 8, {sizes[0]}M params): vLLM "
            f"{rates['vllm']:.3f}, native server (baseline) {rates['native']:.3f}, ratio "
            f"{rates['vllm'] / rates['native']:.2f}x"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
