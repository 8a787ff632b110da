"""Asynchronous GRPO through RolloutScheduler against a synchronous loop, same work.

Workload (the same in every mode): the story decoder of ``tests/story_prelude.py`` (2
layers, width 128, a BPE vocabulary of 852 ids (1024 asked for); trained here on story
openings, with room for ``P + R`` positions), GRPO on story prefixes of 24 to ``P`` ids
(left padded to ``P``), ``G`` completions of ``R`` new ids per prompt at temperature 1 with
top-k 40, the spec's "dog" reward on the decoded text, ``B`` prompts per step,
``GRPOObjective(behavior_importance=2.0, proximal_in_step=True, response_columns=R)`` and
AdamW. With ``proximal_in_step`` the loss takes the proximal likelihoods from its own forward
pass, so the pipeline has no separate rescoring pass (``--rescore`` puts it back, for the
record); with ``response_columns`` the output head runs on each row's ``R`` sampled ids
only (``--response-columns 0`` scores whole rows). No EOS is drawn, so every completion uses
its whole budget and every step does the same work; truncated completions train on their
reward (``truncation="score"``).

Modes, each a fresh worker process (XLA sizes its thread pool to the cores a process may
use when JAX starts, so each mode gets the pool it is meant to have):

- ``sync-2core``: ``Trainer(rollout=SampledRollout)``: generate, then update, in one process
  on both cores (a two-thread XLA pool for whichever phase runs).
- ``sync-1core``: the same, pinned to core 0.
- ``sync-pipeline``: ``RolloutScheduler(ahead=0, max_lag=0)`` with the server process of
  ``async``: the pipeline's own work (engine, rescoring, packing) without overlap.
- ``async``: ``RolloutScheduler(ahead=1, max_lag=1)``. The trainer process is pinned to core
  0; the rollout server runs in its own process pinned to core 1
  (``ProcessRolloutServer(cpus={1})``); each has a one-thread XLA pool, as two devices would.

Optional modes (``--modes``), for the record: ``async-inprocess`` (the scheduler with the
in-process ``NativeRolloutServer``, one process on both cores, so rollout and update share
one XLA pool) and ``async-unpinned`` (``async`` with neither process pinned).

The rollout server serves in ``--served-dtype`` (default ``auto``: bfloat16 weights where
the CPU multiplies bfloat16 natively, float32 elsewhere; ``dew_pipe.inference.served_precision``);
the synchronous modes generate with the trainer's float32 weights.

A speed-up counts only if the run learns as well per update, so every mode also reports
the mean reward of each step's batch (warm-up steps included, the same quantity in every
mode) and, after its last step, the final policy's reward on held-out prompts (stories no
step trained on, the same prompts and sampling keys in every mode).

Each worker compiles with ``--warmup`` steps, then times ``--steps`` more steps of
``Trainer.fit``. It reports wall seconds, CPU seconds of the trainer process (and of the
server process), and for the pipeline modes the per-edge queue waits and the per-stage busy
time of the scheduler's pipeline (``RolloutScheduler.snapshot()``) over the timed steps.
Rounds rotate the order of the modes; the summary takes medians. The headline ratio is, per
round, the faster of ``sync-2core`` and ``sync-1core`` over ``async``.

Usage::

    .venv/bin/python benchmarks/async_vs_sync.py              # the RESULTS.md table
    .venv/bin/python benchmarks/async_vs_sync.py --rounds 1 --steps 6 --modes async
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import print_machine

MODES = ("sync-2core", "sync-1core", "sync-pipeline", "async")
EXTRA = ("async-inprocess", "async-unpinned")
TRAINER_CPU, SERVER_CPU = 0, 1
SYNC = ("sync-2core", "sync-1core")
# the server's counters reported over the timed steps
COUNTERS = (
    "steps",
    "calls",
    "prefills",
    "joined",
    "joined_mid_flight",
    "prompts_prefilled",
    "reloads",
)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="timed GRPO steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compiles)")
    parser.add_argument("--prompts", type=int, default=16, help="B, prompts per step")
    parser.add_argument("--groups", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=64, help="P, prompt width")
    parser.add_argument("--new-tokens", type=int, default=24, help="R, ids per completion")
    parser.add_argument("--steps-per-call", type=int, default=8, help="server decode steps")
    parser.add_argument(
        "--response-columns",
        type=int,
        default=None,
        help="GRPOObjective(response_columns=...): the head runs on this many columns per "
        "row (default R, the completion budget, as one chain fills a row); 0 scores whole rows",
    )
    parser.add_argument(
        "--share-prompts",
        action="store_true",
        help="pack each prompt once for its G completions (SampledRollout and "
        "RolloutScheduler share_prompts=True): rows of P - 1 + G * (R + 1) ids, rounded up, "
        "one prompt a row, and a head on G * R columns",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--lag",
        type=int,
        default=1,
        help="the async modes' RolloutScheduler(ahead=N, max_lag=N): batches the server "
        "may run ahead of the update, and the most updates a batch's weights may lag",
    )
    parser.add_argument(
        "--served-dtype",
        default="auto",
        help="the rollout server's precision: auto (bfloat16 where the CPU multiplies it "
        "natively, else float32), float32 or bfloat16",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="the update's compute precision (parameters and optimizer stay float32): "
        "bfloat16 multiplies in bfloat16 with float32 accumulation; auto picks it where the "
        "CPU multiplies bfloat16 natively, as --served-dtype auto does",
    )
    parser.add_argument(
        "--eval-prompts", type=int, default=256, help="prompts of the final held-out reward"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW's")
    parser.add_argument(
        "--seeds",
        choices=("fixed", "per-round"),
        default="fixed",
        help="sampling seeds: the same in every round (fixed) or round r's own (per-round), "
        "so the learning figures average over draws",
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="rescore each batch in a separate forward pass (proximal_in_step=False)",
    )
    parser.add_argument(
        "--quiet", type=float, default=0.5, help="wait for other processes to use fewer cores"
    )
    parser.add_argument("--max-wait", type=float, default=120.0, help="most seconds to wait")
    parser.add_argument(
        "--attempts", type=int, default=1, help="runs of a worker while the machine was busy"
    )
    parser.add_argument("--worker", choices=MODES + EXTRA, help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.response_columns is None:
        args.response_columns = args.new_tokens * (args.groups if args.share_prompts else 1)
    unknown = sorted(set(args.modes) - set(MODES + EXTRA))
    if unknown:
        parser.error(f"--modes has {unknown}; expected names among {list(MODES + EXTRA)}")
    return args


# ---------------------------------------------------------------------- the workload


def prelude(args: argparse.Namespace, path: Path) -> None:
    """Train the story decoder with room for P + R positions; pickle it to ``path``."""
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from story_prelude import story_decoder

    from dew_pipe.data.stories import story_tokenizer

    width = args.prompt_len + args.new_tokens
    tokenizer = story_tokenizer()
    # Openings of 57 ids (every generated story is longer); later positions are untrained,
    # which changes what is sampled there but not what a step costs.
    decoder = story_decoder(tokenizer, seq_len=56, config={"max_seq_len": width})
    variables = jax.device_get(decoder.lm_state.params)
    path.write_bytes(pickle.dumps({"config": decoder.model.config, "variables": variables}))


def prompt_rows(tokenizer, args: argparse.Namespace, count: int = 512) -> list[dict]:
    """``count // B`` Prompts batches of story prefixes, 24 to P ids, left padded to P."""
    import numpy as np

    from dew_pipe.data.stories import generate_stories
    from dew_pipe.data.text_columns import encode_text_column

    draw = np.random.default_rng(1)
    width, batch = args.prompt_len, args.prompts
    prefixes = []
    for story in generate_stories(count, seed=7):
        ids = tokenizer.encode(story)
        prefixes.append(ids[: int(draw.integers(min(24, width), width + 1))])
    batches = []
    for start in range(0, count - batch + 1, batch):
        chunk = prefixes[start : start + batch]
        prompt = np.zeros((batch, width), np.int32)
        for row, ids in enumerate(chunk):
            prompt[row, width - len(ids) :] = ids
        batches.append(
            {
                "prompt": prompt,
                "prompt_length": np.array([len(ids) for ids in chunk], np.int32),
                "data_source": encode_text_column(["stories"] * batch),
                "ground_truth": encode_text_column(["dog"] * batch),
                "extra_info": encode_text_column([""] * batch),
                "task_id": np.arange(start, start + batch, dtype=np.int64),
            }
        )
    return batches


def reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
    """The spec's GRPO example reward: does the completion mention the ground truth."""
    return float(ground_truth in completion)


# ---------------------------------------------------------------------- measuring


def process_cpu(pid: int | str = "self") -> float:
    """CPU seconds process ``pid`` has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds all processes have used so far, over every core (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def runqueue_wait(pid: int | str = "self") -> float:
    """Seconds the threads of ``pid`` have been runnable but waiting for a core."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:  # a thread that just ended
            continue
    return total / 1e9


class Probe:
    """What a timed run used: wall, CPU of this process and the server process, the cores
    other processes used meanwhile, and how long our threads waited for a core."""

    def __init__(self, child: int | None = None) -> None:
        self.child = child
        self.start = (
            time.perf_counter(),
            process_cpu(),
            None if child is None else process_cpu(child),
            machine_busy(),
            runqueue_wait(),
            None if child is None else runqueue_wait(child),
        )

    def stop(self) -> dict:
        wall0, cpu0, child0, busy0, wait0, child_wait0 = self.start
        wall = time.perf_counter() - wall0
        out = {
            "wall_s": wall,
            "cpu_s": process_cpu() - cpu0,
            "runqueue_s": runqueue_wait() - wait0,
        }
        ours = out["cpu_s"]
        if self.child is not None:
            out["server_cpu_s"] = process_cpu(self.child) - child0
            out["server_runqueue_s"] = runqueue_wait(self.child) - child_wait0
            ours += out["server_cpu_s"]
        out["others_cores"] = max(0.0, (machine_busy() - busy0 - ours) / wall)
        return out


