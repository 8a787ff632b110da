"""Flow-GRPO on a small DiT: flow-matching pretraining on generated shapes, then RL on colour.

    dew-pipe run pipelines/flow_grpo.py [--set grpo_steps=60 --set target=green ...]

Nothing is downloaded: the images are made from the seed. Each is a ``size x size`` RGB
picture of one shape (a filled square, a plus or a horizontal bar) in one of three colours
(red, green, blue) at a random place on black. The job

1. pretrains a `~dew_pipe.models.SimpleDiT` by flow matching
   (`~dew_pipe.objectives.DiffusionObjective`) for ``pretrain_steps`` on fresh batches of
   those images, so it draws shapes in all three colours;
2. writes ``samples_before.png``, a grid of ``preview`` samples of the pretrained model;
3. trains it with Flow-GRPO (`~dew_pipe.objectives.rl.FlowGRPOObjective` fed by
   `~dew_pipe.objectives.rl.FlowRollout`) for ``grpo_steps`` against the ``target`` colour
   reward (`colour_reward`): how purely the lit pixels are of the target colour, less a
   penalty for lighting more than a shape's area. A white image scores below a black one and
   an image flooded with the target colour below a shape of it, so neither brightness nor
   colour alone wins;
4. writes ``samples_after.png`` (the same noise as before), ``reward.png`` (the mean reward
   of each Flow-GRPO batch) and ``summary.json``.

Everything measured goes to the run's ``metrics.jsonl`` as ``values`` records with a
``phase`` ("pretrain", "grpo" or "final"). The settings are the parameters of
:func:`pipeline`, each documented beside it; ``dew-pipe run --set NAME=VALUE`` overrides them
and ``--dry-run`` lists them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from dew_pipe import Field, InputSpec, Trainer, models, presets
from dew_pipe._validate import check_float, check_int
from dew_pipe.data import Dataset
from dew_pipe.flow import Cancelled, RunContext
from dew_pipe.objectives import DiffusionObjective
from dew_pipe.objectives.rl import FlowGRPOObjective, FlowRollout, sample_trajectory

COLOURS = {"red": 0, "green": 1, "blue": 2}
SHAPES = ("square", "plus", "bar")


def pipeline(
    seed: int = 0,  # seeds the images, the initialisation and the sampling
    size: int = 8,  # image side in pixels (a multiple of patch_size)
    # --- the model
    emb_features: int = 32,  # DiT width
    num_layers: int = 2,  # DiT blocks
    num_heads: int = 4,  # attention heads (divide emb_features)
    patch_size: int = 2,  # DiT patch side
    # --- flow-matching pretraining
    pretrain_steps: int = 400,  # updates on fresh batches of generated shapes
    pretrain_batch: int = 64,  # images per pretraining batch
    pretrain_learning_rate: float = 3e-3,  # Adam
    # --- Flow-GRPO
    target: str = "red",  # the colour the reward asks for: red, green or blue
    grpo_steps: int = 40,  # Flow-GRPO updates
    sources: int = 4,  # source rows per batch (each one group)
    groups: int = 8,  # samples per group; advantages compare them
    steps: int = 6,  # time points of the sampling grid, both ends included
    train_steps: int | None = None,  # stochastic transitions trained per sample (None: all)
    learning_rate: float = 1e-3,  # Adam
    beta: float = 0.0,  # KL coefficient against the pretrained model (0: no reference)
    preview: int = 16,  # samples in each PNG grid
) -> FlowGRPOJob:
    """The job with these settings; ``dew-pipe run`` calls ``job.run(context)``.

    Raises:
      TypeError, ValueError: a setting of the wrong type or out of range, named.

    Example:
      >>> pipeline(grpo_steps=2).settings.target
      'red'
      >>> pipeline(target="white")
      Traceback (most recent call last):
      ...
      ValueError: target is 'white'; expected one of ['red', 'green', 'blue']
    """
    settings = types.SimpleNamespace(**locals())
    check_int("seed", seed, minimum=0, maximum=2**31 - 1)
    for name in ("emb_features", "num_heads", "patch_size", "pretrain_batch", "sources"):
        check_int(name, getattr(settings, name), minimum=1)
    check_int("size", size, minimum=patch_size)
    if size % patch_size:
        raise ValueError(f"size ({size}) is not a multiple of patch_size ({patch_size})")
    check_int("num_layers", num_layers, minimum=0)
    check_int("pretrain_steps", pretrain_steps, minimum=0)
    check_int("grpo_steps", grpo_steps, minimum=1)
    check_int("groups", groups, minimum=2)
    check_int("steps", steps, minimum=2)
    check_int("preview", preview, minimum=1, maximum=256)
    for name in ("pretrain_learning_rate", "learning_rate"):
        check_float(name, getattr(settings, name), above=0.0)
    check_float("beta", beta, minimum=0.0)
    if target not in COLOURS:
        raise ValueError(f"target is {target!r}; expected one of {list(COLOURS)}")
    model = models.SimpleDiT(
        output_channels=3,
        patch_size=patch_size,
        emb_features=emb_features,
        num_layers=num_layers,
        num_heads=num_heads,
        mlp_ratio=4,
    )
    return FlowGRPOJob(settings, model)


def shapes(rng: np.random.Generator, rows: int, size: int) -> np.ndarray:
    """``rows`` generated pictures, ``uint8 [rows, size, size, 3]``: one coloured shape each.

    Example:
      >>> images = shapes(np.random.default_rng(0), 5, 8)
      >>> images.shape, sorted(np.unique(images).tolist())
      ((5, 8, 8, 3), [0, 255])
    """
    images = np.zeros((rows, size, size, 3), np.uint8)
    side = max(2, size // 2)
    for i in range(rows):
        shape = SHAPES[rng.integers(len(SHAPES))]
        channel = rng.integers(3)
        top, left = rng.integers(0, size - side + 1, 2)
        mask = np.zeros((side, side), bool)
        middle = slice(side // 2 - 1, side // 2 + 1)  # the two middle rows or columns
        if shape == "square":
            mask[:] = True
        elif shape == "plus":
            mask[middle, :] = True
            mask[:, middle] = True
        else:
            mask[middle, :] = True
        images[i, top : top + side, left : left + side, channel] = np.where(mask, 255, 0)
    return images


def colour_reward(target: str):
    """``reward(images, batch)``: a shape of the ``target`` colour, per image, in ``[-2.5, 1]``.

    With colours mapped from ``[-1, 1]`` to ``[0, 1]``, a pixel is lit when its brightest
    channel exceeds 0.5. ``purity`` is the mean over lit pixels of
    ``c_target - max(other channels)`` (0 with none lit), ``area`` the lit share of the
    image, and the reward is ``purity - 2 * max(0, area - 1/4)``: a shape of the target
    colour (at most a quarter of the picture) scores 1, one of another colour -1, black 0,
    white -1.5 and a picture flooded with the target colour -0.5.

    Example:
      >>> red = np.full((1, 4, 4, 3), -1.0); red[0, :2, :2, 0] = 1
      >>> colour_reward("red")(red, {}).tolist(), colour_reward("blue")(red, {}).tolist()
      ([1.0], [-1.0])
    """
    index = COLOURS[target]
    others = [c for c in range(3) if c != index]

    def reward(images: np.ndarray, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        colours = (np.asarray(images, np.float64) + 1.0) / 2.0
        lit = colours.max(axis=-1) > 0.5
        count = lit.sum(axis=(1, 2))
        margin = colours[..., index] - colours[..., others].max(axis=-1)
        purity = np.where(lit, margin, 0.0).sum(axis=(1, 2)) / np.maximum(count, 1)
        area = count / (lit.shape[1] * lit.shape[2])
        return purity - 2.0 * np.maximum(0.0, area - 0.25)

    reward.__name__ = f"{target}_reward"
    return reward


def grid(images: np.ndarray) -> np.ndarray:
    """Images in ``[-1, 1]`` tiled into one ``uint8`` RGB picture, one pixel of grey between."""
    rows = int(np.ceil(np.sqrt(len(images))))
    cols = int(np.ceil(len(images) / rows))
    size = images.shape[1]
    out = np.full((rows * (size + 1) + 1, cols * (size + 1) + 1, 3), 128, np.uint8)
    pixels = np.clip((np.asarray(images) + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
    for i, image in enumerate(pixels):
        r, c = divmod(i, cols)
        out[
            1 + r * (size + 1) : 1 + r * (size + 1) + size,
            1 + c * (size + 1) : 1 + c * (size + 1) + size,
        ] = image
    return out


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished :class:`FlowGRPOJob` reports (also written as ``summary.json``)."""

    pretrain_loss: float | None  # last pretraining loss (None with pretrain_steps=0)
    reward_before: float  # mean target reward of the preview samples, pretrained model
    reward_after: float  # the same, after Flow-GRPO (same noise)
    rewards: list[float]  # mean reward of each Flow-GRPO batch
    seconds: float  # wall time of the whole job


