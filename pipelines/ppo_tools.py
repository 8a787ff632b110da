"""Multi-turn tool use with PPO and a critic, through the stages of the pipeline view.

    dew-pipe run pipelines/ppo_tools.py [--set seed=1 --set ppo_steps=80 ...]

The task is the project's calculator task (:class:`~dew_pipe.tasks.tool_calc.ToolCalcTask`,
as in ``pipelines/tool_calc.py``): products ``"37*48="`` a small decoder cannot work out
itself, a calculator it can call (``#37*48</s>``, answered ``@1776``) and an answer turn
(``A1776</s>``). The job

1. runs the same SFT warm-up (:func:`~dew_pipe.tasks.recipe.train_sft`): the model learns
   both kinds of turn, and under greedy decoding answers at once, wrongly;
2. measures held-out success (one greedy episode per test problem, every tool call a worker
   process): the "before" figure;
3. runs PPO through :func:`dew_pipe.stages.build_graph` with the values stage in rescore's
   place::

       tasks ─► rollout ─► reward ─► pack ─► values ─► update (Train: PPOObjective's step)
                  ▲  (EnvironmentSource on the sampling server; episodes, turn by turn)
                  └──────── weights: the policy subtree (PolicyWeights) ◄──────┘

   pack lays each episode's reward on its ids (``estimator="reward"``; truncated episodes
   masked), values scores the batch with the trainer's critic and policy and writes the GAE
   targets (``gamma``, ``lam``), and the update stage trains policy and critic as one
   variables tree (:class:`~dew_pipe.objectives.rl.PPOObjective`; the critic is a
   :class:`~dew_pipe.objectives.rl.ValueHead` on a fresh decoder of the policy's size);
4. measures held-out success again ("after") and writes ``summary.json`` and
   ``metrics.jsonl`` into the run directory.

Unlike GRPO, whose advantage is one number per episode relative to its group, the critic
gives every turn its own advantage, so ``groups`` can be small. ``benchmarks/ppo_vs_grpo.py``
compares the two on this task (in the library view) and ``benchmarks/RESULTS.md`` keeps the
figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
from typing import Any

import jax
import optax

from dew_pipe import Trainer
from dew_pipe._validate import check_float, check_int
from dew_pipe.flow import Cancelled, RunContext
from dew_pipe.inference import EnvironmentSource, NativeRolloutServer, Server, ServeTask
from dew_pipe.objectives.rl import PPOObjective, ValueHead, prompt_tasks
from dew_pipe.sampling import Sampling
from dew_pipe.stages import GraphSettings, PolicyWeights, TaskBatches, Values, build_graph
from dew_pipe.tasks.recipe import SFTRecipe, train_sft
from dew_pipe.tasks.tool_calc import ToolCalcTask


def pipeline(
    # --- the task
    seed: int = 0,  # seeds the task, the initialization and the sampling
    digits: int = 2,  # the most digits an operand has
    min_digits: int = 2,  # the fewest
    tool_share: float = 0.4,  # share of SFT transcripts that call the tool (below one half)
    max_turns: int = 3,  # the most model calls per episode
    # --- SFT
    sft_steps: int = 600,  # SFT updates (batches of 32 rows of 64 ids)
    sft_learning_rate: float = 5e-3,  # peak AdamW learning rate of SFT
    # --- PPO
    ppo_steps: int = 40,  # PPO updates
    prompts: int = 8,  # problems per PPO batch
    groups: int = 4,  # episodes sampled per problem
    learning_rate: float = 5e-4,  # AdamW learning rate of PPO (policy and critic)
    gamma: float = 1.0,  # discount per action id (1: the reward is not discounted)
    lam: float = 0.95,  # GAE's lambda
    value_coefficient: float = 0.5,  # weight of the critic's loss
    epsilon: float = 0.2,  # PPO clip range, both sides
    max_lag: int = 1,  # most updates a trained episode's oldest turn may lag its update
    ahead: int = 1,  # task batches rolled out beyond the one being trained
    slots: int = 64,  # rows the sampling server decodes together
    workers: int = 32,  # episodes running at once
    eval_every: int = 10,  # PPO updates between held-out probes
    # --- evaluation
    test_size: int = 200,  # held-out problems, one greedy episode each per probe
) -> PPOToolsJob:
    """The PPO tool-use job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> job = pipeline(ppo_steps=10)
      >>> job.graph.width, job.graph.rows, job.graph.estimator
      (37, 32, 'reward')
      >>> pipeline(gamma=1.5)
      Traceback (most recent call last):
      ...
      ValueError: gamma is 1.5; expected a finite float >= 0.0 and <= 1.0
    """
    settings = types.SimpleNamespace(**locals())  # first: the parameters, written once above
    check_int("seed", seed, minimum=0, maximum=2**31 - 1)
    check_int("sft_steps", sft_steps, minimum=2)
    for name in ("ppo_steps", "prompts", "slots", "workers", "eval_every"):
        check_int(name, getattr(settings, name), minimum=1)
    check_int("groups", groups, minimum=2)
    for name in ("sft_learning_rate", "learning_rate"):
        check_float(name, getattr(settings, name), above=0.0)
    for name in ("gamma", "lam", "epsilon"):
        check_float(name, getattr(settings, name), minimum=0.0, maximum=1.0)
    check_float("value_coefficient", value_coefficient, minimum=0.0)
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
        estimator="reward",  # each episode's reward on its ids: the values stage's input
        truncation="mask",  # truncated episodes are masked, not bootstrapped
        reward_workers=1,  # the source scores each episode; the stage only passes them on
    )
    return PPOToolsJob(settings, task, graph)


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`PPOToolsJob` reports (also written as ``summary.json``).

    Attributes:
      before, after: held-out success after SFT and after PPO.
      sft_s, ppo_s, wall_s: wall seconds of SFT, of PPO and of the whole job.
      load: 1-minute load average at the start and at the end.
      run_dir: the run directory.
    """

    before: float
    after: float
    sft_s: float
    ppo_s: float
    wall_s: float
    load: tuple[float, float]
    run_dir: str


