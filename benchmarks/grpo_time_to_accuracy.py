"""GRPO time to accuracy from one weak start: dew_pipe's asynchronous pipeline against TRL.

What it measures: how fast GRPO itself lifts a weak model, side by side with TRL's
``GRPOTrainer``. Both sides start from the same weak checkpoint and see the same prompts:

1. **The weak start.** A fresh decoder (``SFTRecipe()``) is SFT-trained on the generated
   arithmetic task (``ArithmeticTask(seed=--seed)``: three-digit addition, reversed answers)
   only until its greedy exact match on the 1000 held-out problems first lands in
   ``--band`` (checked every ``--check-every`` steps). It is saved with ``Pretrained.save``
   in the transformers Llama layout and the task's tokenizer with ``save_pretrained``;
   dew_pipe reads it back with ``load_pretrained``, TRL with ``AutoModelForCausalLM`` and
   ``AutoTokenizer``. The checkpoint is kept in ``--work`` and reused by later runs.
2. **The runs.** Each learning rate of each side's sweep trains for ``--budget`` seconds in
   a fresh worker process, sides alternating: dew_pipe through the embedded job's GRPO
   phase (``pipelines/arithmetic.py``: ``NativeRolloutServer`` rollouts one update ahead of
   the update stage, ``max_lag=1``; with ``--dew-rollouts async,sync`` also the job's
   ``rollout="sync"``, the library's synchronous ``Trainer(rollout=SampledRollout)`` loop, as
   the side ``dew_pipe-sync``, and with ``curriculum`` that loop serving the same pool
   through a ``PassRateCurriculum`` that rests each problem whose last group was all right
   for ``--curriculum-rest`` passes, as ``dew_pipe-curriculum``; ``curriculum-drop`` adds
   the job's ``drop_zero_advantage``, so each update trains only the problems whose group's
   rewards differ, as ``dew_pipe-curriculum-drop``), TRL in the reference
   environment (TRL 1.16 on PyTorch
   CPU: ``use_cpu=True``, float32, on-policy, one update per generation batch). Both sides:
   ``--prompts`` problems x ``--groups`` completions per update, at most
   ``task.max_new_tokens`` (5) completion ids, sampled at ``--temperature`` (1), no KL
   term, clip 0.2, group standardised advantages, AdamW (b2 0.98, no weight decay, gradient
   norm clipped to 1, ``--warmup`` linear warm-up updates then a constant rate), the same
   training problems in the same order (``shuffle=False`` / ``shuffle_dataset=False``). TRL
   keeps its GRPO loss defaults (``loss_type="dapo"``, ``scale_rewards="group"``); gradient
   checkpointing, which TRL turns on by default to save memory, is turned off (it only
   costs time here).
3. **The clock.** Each worker copies the policy weights to host memory every
   ``--snapshot-every`` seconds of its clock (dew_pipe's clock starts when its GRPO phase
   starts, compiles included; TRL's when ``trainer.train()`` is called) and writes them out
   after the budget. This script then scores every snapshot with one evaluator (greedy
   exact match on the same 1000 held-out problems, dew_pipe's ``task.evaluate``), so no
   evaluation runs on either clock. A threshold's time is the first snapshot at or above it,
   so times have the snapshot interval's resolution.

It prints, per run, the time to 50%, 70% and 90% held out, the peak and when it came; the
best learning rate of each side (the one reaching the highest threshold soonest, then the
higher peak); for each dew_pipe side, the ratios of its best run's times to TRL's best run's,
and how soon it reached TRL's peak.
``--work`` keeps ``results.json`` (every curve) and ``time_to_accuracy.png``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/grpo_time_to_accuracy.py            # the RESULTS.md figures
    .venv/bin/python benchmarks/grpo_time_to_accuracy.py --budget 120 --dew-lrs 1e-3 \\
        --trl-lrs 1e-3                                                # a short development run

The TRL side's interpreter: ``--reference-python``, else ``$DEW_PIPE_REFERENCE_PYTHON``,
else ``.reference-venv/bin/python`` (``benchmarks/reference_env.sh`` builds it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, print_machine
from reference import add_reference_argument, reference_python

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "arithmetic.py"
THRESHOLDS = (0.5, 0.7, 0.9)
# dew_pipe's sides, by the embedded job's `rollout` setting: the asynchronous pipeline, the
# library's synchronous loop (Trainer(rollout=SampledRollout)), and that loop serving its
# problems through a PassRateCurriculum (the job's `curriculum` setting, --curriculum-rest),
# with or without training only the groups whose rewards differ (`drop_zero_advantage`).
ROLLOUTS = {
    "async": "dew_pipe",
    "sync": "dew_pipe-sync",
    "curriculum": "dew_pipe-curriculum",
    "curriculum-drop": "dew_pipe-curriculum-drop",
}
CURRICULUM = ("curriculum", "curriculum-drop")
SIDES = (*ROLLOUTS.values(), "trl")
UPDATE_CAP = 100_000  # more updates than any budget allows; the clock ends each run


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--snapshot-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--seed", type=int, default=2, help="the task's and the SFT's seed")
    parser.add_argument("--band", type=float, nargs=2, default=(0.2, 0.4), metavar=("LOW", "HIGH"))
    parser.add_argument("--check-every", type=int, default=10, help="SFT steps between checks")
    parser.add_argument("--prompts", type=int, default=32, help="problems per update")
    parser.add_argument("--groups", type=int, default=8, help="completions per problem")
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up updates")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--pool", type=int, default=64_000, help="distinct training problems")
    parser.add_argument("--slots", type=int, default=512, help="dew_pipe server rows")
    parser.add_argument("--ahead", type=int, default=1, help="dew_pipe batches rolled out ahead")
    parser.add_argument("--max-lag", type=int, default=1, help="dew_pipe's staleness bound")
    parser.add_argument(
        "--proximal-in-step",
        choices=("true", "false"),
        default="true",
        help="dew_pipe: proximal likelihoods from the update's forward pass (false: a rescore stage)",
    )
    parser.add_argument("--dew-lrs", default="3e-4,1e-3,3e-3", help="comma-separated")
    parser.add_argument(
        "--dew-rollouts",
        default="async",
        help="comma-separated dew_pipe sides: async (the pipeline), sync (the synchronous "
        "loop), curriculum (the synchronous loop with a pass-rate curriculum), "
        "curriculum-drop (that, training only the groups whose rewards differ)",
    )
    parser.add_argument(
        "--curriculum-rest",
        type=int,
        default=1,
        help="the curriculum sides: passes over the pool a solved problem sits out",
    )
    parser.add_argument("--trl-lrs", default="3e-4,1e-3,3e-3", help="comma-separated")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "grpo-time-to-accuracy")
    parser.add_argument("--fresh", action="store_true", help="rebuild the weak checkpoint")
    add_reference_argument(parser)
    # The workers' own arguments (the parent passes them).
    parser.add_argument("--dew-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--rollout", choices=ROLLOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the weak start


def weak_checkpoint(args: argparse.Namespace) -> dict:
    """The weak checkpoint in ``work/checkpoint`` (made or reused) and its record."""
    directory = args.work / "checkpoint"
    record_file = directory / "weak.json"
    low, high = args.band
    if record_file.is_file() and not args.fresh:
        record = json.loads(record_file.read_text())
        if record["seed"] == args.seed and low <= record["held_out"] <= high:
            print(f"weak start reused: {directory} ({json.dumps(record)})", flush=True)
            return record
    import jax

    from dew_pipe.models import Pretrained
    from dew_pipe.tasks import ArithmeticTask
    from dew_pipe.tasks.recipe import SFTRecipe, train_sft

    task = ArithmeticTask(seed=args.seed)
    start = time.perf_counter()
    model, state = train_sft(
        task, SFTRecipe(), key=jax.random.key(args.seed), until=low, check_every=args.check_every
    )
    held_out = task.evaluate(model, state.params)
    step = int(state.step)
    if not low <= held_out <= high:
        raise SystemExit(
            f"SFT of seed {args.seed} went from below {low:.0%} to {held_out:.1%} held out at "
            f"step {step}, past the band {low:.0%}-{high:.0%}; pass --check-every lower or "
            "another --seed"
        )
    if directory.exists():
        shutil.rmtree(directory)
    pretrained = Pretrained.from_model(
        model, state.params, eos_token_id=task.eos_id, pad_token_id=task.pad_id, bos_token_id=1
    )
    pretrained.save(state.params, directory)
    task.tokenizer().save_pretrained(directory)
    record = {
        "seed": args.seed,
        "sft_steps": step,
        "held_out": held_out,
        "max_new_tokens": task.max_new_tokens,
        "sft_s": round(time.perf_counter() - start, 1),
    }
    record_file.write_text(json.dumps(record) + "\n")
    print(f"weak start made: {directory} ({json.dumps(record)})", flush=True)
    return record


def problem_file(args: argparse.Namespace) -> Path:
    """The training pool (in order) and the held-out problems, as JSON for both workers."""
    from dew_pipe.tasks import ArithmeticTask

    task = ArithmeticTask(seed=args.seed)
    problems = {"train": task.records("train", args.pool), "test": task.records("test")}
    path = args.work / "problems.json"
    path.write_text(json.dumps(problems))
    return path


# ---------------------------------------------------------------- the clock


class Snapshots:
    """Host copies of the policy weights every ``every`` seconds of a run's clock.

    ``take(updates, weights)`` keeps a copy when a snapshot is due and returns whether the
    budget has run out. The clock starts at construction.
    """

    def __init__(self, every: float, budget: float, copy) -> None:
        self.every, self.budget, self.copy = every, budget, copy
        self.start = time.perf_counter()
        self.taken: list[tuple[float, int, object]] = []
        self.due = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.start

    def take(self, updates: int, weights) -> bool:
        now = self.clock()
        if now >= self.due:
            self.taken.append((round(now, 2), updates, self.copy(weights)))
            self.due = now + self.every
        return now >= self.budget

    def write(self, out: Path, save) -> None:
        """``save(weights, directory)`` for each snapshot, then ``snapshots.json``."""
        index = []
        for number, (clock, updates, weights) in enumerate(self.taken):
            directory = out / f"snapshot-{number:04d}"
            save(weights, directory)
            index.append({"dir": directory.name, "clock_s": clock, "updates": updates})
        (out / "snapshots.json").write_text(json.dumps(index) + "\n")


# ---------------------------------------------------------------- the dew_pipe side


def dew_worker(args: argparse.Namespace) -> dict:
    """One dew_pipe run: the embedded job's GRPO phase from the checkpoint, on the clock."""
    import io

    import jax
    import numpy as np
    from rich.console import Console

    from dew_pipe.cli import load_file
    from dew_pipe.flow import Cancelled, MetricsWriter, RunContext
    from dew_pipe.flow.display import Display
    from dew_pipe.models import load_pretrained

    pretrained = load_pretrained(args.work / "checkpoint")
    job = load_file(PIPELINE).pipeline(
        seed=args.seed,
        prompts=args.prompts,
        groups=args.groups,
        learning_rate=args.lr,
        warmup=args.warmup,
        schedule="constant",
        grpo_steps=UPDATE_CAP,
        grpo_eval_every=UPDATE_CAP,
        sample_probe=0,
        slots=args.slots,
        ahead=args.ahead,
        max_lag=args.max_lag,
        proximal_in_step=args.proximal_in_step == "true",
        temperature=args.temperature,
        rollout="sync" if args.rollout in CURRICULUM else args.rollout,
        curriculum=args.curriculum_rest if args.rollout in CURRICULUM else 0,
        drop_zero_advantage=args.rollout == "curriculum-drop",
        guide=False,  # the recorded runs predate the guide; the job's default turns it on
        grpo_until=None,  # the clock decides when a run ends, not an accuracy check
    )
    args.out.mkdir(parents=True, exist_ok=True)
    context = RunContext(
        args.out,
        {},
        MetricsWriter(args.out / "metrics.jsonl"),
        Display(Console(file=io.StringIO()), live=False),
    )
    problems = job.task.prompts("train", args.pool, shuffle=False)
    data = problems.arrays() if args.rollout in CURRICULUM else problems.load(args.prompts)

    def host(params):
        return jax.tree.map(np.array, jax.device_get(params))  # a copy: buffers are donated

    snapshots = Snapshots(args.snapshot_every, args.budget, host)
    snapshots.take(0, pretrained.variables)

    def after_update(updates: int, state) -> None:
        if snapshots.take(updates, state.params):
            context.cancel.set()  # the budget is spent: the job stops at the next update

    with contextlib.suppress(Cancelled):  # how the budget ends a run
        job.grpo(context, pretrained.model, pretrained.variables, data, after_update)
    end = snapshots.clock()
    snapshots.write(args.out, lambda weights, directory: pretrained.save(weights, directory))
    return {"updates": snapshots.taken[-1][1], "clock_s": round(end, 1)}


