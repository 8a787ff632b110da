"""Asynchronous GRPO with rollouts drawn by a real vLLM server and weights pushed back to it.

    dew-pipe run pipelines/grpo_vllm.py                  # 1st run: SFT, write the checkpoint
    <start vLLM on the checkpoint: the command the first run prints, or the README's>
    dew-pipe run pipelines/grpo_vllm.py [--set steps=40 --set engine=http://127.0.0.1:8011]

The task is the arithmetic task of the embedded job (``dew_pipe.tasks.ArithmeticTask``,
answers with reversed digits); the model a small Qwen3-layout decoder with head_dim 32
(vLLM's CPU attention needs head_dim >= 32). The first run fine-tunes it (``sft_steps``,
so GRPO starts where some samples of a problem are right and some wrong) and writes it
into ``checkpoint`` with ``SafetensorsReload.write`` (bfloat16, the transformers layout,
the task's tokenizer beside it); vLLM is then launched on that directory. With the engine
up, the run trains through the stages of :func:`dew_pipe.stages.build_graph`:

    task batches ─► rollout (PromptSource on an OpenAIRolloutServer: token ids to vLLM's
    /v1/completions, the sampled ids back) ─► pack ─► rescore (the trainer's proximal
    log-probs) ─► update ─► weights: Publication(SafetensorsReload) writes the new policy
    into the checkpoint and has vLLM pause, reload, reset its prefix cache, take the
    version and resume, after every update.

Rollouts for the next batch run while the trainer updates (``ahead``), no admitted
completion lags more than ``max_lag`` updates, and the behavior likelihoods are vLLM's own,
so the loss reports the trainer-engine mismatch: ``mismatch/kl`` (the mean k1 estimate of
KL(engine || trainer) over the sampled ids) and ``mismatch/ess`` (the effective sample size
share of the importance weights). The trainer starts from the bfloat16 values vLLM
serves, so the first update's mismatch is float rounding; after it the trainer's float32
weights leave the bfloat16 grid vLLM is pushed, and lag adds more. The run prints one line per
update (reward, held-out greedy accuracy every ``eval_every``, the mismatch) and writes
``summary.json`` with the curves.

The pushes write each new policy over ``checkpoint``, since that is the directory vLLM
serves and reloads: a second GRPO run continues from the last policy the first one pushed,
not from the SFT weights. To start GRPO again from SFT, delete ``checkpoint`` (the next run
fine-tunes and writes it anew) and restart vLLM on it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from dew_pipe import Trainer
from dew_pipe._validate import check_float, check_int
from dew_pipe.flow import RunContext
from dew_pipe.inference import (
    EngineError,
    JSONClient,
    NativeRolloutServer,
    OpenAICompletion,
    OpenAIRolloutServer,
    PromptSource,
    Publication,
    SafetensorsReload,
    Server,
    ServeTask,
)
from dew_pipe.models.hf import Pretrained, load_pretrained
from dew_pipe.objectives.rl import GRPOObjective, prompt_tasks
from dew_pipe.sampling import Sampling
from dew_pipe.stages import GraphSettings, TaskBatches, build_graph, rescorer
from dew_pipe.tasks import ArithmeticTask
from dew_pipe.tasks.recipe import SFTRecipe, train_sft

SERVERS = ("vllm", "native")


def launch_command(checkpoint: Path, port: int) -> str:
    """The shell command that serves ``checkpoint`` the way this pipeline expects.

    ``--max-model-len`` is the checkpoint's ``max_position_embeddings`` (vLLM refuses a
    longer one).
    """
    positions = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    return (
        f"VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .vllm-venv/bin/python -m "
        f"vllm.entrypoints.openai.api_server --model {checkpoint.resolve()} "
        f"--served-model-name grpo --host 127.0.0.1 --port {port} --dtype float32 "
        f"--max-model-len {positions} --enforce-eager --max-logprobs 5 --seed 0"
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's settings (see :func:`pipeline`)."""

    engine: str
    checkpoint: Path
    steps: int
    prompts: int
    groups: int
    learning_rate: float
    sft_steps: int
    digits: int
    max_lag: int
    ahead: int
    eval_every: int
    test_size: int
    timeout: float
    seed: int
    server: str


