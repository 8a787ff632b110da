"""Multi-turn tool use: SFT, then asynchronous GRPO on episodes with a calculator worker.

    dew-pipe run pipelines/tool_calc.py [--set seed=1 --set grpo_steps=80 ...]

The task (:class:`~dew_pipe.tasks.tool_calc.ToolCalcTask`) is generated from the seed:
multiplication problems ``"37*48="`` that a small decoder cannot work out itself, and a
calculator it can call (``#37*48</s>``, answered ``@1776``) before it answers
(``A1776</s>``). The job

1. runs an SFT warm-up (:func:`~dew_pipe.tasks.recipe.train_sft`) on generated transcripts,
   a share ``tool_share`` of which call the tool while the rest answer at once; the model
   learns both kinds of turn, but under greedy decoding it answers at once, and wrongly;
2. measures held-out success (``test_size`` problems it never trains on): one greedy
   episode per problem through an ``EnvironmentSource`` on a greedy ``NativeRolloutServer``,
   every episode's tool a worker process (``SubprocessEnvironment``, the JSON-lines program
   :mod:`dew_pipe.tasks.tool_calc_worker`): the "before" figure;
3. runs asynchronous GRPO through the stages of :func:`dew_pipe.stages.build_graph`: task
   batches → rollout (an ``EnvironmentSource`` on the sampling ``NativeRolloutServer``,
   ``groups`` episodes per problem, each turn of each episode a request that joins the
   server's continuous batch, each episode's tool a worker process) → reward (the verifier
   has scored each episode already) → pack (each episode one append-only chain) → rescore →
   update (a ``Train`` stage), probing held-out success every ``eval_every`` updates;
4. measures held-out success again ("after"), prints both, and writes ``summary.json``,
   ``metrics.jsonl`` and ``progress.png`` (:func:`dew_pipe.tasks.plot.plot_run`) into the run
   directory.

What GRPO learns here is *when to call the tool*: a group of ``groups`` episodes holds some
that called it (and got the answer right) and some that answered at once (and got it wrong),
so the calls get positive advantages. ``tool_share`` in the metrics is the share of sampled
episodes that called it. ``benchmarks/RESULTS.md`` records what the default run reaches and
how long it takes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import threading
import time
import types
from typing import Any

import jax
import optax

from dew_pipe import Trainer
from dew_pipe._validate import check_float, check_int
from dew_pipe.flow import Cancelled, Pipeline, RunContext
from dew_pipe.inference import EnvironmentSource, NativeRolloutServer, Server, ServeTask
from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
from dew_pipe.sampling import Sampling
from dew_pipe.stages import GraphSettings, TaskBatches, build_graph, rescorer
from dew_pipe.tasks.plot import plot_run
from dew_pipe.tasks.recipe import SFTRecipe, train_sft
from dew_pipe.tasks.tool_calc import ToolCalcTask


def pipeline(
    # --- the task
    seed: int = 0,  # seeds the task, the initialization and the sampling
    digits: int = 2,  # the most digits an operand has
    min_digits: int = 2,  # the fewest: products of two 2-digit numbers, too hard to guess
    tool_share: float = 0.4,  # share of SFT transcripts that call the tool; below one half,
    #   so greedy decoding after SFT answers at once (see the module docstring)
    max_turns: int = 3,  # the most model calls per episode (a call, another, an answer)
    # --- SFT
    sft_steps: int = 600,  # SFT updates (batches of 32 rows of 64 ids)
    sft_learning_rate: float = 5e-3,  # peak AdamW learning rate of SFT
    # --- GRPO
    grpo_steps: int = 40,  # GRPO updates
    prompts: int = 8,  # problems per GRPO batch
    groups: int = 8,  # episodes sampled per problem (G); advantages compare them
    learning_rate: float = 5e-4,  # peak AdamW learning rate of GRPO (a fresh optimizer); 1e-3
    #   and above broke the copying of tool results (see benchmarks/RESULTS.md)
    warmup: int = 5,  # linear warm-up updates, then a cosine decay to a tenth of the peak
    epsilon: float = 0.2,  # PPO clip range, both sides
    max_lag: int = 1,  # most updates a trained episode's oldest turn may lag its update
    ahead: int = 1,  # task batches rolled out beyond the one being trained
    slots: int = 64,  # rows the sampling server decodes together
    workers: int = 32,  # episodes running at once (threads; each waits on its draws)
    eval_every: int = 10,  # GRPO updates between held-out probes
    # --- evaluation
    test_size: int = 200,  # held-out problems, one greedy episode each per probe
) -> ToolCalcJob:
    """The tool-use job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> job = pipeline(grpo_steps=10)
      >>> job.graph.width, job.graph.rows, job.task.max_turns
      (37, 64, 3)
      >>> pipeline(groups=1)
      Traceback (most recent call last):
      ...
      ValueError: groups is 1; expected an int >= 2
    """
    settings = types.SimpleNamespace(**locals())  # first: the parameters, written once above
    check_int("seed", seed, minimum=0, maximum=2**31 - 1)
    check_int("sft_steps", sft_steps, minimum=2)
    for name in ("grpo_steps", "prompts", "slots", "workers", "eval_every"):
        check_int(name, getattr(settings, name), minimum=1)
    check_int("groups", groups, minimum=2)
    check_int("warmup", warmup, minimum=0)
    for name in ("sft_learning_rate", "learning_rate"):
        check_float(name, getattr(settings, name), above=0.0)
    check_float("epsilon", epsilon, minimum=0.0, maximum=1.0)
    task = ToolCalcTask(
        seed, digits, min_digits=min_digits, tool_share=tool_share, max_turns=max_turns,
        test_size=test_size,
    )  # fmt: skip
    graph = GraphSettings(
        width=task.width,  # an episode is one append-only chain of at most P + R ids
        rows=prompts * groups,  # so a batch's episodes always fit one row each
        groups=groups,
        max_lag=max_lag,
        ahead=ahead,
        # An episode cut by its turns or its context never answered: wrong, and trained as
        # such. Masking it instead ("mask") would leave calling the tool forever unpunished.
        truncation="zero",
        reward_workers=1,  # the source scores each episode; the stage only passes them on
    )
    return ToolCalcJob(settings, task, graph)


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`ToolCalcJob` reports (also written as ``summary.json``).

    Attributes:
      before: held-out success after SFT (share of ``test_size`` greedy episodes).
      after: the same after GRPO.
      tool_share_before, tool_share_after: share of those episodes that called the tool.
      sft_s, grpo_s, wall_s: wall seconds of SFT, of GRPO and of the whole job.
      cpu_s: CPU seconds of the process and its finished children (the tool workers).
      load: 1-minute load average at the start and at the end.
      run_dir: the run directory.
    """

    before: float
    after: float
    tool_share_before: float
    tool_share_after: float
    sft_s: float
    grpo_s: float
    wall_s: float
    cpu_s: float
    load: tuple[float, float]
    run_dir: str


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Episodes:
    """Counts the episodes an EnvironmentSource finished and how many called the tool; says
    why the first few failed episodes failed (``report``)."""

    def __init__(self, report: Any = None, failures: int = 3) -> None:
        self._lock = threading.Lock()
        self.count = self.called = 0
        self.report, self.failures = report, failures

    def __call__(self, task: Any, episode: Any) -> None:
        called = ToolCalcTask.called_tool(episode)
        with self._lock:
            self.count, self.called = self.count + 1, self.called + called
            tell = episode.status.value == "error" and self.report is not None and self.failures
            self.failures -= bool(tell)
        if tell:
            self.report(f"a failed episode of task {task.id} (resubmitted): {episode.detail}")

    def take(self) -> float | None:
        """The share of episodes that called the tool since the last take (None: none)."""
        with self._lock:
            count, called, self.count, self.called = self.count, self.called, 0, 0
        return called / count if count else None