# ---------------------------------------------------------------- the TRL side


def exact(text: str, truth: str) -> float:
    """The task's exact-match rule for reversed answers (dew_pipe.tasks.problems), in plain
    Python for the reference environment: cut at ``</s>``, strip, reverse, compare."""
    answer = text.split("</s>", 1)[0].strip()
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    if digits.isdigit():
        answer = sign + digits[::-1]
    return float(answer == truth)


def trl_worker(args: argparse.Namespace) -> dict:
    """One TRL run (in the reference environment): GRPOTrainer from the checkpoint."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    checkpoint = args.work / "checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    problems = json.loads((args.work / "problems.json").read_text())
    budget = json.loads((checkpoint / "weak.json").read_text())["max_new_tokens"]
    start_accuracy = trl_greedy(model, tokenizer, problems["test"], budget)

    def reward(prompts, completions, completion_ids, ground_truth, **_):
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        return [exact(t, g) for t, g in zip(texts, ground_truth, strict=True)]

    rows = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in problems["train"]]

    def copy(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    snapshots: Snapshots | None = None

    class Clock(TrainerCallback):
        def on_step_end(self, train_args, state, control, **_):
            if snapshots.take(state.global_step, model):
                control.should_training_stop = True

    with tempfile.TemporaryDirectory() as scratch:
        config = GRPOConfig(
            output_dir=scratch,
            use_cpu=True,
            bf16=False,
            learning_rate=args.lr,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=args.warmup,
            adam_beta2=0.98,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=args.prompts * args.groups,
            num_generations=args.groups,
            max_completion_length=budget,
            temperature=args.temperature,
            beta=0.0,
            shuffle_dataset=False,
            gradient_checkpointing=False,
            max_steps=UPDATE_CAP,
            save_strategy="no",
            report_to=[],
            logging_steps=50,
            disable_tqdm=True,
            seed=args.seed,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        snapshots = Snapshots(args.snapshot_every, args.budget, copy)
        snapshots.take(0, model)
        trainer.train()
        end = snapshots.clock()

    def save(weights, directory):
        model.load_state_dict(weights)
        model.save_pretrained(directory)

    snapshots.write(args.out, save)
    return {
        "updates": snapshots.taken[-1][1],
        "clock_s": round(end, 1),
        "start_held_out_transformers": start_accuracy,
        "torch": torch.__version__,
    }


def trl_greedy(model, tokenizer, records: list[dict], budget: int) -> float:
    """Greedy exact match by transformers' ``generate`` (a check that both sides start from
    the same model; not used for the curves)."""
    import torch

    prompts = [r["prompt"] for r in records]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])
    scores = [exact(t, r["ground_truth"]) for t, r in zip(texts, records, strict=True)]
    return sum(scores) / len(scores)


# ---------------------------------------------------------------- the parent


def run_worker(args: argparse.Namespace, side: str, lr: float) -> dict:
    """Runs one worker process and returns its report, with its snapshots' directory."""
    out = args.work / "runs" / f"{side}-lr{lr:g}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if side == "trl":
        command = [args.reference_python, __file__, "--trl-worker"]
    else:
        rollout = next(r for r, name in ROLLOUTS.items() if name == side)
        command = [sys.executable, __file__, "--dew-worker", "--rollout", rollout]
    command += ["--lr", repr(lr), "--out", str(out)]
    names = (
        "budget",
        "snapshot_every",
        "seed",
        "prompts",
        "groups",
        "warmup",
        "pool",
        "work",
        "slots",
        "ahead",
        "max_lag",
        "proximal_in_step",
        "temperature",
        "curriculum_rest",
    )
    for name in names:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the {side} worker (lr {lr:g}) failed:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report | {"side": side, "lr": lr, "dir": str(out), "load": [load, os.getloadavg()[0]]}


