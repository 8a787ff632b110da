"""Greedy tokens/s at the served precision against transformers `generate`, and the roofline.

Both sides run the same Llama-style model with the same weights: the script initialises
the decoder, writes it as a transformers checkpoint with `Pretrained.save`, loads it back
for JAX with `load_pretrained` (the HF import) and hands the directory to the torch side,
which loads it with ``LlamaForCausalLM.from_pretrained`` in float32 and in bfloat16 and
calls ``generate`` with its KV cache (greedy, no EOS, so every row runs the full budget).

dew_pipe runs `dew_pipe.inference.generate` in float32 and at the served precision
(``--served-dtype``, default ``auto``: `dew_pipe.inference.served_precision`, bfloat16
weights where the CPU multiplies bfloat16 natively, with float32 activations and cache on a
CPU; float32 on AVX2-only CPUs), the same split into ``--lanes`` lanes (``generate(...,
lanes=N)``: N calls on N threads at once, by default one per core this process may use),
and the continuous-batching `Server` at the served precision (every row submitted at once,
``--steps-per-call`` ids per compiled call). The
baseline is transformers at its best CPU setting in the same round: the fastest of float32
and bfloat16, each with torch's default intra-op threads and with one (on a machine other
jobs load, the default OpenMP threads spin at every barrier on a core they do not get, and
one thread is then the faster).

The roofline: ``--bandwidth-mb`` arrays are read (a jitted sum, the way decode reads weights)
and copied in JAX on one core in the same run, between the rounds; a decode step must read
every matmul weight at the served precision plus each row's filled cache, so the fastest a
step can be is those bytes over the read bandwidth. The figure is that time over the
measured decode time (the whole call minus a prefill-only call, ``max_new_tokens=1``).
Weights that fit in the CPU's caches can beat it (above 100%).

The matmul floor: the same run also times a decode step's matmuls alone (each layer's
joined q/k/v, o, joined gate/up and down, then the head, as the served decode step holds
them), back to back in one compiled loop at the batch's rows, without attention, norms or
sampling. Where the CPU multiplies slower than it reads (16 flops per bfloat16 weight byte at
batch 16), that floor lies above the bandwidth one, and it is the nearer bound.

The torch side runs in the reference environment (dew_pipe never imports torch): the
Python found from ``--reference-python``, else ``$DEW_PIPE_REFERENCE_PYTHON``, else
``.reference-venv/bin/python`` (``benchmarks/reference_env.sh`` builds it). The sides
alternate call by call; each figure is the median of its rounds.

Default sizes (issue 5): vocab 4096, hidden 256, 4 layers, 8 heads, 4 kv heads,
intermediate 704; prompt 32, 64 new tokens; batches 16, 64 and 256. Goal (issue 18): at
batch 16, >= 3x transformers and >= 70% of the roofline.

    .venv/bin/python benchmarks/generate.py [--rounds 7] [--batches 16,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import print_machine
from reference import add_reference_argument, reference_python

TORCH_DTYPES = ("float32", "bfloat16")
THREADS = {"default": 0, "one": 1}  # torch's default intra-op threads, and one
CONFIG = dict(
    vocab_size=4096,
    emb_features=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    mlp_features=704,
    max_seq_len=256,
)


def torch_worker(directory: str) -> None:
    """Runs in the reference environment: answers ``{"batch", "dtype", "threads"}`` (0:
    torch's default) with a timed call."""
    import numpy as np
    import torch
    import transformers

    default = torch.get_num_threads()
    spec = json.loads(Path(directory, "bench.json").read_text())
    models = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        model.generation_config.eos_token_id = None  # no early stop: every row runs the budget
        model.generation_config.pad_token_id = 0
        models[name] = model
    every = torch.from_numpy(np.load(Path(directory, "prompts.npy")).astype(np.int64))

    def run(batch: int, name: str, threads: int = 0) -> tuple[float, list]:
        torch.set_num_threads(threads or default)
        prompts = every[:batch]
        start = time.perf_counter()
        with torch.inference_mode():
            out = models[name].generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=spec["new"],
                do_sample=False,
            )
        return time.perf_counter() - start, out[:, prompts.shape[1] :].tolist()

    for name in models:
        run(spec["batches"][0], name)  # warm-up
    print(json.dumps({"ready": True, "threads": default}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        seconds, ids = run(request["batch"], request["dtype"], request["threads"])
        print(json.dumps({"seconds": seconds, "ids": ids}), flush=True)


class TorchSide:
    """The torch worker process, one timed generate per `run` call."""

    def __init__(self, python: str, directory: str) -> None:
        self.process = subprocess.Popen(
            [python, __file__, "--torch-worker", directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"torch worker exited with status {self.process.wait()}")
        return json.loads(line)

    def run(self, batch: int, dtype: str, threads: int) -> dict:
        request = {"batch": batch, "dtype": dtype, "threads": threads}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=120)


def bandwidth(megabytes: int) -> dict:
    """Read and copy bandwidth of this process's XLA (one core here), GB/s, best of 5."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    read, copy = jax.jit(jnp.sum), jax.jit(lambda x: x + 1.0)
    read(x).block_until_ready(), copy(x).block_until_ready()
    best = {"read": 1e9, "copy": 1e9}
    for _ in range(5):
        for name, f in (("read", read), ("copy", copy)):
            start = time.perf_counter()
            f(x).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
    return {"read": x.nbytes / best["read"] / 1e9, "copy": 2 * x.nbytes / best["copy"] / 1e9}


def matmul_floor(model, variables, batch: int, steps: int = 64) -> dict:
    """Seconds per decode step of the step's matmuls alone (best of 5 loops of ``steps``),
    and their rate in GFLOP/s: every 2-D weight of the served decode step plus the head,
    each fed ``[batch, in]`` float32 rows read in the weight's dtype, summing in float32."""
    import jax
    import jax.numpy as jnp

    from dew_pipe.inference.decoding import decode_step

    layers = getattr(decode_step(model, variables), "layers", None) or []
    params = variables["params"]
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    weights = [w for layer in layers for w in jax.tree.leaves(layer) if w.ndim == 2] + [head]
    inputs = [jnp.ones((batch, w.shape[0]), jnp.float32) for w in weights]

    @jax.jit
    def loop(weights, inputs):
        def body(i, carry):
            for w, x in zip(weights, inputs, strict=True):
                y = jnp.dot((x * carry).astype(w.dtype), w, preferred_element_type=jnp.float32)
                carry = carry + 1e-12 * y[0, 0]  # each product waits for the one before
            return carry

        return jax.lax.fori_loop(0, steps, body, jnp.float32(1.0))

    jax.block_until_ready(loop(weights, inputs))
    best = 1e9
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(loop(weights, inputs))
        best = min(best, time.perf_counter() - start)
    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)
    return {"seconds": best / steps, "gflops": flops * steps / best / 1e9}


def step_bytes(variables, config: dict, batch: int, prompt: int, new: int, cache_bytes: int):
    """Bytes a decode step must read, averaged over the steps: every matmul weight as
    stored (the embedding only for the fed rows) and each row's filled keys and values."""
    import jax

    weights = sum(
        leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(variables)
        if "embed" not in jax.tree_util.keystr(path)
    )  # fmt: skip
    head_dim = config["emb_features"] // config["num_heads"]
    per_position = 2 * config["num_layers"] * config["num_kv_heads"] * head_dim * cache_bytes
    filled = prompt + (new - 1) / 2  # the mean cache length over the decode steps
    return weights + batch * filled * per_position


def measure(args: argparse.Namespace, python: str) -> dict:
    """Builds the model, exports it for torch, and times alternating rounds of every side."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew_pipe import models
    from dew_pipe.inference import Server, ServeTask, generate, served_precision
    from dew_pipe.inference.servers.engine_setup import served_copy, served_model
    from dew_pipe.sampling import Sampling

    P, R = args.prompt, args.new
    model = models.build("causal_transformer", **CONFIG)
    variables = model.init(jax.random.key(args.seed), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(args.seed)
    every = rng.integers(0, CONFIG["vocab_size"], (max(args.batches), P)).astype(np.int32)
    greedy = Sampling(temperature=0)
    device = jax.devices()[0]
    dtype = served_precision(device.platform) if args.served_dtype == "auto" else args.served_dtype
    dtype = np.dtype(dtype)
    runs: dict = {"served": str(dtype), "batches": {}}
    with tempfile.TemporaryDirectory() as directory:
        exported = models.Pretrained.from_model(model, variables, architecture="LlamaForCausalLM")
        exported.save(variables, directory)
        np.save(Path(directory, "prompts.npy"), every)
        Path(directory, "bench.json").write_text(json.dumps({"new": R, "batches": args.batches}))
        pretrained = models.load_pretrained(directory, max_seq_len=CONFIG["max_seq_len"])
        served, _ = served_model(pretrained.model, dtype, device.platform)
        served_vars = served_copy(pretrained.variables, dtype, device)
        ours = {  # name: (model, variables, lanes)
            "float32": (pretrained.model, pretrained.variables, 1),
            "served": (served, served_vars, 1),
            "lanes": (served, served_vars, args.lanes),
        }

        def call(name: str, batch: int, new: int) -> tuple[float, np.ndarray]:
            m, v, lanes = ours[name]
            prompts, lengths = every[:batch], np.full(batch, P, np.int32)
            start = time.perf_counter()
            out = generate(m, v, prompts, lengths, new, jax.random.key(0), greedy, lanes=lanes)
            ids = np.asarray(out.ids)  # includes the device-to-host copy
            return time.perf_counter() - start, ids

        def serve(server: Server, batch: int) -> tuple[float, np.ndarray]:
            start = time.perf_counter()
            futures = [server.submit(every[b], R, seed=0) for b in range(batch)]
            ids = np.stack([f.result().sampled_ids for f in futures])
            return time.perf_counter() - start, ids

        torch_side = TorchSide(python, directory)
        try:
            runs["threads"] = torch_side.info["threads"]
            for batch in args.batches:
                server = Server.from_task(
                    ServeTask(pretrained.model, pretrained.variables, greedy),
                    slots=batch, capacity=P + R - 1, dtype=dtype,
                    steps_per_call=args.steps_per_call, buckets=(P,), gather_s=1.0,
                )  # fmt: skip
                try:
                    row = {k: [] for k in ("float32", "served", "lanes", "server")}
                    row.update(prefill=[], lanes_prefill=[])
                    row.update({f"torch_{d}_{t}": [] for d in TORCH_DTYPES for t in THREADS})
                    row["bandwidth"] = []
                    compile_s = {n: call(n, batch, R)[0] for n in ours}
                    call("served", batch, 1), call("lanes", batch, 1), serve(server, batch)
                    for _ in range(args.rounds):
                        for name in ours:
                            seconds, row[f"{name}_ids"] = call(name, batch, R)
                            row[name].append(seconds)
                        row["prefill"].append(call("served", batch, 1)[0])
                        row["lanes_prefill"].append(call("lanes", batch, 1)[0])
                        seconds, row["server_ids"] = serve(server, batch)
                        row["server"].append(seconds)
                        for name in TORCH_DTYPES:
                            for threads in THREADS:
                                reply = torch_side.run(batch, name, THREADS[threads])
                                row[f"torch_{name}_{threads}"].append(reply["seconds"])
                            row[f"torch_{name}_ids"] = np.asarray(reply["ids"])
                        row["bandwidth"].append(bandwidth(args.bandwidth_mb))
                finally:
                    server.close()
                row["compile_s"] = compile_s
                row["bytes"] = step_bytes(served_vars, CONFIG, batch, P, R, 4)
                row["matmuls"] = matmul_floor(served, served_vars, batch)
                runs["batches"][batch] = row
        finally:
            torch_side.close()
    runs["devices"] = str(jax.devices())
    return runs


def report(args: argparse.Namespace, runs: dict) -> None:
    """Per batch: each side's median, the speed-ups, the roofline and the greedy agreement."""
    med = statistics.median
    print(
        f"prompt {args.prompt}, {args.new} new tokens, greedy, {args.rounds} rounds; served "
        f"precision {runs['served']}; torch default threads {runs['threads']}; "
        f"jax {runs['devices']}"
    )
    for batch, row in runs["batches"].items():
        tokens = batch * args.new
        reads = [b["read"] for b in row["bandwidth"]]
        copies = [b["copy"] for b in row["bandwidth"]]
        print(f"\nbatch {batch}: read bandwidth {med(reads):.1f} GB/s (copy {med(copies):.1f})")
        print("| side | median ms | tokens/s | vs transformers (its fastest setting per round) |")
        print("|---|---:|---:|---:|")
        settings = [f"torch_{d}_{t}" for d in TORCH_DTYPES for t in THREADS]
        best_torch = [min(times) for times in zip(*(row[k] for k in settings), strict=True)]
        names = (
            ("dew_pipe generate, float32", "float32"),
            (f"dew_pipe generate, served {runs['served']}", "served"),
            (f"dew_pipe generate, served {runs['served']}, {args.lanes} lanes", "lanes"),
            (f"dew_pipe Server, served {runs['served']}", "server"),
            *(
                (f"transformers, {d}, {t} threads", f"torch_{d}_{t}")
                for d in TORCH_DTYPES
                for t in THREADS
            ),
        )
        for label, key in names:
            seconds = med(row[key])
            ratios = [t / s for s, t in zip(row[key], best_torch, strict=True)]
            print(
                f"| {label} | {seconds * 1e3:.1f} | {tokens / seconds:.0f} | "
                f"{med(best_torch) / seconds:.2f}x (per round {med(ratios):.2f}x, "
                f"{min(ratios):.2f}-{max(ratios):.2f}) |"
            )
        floor = row["bytes"] / (med(reads) * 1e9)
        step = {}  # seconds per decode step, by side
        for label, key, prefill in (
            ("served", "served", "prefill"),
            (f"served, {args.lanes} lanes", "lanes", "lanes_prefill"),
        ):
            decode = [t - p for t, p in zip(row[key], row[prefill], strict=True)]
            step[key] = step_s = med(decode) / (args.new - 1)
            print(
                f"roofline ({label}): {row['bytes'] / 2**20:.1f} MiB read per decode step, "
                f"{floor * 1e3:.3f} ms at {med(reads):.1f} GB/s; measured {step_s * 1e3:.3f} "
                f"ms per step (prefill {med(row[prefill]) * 1e3:.1f} ms): {floor / step_s:.0%}"
            )
        matmuls = row["matmuls"]
        print(
            f"matmul floor (served): {matmuls['seconds'] * 1e3:.3f} ms per step for the "
            f"step's matmuls alone ({matmuls['gflops']:.0f} GFLOP/s); the bandwidth floor is "
            f"{floor / matmuls['seconds']:.0%} of it, the measured step reaches "
            f"{matmuls['seconds'] / step['served']:.0%} of it"
        )
        same = lambda a, b, row=row: f"{(row[a] == row[b]).mean():.1%}"  # noqa: E731
        print(
            "same greedy ids: float32 vs transformers float32 "
            f"{same('float32_ids', 'torch_float32_ids')}; served vs transformers bfloat16 "
            f"{same('served_ids', 'torch_bfloat16_ids')}; served vs float32 "
            f"{same('served_ids', 'float32_ids')}; Server vs generate (served) "
            f"{same('server_ids', 'served_ids')}; {args.lanes} lanes vs one "
            f"{same('lanes_ids', 'served_ids')}"
        )
        print(f"first call (compile): {', '.join(f'{k} {v:.1f} s' for k, v in row['compile_s'].items())}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served-dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--steps-per-call", type=int, default=16, help="the Server's")
    parser.add_argument(
        "--lanes",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="generate(lanes=...) of the extra served row (default: the cores this process may use)",
    )
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="array size, MiB")
    add_reference_argument(parser)
    parser.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_worker:
        torch_worker(args.torch_worker)
        return
    args.batches = [int(b) for b in args.batches.split(",") if b]
    report(args, measure(args, reference_python(args.reference_python)))


if __name__ == "__main__":
    print_machine()
    main()
