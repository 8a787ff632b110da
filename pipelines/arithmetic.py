"""The embedded default job: SFT to a weak start, then GRPO that does the rest, on generated
multi-digit addition.

    dew-pipe run pipelines/arithmetic.py [--set seed=1 --set grpo_until=0.99 ...]

Nothing is downloaded: the problems ("37+485=", answered with reversed digits "225"), the
character tokenizer and the decoder are made from the seed
(:class:`~dew_pipe.tasks.ArithmeticTask`). The job

1. saves the task's tokenizer in the run directory under ``tokenizer/``;
2. runs supervised fine-tuning (:func:`~dew_pipe.tasks.recipe.train_sft`) until greedy
   exact match on ``test_size`` *training* problems, checked every ``sft_check_every``
   steps, reaches ``sft_until`` (at most ``sft_steps``), probing held-out greedy exact
   match and the sampled reward as it goes;
3. evaluates held-out exact match on the whole test split: the "before GRPO" figure;
4. runs GRPO, probing held-out exact match every ``grpo_eval_every`` updates and stopping
   at the first probe where greedy exact match on ``test_size`` training problems drawn
   after GRPO's pool (so not the ones it trains on) reaches ``grpo_until`` (at most
   ``grpo_steps`` updates). With ``rollout="sync"`` (the default)
   it is the library's synchronous loop, ``Trainer(rollout=SampledRollout)``, with the
   pass-rate curriculum (:class:`~dew_pipe.data.PassRateCurriculum`), the zero-advantage
   cut and the task's guide; with ``rollout="async"`` it goes through the stages of
   :func:`dew_pipe.stages.build_graph` (task batches -> rollout on a
   ``NativeRolloutServer`` via ``PromptSource``, which scores each draw with the task's
   exact-match reward -> pack -> a ``Train`` update stage whose forward pass also gives
   the proximal likelihoods, or a rescore stage before it with ``proximal_in_step=False``);
5. evaluates again ("after GRPO"), prints the summary, and writes ``summary.json`` and
   ``progress.png`` (:func:`dew_pipe.tasks.plot.plot_run`) into the run directory.

Everything it measures goes to the run's ``metrics.jsonl`` as ``values`` records with a
``phase`` ("sft", "grpo" or "final"), next to the flow counters of the GRPO pipeline when
``rollout="async"``. The settings are the parameters of :func:`pipeline` below, each
documented beside it; ``dew-pipe run --set NAME=VALUE`` overrides them and ``--dry-run``
lists them.

Why the default looks the way it does. GRPO sharpens the distribution the model already
samples from: a group of ``groups`` completions whose rewards are all equal has zero
advantage and teaches nothing. SFT on this task learns carrying in a jump whose step varies
with the seed (about 300 steps on seeds 1-4, 1200 on seed 0). Handed over inside the jump,
plain GRPO stalls (seed 2 from 58% held out: 76% after 1000 updates of the asynchronous
pipeline), because the problems it can already do fill its batches with all-right groups,
and a few mistakes it makes with near certainty fill them with identical wrong replies.
The curriculum rests the solved problems, the cut trains only on groups that disagree, and
the guide puts the task's reference answer into a group whose eight replies are the same
wrong one. With the three, the default hands over at half the training problems solved and
GRPO takes held-out exact match from about 60% to 96-99% on seeds 0-4
(``benchmarks/RESULTS.md`` records each seed's run and how long it took).

Two settings keep that short and robust. The curriculum can rest a solved problem only
when the problem comes round again, so the pool is 8000 problems, a pass every 125
updates (over 64,000 the first pass took 1000 updates, and the slowest seed needed 1750
updates where it now needs 900). And SFT's schedule runs over 3000 steps although the
hand-over stops it far sooner: the jump's step also moves with the machine's float
rounding, and with XLA compiled for AVX2 only, seed 0 was still at 40% after 1500 steps
of a schedule that had by then decayed the learning rate to a tenth; over 3000 steps it
hands over at 1250.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from dew_pipe import Trainer
from dew_pipe._validate import check_float, check_int
from dew_pipe.data import PassRateCurriculum
from dew_pipe.flow import Cancelled, RunContext
from dew_pipe.inference import (
    NativeRolloutServer,
    PromptSource,
    SampledRollout,
    Server,
    ServeTask,
)
from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
from dew_pipe.sampling import Sampling
from dew_pipe.stages import GraphSettings, TaskBatches, build_graph, rescorer
from dew_pipe.stages.train import update_values
from dew_pipe.tasks import ArithmeticTask
from dew_pipe.tasks.plot import plot_run
from dew_pipe.tasks.recipe import SFTRecipe, train_sft

AGGREGATIONS = ("token-mean", "session-mean")
SCHEDULES = ("cosine", "constant")
ROLLOUTS = ("async", "sync")


def pipeline(
    # --- the task
    seed: int = 0,  # seeds the task, the initialization and the sampling; GRPO runs are
    #   reproducible up to thread timing (which draws land in which batch)
    digits: int = 3,  # the most digits an operand has (1 to 9)
    operations: str = "+",  # operations drawn from ("+", "+-"...)
    # --- SFT (the SFTRecipe defaults otherwise)
    sft_steps: int = 3000,  # the most SFT updates (batches of 32 rows of 64 ids, ~170
    #   problems each), and the length of SFT's cosine schedule: `sft_until` stops it long
    #   before, while the learning rate is still high (see the module docstring)
    sft_learning_rate: float = 5e-3,  # peak AdamW learning rate of SFT
    sft_until: float | None = 0.5,  # stop SFT at the first check (every `sft_check_every`
    #   steps) whose greedy exact match on `test_size` *training* problems reaches this
    #   share, leaving the rest to GRPO (see the module docstring); None: all `sft_steps`
    sft_check_every: int = 25,  # SFT steps between those checks
    eval_every: int = 100,  # SFT steps between held-out probes
    # --- GRPO
    grpo_steps: int = 2000,  # the most GRPO updates (`grpo_until` usually stops it sooner)
    prompts: int = 64,  # problems per GRPO batch
    groups: int = 8,  # completions sampled per problem (G); advantages compare them
    learning_rate: float = 1e-3,  # peak AdamW learning rate of GRPO (a fresh optimizer)
    warmup: int = 10,  # linear warm-up updates to the peak learning rate, then `schedule`
    schedule: str = "cosine",  # "cosine": decay to a tenth of the peak at grpo_steps;
    #   "constant": stay at the peak (a run stopped by time rather than by grpo_steps)
    temperature: float = 1.0,  # sampling temperature of the rollout server and GRPO's scoring
    beta: float = 0.0,  # KL coefficient against the SFT weights (0: no reference, no KL)
    epsilon: float = 0.2,  # PPO clip range, both sides
    aggregation: str = "token-mean",  # "token-mean" or "session-mean" of the policy loss
    rollout: str = "sync",  # "async": the stages of dew_pipe.stages (a rollout server one
    #   batch ahead of the update); "sync": Trainer(rollout=SampledRollout), which samples
    #   each batch in one compiled call under the current weights, then updates (the
    #   settings from max_lag to join_rows below apply to "async" only)
    problems: int | None = 8000,  # GRPO's pool: the first this many training problems,
    #   served in turn (None: prompts x (grpo_steps + ahead + 2), so none comes round
    #   again); the curriculum rests a solved problem only when it comes round, every
    #   problems / prompts updates
    curriculum: int | None = None,  # with rollout="sync": passes over the training problems
    #   that a problem whose last group was all right sits out
    #   (dew_pipe.data.PassRateCurriculum; it needs problems that come again: set
    #   `problems`); 0: no curriculum; None: 1 with rollout="sync", 0 with "async"
    drop_zero_advantage: bool | None = None,  # with rollout="sync": run each update only on
    #   the problems whose group's rewards differ (all-right and all-wrong groups carry no
    #   gradient; SampledRollout(drop_zero_advantage=True)): the same update, on fewer rows;
    #   None: True with rollout="sync", False with "async"
    guide: bool | None = None,  # with rollout="sync": a problem whose completions all
    #   earned the same reward trains on the task's reference answer in place of its last
    #   one when that answer scores higher (SampledRollout(guide=task.reference): the
    #   policy never samples an answer it gives almost no probability, so such a group
    #   alone trains nothing); None: True with rollout="sync", False with "async"
    max_lag: int = 1,  # most updates a trained completion may lag the weights it trains;
    #   at least ahead (weights are pushed after every update)
    ahead: int = 1,  # task batches rolled out beyond the one being trained
    proximal_in_step: bool = True,  # the update's own forward pass gives the proximal
    #   likelihoods (each batch trains one update), so the graph needs no rescore stage;
    #   False rescores each batch in a stage of its own before the update
    slots: int = 128,  # rows the rollout server decodes together
    join_rows: int | None = None,  # rows that must finish before waiting draws join a busy
    #   server (Server's join_rows); None: all `slots`, so every wave of these few-id
    #   completions ends before the next starts in one prefill (fewer compiled shapes)
    grpo_eval_every: int = 50,  # GRPO updates between held-out probes
    grpo_until: float | None = 0.97,  # stop GRPO at the first probe (every
    #   `grpo_eval_every` updates) whose greedy exact match on `test_size` *training*
    #   problems reaches this share (the draws after the `problems` GRPO trains on: not
    #   its pool, not the held-out split); None: all `grpo_steps`
    # --- evaluation
    test_size: int = 1000,  # held-out test problems (greedy exact match on all, every probe)
    sample_probe: int = 500,  # training problems whose temperature-`temperature` completions
    #   make the "sampled reward" probe during SFT (0: none); GRPO's batches report the same
) -> ArithmeticJob:
    """The embedded job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> job = pipeline(grpo_steps=10)
      >>> job.settings.groups, job.graph.rows, job.settings.guide
      (8, 512, True)
      >>> pipeline(rollout="async").settings.guide  # the synchronous loop's options: off
      False
      >>> pipeline(groups=1)
      Traceback (most recent call last):
      ...
      ValueError: groups is 1; expected an int >= 2
    """
    settings = types.SimpleNamespace(**locals())  # first: the parameters, written once above
    if rollout in ROLLOUTS:  # None: each of the synchronous loop's options on with it
        for name in ("curriculum", "drop_zero_advantage", "guide"):
            if getattr(settings, name) is None:
                on = rollout == "sync"
                setattr(settings, name, int(on) if name == "curriculum" else on)
    curriculum, drop_zero_advantage, guide = (
        settings.curriculum,
        settings.drop_zero_advantage,
        settings.guide,
    )
    check_int("sft_steps", sft_steps, minimum=2)  # the SFT warm-up needs a step after it
    check_int("sft_check_every", sft_check_every, minimum=1)
    for name in ("sft_until", "grpo_until"):
        if getattr(settings, name) is not None:
            check_float(name, getattr(settings, name), above=0.0, maximum=1.0)
    for name in ("eval_every", "grpo_steps", "slots", "grpo_eval_every"):
        check_int(name, getattr(settings, name), minimum=1)
    check_int("sample_probe", sample_probe, minimum=0, maximum=10**6)
    check_int("join_rows", join_rows, minimum=1, maximum=slots, allow_none=True)
    check_int("warmup", warmup, minimum=0)
    if not isinstance(proximal_in_step, bool):
        raise TypeError(f"proximal_in_step is {proximal_in_step!r}; expected True or False")
    for name in ("sft_learning_rate", "learning_rate", "temperature"):
        check_float(name, getattr(settings, name), above=0.0)
    check_float("beta", beta, minimum=0.0)
    check_float("epsilon", epsilon, minimum=0.0, maximum=1.0)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation is {aggregation!r}; expected one of {AGGREGATIONS}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule is {schedule!r}; expected one of {SCHEDULES}")
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout is {rollout!r}; expected one of {ROLLOUTS}")
    check_int("curriculum", curriculum, minimum=0)
    if curriculum and rollout != "sync":
        raise ValueError(
            f"curriculum is {curriculum} with rollout={rollout!r}; the pass-rate curriculum "
            "reads each group's rewards from the synchronous loop: set rollout='sync' or "
            "curriculum=0"
        )
    if not isinstance(drop_zero_advantage, bool):
        raise TypeError(f"drop_zero_advantage is {drop_zero_advantage!r}; expected True or False")
    if not isinstance(guide, bool):
        raise TypeError(f"guide is {guide!r}; expected True or False")
    if guide and rollout != "sync":
        raise ValueError(
            f"guide is True with rollout={rollout!r}; the reference answers go into the "
            "synchronous loop's groups: set rollout='sync' or guide=False"
        )
    if drop_zero_advantage and rollout != "sync":
        raise ValueError(
            f"drop_zero_advantage is True with rollout={rollout!r}; the pipeline's pack stage "
            "keeps one batch shape: set rollout='sync' or drop_zero_advantage=False"
        )
    check_int("seed", seed, minimum=0, maximum=2**31 - 1)
    check_int("test_size", test_size, minimum=1, maximum=10**6)
    check_int("prompts", prompts, minimum=1)
    check_int("problems", problems, minimum=prompts, allow_none=True)  # one batch at least
    task = ArithmeticTask(seed=seed, digits=digits, operations=operations, test_size=test_size)
    graph = GraphSettings(
        width=task.max_prompt_len + task.max_new_tokens,  # one completion per row
        rows=prompts * groups,
        groups=groups,
        max_lag=max_lag,
        ahead=ahead,
        truncation="zero",  # an answer without EOS is wrong, and trains as such
        reward_workers=2,
    )
    return ArithmeticJob(settings, task, graph)


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`ArithmeticJob` reports (also written as ``summary.json``).

    Attributes:
      before: held-out greedy exact match after SFT (share of ``test_size`` problems).
      after: the same after GRPO.
      sft_steps, grpo_updates: SFT steps and GRPO updates run (fewer than the settings'
        when ``sft_until`` or ``grpo_until`` stopped a phase early).
      sft_s, grpo_s, wall_s: wall seconds of SFT, of GRPO and of the whole job (setup and
        evaluations included).
      cpu_s: CPU seconds of the process (user + system, all threads) over the job.
      load: 1-minute load average at the start and at the end.
      run_dir: the run directory.
    """

    before: float
    after: float
    sft_steps: int
    grpo_updates: int
    sft_s: float
    grpo_s: float
    wall_s: float
    cpu_s: float
    load: tuple[float, float]
    run_dir: str