def evaluate(run: dict, task, model) -> list[dict]:
    """Held-out greedy exact match of every snapshot of a run, by dew_pipe's evaluator."""
    from dew_pipe.models import load_pretrained

    out = Path(run["dir"])
    curve = []
    for entry in json.loads((out / "snapshots.json").read_text()):
        variables = load_pretrained(out / entry["dir"]).variables
        accuracy = task.evaluate(model, variables)
        curve.append(
            {"clock_s": entry["clock_s"], "updates": entry["updates"], "held_out": accuracy}
        )
    return curve


def time_to(curve: list[dict], level: float) -> float | None:
    """The clock of the first snapshot at or above ``level`` (None: never)."""
    return next((p["clock_s"] for p in curve if p["held_out"] >= level), None)


def updates_to(curve: list[dict], level: float) -> int | None:
    """The updates done by the first snapshot at or above ``level`` (None: never): how
    much each side learns per update, apart from how fast it updates."""
    return next((p["updates"] for p in curve if p["held_out"] >= level), None)


def summarize(curve: list[dict]) -> dict:
    peak = max(curve, key=lambda p: p["held_out"])  # the first snapshot at the peak
    return {
        "start": curve[0]["held_out"],
        "time_to": {f"{t:.0%}": time_to(curve, t) for t in THRESHOLDS},
        "updates_to": {f"{t:.0%}": updates_to(curve, t) for t in THRESHOLDS},
        "peak": peak["held_out"],
        "peak_s": peak["clock_s"],
        "final": curve[-1]["held_out"],
    }