def pipeline(
    engine: str = "http://127.0.0.1:8011",  # the vLLM server's root URL
    checkpoint: Path = Path("runs/grpo_vllm-model"),  # where the model lives; vLLM serves it
    steps: int = 30,  # GRPO updates (one push into vLLM after each)
    prompts: int = 16,  # problems per batch
    groups: int = 8,  # completions per problem
    learning_rate: float = 1e-4,  # Adam, clipped at global norm 1 (1e-3 collapsed the policy)
    sft_steps: int = 500,  # SFT updates of the first run (2-digit problems: ~60% held out)
    digits: int = 2,  # the most digits an operand has
    max_lag: int = 1,  # most updates an admitted completion may lag
    ahead: int = 1,  # task batches rolled out beyond the one being trained
    eval_every: int = 10,  # updates between held-out greedy probes (0: none)
    test_size: int = 200,  # held-out problems per probe
    timeout: float = 300.0,  # seconds any request to vLLM may take (a push too)
    seed: int = 0,
    server: str = "vllm",  # "native": the in-process server instead (a baseline, no vLLM)
) -> VLLMGRPOJob:
    """The job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> job = pipeline(steps=3)
      >>> job.graph.rows, job.graph.width
      (128, 10)
    """
    for name, value in (("steps", steps), ("prompts", prompts), ("digits", digits)):
        check_int(name, value, minimum=1)
    check_int("groups", groups, minimum=2)
    check_int("sft_steps", sft_steps, minimum=2)
    check_int("eval_every", eval_every, minimum=0)
    check_int("test_size", test_size, minimum=1)
    check_float("learning_rate", learning_rate, above=0.0)
    if server not in SERVERS:
        raise ValueError(f"server is {server!r}; expected one of {SERVERS}")
    JSONClient(engine, timeout=timeout)  # checks the URL and the timeout
    settings = Settings(
        engine, Path(checkpoint), steps, prompts, groups, learning_rate, sft_steps, digits,
        max_lag, ahead, eval_every, test_size, timeout, seed, server,
    )  # fmt: skip
    task = ArithmeticTask(seed=seed, digits=digits, test_size=test_size)
    graph = GraphSettings(
        width=task.max_prompt_len + task.max_new_tokens,  # one completion per row
        rows=prompts * groups,
        groups=groups,
        max_lag=max_lag,
        ahead=ahead,
        truncation="zero",  # an answer without EOS is wrong, and trains as such
        reward_workers=2,
    )
    return VLLMGRPOJob(settings, task, graph)