class PPOToolsJob:
    """SFT, then PPO with a critic on tool episodes; ``run(context)`` runs it."""

    def __init__(self, settings: types.SimpleNamespace, task: ToolCalcTask, graph: GraphSettings):
        self.settings, self.task, self.graph = settings, task, graph
        self.context: RunContext | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self.settings).items())
        return f"PPOToolsJob({fields})"

    def run(self, context: RunContext) -> JobResult:
        """Run the job with ``context`` (what ``dew-pipe run`` passes).

        Raises:
          Cancelled: ``context.cancel`` was set; servers are closed before it propagates.
        """
        self.context = context
        start, load0 = time.monotonic(), os.getloadavg()[0]
        s = self.settings
        digits = f"{s.digits}" if s.min_digits == s.digits else f"{s.min_digits}-{s.digits}"
        context.print(
            f"ppo_tools job: {digits}-digit products with a calculator worker, "
            f"{s.sft_steps} SFT steps, then {s.ppo_steps} PPO updates of {s.prompts} x "
            f"{s.groups} episodes (gamma {s.gamma}, lambda {s.lam}); held-out test: "
            f"{s.test_size} problems"
        )
        model, params = self._sft()
        sft_s = time.monotonic() - start
        greedy = self._server(model, params, temperature=0.0, slots=min(s.slots, s.test_size))
        try:
            before = self._probe(greedy, "sft", 0, params)
            context.print(f"SFT done in {sft_s:.0f} s: held-out success {before:.1%}; now PPO")
            ppo_start = time.monotonic()
            objective, params = self._ppo(model, params, greedy)
            ppo_s = time.monotonic() - ppo_start
            after = self._probe(greedy, "ppo", s.ppo_steps, objective.policy_variables(params))
        finally:
            greedy.close()
        result = JobResult(
            before=before, after=after, sft_s=round(sft_s, 1), ppo_s=round(ppo_s, 1),
            wall_s=round(time.monotonic() - start, 1),
            load=(round(load0, 2), round(os.getloadavg()[0], 2)), run_dir=str(context.run_dir),
        )  # fmt: skip
        context.metrics.write("values", phase="final", **dataclasses.asdict(result))
        summary = dataclasses.asdict(result) | {"settings": vars(s)}
        (context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        context.print(f"held-out success before PPO: {before:.1%}")
        context.print(f"held-out success after PPO: {after:.1%}")
        context.print(f"wall time: {result.wall_s:.0f} s (SFT {sft_s:.0f} s, PPO {ppo_s:.0f} s)")
        return result

    # ------------------------------------------------------------------ phases

    def _cancelled(self) -> None:
        if self.context.cancelled:
            raise Cancelled("the ppo_tools job was cancelled")

    def _server(self, model: Any, params: Any, *, temperature: float, slots: int) -> Any:
        sampling = Sampling(eos_id=self.task.eos_id, temperature=temperature)
        serve = ServeTask(model, params, sampling)
        return NativeRolloutServer(
            Server.from_task(
                serve, slots=slots, capacity=self.task.width - 1,
                buckets=(self.task.max_prompt_tokens,), seed=self.settings.seed,
                pad_id=self.task.pad_id,
            )
        )  # fmt: skip

    def _probe(self, greedy: Any, phase: str, step: int, policy: Any) -> float:
        """Held-out success of greedy episodes under the policy variables ``policy``."""
        self._cancelled()
        greedy.load(policy, step)
        success = self.task.success(greedy, "test", workers=self.settings.workers)
        self.context.log(step=step, phase=phase, held_out=round(success, 4))
        return success

    def _sft(self) -> tuple[Any, Any]:
        s = self.settings
        recipe = SFTRecipe(
            steps=s.sft_steps, learning_rate=s.sft_learning_rate,
            warmup=min(100, max(1, s.sft_steps // 10)),
        )  # fmt: skip

        def progress(state: Any, batch: Any, key: Any) -> Any:
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

    def _ppo(self, model: Any, params: Any, greedy: Any) -> tuple[PPOObjective, Any]:
        """PPO from the SFT policy ``params``; returns the objective and trained variables."""
        s, task, graph = self.settings, self.task, self.graph
        self._cancelled()
        objective = PPOObjective(
            model, seq_len=graph.width - 1, critic=ValueHead(SFTRecipe().model(task)),
            value_coefficient=s.value_coefficient, pretrained=params, epsilon_low=s.epsilon,
            epsilon_high=s.epsilon, behavior_importance=2.0,  # TIS cap for lagging turns
        )  # fmt: skip
        graph.check_objective(objective)
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(s.learning_rate))
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        server = self._server(model, params, temperature=1.0, slots=s.slots)
        source = EnvironmentSource(
            server, task.environment(), task.verify, max_prompt_tokens=task.max_prompt_tokens,
            max_new_tokens=task.max_new_tokens, max_turns=task.max_turns, workers=s.workers,
            seed=s.seed,
        )  # fmt: skip
        try:
            prompts = task.prompts("train", s.prompts * (s.ppo_steps + s.ahead + 2), seed=s.seed)
            pipeline = build_graph(
                graph,
                tasks=TaskBatches(prompts.load(batch=s.prompts), prompt_tasks),
                source=source,
                weights=PolicyWeights(server, objective),
                scorer=None,
                values=Values(objective, width=graph.width, gamma=s.gamma, lam=s.lam),
                reward=None,  # the source's verifier scored every episode
                trainer=trainer,
                steps=s.ppo_steps,
                log=lambda step, metrics, record: self._on_update(
                    pipeline, objective, greedy, step, metrics, record
                ),
                owns_source=True,
                name="ppo-tools",
            )
            self.context.run_pipeline(pipeline)
            return objective, jax.device_get(pipeline.stages["update"].state.params)
        finally:
            source.close()
            server.close()

    def _on_update(self, pipeline, objective, greedy, step, metrics, record) -> None:
        """After each PPO update (on the update stage's thread): log, probe, show progress."""
        s = self.settings
        names = ("loss", "pg_loss", "value_loss", "value_error", "values", "returns")
        values: dict[str, Any] = {k: round(metrics[k], 5) for k in names if k in metrics}
        if record is not None:
            values["reward"] = record.metrics.get("reward/mean")
            values["lag"] = record.lag
        values = {k: v for k, v in values.items() if v is not None and v == v}
        self.context.log(step=step + 1, phase="ppo", **values)
        self.context.progress("PPO updates", step + 1, s.ppo_steps)
        done = step + 1
        if done % s.eval_every == 0 and done < s.ppo_steps:
            params = pipeline.stages["update"].state.params
            self._probe(greedy, "ppo", done, objective.policy_variables(params))
