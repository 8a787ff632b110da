"""The embedded default job: SFT, then asynchronous GRPO, on a generated arithmetic task.

``dew-pipe run pipelines/arithmetic.py`` runs :class:`ArithmeticJob`; everything it needs is
made from a seed (problems, the character tokenizer, the decoder). The job

1. builds an :class:`~dew_pipe.tasks.ArithmeticTask` and its tokenizer (saved in the run
   directory under ``tokenizer/``);
2. runs supervised fine-tuning (:func:`~dew_pipe.tasks.recipe.train_sft`) for
   ``sft_steps``, probing held-out greedy exact match and the sampled reward as it goes;
3. evaluates held-out exact match on the whole test split: the "before GRPO" figure;
4. runs asynchronous GRPO through the stages of :func:`dew_pipe.stages.grpo_pipeline`
   (task batches → rollout on a ``NativeRolloutServer`` via ``PromptSource``, which scores
   each draw with the task's exact-match reward → pack → rescore → update), probing
   held-out exact match every ``grpo_eval_every`` updates;
5. evaluates again ("after GRPO"), prints the summary, and writes ``summary.json`` and
   ``progress.png`` (:func:`dew_pipe.tasks.plot.plot_run`) into the run directory.

Everything it measures goes to the run's ``metrics.jsonl`` as ``values`` records with a
``phase`` ("sft", "grpo" or "final"), next to the flow counters of the GRPO pipeline.

Why GRPO starts where it does: GRPO sharpens the distribution the model already samples
from. A group of ``groups`` completions whose rewards are all equal has zero advantage and
teaches nothing, so GRPO only has signal where the model sometimes, but not always, gets a
problem right. SFT on this task learns in a sudden jump (carrying), whose step varies with
the seed; a model stopped before it (seed 2 after 900 SFT steps: 36% held out) samples too
few right answers for GRPO to climb from, and 1000 GRPO updates left it there. The default
SFT budget (1500 steps) is past the jump on every seed tried (0 to 4: 98.3-100% held out);
GRPO then trains on the problems the model still gets wrong in some samples, turning pass@G
into greedy accuracy. ``benchmarks/RESULTS.md`` records what each phase contributed.

Floors: this module sits with the pipelines (it composes ``dew_pipe.stages``); nothing in
``dew_pipe`` below it imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time
from typing import Any

from dew_pipe.flow.errors import Cancelled

__all__ = ["ArithmeticJob", "JobResult", "JobSettings"]

_AGGREGATIONS = ("token-mean", "session-mean")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check(name: str, value: Any, kind: type, low: float, high: float = math.inf) -> None:
    noun = "an int" if kind is int else "a float"
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} is {value!r}; expected {noun}")
    if not low <= value <= high:
        bound = "" if high == math.inf else f" and <= {high}"
        raise ValueError(f"{name} is {value!r}; expected {noun} >= {low}{bound}")


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """The settings of :class:`ArithmeticJob`; the defaults are the embedded default job.

    Task:
      seed: seeds the task, the initialization, the sampling; runs are reproducible up to
        thread timing in GRPO (which draws land in which batch).
      digits: the most digits an operand has.
      operations: operations drawn from (``"+"``, ``"+-"``...).

    SFT (the :class:`~dew_pipe.tasks.recipe.SFTRecipe` defaults otherwise):
      sft_steps: SFT updates (batches of 32 rows of 64 ids, about 170 problems each).
      sft_learning_rate: peak AdamW learning rate of SFT.
      eval_every: SFT steps between held-out probes.

    GRPO:
      grpo_steps: GRPO updates.
      prompts: problems per GRPO batch.
      groups: completions sampled per problem (G); advantages compare them.
      learning_rate: peak AdamW learning rate of GRPO (a fresh optimizer).
      warmup: linear warm-up updates of that learning rate, then a cosine decay to a tenth
        of it at the last update.
      temperature: sampling temperature of the rollout server (and of GRPO's scoring).
      beta: KL coefficient against the SFT weights (0: no reference, no KL).
      epsilon: PPO clip range, both sides.
      aggregation: "token-mean" or "session-mean" of the policy loss.
      max_lag: most updates a trained completion may lag the weights it trains.
      ahead: task batches rolled out beyond the one being trained.
      slots: rows the rollout server decodes together.
      grpo_eval_every: GRPO updates between held-out probes.

    Evaluation:
      test_size: held-out test problems (greedy exact match on all of them, every probe).
      sample_probe: training problems whose temperature-``temperature`` completions make
        the "sampled reward" probe during SFT (the same measure GRPO's batches report).

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> JobSettings(grpo_steps=10).groups
      8
      >>> JobSettings(groups=1)
      Traceback (most recent call last):
      ...
      ValueError: groups is 1; expected an int >= 2
    """

    seed: int = 0
    digits: int = 3
    operations: str = "+"
    sft_steps: int = 1500
    sft_learning_rate: float = 5e-3
    eval_every: int = 100
    grpo_steps: int = 1000
    prompts: int = 32
    groups: int = 8
    learning_rate: float = 2e-4
    warmup: int = 50
    temperature: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    aggregation: str = "token-mean"
    max_lag: int = 1
    ahead: int = 1
    slots: int = 128
    grpo_eval_every: int = 50
    test_size: int = 1000
    sample_probe: int = 500

    def __post_init__(self) -> None:
        _check("seed", self.seed, int, 0, 2**31 - 1)
        _check("digits", self.digits, int, 1, 9)
        if not isinstance(self.operations, str):
            raise TypeError(f"operations is {self.operations!r}; expected a str such as '+-'")
        _check("sft_steps", self.sft_steps, int, 2)  # the SFT warm-up needs a step after it
        for name in ("eval_every", "grpo_steps", "prompts", "slots"):
            _check(name, getattr(self, name), int, 1)
        _check("grpo_eval_every", self.grpo_eval_every, int, 1)
        _check("test_size", self.test_size, int, 1, 10**6)
        _check("sample_probe", self.sample_probe, int, 0, 10**6)
        _check("groups", self.groups, int, 2)
        _check("warmup", self.warmup, int, 0)
        _check("max_lag", self.max_lag, int, 0)
        _check("ahead", self.ahead, int, 0)
        for name in ("sft_learning_rate", "learning_rate", "temperature"):
            value = getattr(self, name)
            _check(name, value, float, 0.0)
            if not value > 0:
                raise ValueError(f"{name} is {value!r}; expected a float > 0")
        _check("beta", self.beta, float, 0.0)
        _check("epsilon", self.epsilon, float, 0.0, 1.0)
        if self.aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"aggregation is {self.aggregation!r}; expected one of {_AGGREGATIONS}"
            )
        if self.max_lag < self.ahead:
            raise ValueError(
                f"max_lag is {self.max_lag} with ahead={self.ahead}; expected max_lag >= ahead "
                "(a batch rolled out ahead trains that many updates later)"
            )


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`ArithmeticJob` reports (also written as ``summary.json``).

    Attributes:
      before: held-out greedy exact match after SFT (share of ``test_size`` problems).
      after: the same after GRPO.
      sft_s, grpo_s, wall_s: wall seconds of SFT, of GRPO and of the whole job (setup and
        evaluations included).
      cpu_s: CPU seconds of the process (user + system, all threads) over the job.
      load: 1-minute load average at the start and at the end.
      run_dir: the run directory.
    """

    before: float
    after: float
    sft_s: float
    grpo_s: float
    wall_s: float
    cpu_s: float
    load: tuple[float, float]
    run_dir: str


class ArithmeticJob:
    """SFT then asynchronous GRPO on an arithmetic task; ``run(context)`` runs it.

    Args:
      settings: the :class:`JobSettings` (default: the embedded default job).

    Example (what ``dew-pipe run pipelines/arithmetic.py`` does)::

        job = ArithmeticJob(JobSettings(sft_steps=300, grpo_steps=20))
        result = job.run(context)        # a dew_pipe.flow.RunContext
        print(result.before, result.after)
    """

    def __init__(self, settings: JobSettings | None = None) -> None:
        settings = JobSettings() if settings is None else settings
        if not isinstance(settings, JobSettings):
            raise TypeError(f"settings is {settings!r}; expected a JobSettings")
        self.settings = settings
        from dew_pipe.tasks.arithmetic import ArithmeticTask

        self.task = ArithmeticTask(
            seed=settings.seed,
            digits=settings.digits,
            operations=settings.operations,
            test_size=settings.test_size,
        )
        self.context: Any = None
        self._evaluated = 0.0  # wall seconds spent in held-out probes

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.settings).items())
        return f"ArithmeticJob({fields})"

    # ------------------------------------------------------------------ the run

    def run(self, context: Any) -> JobResult:
        """Run the job with ``context`` (a :class:`~dew_pipe.flow.RunContext`).

        Returns:
          The :class:`JobResult`.

        Raises:
          Cancelled: ``context.cancel`` was set (Ctrl-C); the rollout server is closed and
            every thread joined before it propagates.
        """
        from dew_pipe.tasks.plot import plot_run

        self.context = context
        start, cpu0, load0 = time.monotonic(), _cpu_seconds(), os.getloadavg()[0]
        s, task = self.settings, self.task
        context.print(
            f"arithmetic job: {s.digits}-digit '{s.operations}' problems (reversed answers), "
            f"{s.sft_steps} SFT steps then {s.grpo_steps} GRPO updates of {s.prompts} x "
            f"{s.groups} completions; held-out test: {s.test_size} problems"
        )
        task.tokenizer().save_pretrained(context.run_dir / "tokenizer")
        model, params = self._sft()
        sft_s = time.monotonic() - start
        probe = self._probe("sft", s.sft_steps, model, params, sampled=True)
        before = probe["held_out"]
        context.print(f"SFT done in {sft_s:.0f} s: held-out exact match {before:.1%}; now GRPO")
        grpo_start = time.monotonic()
        context.log(step=0, phase="grpo", **probe)  # GRPO's update 0 is SFT's end
        params = self._grpo(model, params)
        grpo_s = time.monotonic() - grpo_start
        after = self._probe("grpo", s.grpo_steps, model, params, sampled=True)["held_out"]
        result = JobResult(
            before=before,
            after=after,
            sft_s=round(sft_s, 1),
            grpo_s=round(grpo_s, 1),
            wall_s=round(time.monotonic() - start, 1),
            cpu_s=round(_cpu_seconds() - cpu0, 1),
            load=(round(load0, 2), round(os.getloadavg()[0], 2)),
            run_dir=str(context.run_dir),
        )
        context.metrics.write("values", phase="final", **dataclasses.asdict(result))
        (context.run_dir / "summary.json").write_text(
            json.dumps(dataclasses.asdict(result) | {"settings": dataclasses.asdict(s)}, indent=2)
            + "\n"
        )
        plot = plot_run(context.run_dir / "metrics.jsonl", context.run_dir / "progress.png")
        context.print(f"held-out exact match before GRPO: {before:.1%}")
        context.print(f"held-out exact match after GRPO: {after:.1%}")
        context.print(
            f"wall time: {result.wall_s:.0f} s (SFT {sft_s:.0f} s, GRPO {grpo_s:.0f} s; "
            f"{result.cpu_s:.0f} CPU s, load {load0:.1f} -> {result.load[1]:.1f})"
        )
        context.print(f"run directory: {context.run_dir} (metrics.jsonl, {plot.name})")
        return result

    # ------------------------------------------------------------------ probes

    def _probe(
        self, phase: str, step: int, model: Any, params: Any, *, sampled: bool
    ) -> dict[str, float]:
        """Held-out greedy exact match (and, if asked, the sampled reward), logged."""
        import jax

        from dew_pipe.sampling import Sampling

        begin = time.monotonic()
        s, task = self.settings, self.task
        accuracy = task.evaluate(model, params, "test", batch=min(500, s.test_size))
        values = {"held_out": round(accuracy, 4)}
        if sampled and s.sample_probe:
            texts = task.completions(
                model,
                params,
                "train",
                s.sample_probe,
                batch=min(500, s.sample_probe),
                sampling=Sampling(temperature=s.temperature),
                key=jax.random.key(s.seed * 7919 + step),
            )
            values["sampled_reward"] = round(float(task.score(texts, "train").mean()), 4)
        self._evaluated += time.monotonic() - begin
        self.context.log(step=step, phase=phase, **values)
        return values

    def _cancelled(self) -> None:
        if self.context.cancelled:
            raise Cancelled("the arithmetic job was cancelled")

    # ------------------------------------------------------------------ SFT

    def _sft(self) -> tuple[Any, Any]:
        import jax

        from dew_pipe.tasks.recipe import SFTRecipe, train_sft

        s = self.settings
        recipe = SFTRecipe(
            steps=s.sft_steps,
            learning_rate=s.sft_learning_rate,
            warmup=min(100, max(1, s.sft_steps // 10)),
        )
        model = recipe.model(self.task)

        def probe(state: Any, batch: Any, key: Any) -> Any:
            self._cancelled()
            step = int(state.step)
            if step % s.eval_every == 0:
                self._probe("sft", step, model, state.params, sampled=True)
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
            log_every=max(1, min(50, s.sft_steps // 4)),
        )
        return model, state.params

    # ------------------------------------------------------------------ GRPO

    def _grpo(self, model: Any, params: Any) -> Any:
        """Asynchronous GRPO from ``params``; returns the trained variables."""
        import jax
        import optax

        from dew_pipe import Trainer
        from dew_pipe.inference import NativeRolloutServer, PromptSource, Server, ServeTask
        from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
        from dew_pipe.sampling import Sampling
        from dew_pipe.stages import TaskBatches, grpo_pipeline

        s, task = self.settings, self.task
        self._cancelled()
        width = task.max_prompt_len + task.max_new_tokens  # one completion per row
        objective = GRPOObjective(
            model,
            seq_len=width - 1,
            beta=s.beta,
            pretrained=params,
            epsilon_low=s.epsilon,
            epsilon_high=s.epsilon,
            aggregation=s.aggregation,
            behavior_importance=2.0,  # TIS cap: lagging completions are weighted, capped
            sampling_temperature=None if s.temperature == 1.0 else s.temperature,
        )
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, s.learning_rate, s.warmup, max(s.grpo_steps, s.warmup + 1), 0.1 * s.learning_rate
        )
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        sampling = Sampling(eos_id=task.eos_id, temperature=s.temperature)
        server = NativeRolloutServer(
            Server.from_task(
                ServeTask(model, params, sampling),
                slots=s.slots,
                capacity=width - 1,
                seed=s.seed,
                pad_id=task.pad_id,
            )
        )
        source = PromptSource(
            server,
            task.reward,
            decode=task.decode,
            max_new_tokens=task.max_new_tokens,
            workers=2,
            seed=s.seed,
        )
        try:
            prompts = task.prompts("train", s.prompts * (s.grpo_steps + s.ahead + 2), seed=s.seed)
            data = prompts.load(batch=s.prompts)
            pipeline = grpo_pipeline(
                tasks=TaskBatches(data, prompt_tasks),
                source=source,
                weights=server,
                trainer=trainer,
                score=None,  # PromptSource scores each draw as it finishes
                width=width,
                rows=s.prompts * s.groups,
                groups=s.groups,
                steps=s.grpo_steps,
                max_lag=s.max_lag,
                ahead=s.ahead,
                truncation="zero",  # an answer without EOS is wrong, and trains as such
                log=lambda step, metrics, record: self._on_update(
                    pipeline, model, step, metrics, record
                ),
                name="arithmetic-grpo",
            )
            update = pipeline.stages["update"]
            update.state = trainer.initial_state()
            self.context.run_pipeline(pipeline)
            return jax.device_get(update.state.params)
        finally:
            source.close()
            server.close()

    def _on_update(
        self, pipeline: Any, model: Any, step: int, metrics: dict[str, float], record: Any
    ) -> None:
        """After each GRPO update (on the update stage's thread): log, probe, show progress."""
        s = self.settings
        values: dict[str, Any] = {
            "loss": round(metrics["loss"], 5),
            "grad_norm": round(metrics.get("grad_norm", float("nan")), 4),
            "entropy": round(metrics.get("entropy", float("nan")), 4),
        }
        if record is not None:
            reward = record.metrics.get("reward/mean")
            if reward is not None:
                values["reward"] = round(reward, 4)
            values["lag"] = record.lag
            values["waited_s"] = round(record.waited_s, 3)
        values = {k: v for k, v in values.items() if v is not None and v == v}
        self.context.log(step=step + 1, phase="grpo", **values)
        self.context.progress("GRPO updates", step + 1, s.grpo_steps)
        done = step + 1
        if done % s.grpo_eval_every == 0 and done < s.grpo_steps:
            state = pipeline.stages["update"].state
            self._probe("grpo", done, model, state.params, sampled=False)