def _until(share: float | None, most: int, unit: str) -> str:
    """'until 50% of training problems are right (at most 1500 steps)', or 'for 1500 steps'."""
    if share is None:
        return f"for {most} {unit}"
    return f"until {share:.0%} of training problems are right (at most {most} {unit})"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _BeforeEachRollout:
    """A Trainer rollout that first calls ``before(state)`` (the state after the previous
    update), then ``rollout``; ``metrics`` are the rollout's."""

    def __init__(self, rollout: Any, before: Callable[[Any], None]) -> None:
        self.rollout, self.before = rollout, before
        self.read_ahead = getattr(rollout, "read_ahead", 1)  # the Trainer reads these here
        self.rows_vary = bool(getattr(rollout, "rows_vary", False))

    def __call__(self, state: Any, batch: Any, key: Any) -> Any:
        self.before(state)
        return self.rollout(state, batch, key)

    def metrics(self) -> dict[str, float]:
        return self.rollout.metrics()


class ArithmeticJob:
    """SFT, then GRPO (synchronous or through the stages) on an arithmetic task; ``run(context)``
    runs it.

    Made by :func:`pipeline`, which checks the settings.

    Args:
      settings: the parameters of :func:`pipeline`, as attributes.
      task: the task they describe.
      graph: the GRPO graph's settings.
    """

    def __init__(self, settings: types.SimpleNamespace, task: ArithmeticTask, graph: GraphSettings):
        self.settings, self.task, self.graph = settings, task, graph
        self.context: RunContext | None = None
        self.updates = 0  # GRPO updates the last grpo() ran
        self._after_update: Callable[[int, Any], None] | None = None
        self._check_start = 0  # where grpo_until's training problems begin (set by grpo)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self.settings).items())
        return f"ArithmeticJob({fields})"

    def run(self, context: RunContext) -> JobResult:
        """Run the job with ``context`` (what ``dew-pipe run`` passes).

        Returns:
          The :class:`JobResult`.

        Raises:
          Cancelled: ``context.cancel`` was set (Ctrl-C); the rollout server is closed and
            every thread joined before it propagates.
        """
        self.context = context
        start, cpu0, load0 = time.monotonic(), _cpu_seconds(), os.getloadavg()[0]
        s, task = self.settings, self.task
        context.print(
            f"arithmetic job: {s.digits}-digit '{s.operations}' problems (reversed answers); "
            f"SFT {_until(s.sft_until, s.sft_steps, 'steps')}, then {s.rollout} GRPO of "
            f"{s.prompts} x {s.groups} completions {_until(s.grpo_until, s.grpo_steps, 'updates')}"
            f"; held-out test: {s.test_size} problems"
        )
        task.tokenizer().save_pretrained(context.run_dir / "tokenizer")
        model, params, sft_done = self._sft()
        sft_s = time.monotonic() - start
        probe = self._probe("sft", sft_done, model, params, sampled=True)
        before = probe["held_out"]
        context.print(
            f"SFT done in {sft_s:.0f} s after {sft_done} steps: held-out exact match "
            f"{before:.1%}; now GRPO"
        )
        grpo_start = time.monotonic()
        context.log(step=0, phase="grpo", **probe)  # GRPO's update 0 is SFT's end
        params = self.grpo(context, model, params)
        grpo_s = time.monotonic() - grpo_start
        after = self._probe("grpo", self.updates, model, params, sampled=True)["held_out"]
        result = JobResult(
            before=before,
            after=after,
            sft_steps=sft_done,
            grpo_updates=self.updates,
            sft_s=round(sft_s, 1),
            grpo_s=round(grpo_s, 1),
            wall_s=round(time.monotonic() - start, 1),
            cpu_s=round(_cpu_seconds() - cpu0, 1),
            load=(round(load0, 2), round(os.getloadavg()[0], 2)),
            run_dir=str(context.run_dir),
        )
        context.metrics.write("values", phase="final", **dataclasses.asdict(result))
        summary = dataclasses.asdict(result) | {"settings": vars(s)}
        (context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot = plot_run(context.run_dir / "metrics.jsonl", context.run_dir / "progress.png")
        context.print(f"held-out exact match before GRPO: {before:.1%}")
        context.print(
            f"held-out exact match after GRPO: {after:.1%} ({self.updates} updates"
            + (f", stopped at grpo_until={s.grpo_until}" if self.updates < s.grpo_steps else "")
            + ")"
        )
        context.print(
            f"wall time: {result.wall_s:.0f} s (SFT {sft_s:.0f} s, GRPO {grpo_s:.0f} s; "
            f"{result.cpu_s:.0f} CPU s, load {load0:.1f} -> {result.load[1]:.1f})"
        )
        context.print(f"run directory: {context.run_dir} (metrics.jsonl, {plot.name})")
        return result

    def _probe(
        self, phase: str, step: int, model: Any, params: Any, *, sampled: bool
    ) -> dict[str, float]:
        """Held-out greedy exact match (and, if asked, the sampled reward), logged."""
        s, task = self.settings, self.task
        accuracy = task.evaluate(model, params, "test", batch=min(500, s.test_size))
        values = {"held_out": round(accuracy, 4)}
        if sampled and s.sample_probe:
            reward = task.sampled_reward(
                model,
                params,
                "train",
                s.sample_probe,
                temperature=s.temperature,
                key=jax.random.key(s.seed * 7919 + step),
                batch=min(500, s.sample_probe),
            )
            values["sampled_reward"] = round(reward, 4)
        self.context.log(step=step, phase=phase, **values)
        return values

    def _cancelled(self) -> None:
        if self.context.cancelled:
            raise Cancelled("the arithmetic job was cancelled")

    def _sft(self) -> tuple[Any, Any, int]:
        """SFT from scratch: ``(model, trained variables, steps run)``."""
        s = self.settings
        recipe = SFTRecipe(
            steps=s.sft_steps,
            learning_rate=s.sft_learning_rate,
            warmup=min(100, max(1, s.sft_steps // 10)),
        )
        model = recipe.model(self.task)

        def probe(state: Any, batch: Any, key: Any) -> Any:  # runs before every SFT step
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
            until=s.sft_until,
            check_every=s.sft_check_every,
            check_split="train",
        )
        return model, state.params, int(state.step)

    def grpo(
        self,
        context: RunContext,
        model: Any,
        params: Any,
        prompts: Any = None,
        after_update: Callable[[int, Any], None] | None = None,
    ) -> Any:
        """The GRPO phase alone: GRPO of ``model`` from ``params`` (the ``rollout`` setting's).

        :meth:`run` calls it after SFT; ``benchmarks/grpo_time_to_accuracy.py`` calls it on
        a saved checkpoint.

        Args:
          context: the run's context (metrics, display, cancellation).
          model, params: the decoder and its ``{"params": ...}`` to start from.
          prompts: the training prompt batches (a Dataset of ``prompts`` rows per batch);
            default ``task.prompts("train", ...)`` enough for ``grpo_steps`` updates. With
            ``curriculum``, the pool the curriculum serves from instead: a mapping of
            columns (``Prompts.arrays()``), by default those same problems.
          after_update: ``after_update(updates, state)`` after each update and its log, on
            the update stage's thread (``state`` is the new TrainState; copy what you keep,
            as the next update donates its buffers).

        Returns:
          The trained variables (on the host); :attr:`updates` is how many updates ran
          (``grpo_steps``, or fewer when ``grpo_until`` stopped the phase).

        Raises:
          Cancelled: ``context.cancel`` was set; the server is closed and every thread
            joined first.
        """
        s, task, graph = self.settings, self.task, self.graph
        self.context, self._after_update = context, after_update
        self.updates = 0
        self._cancelled()
        objective = GRPOObjective(
            model,
            seq_len=graph.width - 1,
            beta=s.beta,
            pretrained=params,
            epsilon_low=s.epsilon,
            epsilon_high=s.epsilon,
            aggregation=s.aggregation,
            behavior_importance=2.0,  # TIS cap: lagging completions are weighted, capped
            sampling_temperature=None if s.temperature == 1.0 else s.temperature,
            proximal_in_step=s.proximal_in_step,
        )
        graph.check_objective(objective)
        if s.schedule == "cosine":
            schedule = optax.warmup_cosine_decay_schedule(
                0.0,
                s.learning_rate,
                s.warmup,
                max(s.grpo_steps, s.warmup + 1),
                0.1 * s.learning_rate,
            )
        else:
            warm = optax.linear_schedule(0.0, s.learning_rate, max(s.warmup, 1))
            schedule = optax.join_schedules(
                [warm, optax.constant_schedule(s.learning_rate)], [max(s.warmup, 1)]
            )
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98))
        count = s.problems or s.prompts * (s.grpo_steps + s.ahead + 2)
        self._check_start = count  # grpo_until's problems: the draws after the pool
        if prompts is None:
            problems = task.prompts("train", count, seed=s.seed)
            prompts = problems.arrays() if s.curriculum else problems.load(batch=s.prompts)
        if s.curriculum:
            if not isinstance(prompts, Mapping):
                raise TypeError(
                    f"prompts is {type(prompts).__name__}; with curriculum={s.curriculum} "
                    "expected the pool as a mapping of columns (Prompts.arrays())"
                )
            prompts = PassRateCurriculum(prompts, batch=s.prompts, rest=s.curriculum)
        if s.rollout == "sync":
            return self._grpo_sync(objective, optimizer, model, prompts)
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        sampling = Sampling(eos_id=task.eos_id, temperature=s.temperature)
        server = NativeRolloutServer(
            Server.from_task(
                ServeTask(model, params, sampling),
                slots=s.slots,
                join_rows=s.slots if s.join_rows is None else s.join_rows,
                capacity=graph.width - 1,
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
            pipeline = build_graph(
                graph,
                tasks=TaskBatches(prompts, prompt_tasks),
                source=source,
                weights=server,
                scorer=rescorer(objective),
                reward=None,  # PromptSource scores each draw as it finishes
                trainer=trainer,
                steps=s.grpo_steps,
                log=self._on_update,
                until=lambda state: self._after(model, int(state.updates), state),
                owns_source=True,
                name="arithmetic-grpo",
            )
            self.context.run_pipeline(pipeline)
            return jax.device_get(pipeline.stages["update"].state.params)
        finally:
            source.close()
            server.close()

    def _on_update(self, step: int, metrics: dict[str, float], record: Any) -> None:
        """After each asynchronous GRPO update (on the update stage's thread): log, progress."""
        self.context.log(step=step + 1, phase="grpo", **update_values(metrics, record))
        self.context.progress("GRPO updates", step + 1, self.settings.grpo_steps)

    def _after(self, model: Any, done: int, state: Any) -> bool:
        """After update ``done``: the probes when due, then the caller's ``after_update``.

        Returns:
          Whether GRPO stops here: ``grpo_until``'s share of training problems reached.
        """
        s = self.settings
        self.updates = done
        stop = False
        if done % s.grpo_eval_every == 0 and done < s.grpo_steps:
            if s.grpo_until is not None:
                solved = self.task.evaluate(
                    model,
                    state.params,
                    "train",
                    s.test_size,
                    batch=min(500, s.test_size),
                    start=self._check_start,
                )
                self.context.log(step=done, phase="grpo", train_exact=round(solved, 4))
                stop = solved >= s.grpo_until
            if not stop:  # the last update's held-out probe is the caller's (run's final)
                self._probe("grpo", done, model, state.params, sampled=False)
        if self._after_update is not None:
            self._after_update(done, state)
        return stop

    def _grpo_sync(self, objective: GRPOObjective, optimizer: Any, model: Any, prompts: Any) -> Any:
        """GRPO as the library's synchronous loop: ``Trainer(rollout=SampledRollout)``.

        Each update samples its batch in one compiled call under the newest weights (lag 0),
        scores it with the task's reward and trains on it; nothing overlaps. Logs, probes
        and ``after_update`` as the asynchronous path does.
        """
        s, task = self.settings, self.task
        sampled = SampledRollout(
            objective,
            reward=task.reward,
            groups=s.groups,
            max_new_tokens=task.max_new_tokens,
            sampling=Sampling(eos_id=task.eos_id, temperature=s.temperature),
            decode=task.decode,
            truncation="zero",  # as the pipeline: an answer without EOS is wrong
            pad_id=task.pad_id,
            drop_zero_advantage=s.drop_zero_advantage,
            guide=task.reference if s.guide else None,
        )

        def log(record: dict[str, Any]) -> None:
            reward = types.SimpleNamespace(
                metrics={"reward/mean": record.get("rollout/reward/mean")}, lag=0, waited_s=0.0
            )
            skipped = record.get("rollout/curriculum/skipped")  # turns rested so far
            extra = {} if skipped is None else {"rested": int(skipped)}
            extra["flat"] = round(record["rollout/groups/zero_advantage"], 4)  # trained nothing
            if s.drop_zero_advantage:
                extra["rows"] = int(record["rollout/rows"])  # what the update ran on
            if s.guide:
                extra["guided"] = round(record["rollout/groups/guided"], 4)
            values = update_values(record, reward, **extra)
            del values["waited_s"]  # nothing waits for a rollout here
            self.context.log(step=record["step"], phase="grpo", **values)
            self.context.progress("GRPO updates", record["step"], s.grpo_steps)

        hook: Any = sampled
        if isinstance(prompts, PassRateCurriculum):
            hook, prompts = prompts.watch(sampled), prompts.dataset()
        trainer = Trainer(
            objective,
            optimizer,
            key=jax.random.key(s.seed + 1),
            rollout=_BeforeEachRollout(hook, lambda state: self._cancelled()),
            log=log,
            progress=False,
        )
        state = trainer.fit(  # from the objective's pretrained weights, as the pipeline's
            prompts,  #         update stage starts
            steps=s.grpo_steps,
            log_every=1,
            until=lambda state: self._after(model, int(state.updates), state),
        )
        return jax.device_get(state.params)