def ranking(run: dict) -> tuple:
    """Sort key of a sweep: the highest threshold reached, reached soonest, then the peak."""
    times = list(run["summary"]["time_to"].values())
    reached = [t for t in times if t is not None]
    return (len(reached), -(reached[-1] if reached else 0.0), run["summary"]["peak"])


def seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


def reached(time: float | None, updates: int | None) -> str:
    return "not reached" if time is None else f"{time:.0f} s ({updates} u)"


def report(args: argparse.Namespace, weak: dict, runs: list[dict]) -> dict:
    print(
        f"\nweak start: seed {weak['seed']}, {weak['sft_steps']} SFT steps, "
        f"{weak['held_out']:.1%} held out; {args.prompts} x {args.groups} completions per "
        f"update, {args.budget:.0f} s per run, snapshots every {args.snapshot_every:g} s"
    )
    head = " | ".join(f"to {t:.0%}" for t in THRESHOLDS)
    print(
        f"\n(u: updates done by then)\n| side | lr | updates | {head} | peak (at) | final | load |"
    )
    print("|---|---:|---:|" + "---:|" * len(THRESHOLDS) + "---|---:|---|")
    for run in runs:
        s = run["summary"]
        times = " | ".join(
            reached(t, u)
            for t, u in zip(s["time_to"].values(), s["updates_to"].values(), strict=True)
        )
        print(
            f"| {run['side']} | {run['lr']:g} | {run['updates']} | {times} | "
            f"{s['peak']:.1%} ({s['peak_s']:.0f} s) | {s['final']:.1%} | "
            f"{run['load'][0]:.1f} -> {run['load'][1]:.1f} |"
        )
    best = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        if mine:
            best[side] = max(mine, key=ranking)
            print(f"best {side}: lr {best[side]['lr']:g}")
    verdict: dict = {"best": {k: v["lr"] for k, v in best.items()}}
    if "trl" in best:
        for side in ROLLOUTS.values():
            if side in best:
                verdict[side] = against_trl(side, best[side], best["trl"])
    return verdict