class FlowGRPOJob:
    """Pretraining then Flow-GRPO, as the module docstring describes.

    Attributes:
      settings: the resolved settings (the parameters of :func:`pipeline`).
      model: the `SimpleDiT` both phases train.
    """

    def __init__(self, settings: types.SimpleNamespace, model: Any):
        self.settings, self.model = settings, model

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self.settings).items())
        return f"FlowGRPOJob({fields})"

    def _inputs(self) -> InputSpec:
        return InputSpec(Field("image", (self.settings.size, self.settings.size, 3)))

    def _logger(self, context: RunContext, phase: str, steps: int, records: list[dict]):
        """The Trainer's ``log``: keeps each record, writes it as a ``values`` line with its
        ``phase``, and stops the run once the context is cancelled."""

        def log(record: dict[str, Any]) -> None:
            records.append(record)
            if context.cancelled:
                raise Cancelled(f"{phase} cancelled at step {record.get('step')}")
            values = {
                k.replace("rollout/", "").replace("/", "_"): v
                for k, v in record.items()
                if isinstance(v, int | float) and k not in ("step",)
            }
            context.log(step=record.get("step"), phase=phase, **values)
            context.progress(phase, record.get("step", 0), steps)

        return log

    def _preview(self, objective: Any, params: Any) -> np.ndarray:
        s = self.settings
        trajectory = sample_trajectory(
            objective, params, jax.random.key(s.seed + 1), rows=s.preview, steps=s.steps
        )
        return np.asarray(objective.diffusion.decode(trajectory.states[:, -1]))

    def pretrain(self, context: RunContext) -> tuple[Any, float | None]:
        """Flow matching on generated shapes; returns ``(variables, last loss)``."""
        s = self.settings
        objective = DiffusionObjective(self.model, presets.Flow()(), self._inputs(), steps=s.steps)
        records: list[dict] = []
        trainer = Trainer(
            objective,
            optax.adam(s.pretrain_learning_rate),
            key=jax.random.key(s.seed),
            log=self._logger(context, "pretrain", s.pretrain_steps, records),
            progress=False,
        )
        if s.pretrain_steps == 0:
            return trainer.initial_state().params, None

        def train(partition):
            rng = np.random.default_rng([s.seed, partition.index])
            while True:
                yield {"image": shapes(rng, s.pretrain_batch, s.size)}

        data = Dataset(train=train, val=None, records=None, batch=s.pretrain_batch)
        state = trainer.fit(data, steps=s.pretrain_steps, log_every=max(1, s.pretrain_steps // 20))
        return jax.device_get(state.params), records[-1]["loss"]

    def run(self, context: RunContext) -> JobResult:
        """Run the job with ``context`` (what ``dew-pipe run`` passes).

        Raises:
          Cancelled: ``context.cancel`` was set (Ctrl-C).
        """
        s = self.settings
        start = time.monotonic()
        context.print(
            f"flow_grpo job: {s.pretrain_steps} flow-matching steps on {s.size}x{s.size} "
            f"shapes, then {s.grpo_steps} Flow-GRPO updates toward {s.target}"
        )
        pretrained, pretrain_loss = self.pretrain(context)
        objective = FlowGRPOObjective(
            self.model,
            presets.Flow()(),
            self._inputs(),
            beta=s.beta,
            steps=s.steps,
            pretrained=pretrained,
        )
        reward = colour_reward(s.target)
        before = self._preview(objective, pretrained)
        _save_png(context.run_dir / "samples_before.png", grid(before))
        rollout = FlowRollout(objective, reward, s.groups, s.steps, s.train_steps)
        records: list[dict] = []
        trainer = Trainer(
            objective,
            optax.adam(s.learning_rate),
            key=jax.random.key(s.seed + 2),
            rollout=rollout,
            log=self._logger(context, "grpo", s.grpo_steps, records),
            progress=False,
        )
        source = {"image": np.zeros((s.sources, s.size, s.size, 3), np.uint8)}
        data = Dataset(
            train=lambda partition: itertools.repeat(source),
            val=None,
            records=None,
            batch=s.sources,
        )
        state = trainer.fit(data, steps=s.grpo_steps, log_every=1)
        rewards = [record["rollout/reward/mean"] for record in records]
        after = self._preview(objective, state.params)
        _save_png(context.run_dir / "samples_after.png", grid(after))
        _plot_rewards(context.run_dir / "reward.png", rewards, s.target)
        result = JobResult(
            pretrain_loss=pretrain_loss,
            reward_before=float(reward(before, {}).mean()),
            reward_after=float(reward(after, {}).mean()),
            rewards=rewards,
            seconds=round(time.monotonic() - start, 3),
        )
        context.log(
            phase="final", reward_before=result.reward_before, reward_after=result.reward_after
        )
        summary = dataclasses.asdict(result)
        (context.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        context.print(
            f"{s.target} reward of the preview samples: {result.reward_before:.3f} before, "
            f"{result.reward_after:.3f} after Flow-GRPO"
        )
        return result


def _save_png(path: Any, picture: np.ndarray) -> None:
    import matplotlib.image

    matplotlib.image.imsave(path, picture)


def _plot_rewards(path: Any, rewards: list[float], target: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(range(1, len(rewards) + 1), rewards, marker=".")
    axes.set_xlabel("Flow-GRPO update")
    axes.set_ylabel(f"mean {target} reward")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
