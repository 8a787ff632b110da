"""Stage chains: SFT, DPO and GRPO one after another on one decoder (``recipes.chain``).

A :class:`Recipe` holds what the stages share (the decoder, the optimizer, the key, the
output directory, the batch size) and a tuple of :class:`Stage` values. :meth:`Recipe.run`
trains them in order:

* **The dataset picks the objective.** ``ChatMessages`` trains SFT
  (``LMObjective(loss_role=Role.ASSISTANT)``, no EMA copy), ``PreferencePairs`` trains DPO
  (``DPOObjective``) and ``Prompts`` trains GRPO (``GRPOObjective`` with a
  ``SampledRollout``). The stage's name only labels its directory, ``OUTPUT/<name>/``; a name
  such as ``"sft"`` infers nothing and converts nothing.
* **Each stage starts afresh from the previous one's policy.** A new Trainer, so a new
  optimizer state and step counter, whose objective starts from the previous stage's final
  ``params`` (the first stage from ``pretrained``, or a random initialization). DPO, and GRPO
  with ``beta > 0``, freeze those starting weights as their reference (``TrainState.ema``).
* **A stage directory that exists is restored, not retrained.** Each stage's Trainer
  checkpoints into its own directory, so a finished stage restores its final checkpoint
  (``fit`` returns it without a step) and an interrupted one resumes from its newest
  checkpoint, with its data position and key: a chain killed anywhere and run again ends with
  the weights an uninterrupted run has. For a fresh chain use distinct stage names and a new
  output directory.
* **The chain exposes beta, reward, groups, max_new_tokens and sample** (see
  :class:`Stage`) and nothing else of the rollout: no ``decode`` (the reward reads token-ID
  text, ``"12 7 9"``), no ``eos_id`` (every completion is ``max_new_tokens`` ids long) and no
  temperature (1.0). For rewards on decoded text or for stop tokens, build
  ``SampledRollout`` and ``Trainer`` yourself.

``run`` returns every stage's final :class:`~dew_pipe.TrainState`, so a long chain holds
every stage's parameters, optimizer state and reference in memory at the end.

Each stage directory holds ``stage.json`` (the stage's index and objective, checked when the
directory is reused), the Trainer's ``metrics.jsonl`` and ``checkpoints/``, and, when the
stage asks for ``sample``, ``samples.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import optax

from dew_pipe._validate import check_float, check_int
from dew_pipe.data.chat import ChatMessages, Role
from dew_pipe.data.preference import PreferencePairs
from dew_pipe.data.prompts import Prompts
from dew_pipe.inference.sampled_rollout import SampledRollout
from dew_pipe.objectives.lm import LMObjective
from dew_pipe.objectives.rl.dpo import DPOObjective
from dew_pipe.objectives.rl.grpo import GRPOObjective
from dew_pipe.recipes.samples import write_samples
from dew_pipe.training.step import TrainState
from dew_pipe.training.trainer import Trainer

__all__ = ["OBJECTIVES", "Recipe", "Stage"]

OBJECTIVES: dict[type, str] = {ChatMessages: "sft", PreferencePairs: "dpo", Prompts: "grpo"}
"""Dataset type -> the objective a stage on it trains."""

DPO_BETA = 0.1  # the spec's examples; DPOObjective requires beta > 0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a chain: its name, its dataset and how long it trains.

    Args:
        name: the stage directory's name under the recipe's output (letters, digits, ``_``,
            ``-`` and ``.``, not starting with a dot); unique within a recipe. It labels the
            stage, nothing more.
        data: a ``ChatMessages`` (SFT), ``PreferencePairs`` (DPO) or ``Prompts`` (GRPO);
            the recipe calls its ``load(batch=...)``.
        steps: optimizer steps of this stage, counted from 0.
        beta: DPO: the preference strength, > 0 (default 0.1). GRPO: the KL coefficient
            against the stage's starting policy, >= 0 (default 0: no reference). Not for SFT.
        reward: GRPO only, required: ``reward(data_source, completion, ground_truth,
            extra_info) -> float``; ``completion`` is the sampled ids as token-ID text
            (decimal ids separated by spaces).
        groups: GRPO only: completions sampled per prompt, >= 2 (default 4).
        max_new_tokens: GRPO: the ids sampled per completion, required. Other stages: the
            length of the ``sample`` previews (required when ``sample`` > 0).
        sample: completions drawn from the stage's final policy, for a look at what it
            writes: one for each of the first ``sample`` prompts of the stage's data (its
            training rows: the user part of a conversation, the shared prompt of a pair, a
            GRPO prompt), ``max_new_tokens`` ids each at temperature 1, written to
            ``samples.jsonl`` in the stage directory (with the reward, for a GRPO stage).
            0 draws none.

    Raises:
        TypeError: a dataset of another type, or a setting of the wrong type.
        ValueError: a bad name, a setting out of range, or one the stage's objective does
            not take (a reward on a DPO stage, say), each named with the stage.

    Example:
        >>> import json
        >>> pairs = PreferencePairs(records=(json.dumps({"chosen": [1, 2], "rejected": [1, 3]}),),
        ...                         seq_len=4)
        >>> Stage("dpo", pairs, steps=10).objective
        'dpo'
        >>> Stage("dpo", pairs, steps=10, groups=4)
        Traceback (most recent call last):
        ...
        ValueError: stage 'dpo': groups is for GRPO stages (Prompts data); this stage trains dpo
    """

    name: str
    data: ChatMessages | PreferencePairs | Prompts
    steps: int
    beta: float | None = None
    reward: Callable[[str, str, str, str], float] | None = None
    groups: int | None = None
    max_new_tokens: int | None = None
    sample: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"stage name {self.name!r}; expected a directory name of letters, digits, "
                "'_', '-' and '.', not starting with a dot"
            )
        where = f"stage {self.name!r}"
        if type(self.data) not in OBJECTIVES:
            raise TypeError(
                f"{where}: data is a {type(self.data).__name__}; expected ChatMessages (SFT), "
                "PreferencePairs (DPO) or Prompts (GRPO)"
            )
        check_int(f"{where}: steps", self.steps, minimum=1)
        check_int(f"{where}: sample", self.sample, minimum=0)
        kind = self.objective
        grpo_only = {"reward": self.reward, "groups": self.groups}
        for field, value in grpo_only.items():
            if value is not None and kind != "grpo":
                raise ValueError(
                    f"{where}: {field} is for GRPO stages (Prompts data); this stage trains {kind}"
                )
        if self.beta is not None:
            if kind == "sft":
                raise ValueError(f"{where}: beta is for DPO and GRPO stages; this one trains sft")
            check_float(f"{where}: beta", self.beta, **({"above": 0.0} if kind == "dpo" else
                                                         {"minimum": 0.0}))  # fmt: skip
        if self.max_new_tokens is not None:
            check_int(f"{where}: max_new_tokens", self.max_new_tokens, minimum=1)
        if kind == "grpo":
            if not callable(self.reward):
                raise ValueError(
                    f"{where}: reward is {self.reward!r}; a GRPO stage needs reward(data_source, "
                    "completion, ground_truth, extra_info) -> float"
                )
            if self.groups is not None:
                check_int(f"{where}: groups", self.groups, minimum=2)
            if self.max_new_tokens is None:
                raise ValueError(f"{where}: max_new_tokens is missing; a GRPO stage needs it")
        elif self.sample and self.max_new_tokens is None:
            raise ValueError(
                f"{where}: sample={self.sample} needs max_new_tokens, the length of each preview"
            )

    @property
    def objective(self) -> str:
        """``"sft"``, ``"dpo"`` or ``"grpo"``: what the stage's dataset type trains."""
        return OBJECTIVES[type(self.data)]


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """A chain of stages on one decoder; :meth:`run` trains them in order.

    Args:
        model: the decoder every stage trains (``models.build("causal_transformer", ...)``).
        optimizer: the optax optimizer; each stage starts a fresh state of it.
        key: a PRNG key; stage ``i`` trains with ``fold_in(key, i)``.
        output: the chain's directory; stage ``s`` lives in ``output / s.name``.
        batch: examples per step in every stage (conversation rows, pairs or prompts).
        stages: the stages, in training order, with distinct names.
        pretrained: the first stage's starting variables ``{"params": ...}``; None starts
            from a random initialization.
        checkpoint_every: steps between checkpoints within a stage (each stage also saves
            its last step); None saves only the last.
        log_every: steps between training records (at most the stage's steps).
        log: called as ``log(stage_name, record)`` with every training record.
        on_stage: called as ``on_stage(stage, state)`` when a stage has its final state,
            trained or restored (to evaluate it, say), before the next stage starts.
        progress: the Trainer's progress bar; None shows it on a terminal.

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, no stages, a
            stage that is not a Stage, or two stages with one name.

    Example:
        >>> recipe = Recipe(model, optax.adam(1e-3), key=jax.random.key(0), output="runs/chain",
        ...                 batch=8, stages=(Stage("sft", chats, steps=100),
        ...                                  Stage("dpo", pairs, steps=50)))  # doctest: +SKIP
        >>> sft_state, dpo_state = recipe.run()  # doctest: +SKIP
    """

    model: Any
    optimizer: optax.GradientTransformation
    key: jax.Array
    output: str | Path
    batch: int
    stages: tuple[Stage, ...]
    pretrained: Mapping[str, Any] | None = None
    checkpoint_every: int | None = None
    log_every: int = 10
    log: Callable[[str, dict[str, Any]], None] | None = None
    on_stage: Callable[[Stage, TrainState], None] | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if not (callable(getattr(self.model, "init", None)) and callable(getattr(self.model, "apply", None))):  # fmt: skip
            raise TypeError(
                f"model is a {type(self.model).__name__}; expected a Flax linen decoder"
            )
        if not callable(getattr(self.optimizer, "init", None)):
            raise TypeError(
                f"optimizer={self.optimizer!r}; expected an optax GradientTransformation"
            )
        check_int("batch", self.batch, minimum=1)
        check_int("log_every", self.log_every, minimum=1)
        check_int("checkpoint_every", self.checkpoint_every, minimum=1, allow_none=True)
        if self.log is not None and not callable(self.log):
            raise TypeError(f"log={self.log!r}; expected None or log(stage_name, record)")
        if self.on_stage is not None and not callable(self.on_stage):
            raise TypeError(f"on_stage={self.on_stage!r}; expected None or on_stage(stage, state)")
        stages = tuple(self.stages) if isinstance(self.stages, list | tuple) else None
        if not stages:
            raise ValueError(f"stages is {self.stages!r}; expected a non-empty tuple of Stage")
        names: set[str] = set()
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(f"stages holds a {type(stage).__name__}; expected Stage values")
            if stage.name in names:
                raise ValueError(
                    f"two stages are named {stage.name!r}; expected distinct names (each "
                    "names its directory, and a second one would restore the first's checkpoint)"
                )
            names.add(stage.name)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "output", Path(self.output))

    def directory(self, stage: Stage) -> Path:
        """Where ``stage`` keeps its checkpoints, metrics and samples."""
        return Path(self.output) / stage.name

    def run(self) -> list[TrainState]:
        """Train every stage in order (restoring those already trained); return their states.

        Returns:
            One final :class:`~dew_pipe.TrainState` per stage, in order.

        Raises:
            ValueError: a stage directory that holds another stage (another objective or
                place in the chain), or what the stage's objective, data or Trainer refuse
                (a sequence longer than the model's ``max_seq_len``, a batch that does not
                divide across the devices...).
            CheckpointError: a stage checkpoint that cannot be restored.
        """
        states: list[TrainState] = []
        previous = self.pretrained
        for index, stage in enumerate(self.stages):
            state = self._stage(index, stage, previous)
            states.append(state)
            previous = state.params
            if self.on_stage is not None:
                self.on_stage(stage, state)
        return states

    # ------------------------------------------------------------------ one stage

    def _claim(self, index: int, stage: Stage) -> Path:
        """The stage's directory, with ``stage.json`` written, or checked if it exists."""
        folder = self.directory(stage)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"stage": stage.name, "index": index, "objective": stage.objective}
        marker = folder / "stage.json"
        if marker.exists():
            try:
                found = json.loads(marker.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(
                    f"{marker}: cannot be read ({error}); expected {record}"
                ) from error
            if not isinstance(found, dict) or any(found.get(k) != v for k, v in record.items()):
                raise ValueError(
                    f"{folder} holds {found}, not stage {stage.name!r} (index {index}, "
                    f"{stage.objective}); expected this chain's directory (for a fresh chain, "
                    "use a new output directory)"
                )
        else:
            marker.write_text(json.dumps(record) + "\n")
        return folder

    def _objective(self, stage: Stage, start: Mapping[str, Any] | None) -> Any:
        data, model = stage.data, self.model
        if stage.objective == "sft":
            return LMObjective(
                model, data.seq_len, pretrained=start, loss_role=Role.ASSISTANT, ema_decay=None
            )
        if stage.objective == "dpo":
            beta = DPO_BETA if stage.beta is None else stage.beta
            return DPOObjective(model, data.seq_len - 1, beta=beta, pretrained=start)
        width = data.max_prompt_len + stage.max_new_tokens
        return GRPOObjective(model, width - 1, beta=stage.beta or 0.0, pretrained=start)

    def _stage(self, index: int, stage: Stage, start: Mapping[str, Any] | None) -> TrainState:
        folder = self._claim(index, stage)
        objective = self._objective(stage, start)
        rollout = None
        if stage.objective == "grpo":
            groups = 4 if stage.groups is None else stage.groups
            rollout = SampledRollout(objective, stage.reward, groups, stage.max_new_tokens)
        log = None
        if self.log is not None:
            log = lambda record, name=stage.name: self.log(name, record)  # noqa: E731
        trainer = Trainer(
            objective,
            self.optimizer,
            key=jax.random.fold_in(self.key, index),
            rollout=rollout,
            run_dir=folder,
            checkpoint_every=self.checkpoint_every,
            log=log,
            progress=self.progress,
        )
        state = trainer.fit(
            stage.data.load(batch=self.batch),
            steps=stage.steps,
            log_every=min(self.log_every, stage.steps),
        )
        if stage.sample and not (folder / "samples.jsonl").exists():
            write_samples(
                folder / "samples.jsonl",
                self.model,
                state.params,
                stage,
                jax.random.fold_in(jax.random.fold_in(self.key, index), 1),
            )
        return state