def others_now(seconds: float = 2.0) -> float:
    """Cores other processes keep busy, sampled over ``seconds`` while we run nothing."""
    busy, mine = machine_busy(), process_cpu()
    time.sleep(seconds)
    return max(0.0, (machine_busy() - busy - (process_cpu() - mine)) / seconds)


class TimedRollout:
    """Wraps the synchronous rollout hook: seconds waiting for the last update, and rolling out."""

    def __init__(self, inner) -> None:
        self.inner, self.update_wait, self.rollout, self.rewards = inner, [], [], []

    def __call__(self, state, batch, key):
        import jax

        start = time.perf_counter()
        jax.block_until_ready(state.params)
        ready = time.perf_counter()
        out = self.inner(state, batch, key)
        self.update_wait.append(ready - start)
        self.rollout.append(time.perf_counter() - ready)
        self.rewards.append(self.inner.metrics().get("reward/mean"))
        return out

    def metrics(self):
        return self.inner.metrics()


# ---------------------------------------------------------------------- a worker


def worker(args: argparse.Namespace) -> dict:
    mode = args.worker
    pinned = mode not in ("sync-2core", "async-inprocess", "async-unpinned")
    os.sched_setaffinity(0, {TRAINER_CPU} if pinned else {0, 1})  # before JAX starts

    import itertools

    import jax
    import optax

    from dew_pipe import Dataset, Sampling, Trainer, models
    from dew_pipe.data.stories import story_tokenizer
    from dew_pipe.objectives.rl import GRPOObjective, SampledRollout

    saved = pickle.loads(Path(args.weights).read_bytes())
    width, rows = packed_shape(args)
    config = {**vars(saved["config"]), "max_seq_len": max(saved["config"].max_seq_len, width)}
    # The sampler (the sync modes' generate, the server, the held-out draws) keeps the
    # prelude's float32 compute whatever the update's precision (--compute-dtype).
    model = models.build("causal_transformer", **config)  # rotary: no weights per position
    config["dtype"] = compute_dtype(args.compute_dtype)
    trained = models.build("causal_transformer", **config)
    variables = saved["variables"]
    tokenizer = story_tokenizer()
    batches = prompt_rows(tokenizer, args)
    data = Dataset(
        train=lambda partition: itertools.cycle(batches),
        val=None,
        records=len(batches) * args.prompts,
        batch=args.prompts,
    )
    objective = GRPOObjective(
        trained,
        seq_len=width - 1,
        pretrained=variables,
        behavior_importance=2.0,
        proximal_in_step=not args.rescore,
        response_columns=args.response_columns or None,
    )
    sampling = Sampling(temperature=1.0, top_k=40)
    trainer_of = lambda rollout: Trainer(  # noqa: E731
        objective,
        optax.adamw(args.learning_rate),
        key=jax.random.key(args.seed),
        rollout=rollout,
        progress=False,
    )
    out: dict = {"mode": mode, "cores": sorted(os.sched_getaffinity(0))}
    if mode in SYNC:
        rollout = TimedRollout(
            SampledRollout(
                objective,
                reward,
                groups=args.groups,
                max_new_tokens=args.new_tokens,
                sampling=sampling,
                decode=tokenizer.decode,
                share_prompts=args.share_prompts,
                sample_model=model,
            )
        )
        trainer = trainer_of(rollout)
        state = trainer.fit(data, steps=args.warmup, log_every=args.warmup)
        del rollout.update_wait[:], rollout.rollout[:]
        probe = Probe()
        state = trainer.fit(data, steps=args.warmup + args.steps, state=state, log_every=1000)
        jax.block_until_ready(state)
        out.update(probe.stop())
        out["rollout_s"] = statistics.median(rollout.rollout)
        out["rewards"] = rollout.rewards  # every step's batch, warm-up steps first
    else:
        found = pipelined(args, mode, trainer_of, objective, model, sampling, tokenizer, data)
        state = found.pop("state")
        out.update(found)
    out["eval_reward"] = held_out_reward(args, model, state.params, tokenizer)
    return out