class ToolCalcJob:
    """SFT then asynchronous GRPO on tool episodes; ``run(context)`` runs it.

    Made by :func:`pipeline`, which checks the settings.
    """

    def __init__(self, settings: types.SimpleNamespace, task: ToolCalcTask, graph: GraphSettings):
        self.settings, self.task, self.graph = settings, task, graph
        self.context: RunContext | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self.settings).items())
        return f"ToolCalcJob({fields})"

    def run(self, context: RunContext) -> JobResult:
        """Run the job with ``context`` (what ``dew-pipe run`` passes).

        Raises:
          Cancelled: ``context.cancel`` was set (Ctrl-C); the servers are closed and every
            thread joined before it propagates.
        """
        self.context = context
        start, cpu0, load0 = time.monotonic(), _cpu_seconds(), os.getloadavg()[0]
        s, task = self.settings, self.task
        digits = f"{s.digits}" if s.min_digits == s.digits else f"{s.min_digits}-{s.digits}"
        context.print(
            f"tool_calc job: {digits}-digit products with a calculator worker "
            f"(at most {s.max_turns} turns), {s.sft_steps} SFT steps ({s.tool_share:.0%} of the "
            f"transcripts call the tool), then {s.grpo_steps} GRPO updates of {s.prompts} x "
            f"{s.groups} episodes; held-out test: {s.test_size} problems"
        )
        task.tokenizer().save_pretrained(context.run_dir / "tokenizer")
        model, params = self._sft()
        sft_s = time.monotonic() - start
        greedy = self._server(model, params, temperature=0.0, slots=min(s.slots, s.test_size))
        try:
            before, used_before = self._probe(greedy, "sft", 0, params)
            context.print(
                f"SFT done in {sft_s:.0f} s: held-out success {before:.1%} (greedy episodes "
                f"calling the tool: {used_before:.0%}); now GRPO"
            )
            context.log(step=0, phase="grpo", held_out=round(before, 4))  # GRPO's update 0
            grpo_start = time.monotonic()
            params = self._grpo(model, params, greedy)
            grpo_s = time.monotonic() - grpo_start
            after, used_after = self._probe(greedy, "grpo", s.grpo_steps, params)
        finally:
            greedy.close()
        result = JobResult(
            before=before, after=after, tool_share_before=used_before,
            tool_share_after=used_after, sft_s=round(sft_s, 1), grpo_s=round(grpo_s, 1),
            wall_s=round(time.monotonic() - start, 1), cpu_s=round(_cpu_seconds() - cpu0, 1),
            load=(round(load0, 2), round(os.getloadavg()[0], 2)), run_dir=str(context.run_dir),
        )  # fmt: skip
        context.metrics.write("values", phase="final", **dataclasses.asdict(result))
        summary = dataclasses.asdict(result) | {"settings": vars(s)}
        (context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot = plot_run(context.run_dir / "metrics.jsonl", context.run_dir / "progress.png")
        context.print(f"held-out success before GRPO: {before:.1%} (tool calls {used_before:.0%})")
        context.print(f"held-out success after GRPO: {after:.1%} (tool calls {used_after:.0%})")
        context.print(
            f"wall time: {result.wall_s:.0f} s (SFT {sft_s:.0f} s, GRPO {grpo_s:.0f} s; "
            f"{result.cpu_s:.0f} CPU s with the workers, load {load0:.1f} -> {result.load[1]:.1f})"
        )
        context.print(f"run directory: {context.run_dir} (metrics.jsonl, {plot.name})")
        return result

    # ------------------------------------------------------------------ phases

    def _cancelled(self) -> None:
        if self.context.cancelled:
            raise Cancelled("the tool_calc job was cancelled")

    def _server(self, model: Any, params: Any, *, temperature: float, slots: int) -> Any:
        sampling = Sampling(eos_id=self.task.eos_id, temperature=temperature)
        return NativeRolloutServer(
            Server.from_task(
                ServeTask(model, params, sampling),
                slots=slots,
                capacity=self.task.width - 1,
                buckets=(self.task.max_prompt_tokens,),  # one prefill width: fewer compiles
                seed=self.settings.seed,
                pad_id=self.task.pad_id,
            )
        )

    def _probe(self, greedy: Any, phase: str, step: int, params: Any) -> tuple[float, float]:
        """Held-out success of greedy episodes under ``params``, logged; and their tool use."""
        self._cancelled()
        greedy.load(params, step)
        episodes = _Episodes()
        success = self.task.success(greedy, "test", workers=self.settings.workers, record=episodes)
        used = episodes.take() or 0.0
        self.context.log(step=step, phase=phase, held_out=round(success, 4),
                         tool_share=round(used, 4))  # fmt: skip
        return success, used

    def _sft(self) -> tuple[Any, Any]:
        """The SFT warm-up from scratch: ``(model, trained variables)``."""
        s = self.settings
        recipe = SFTRecipe(
            steps=s.sft_steps, learning_rate=s.sft_learning_rate,
            warmup=min(100, max(1, s.sft_steps // 10)),
        )  # fmt: skip

        def progress(state: Any, batch: Any, key: Any) -> Any:  # runs before every SFT step
            self._cancelled()
            self.context.progress("SFT steps", int(state.step) + 1, s.sft_steps)
            return batch

        def log(record: dict[str, Any]) -> None:
            if "loss" in record:
                self.context.log(step=record["step"], phase="sft", loss=record["loss"])

        model, state = train_sft(
            self.task, recipe, key=jax.random.key(s.seed), log=log, progress=False,
            rollout=progress, log_every=max(1, min(50, s.sft_steps // 4)),
        )  # fmt: skip
        return model, state.params

    def _grpo(self, model: Any, params: Any, greedy: Any) -> Any:
        """Asynchronous GRPO from ``params``; returns the trained variables."""
        s, task, graph = self.settings, self.task, self.graph
        self._cancelled()
        objective = GRPOObjective(
            model, seq_len=graph.width - 1, pretrained=params, epsilon_low=s.epsilon,
            epsilon_high=s.epsilon, behavior_importance=2.0,  # TIS cap for lagging turns
        )  # fmt: skip
        graph.check_objective(objective)
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, s.learning_rate, s.warmup, max(s.grpo_steps, s.warmup + 1), 0.1 * s.learning_rate
        )
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        server = self._server(model, params, temperature=1.0, slots=s.slots)
        episodes = _Episodes(self.context.print)
        source = EnvironmentSource(
            server, task.environment(), task.verify, max_prompt_tokens=task.max_prompt_tokens,
            max_new_tokens=task.max_new_tokens, max_turns=task.max_turns, workers=s.workers,
            seed=s.seed, record=episodes,
        )  # fmt: skip
        try:
            prompts = task.prompts("train", s.prompts * (s.grpo_steps + s.ahead + 2), seed=s.seed)
            pipeline = build_graph(
                graph,
                tasks=TaskBatches(prompts.load(batch=s.prompts), prompt_tasks),
                source=source,
                weights=server,
                scorer=rescorer(objective),
                reward=None,  # the source's verifier scored every episode
                trainer=trainer,
                steps=s.grpo_steps,
                log=lambda step, metrics, record: self._on_update(
                    pipeline, greedy, episodes, step, metrics, record
                ),
                owns_source=True,
                name="tool-calc-grpo",
            )
            self.context.run_pipeline(pipeline)
            return jax.device_get(pipeline.stages["update"].state.params)
        finally:
            source.close()
            server.close()

    def _on_update(
        self, pipeline: Pipeline, greedy: Any, episodes: _Episodes, step: int,
        metrics: dict[str, float], record: Any,
    ) -> None:  # fmt: skip
        """After each GRPO update (on the update stage's thread): log, probe, show progress."""
        s = self.settings
        values: dict[str, Any] = {
            "loss": round(metrics["loss"], 5),
            "entropy": round(metrics.get("entropy", float("nan")), 4),
            "tool_share": episodes.take(),
        }
        if record is not None:
            values["reward"] = record.metrics.get("reward/mean")
            values["calls_per_chain"] = record.metrics.get("chains/calls_per_chain")
            values["infra_errors"] = record.resubmitted.get("infra_error", 0)
            values["lag"] = record.lag
            values["waited_s"] = round(record.waited_s, 3)
        values = {k: v for k, v in values.items() if v is not None and v == v}
        self.context.log(step=step + 1, phase="grpo", **values)
        self.context.progress("GRPO updates", step + 1, s.grpo_steps)
        done = step + 1
        if done % s.eval_every == 0 and done < s.grpo_steps:
            self._probe(greedy, "grpo", done, pipeline.stages["update"].state.params)