class VLLMGRPOJob:
    """SFT (first run), then GRPO against a vLLM server; ``run(context)`` runs it."""

    def __init__(self, settings: Settings, task: ArithmeticTask, graph: GraphSettings) -> None:
        self.settings, self.task, self.graph = settings, task, graph
        self.context: RunContext | None = None
        self.curve: list[dict[str, float]] = []

    def __repr__(self) -> str:
        return f"VLLMGRPOJob({self.settings})"

    def run(self, context: RunContext) -> dict[str, Any]:
        """Runs the job (see the module docstring); returns the summary it writes."""
        self.context = context
        s = self.settings
        if not (s.checkpoint / "config.json").is_file():
            self._sft_checkpoint()
        if s.server == "native":
            return self._grpo(None)
        client = JSONClient(s.engine, timeout=10)
        try:
            models = client.get("/v1/models", step="models")
        except EngineError as error:
            port = urllib.parse.urlsplit(s.engine).port or 80
            raise RuntimeError(
                f"no vLLM server answers at {s.engine} ({error}); start it on the checkpoint "
                f"with: {launch_command(s.checkpoint, port)}"
            ) from error
        served = models["data"][0]
        if Path(served["root"]).resolve() != s.checkpoint.resolve():
            raise RuntimeError(
                f"the vLLM server at {s.engine} serves {served['root']}, not the checkpoint "
                f"{s.checkpoint.resolve()}; launch it on the checkpoint"
            )
        return self._grpo(served["id"])

    def _sft_checkpoint(self) -> None:
        s, task = self.settings, self.task
        recipe = SFTRecipe(steps=s.sft_steps, num_heads=2, warmup=min(50, s.sft_steps // 2))
        start = time.monotonic()
        model, state = train_sft(task, recipe, key=jax.random.key(s.seed), progress=False)
        held_out = task.evaluate(model, state.params, "test", batch=s.test_size)
        pretrained = Pretrained.from_model(
            model, state.params, eos_token_id=task.eos_id, pad_token_id=task.pad_id
        )
        SafetensorsReload(pretrained, s.checkpoint, [s.engine], "vllm").write(state.params)
        task.tokenizer().save_pretrained(s.checkpoint)
        self.context.print(
            f"grpo_vllm: SFT ({s.sft_steps} steps, {time.monotonic() - start:.0f} s) reached "
            f"{held_out:.1%} held out; checkpoint written to {s.checkpoint}"
        )

    def _grpo(self, name: str | None) -> dict[str, Any]:
        s, task, graph = self.settings, self.task, self.graph
        pretrained = load_pretrained(s.checkpoint)  # the bfloat16 values vLLM serves
        model, params = pretrained.model, pretrained.variables
        if model.config.max_seq_len < graph.width:
            raise ValueError(
                f"the checkpoint's decoder has {model.config.max_seq_len} positions; the task "
                f"needs {graph.width}"
            )
        objective = GRPOObjective(
            model, seq_len=graph.width - 1, pretrained=params, behavior_importance=2.0
        )
        graph.check_objective(objective)
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(s.learning_rate))
        trainer = Trainer(objective, optimizer, key=jax.random.key(s.seed + 1), progress=False)
        sampling = Sampling(eos_id=task.eos_id)
        if name is None:  # the native baseline: the same model served in process
            server = weights = NativeRolloutServer(
                Server.from_task(
                    ServeTask(model, params, sampling), slots=s.prompts * s.groups,
                    capacity=graph.width - 1, seed=s.seed, pad_id=task.pad_id,
                )
            )  # fmt: skip
            self._push = None
        else:
            self._push = SafetensorsReload(
                pretrained, s.checkpoint, [s.engine], "vllm", timeout=s.timeout
            )
            weights = Publication(self._push)  # version 0: the weights vLLM was launched with
            completion = OpenAICompletion(name, JSONClient(f"{s.engine}/v1", timeout=s.timeout))
            server = OpenAIRolloutServer(
                completion, sampling, weights, max_in_flight=s.prompts * s.groups
            )
        source = PromptSource(
            server, task.reward, decode=task.decode, max_new_tokens=task.max_new_tokens,
            workers=2, seed=s.seed,
        )  # fmt: skip
        self._model, self._start = model, time.monotonic()
        before = self._held_out(params)
        self.context.print(
            f"grpo_vllm: {s.steps} GRPO updates of {s.prompts} x {s.groups} completions drawn "
            f"by {'the native server' if name is None else f'vLLM at {s.engine}'}; held-out "
            f"greedy accuracy before: {before:.1%}"
        )
        try:
            prompts = task.prompts("train", s.prompts * (s.steps + s.ahead + 2), seed=s.seed)
            flow = build_graph(
                graph,
                tasks=TaskBatches(prompts.load(batch=s.prompts), prompt_tasks),
                source=source,
                weights=server,
                scorer=rescorer(objective),
                trainer=trainer,
                steps=s.steps,
                log=lambda step, metrics, record: self._on_update(flow, step, metrics, record),
                owns_source=True,
                name="grpo-vllm",
            )
            self.context.run_pipeline(flow)
            final = flow.stages["update"].state.params
            if weights.version < s.steps:  # the graph pushes only what rollout still needs
                weights.load(final, s.steps)
        finally:
            source.close()
            server.close()
        after = self._held_out(final)
        rewards = [row["reward"] for row in self.curve]
        k = max(1, len(rewards) // 5)
        summary = {
            "held_out_before": before,
            "held_out_after": after,
            "reward_first": float(np.mean(rewards[:k])),
            "reward_last": float(np.mean(rewards[-k:])),
            "served_version": weights.version,
            "wall_s": round(time.monotonic() - self._start, 1),
            "curve": self.curve,
            "settings": {k: str(v) for k, v in dataclasses.asdict(s).items()},
        }
        (self.context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.context.print(
            f"grpo_vllm: reward {summary['reward_first']:.3f} over the first {k} updates, "
            f"{summary['reward_last']:.3f} over the last {k}; held-out {before:.1%} -> "
            f"{after:.1%}; {'vLLM' if name else 'the server'} serves version {weights.version}"
        )
        return summary

    def _held_out(self, params: Any) -> float:
        return self.task.evaluate(self._model, params, "test", batch=self.settings.test_size)

    def _on_update(self, flow: Any, step: int, metrics: dict[str, float], record: Any) -> None:
        s = self.settings
        row = {
            "update": step + 1,
            "reward": record.metrics.get("reward/mean", float("nan")) if record else float("nan"),
            "mismatch/kl": float(metrics.get("mismatch/kl", float("nan"))),
            "mismatch/ess": float(metrics.get("mismatch/ess", float("nan"))),
            "lag": record.lag if record else 0,
            # seconds of the latest push into vLLM (the native server copies in place)
            "push_s": round(sum(self._push.timings.values()), 3) if self._push else 0.0,
            "seconds": round(time.monotonic() - self._start, 1),
        }
        if s.eval_every and (step + 1) % s.eval_every == 0:
            row["held_out"] = self._held_out(flow.stages["update"].state.params)
        self.curve.append(row)
        self.context.log(step=step + 1, phase="grpo", **row)
        self.context.progress("GRPO updates", step + 1, s.steps)
        held = f" held-out {row['held_out']:.1%}" if "held_out" in row else ""
        self.context.print(
            f"update {step + 1:3d}: reward {row['reward']:.3f}  mismatch/kl "
            f"{row['mismatch/kl']:.2e}  mismatch/ess {row['mismatch/ess']:.4f}  lag {row['lag']}"
            f"  push {row['push_s']:.2f} s{held}"
        )