def compute_dtype(name: str):
    """The update's compute dtype for ``--compute-dtype``."""
    import jax.numpy as jnp

    from dew_pipe.inference import served_precision

    if name == "auto":
        return jnp.dtype(served_precision("cpu"))
    return jnp.dtype(name)


def packed_shape(args: argparse.Namespace) -> tuple[int, int]:
    """Width and rows of a step's packed batch: one completion a row of P + R ids, or with
    ``--share-prompts`` one prompt and its G completions a row, the width rounded up so
    that its ``seq_len`` is a multiple of 8 (the decoder's causal attention blocks)."""
    if not args.share_prompts:
        return args.prompt_len + args.new_tokens, args.prompts * args.groups
    seq_len = args.prompt_len - 2 + args.groups * (args.new_tokens + 1)
    return -(-seq_len // 8) * 8 + 1, args.prompts


def held_out_reward(args: argparse.Namespace, model, params, tokenizer) -> float:
    """The final policy's mean reward on story prefixes no step trained on: ``G`` draws
    for each of ``--eval-prompts`` prompts, the same prompts and keys in every mode."""
    import jax
    import numpy as np

    from dew_pipe import Sampling
    from dew_pipe.inference import generate

    held = prompt_rows(tokenizer, args, count=512 + args.eval_prompts)[512 // args.prompts :]
    prompts = np.concatenate([b["prompt"] for b in held])[: args.eval_prompts]
    lengths = np.concatenate([b["prompt_length"] for b in held])[: args.eval_prompts]
    prompts, lengths = np.repeat(prompts, args.groups, 0), np.repeat(lengths, args.groups)
    out = generate(
        model, params, prompts, lengths, args.new_tokens, jax.random.key(123),
        Sampling(temperature=1.0, top_k=40),
    )  # fmt: skip
    ids = np.asarray(out.ids)
    return float(np.mean([reward("", tokenizer.decode(list(row)), "dog", "") for row in ids]))


def serving(args: argparse.Namespace, mode: str, model, variables, sampling):
    """The rollout server of a pipeline mode (in a child process, or in this one)."""
    from dew_pipe.inference import NativeRolloutServer, ProcessRolloutServer, Server, ServeTask

    task = ServeTask(model, variables, sampling)
    options = dict(
        slots=args.prompts * args.groups,  # one task batch fills the rows
        capacity=args.prompt_len + args.new_tokens,
        steps_per_call=args.steps_per_call,
        buckets=(args.prompt_len,),  # one prefill width: prompts are left padded to P
        gather_s=0.25,  # a batch's B * G submissions start in one prefill (they fill the rows)
        # Every prefill shape compiles before the timed steps: which join sizes a run meets
        # depends on timing, and each new one stalled the server 1-2 s mid-run.
        warm_up=True,
        dtype=args.served_dtype,
    )
    if mode == "async-inprocess":
        return NativeRolloutServer(Server.from_task(task, **options))
    cpus = None if mode == "async-unpinned" else {SERVER_CPU}
    return ProcessRolloutServer(task, cpus=cpus, **options)


def pipelined(args, mode, trainer_of, objective, model, sampling, tokenizer, data) -> dict:
    """The RolloutScheduler modes; returns times, CPU, waits, edges and stages."""
    import jax

    from dew_pipe.inference import ProcessRolloutServer, PromptSource
    from dew_pipe.objectives.rl import RolloutScheduler, prompt_tasks

    ahead = 0 if mode == "sync-pipeline" else args.lag
    server = serving(args, mode, model, objective.pretrained, sampling)
    source = PromptSource(
        server,
        reward,
        decode=tokenizer.decode,
        max_new_tokens=args.new_tokens,
        workers=2,
        seed=args.seed,
    )
    records = []
    scheduler = RolloutScheduler(
        objective,
        source,
        server,
        width=packed_shape(args)[0],
        rows=packed_shape(args)[1],
        groups=args.groups,
        tasks=prompt_tasks,
        share_prompts=args.share_prompts,
        max_lag=ahead,
        ahead=ahead,
        truncation="score",
        log=records.append,
    )
    child = server.pid if isinstance(server, ProcessRolloutServer) else None
    out: dict = {"server_cores": None if child is None else server.info["cpus"]}
    try:
        trainer = trainer_of(scheduler)
        stream = scheduler.tasks(data)
        state = trainer.fit(stream, steps=args.warmup, log_every=args.warmup)
        warm = [r.metrics["reward/mean"] for r in records]
        del records[:]
        probe = Probe(child)
        before = server.counters()
        state = trainer.fit(stream, steps=args.warmup + args.steps, state=state, log_every=1000)
        jax.block_until_ready(state)
        out.update(probe.stop())
        after = server.counters()
        out["server"] = {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}
        snapshot = scheduler.snapshot()  # the timed fit's pipeline (a new stream, new counters)
    finally:
        scheduler.close()
        source.close()
        server.close()
    out["waited_s"] = statistics.median(r.waited_s for r in records[1:])
    out["push_s"] = statistics.median(r.push_s for r in records)
    out["lag_max"] = max(r.lag for r in records)
    out["latency_p50_s"] = statistics.median(r.metrics["latency/p50"] for r in records)
    # every step's batch, warm-up steps first, in training order (as the sync modes)
    out["rewards"] = warm + [r.metrics["reward/mean"] for r in records]
    out["state"] = state
    out["edges"] = {
        name: {"items": e.items, "put_wait_s": e.put_wait_s, "get_wait_s": e.get_wait_s}
        for name, e in snapshot.edges.items()
    }
    out["stages"] = {name: {"busy_s": s.busy_s} for name, s in snapshot.stages.items()}
    return out


# ---------------------------------------------------------------------- the driver


def run_worker(mode: str, args: argparse.Namespace, weights: Path) -> dict:
    """One worker run; run again (up to ``--attempts`` in all) while other processes kept
    more than ``--quiet`` cores busy during it, keeping the quietest."""
    runs = []
    for _ in range(args.attempts):
        runs.append(attempt(mode, args, weights))
        if runs[-1]["others_cores"] <= args.quiet:
            break
    best = min(runs, key=lambda r: r["others_cores"])
    best["attempts"] = len(runs)
    return best


def attempt(mode: str, args: argparse.Namespace, weights: Path) -> dict:
    command = [
        sys.executable, __file__, "--worker", mode, "--weights", str(weights),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--prompts", str(args.prompts), "--groups", str(args.groups),
        "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--steps-per-call", str(args.steps_per_call), *(["--rescore"] if args.rescore else []),
        "--response-columns", str(args.response_columns),
        "--served-dtype", args.served_dtype, "--compute-dtype", args.compute_dtype,
        "--eval-prompts", str(args.eval_prompts),
        "--learning-rate", str(args.learning_rate), "--seed", str(args.seed),
        "--lag", str(args.lag), *(["--share-prompts"] if args.share_prompts else []),
    ]  # fmt: skip
    others, waited = others_now(), 0.0
    while others > args.quiet and waited < args.max_wait:  # let a neighbour's burst pass
        time.sleep(8.0)
        others, waited = others_now(), waited + 10.0
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {mode} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_before"] = load
    result["others_before"] = others
    return result


def median_of(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def summary(results: list[list[dict]], args: argparse.Namespace) -> None:
    steps = args.steps
    by_mode = {m: [r for rs in results for r in rs if r["mode"] == m] for m in args.modes}
    print(
        "\n| mode | s/step median (per round) | trainer CPU s/step | server CPU s/step "
        "| waited for a core s/step | other processes, cores |"
    )
    print("|---|---|---:|---:|---:|---|")
    for mode, runs in by_mode.items():
        walls = ", ".join(f"{r['wall_s'] / steps:.3f}" for r in runs)
        cpu = median_of(runs, "cpu_s") / steps
        server = median_of(runs, "server_cpu_s")
        server_text = "-" if server is None else f"{server / steps:.3f}"
        starved = median_of(runs, "runqueue_s") + (median_of(runs, "server_runqueue_s") or 0.0)
        others = ", ".join(f"{r['others_cores']:.2f}" for r in runs)
        wall = median_of(runs, "wall_s") / steps
        print(
            f"| {mode} | {wall:.3f} ({walls}) | {cpu:.3f} | {server_text} "
            f"| {starved / steps:.3f} | {others} |"
        )
    ratios = {m: [] for m in (*SYNC, "stronger", "sync-pipeline")}
    for round_results in results:
        times = {r["mode"]: r["wall_s"] for r in round_results}
        if "async" not in times:
            continue
        for mode in (*SYNC, "sync-pipeline"):
            if mode in times:
                ratios[mode].append(times[mode] / times["async"])
        syncs = [times[m] for m in SYNC if m in times]
        if syncs:
            ratios["stronger"].append(min(syncs) / times["async"])
    for name, values in ratios.items():
        if values:
            text = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name} / async: median {statistics.median(values):.2f}x ({text})")
    for mode in ("async", "sync-pipeline", *EXTRA):
        runs = by_mode.get(mode)
        if not runs:
            continue
        print(f"\n{mode}: per-edge queue waits, ms per step (median over rounds)")
        print("| edge | items/step | consumer waited | producer waited |")
        print("|---|---:|---:|---:|")
        for edge in runs[0]["edges"]:
            items = statistics.median(r["edges"][edge]["items"] for r in runs) / steps
            get = statistics.median(r["edges"][edge]["get_wait_s"] for r in runs) / steps
            put = statistics.median(r["edges"][edge]["put_wait_s"] for r in runs) / steps
            print(f"| {edge} | {items:.2f} | {get * 1e3:.0f} | {put * 1e3:.0f} |")
        busy = {
            stage: statistics.median(r["stages"][stage]["busy_s"] for r in runs) / steps * 1e3
            for stage in ("rollout", "reward", "pack", "rescore", "update")
            if stage in runs[0]["stages"]  # no rescore stage with proximal_in_step
        }
        print("stage busy, ms per step: " + ", ".join(f"{k} {v:.0f}" for k, v in busy.items()))
        for key in ("waited_s", "push_s", "latency_p50_s"):
            print(f"{key}: median {median_of(runs, key) * 1e3:.0f} ms")
        print(f"lag max: {max(r['lag_max'] for r in runs)}")
    learning(by_mode, args)


def learning(by_mode: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Reward per update in every mode, on the same scale: the mean reward of each step's
    batch (pooled over rounds), its mean over the first and the second half of the steps,
    and the final policy's held-out reward, so a faster mode that learns less shows."""
    total = args.warmup + args.steps
    half = total // 2
    print("\nlearning per update (mean reward of each step's batch of B x G completions;")
    print(f"steps 0-{half - 1} and {half}-{total - 1}; held out: {args.eval_prompts} new")
    print("prompts x G draws of the final policy, same prompts and keys in every mode)")
    print(
        "| mode | reward, steps 1st half | 2nd half | last step | first step at >= 0.5 "
        "(per round) | held out (per round) |"
    )
    print("|---|---:|---:|---:|---|---|")
    for mode, runs in by_mode.items():
        series = [r["rewards"] for r in runs if len(r.get("rewards") or []) == total]
        if not series:
            continue
        first = statistics.fmean(v for rs in series for v in rs[:half])
        second = statistics.fmean(v for rs in series for v in rs[half:])
        last = statistics.fmean(rs[-1] for rs in series)
        held = ", ".join(f"{r['eval_reward']:.3f}" for r in runs)
        reached = ", ".join(
            str(next((i for i, v in enumerate(r["rewards"]) if v >= 0.5), "-")) for r in runs
        )
        print(f"| {mode} | {first:.4f} | {second:.4f} | {last:.4f} | {reached} | {held} |")
    for mode, runs in by_mode.items():
        for r in runs:
            steps = " ".join(f"{v:.3f}" for v in r.get("rewards") or [])
            print(f"{mode} reward per step: {steps}")


def main() -> None:
    args = arguments()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "decoder.pkl"
        start = time.perf_counter()
        prelude(args, weights)
        print(f"prelude trained in {time.perf_counter() - start:.1f} s; load {os.getloadavg()}")
        results = []
        for index in range(args.rounds):
            shift = index % len(args.modes)
            order = args.modes[shift:] + args.modes[:shift]
            round_results = []
            args.seed = index if args.seeds == "per-round" else 0
            for mode in order:
                result = run_worker(mode, args, weights)
                round_results.append(result)
                brief = {k: v for k, v in result.items() if k not in ("edges", "stages")}
                print(json.dumps({"round": index, **brief}), flush=True)
            results.append(round_results)
        summary(results, args)
        print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    print_machine()
    main()