def against_trl(side: str, ours: dict, theirs: dict) -> dict:
    """Prints and returns one dew_pipe side's times against TRL's (both their best runs)."""
    print(f"\n{side} against TRL:")
    ratios = {}
    for level in THRESHOLDS:
        a, b = time_to(ours["curve"], level), time_to(theirs["curve"], level)
        # no ratio when either never got there, or dew_pipe started there (0 s)
        ratio = None if not a or b is None else round(b / a, 2)
        ratios[f"{level:.0%}"] = ratio
        print(f"time to {level:.0%}: {side} {seconds(a)}, TRL {seconds(b)}", end="")
        print("" if ratio is None else f" (TRL / {side} {ratio:.2f}x)", end="")
        u, v = updates_to(ours["curve"], level), updates_to(theirs["curve"], level)
        dash = ("-" if n is None else n for n in (u, v))
        print(f"; updates by then: {side} {{}}, TRL {{}}".format(*dash))
    peak, peak_s = theirs["summary"]["peak"], theirs["summary"]["peak_s"]
    reach = time_to(ours["curve"], peak)
    print(
        f"TRL's peak {peak:.1%} came at {peak_s:.0f} s; {side} reached it at {seconds(reach)}"
        + ("" if reach is None else f" ({peak_s / max(reach, 1e-9):.2f}x sooner)")
    )
    return {"ratios": ratios, "trl_peak": peak, "trl_peak_s": peak_s, "reaches_trl_peak_s": reach}


