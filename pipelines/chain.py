"""SFT, then DPO, then GRPO on one decoder, as a stage chain (``dew_pipe.recipes.chain``).

    dew-pipe run pipelines/chain.py [--set output=runs/chain2 --set sft_steps=300 ...]

Everything comes from one generator, :class:`~dew_pipe.tasks.chat_arithmetic.ChatArithmetic`
(addition with reversed answers, a character tokenizer and its chat template, nothing
downloaded): the SFT conversations, the DPO pairs (the true answer against the answer a model
that forgot a carry would write) and the GRPO prompts and their exact-match reward. A
:class:`~dew_pipe.recipes.chain.Recipe` trains the three stages in order, each from the
previous stage's final weights with a fresh optimizer; DPO freezes its starting weights as
its reference. After each stage the job measures held-out greedy exact match.

The chain lives in ``output`` (default ``runs/chain``), not in the run directory, so that the
same command continues it: a stage already trained is restored from its directory, the one
that was interrupted (Ctrl-C, or a SIGKILL) resumes from its last checkpoint (every
``checkpoint_every`` steps), and the final weights are those of an uninterrupted run, bit for
bit. ``output/settings.json`` keeps the settings the chain was started with; other settings
for the same ``output`` are refused (give a new ``output`` for a new chain).

It writes, in ``output``: ``sft/``, ``dpo/``, ``grpo/`` (each stage's ``metrics.jsonl``,
``checkpoints/``, ``samples.jsonl``), ``stages.png`` (every stage's curves side by side,
:func:`dew_pipe.curves.plot_runs`), ``weights.safetensors`` (the final parameters) and
``summary.json`` (held-out exact match after each stage, seconds); the run directory gets the
held-out figures in its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from dew_pipe import models
from dew_pipe._files import write_atomic
from dew_pipe._validate import check_float, check_int
from dew_pipe.curves import plot_runs
from dew_pipe.data import ChatMessages, Loading, PreferencePairs, Prompts
from dew_pipe.flow import Cancelled, RunContext
from dew_pipe.recipes.chain import Recipe, Stage
from dew_pipe.tasks.chat_arithmetic import ChatArithmetic

SHOWN = ("loss", "rewards/accuracies", "rewards/margins", "rollout/reward/mean")
SETTINGS = "settings.json"


def pipeline(
    output: Path = Path("runs/chain"),  # the chain's directory; the same command resumes it
    seed: int = 0,  # seeds the problems, the initialization and the sampling
    digits: int = 2,  # the most digits an operand has
    sft_steps: int = 400,  # SFT steps (rows of 64 ids, several conversations each)
    dpo_steps: int = 50,  # DPO steps (batch pairs each)
    grpo_steps: int = 60,  # GRPO steps (batch prompts x groups completions each); the batch
    #   reward peaked near step 60 (0.94) and fell as the warm-up raised the rate further
    batch: int = 32,  # rows, pairs or prompts per step, in every stage
    learning_rate: float = 2e-3,  # peak AdamW rate, the same for every stage (fresh state each)
    warmup: int = 150,  # linear warm-up steps at the start of every stage; the short DPO
    #   stage stays below a third of the peak (more moved greedy accuracy further from SFT's)
    beta: float = 0.5,  # DPO's preference strength (its reference: the SFT weights)
    groups: int = 8,  # GRPO completions per prompt
    checkpoint_every: int = 20,  # steps between checkpoints within a stage
    conversations: int = 10000,  # SFT conversations (problems)
    pairs: int = 4000,  # DPO pairs
    prompts: int = 4000,  # GRPO prompts
    test_size: int = 500,  # held-out problems scored after each stage
    sample: int = 8,  # completions each stage writes to its samples.jsonl
) -> ChainJob:
    """The chain job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting out of range, or an ``output`` that holds a chain
        started with other settings (naming them).

    Example:
      >>> import tempfile
      >>> job = pipeline(output=Path(tempfile.mkdtemp()) / "chain", sft_steps=10)
      >>> [stage.name for stage in job.stages()], job.stages()[2].groups
      (['sft', 'dpo', 'grpo'], 8)
    """
    settings = {k: v for k, v in locals().items()}  # first: the parameters, written once above
    for name in ("sft_steps", "dpo_steps", "grpo_steps", "batch", "checkpoint_every"):
        check_int(name, settings[name], minimum=1)
    check_int("warmup", warmup, minimum=0)
    check_int("sample", sample, minimum=0)
    check_float("learning_rate", learning_rate, above=0.0)
    check_float("beta", beta, above=0.0)
    chat = ChatArithmetic(
        seed=seed, digits=digits, test_size=test_size, sizes=(conversations, pairs, prompts)
    )
    return ChainJob(Path(output), settings, chat)


class ChainJob:
    """The SFT → DPO → GRPO chain of :func:`pipeline`; ``run(context)`` runs it.

    Args:
      output: the chain's directory.
      settings: the parameters of :func:`pipeline`.
      chat: the task generator they describe.
    """

    def __init__(self, output: Path, settings: dict[str, Any], chat: ChatArithmetic) -> None:
        self.output, self.settings, self.chat = output, settings, chat
        self._check_settings()
        self.model = models.build(
            "causal_transformer",
            vocab_size=chat.task.vocab_size,
            emb_features=64,
            num_layers=2,
            num_heads=4,
            mlp_features=256,
            max_seq_len=64,
        )
        self.context: RunContext | None = None

    def __repr__(self) -> str:
        return f"ChainJob({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    def _plain_settings(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.settings.items()}

    def _check_settings(self) -> None:
        """Refuse an ``output`` holding a chain that other settings started."""
        path = self.output / SETTINGS
        if not path.exists():
            return
        try:
            before = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{path}: cannot be read ({error}); expected the chain's settings"
            ) from error
        now = self._plain_settings()
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            shown = ", ".join(f"{k}={before.get(k)!r} (now {now.get(k)!r})" for k in changed)
            raise ValueError(
                f"output {self.output} holds a chain started with {shown}; expected the same "
                "settings to resume it, or a new --set output=DIR for a new chain"
            )

    # ------------------------------------------------------------------ data and stages

    def stages(self) -> tuple[Stage, Stage, Stage]:
        """The three stages on the generator's data (the conversations file is written into
        ``output/data`` the first time)."""
        s, chat = self.settings, self.chat
        tokenizer = chat.tokenizer()
        load = Loading(workers=0, threads=1, read_buffer=2)
        conversations = self.output / "data" / "conversations.jsonl"
        if not conversations.exists():
            conversations.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(conversations, chat.write_conversations)  # a rerun never reads half
        sft = ChatMessages(tokenizer, conversations, seq_len=63, seed=s["seed"], loading=load)
        pairs = PreferencePairs(
            records=chat.pair_records(), seq_len=chat.pair_width, seed=s["seed"], loading=load
        )
        prompts = Prompts(
            records=chat.prompt_records(),
            tokenizer=tokenizer,
            max_prompt_len=chat.max_prompt_len,
            seed=s["seed"],
            loading=load,
        )
        preview = {"sample": s["sample"], "max_new_tokens": chat.max_new_tokens}
        return (
            Stage("sft", sft, steps=s["sft_steps"], **preview),
            Stage("dpo", pairs, steps=s["dpo_steps"], beta=s["beta"], **preview),
            Stage(
                "grpo",
                prompts,
                steps=s["grpo_steps"],
                reward=chat.reward,
                groups=s["groups"],
                **preview,
            ),  # fmt: skip
        )

    def optimizer(self) -> optax.GradientTransformation:
        """Clipped AdamW, warming up at the start of every stage (each has a fresh state)."""
        s = self.settings
        rate = s["learning_rate"]
        if s["warmup"]:
            warm = optax.linear_schedule(rate / s["warmup"], rate, s["warmup"])
            rate = optax.join_schedules([warm, optax.constant_schedule(rate)], [s["warmup"]])
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(rate, b2=0.98))

    # ------------------------------------------------------------------ running

    def run(self, context: RunContext) -> dict[str, Any]:
        """Run (or continue) the chain with ``context``; returns the summary.

        Raises:
          Cancelled: ``context.cancel`` was set (Ctrl-C); the stage stops at its next
            record and keeps its last checkpoint, so the same command resumes it.
        """
        self.context = context
        start = time.monotonic()
        self.output.mkdir(parents=True, exist_ok=True)
        settings = self.output / SETTINGS
        if not settings.exists():
            _write_text(settings, json.dumps(self._plain_settings(), indent=2) + "\n")
        s = self.settings
        context.print(
            f"chain in {self.output}: SFT {s['sft_steps']} steps, DPO {s['dpo_steps']}, GRPO "
            f"{s['grpo_steps']} ({s['groups']} completions a prompt) on {s['digits']}-digit "
            f"addition; held-out test: {s['test_size']} problems"
        )
        stages = self.stages()
        self._cancelled()
        summary: dict[str, Any] = {"held_out": {}, "seconds": {}, "trained": {}}
        trained: set[str] = set()
        stage_start = [time.monotonic()]

        def log(name: str, record: dict[str, Any]) -> None:
            self._cancelled()
            trained.add(name)
            shown = {
                k.replace("/", "_"): round(record[k], 4) for k in SHOWN if record.get(k) is not None
            }
            total = next(st.steps for st in stages if st.name == name)
            with context.display.held():  # the step's progress and values on one line
                context.progress(f"{name} steps", record["step"], total)
                context.log(step=record["step"], phase=name, **shown)

        def finished(stage: Stage, state: Any) -> None:
            held = self.chat.evaluate(self.model, state.params, s["test_size"])
            seconds = round(time.monotonic() - stage_start[0], 1)
            how = "trained" if stage.name in trained else "restored"
            summary["held_out"][stage.name] = round(held, 4)
            summary["seconds"][stage.name] = seconds
            summary["trained"][stage.name] = how == "trained"
            context.log(step=int(state.step), phase=stage.name, held_out=round(held, 4))
            context.print(
                f"{stage.name}: {how} ({int(state.step)} steps, {seconds:.0f} s); held-out "
                f"exact match {held:.1%}"
            )
            self._cancelled()
            stage_start[0] = time.monotonic()

        recipe = Recipe(
            self.model,
            self.optimizer(),
            key=jax.random.key(s["seed"]),
            output=self.output,
            batch=s["batch"],
            stages=stages,
            checkpoint_every=s["checkpoint_every"],
            log_every=min(10, s["checkpoint_every"]),
            log=log,
            on_stage=finished,
            progress=False,
        )
        states = recipe.run()
        weights = _save_weights(self.output / "weights.safetensors", states[-1].params)
        figure = plot_runs(
            [recipe.directory(stage) for stage in stages],
            self.output / "stages.png",
            side_by_side=True,
        )
        summary["wall_s"] = round(time.monotonic() - start, 1)
        summary["settings"] = self._plain_settings()
        _write_text(self.output / "summary.json", json.dumps(summary, indent=2) + "\n")
        context.print(
            f"held-out exact match after SFT {summary['held_out']['sft']:.1%}, DPO "
            f"{summary['held_out']['dpo']:.1%}, GRPO {summary['held_out']['grpo']:.1%}; "
            f"{summary['wall_s']:.0f} s"
        )
        context.print(
            f"chain directory: {self.output} ({figure.name}, {weights.name}, summary.json)"
        )
        return summary

    def _cancelled(self) -> None:
        if self.context is not None and self.context.cancelled:
            raise Cancelled("the chain was cancelled; run the same command to resume it")


def _write_text(path: Path, text: str) -> Path:
    return write_atomic(path, lambda temporary: Path(temporary).write_text(text))


def _save_weights(path: Path, variables: Any) -> Path:
    """The parameters as safetensors, one tensor per leaf named by its path."""
    from safetensors.numpy import save_file

    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(variables))[0]
    tensors = {
        "/".join(str(getattr(k, "key", k)) for k in keys): np.ascontiguousarray(leaf)
        for keys, leaf in flat
    }
    return write_atomic(path, lambda temporary: save_file(tensors, temporary))