def plot(runs: list[dict], best: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    colours = {
        "dew_pipe": "tab:blue",
        "dew_pipe-sync": "tab:green",
        "dew_pipe-curriculum": "tab:purple",
        "dew_pipe-curriculum-drop": "tab:red",
        "trl": "tab:orange",
    }
    for run in runs:
        chosen = best.get(run["side"]) == run["lr"]
        axis.plot(
            [p["clock_s"] for p in run["curve"]],
            [100 * p["held_out"] for p in run["curve"]],
            color=colours[run["side"]],
            alpha=1.0 if chosen else 0.3,
            linewidth=2 if chosen else 1,
            label=f"{run['side']} lr {run['lr']:g}",
        )
    for level in THRESHOLDS:
        axis.axhline(100 * level, color="grey", linewidth=0.5, linestyle=":")
    axis.set_xlabel("seconds of training (evaluation excluded)")
    axis.set_ylabel("held-out greedy exact match (%)")
    axis.set_ylim(0, 100)
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    args = arguments()
    if args.dew_worker or args.trl_worker:
        result = (dew_worker if args.dew_worker else trl_worker)(args)
        print(json.dumps(result), flush=True)
        return
    args.reference_python = reference_python(args.reference_python)
    args.work.mkdir(parents=True, exist_ok=True)
    weak = weak_checkpoint(args)
    problem_file(args)
    dew_lrs = [float(x) for x in args.dew_lrs.split(",") if x]
    sweeps = {}
    for rollout in (r.strip() for r in args.dew_rollouts.split(",") if r.strip()):
        if rollout not in ROLLOUTS:
            raise SystemExit(f"--dew-rollouts: {rollout!r}; expected some of {sorted(ROLLOUTS)}")
        sweeps[ROLLOUTS[rollout]] = dew_lrs
    sweeps["trl"] = [float(x) for x in args.trl_lrs.split(",") if x]
    order = []  # alternate the sides, so drifting load falls on both
    for index in range(max(map(len, sweeps.values()))):
        order += [(side, lrs[index]) for side, lrs in sweeps.items() if index < len(lrs)]
    from dew_pipe.models import load_pretrained
    from dew_pipe.tasks import ArithmeticTask

    task = ArithmeticTask(seed=args.seed)
    model = load_pretrained(args.work / "checkpoint").model
    runs = []
    for side, lr in order:
        run = run_worker(args, side, lr)
        run["curve"] = evaluate(run, task, model)
        run["summary"] = summarize(run["curve"])
        print(json.dumps({k: run[k] for k in ("side", "lr", "updates", "summary")}), flush=True)
        runs.append(run)
    verdict = report(args, weak, runs)
    results = {"machine": describe(), "args": {k: str(v) for k, v in vars(args).items()}}
    results |= {"weak": weak, "runs": runs, "verdict": verdict}
    (args.work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(runs, verdict["best"], args.work / "time_to_accuracy.png")
    print(f"\nresults: {args.work / 'results.json'}, {args.work / 'time_to_accuracy.png'}")


if __name__ == "__main__":
    print_machine()
    main()
