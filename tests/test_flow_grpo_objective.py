"""Flow-GRPO: sample_trajectory's densities, transition_kl, FlowRollout's groups and the loss.

References are written here, independently of the library:

* the SDE transition (Flow-GRPO, Liu et al. 2025, section 4, Euler-Maruyama from t to s = t - h):
  ``x_s = x_t + [v + sigma_t^2 / (2 t) (x_t + (1 - t) v)] (s - t) + sigma_t sqrt(h) z`` with
  ``sigma_t = a sqrt(t / (1 - t))`` (``1 - t_1`` in the denominator at t = 1), and its
  Gaussian log density, computed in NumPy float64 with ``scipy``-free formulas;
* the KL between two Gaussians, ``log(s2 / s1) + (s1^2 + (m1 - m2)^2) / (2 s2^2) - 1/2`` per
  coordinate, here with ``s1 = s2 = sigma_t sqrt(h)`` and averaged over coordinates;
* the policy objective (section 4): ``r = exp(log p_theta - log p_old)`` with per-coordinate
  mean log densities, ``min(r A, clip(r, 1 - eps, 1 + eps) A) - beta KL`` averaged over the
  selected transitions, negated to a loss;
* group statistics: ``(r - mean) / (pstdev + 1e-4)`` with Python's ``statistics`` module.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Field, InputSpec, Trainer, models, presets
from dew_pipe.data import Dataset
from dew_pipe.diffusion import transition_kl, transition_log_density
from dew_pipe.inference.flow_rollout import rewards_from_bytes, rewards_to_bytes
from dew_pipe.objectives.rl import FlowGRPOObjective, FlowRollout, FlowTrajectory, sample_trajectory

NOISE_LEVEL = 0.7


def _dit():
    return models.SimpleDiT(
        output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2
    )


def _objective(beta=0.0, clip=1e-4):
    inputs = InputSpec(Field("image", (4, 4, 1)))
    return FlowGRPOObjective(_dit(), presets.Flow()(), inputs, beta=beta, steps=5, clip=clip)


def _perturbed(variables, seed, scale=0.2):
    """Variables moved off the zero initialisation, so every layer matters."""
    leaves, tree = jax.tree.flatten(variables)
    rng = np.random.default_rng(seed)  # host noise: no compile per leaf shape
    noise = [scale * rng.normal(size=leaf.shape).astype(np.float32) for leaf in leaves]
    return jax.tree.unflatten(tree, [leaf + n for leaf, n in zip(leaves, noise, strict=True)])


class _State:
    def __init__(self, params):
        self.params = params


# ---------------------------------------------------------------------------- references


def _sigma(t: float, t_first: float) -> float:
    return NOISE_LEVEL * math.sqrt(t / (1.0 - min(t, t_first)))


def _sde_mean(x, v, t, s, sigma):
    """Euler-Maruyama drift step of the SDE, written as the SDE reads (float64)."""
    return x + (v + sigma**2 / (2.0 * t) * (x + (1.0 - t) * v)) * (s - t)


def _gaussian_log_density(x, mean, std):
    return np.sum(-((x - mean) ** 2) / (2.0 * std**2) - np.log(std) - 0.5 * np.log(2.0 * np.pi))


class _Linear:
    """A velocity model with a closed form, v = w * x + t * b, for an all-NumPy reference."""

    def __init__(self):
        self.process = presets.Flow()()
        self.inputs = InputSpec(Field("x", (3,)))
        self.latent_shape = (3,)

    def condition(self, params, conditions):
        return None

    def velocity(self, params, x, t, cond):
        return params["w"] * x + t[:, None] * params["b"]


# ---------------------------------------------------------------------------- sampling


def test_trajectory_log_densities_match_float64_gaussian_transitions():
    model = _Linear()
    params = {"w": jnp.array([0.5, -1.0, 0.2]), "b": jnp.array([1.0, 0.0, -2.0])}
    rows = 2000
    trajectory = sample_trajectory(model, params, jax.random.key(4), rows=rows, steps=5)
    assert isinstance(trajectory, FlowTrajectory)
    assert trajectory.states.shape == (rows, 5, 3)  # five time points, both ends included
    assert trajectory.log_densities.shape == (rows, 4) and trajectory.stochastic.all()
    times = trajectory.times
    np.testing.assert_array_equal(times, [1.0, 0.75, 0.5, 0.25, 0.0])
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    states = trajectory.states.astype(np.float64)
    expected = np.zeros((rows, 4))
    standardized = []
    for k in range(4):
        t, s = times[k], times[k + 1]
        sigma = _sigma(t, times[1])
        std = sigma * math.sqrt(t - s)
        x, following = states[:, k], states[:, k + 1]
        mean = _sde_mean(x, w * x + t * b, t, s, sigma)
        expected[:, k] = [
            _gaussian_log_density(f, m, std) for f, m in zip(following, mean, strict=True)
        ]
        standardized.append((following - mean) / std)
    np.testing.assert_allclose(trajectory.log_densities, expected, rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(trajectory.sigmas, [_sigma(t, 0.75) for t in times[:-1]], rtol=1e-12)
    # the paths were drawn from those Gaussians: the implied noise is standard normal
    z = np.concatenate(standardized).ravel()
    assert abs(z.mean()) < 0.03 and abs(z.var() - 1.0) < 0.05
    assert abs(states[:, 0].mean()) < 0.05 and abs(states[:, 0].var() - 1.0) < 0.08
    np.testing.assert_allclose(trajectory.per_coordinate(), trajectory.log_densities / 3, rtol=1e-6)


def test_deterministic_intervals_are_ode_steps_without_density():
    model = _Linear()
    params = {"w": jnp.array([0.5, -1.0, 0.2]), "b": jnp.array([1.0, 0.0, -2.0])}
    marks = np.array([True, False, True, False])
    trajectory = sample_trajectory(
        model, params, jax.random.key(5), rows=4, steps=5, stochastic=marks
    )
    np.testing.assert_array_equal(trajectory.stochastic, marks)
    np.testing.assert_array_equal(trajectory.log_densities[:, [1, 3]], 0.0)
    np.testing.assert_array_equal(trajectory.sigmas[[1, 3]], 0.0)
    assert (trajectory.log_densities[:, [0, 2]] != 0).all()
    w, b = np.asarray(params["w"]), np.asarray(params["b"])
    for k in (1, 3):
        t, s = trajectory.times[k], trajectory.times[k + 1]
        x = trajectory.states[:, k].astype(np.float64)
        np.testing.assert_allclose(
            trajectory.states[:, k + 1], x - (t - s) * (w * x + t * b), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(
        ValueError, match="expected 4 booleans, one per transition of a 5-point grid"
    ):
        sample_trajectory(model, params, jax.random.key(5), rows=4, steps=5, stochastic=[True])
    # noise_level 0: no transition has a density
    model.process = presets.Flow(noise_level=0.0)()
    quiet = sample_trajectory(model, params, jax.random.key(5), rows=2, steps=3)
    assert not quiet.stochastic.any() and (quiet.log_densities == 0).all()


def test_transition_kl_is_the_per_coordinate_gaussian_kl():
    rng = np.random.default_rng(0)
    mean, reference = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    std = np.array([0.3, 1.0, 2.5])
    got = np.asarray(transition_kl(jnp.asarray(mean), jnp.asarray(reference), jnp.asarray(std)))
    s = std[:, None]
    closed = np.log(s / s) + (s**2 + (mean - reference) ** 2) / (2 * s**2) - 0.5
    np.testing.assert_allclose(got, closed.mean(axis=1), rtol=1e-6)
    # elapsed time enters the variance: the std of a transition over h is sigma * sqrt(h)
    sigma, h = 0.7, 0.25
    one = np.asarray(transition_kl(jnp.ones((1, 2)), jnp.zeros((1, 2)), sigma * math.sqrt(h)))
    np.testing.assert_allclose(one, [1.0 / (2 * sigma**2 * h)], rtol=1e-6)


# ---------------------------------------------------------------------------- rollout


def _fixed_reward(values):
    calls = []

    def reward(images, batch):
        calls.append((images, batch))
        return np.array(values, np.float64)

    return reward, calls


def test_rollout_groups_advantages_masks_and_float64_rewards():
    objective = _objective()
    params = _perturbed(objective.init(jax.random.key(0)), 1)
    # group 0: rewards that differ only below float32 resolution (steps of 2^-40, so the
    # group mean is exact in float64 whatever the summation order); group 1: all tied
    tiny = 2.0**-40
    values = [1.0, 1.0 + tiny, 1.0 + 3 * tiny, 1.0 + 6 * tiny, 0.25, 0.25, 0.25, 0.25]
    reward, calls = _fixed_reward(values)
    rollout = FlowRollout(objective, reward, groups=4, steps=5, train_steps=2)
    source = {"image": np.zeros((2, 4, 4, 1), np.uint8)}
    out = rollout(_State(params), source, jax.random.key(2))

    images, seen = calls[0]
    assert images.shape == (8, 4, 4, 1) and images.dtype == np.float32
    assert np.abs(images).max() <= 1.0
    assert seen["image"].shape == (8, 4, 4, 1)  # the source batch, each row repeated G times
    # rewards: the callback's float64 values, bit for bit, through bytes and JSON too
    assert out["rewards"].dtype == np.float64
    np.testing.assert_array_equal(out["rewards"].view(np.uint64), np.array(values).view(np.uint64))
    np.testing.assert_array_equal(rewards_from_bytes(rewards_to_bytes(out["rewards"])), values)
    np.testing.assert_array_equal(json.loads(json.dumps(out["rewards"].tolist())), values)
    # advantages: float64 group statistics (population std, eps 1e-4), then float32
    expected = []
    for group in (values[:4], values[4:]):
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        expected += [(r - mean) / (std + 1e-4) for r in group]
    assert out["advantages"].dtype == np.float32
    np.testing.assert_allclose(out["advantages"], np.float32(expected), rtol=1e-6, atol=0)
    assert (out["advantages"][:4] != 0).all()  # float32 rewards would have tied them all
    # the tied group stays in the batch with its transitions cleared
    np.testing.assert_array_equal(out["advantages"][4:], 0.0)
    np.testing.assert_array_equal(out["transition_mask"], [[1, 1]] * 4 + [[0, 0]] * 4)
    # five time points: the first two of four transitions are trained
    np.testing.assert_array_equal(out["times"][0], [1.0, 0.75])
    np.testing.assert_array_equal(out["next_times"][0], [0.75, 0.5])
    assert out["states"].shape == out["next_states"].shape == (8, 2, 4, 4, 1)
    assert rollout.metrics()["advantage/zero"] == 0.5
    assert rollout.metrics()["transitions"] == 8.0
    objective.validate(out)
    # the batch was sampled under these params: the ratio of the first update is 1
    _, metrics = jax.jit(objective.loss)(params, out, jax.random.key(0), None)
    np.testing.assert_allclose(float(metrics["ratio"]), 1.0, atol=1e-5)
    assert float(metrics["transitions"]) == 8.0


def test_rollout_selection_train_steps_and_refusals():
    objective = _objective()
    reward, _ = _fixed_reward([0.0] * 4)
    everything = FlowRollout(objective, reward, groups=2, steps=5, train_steps=None)
    np.testing.assert_array_equal(everything.selected, [0, 1, 2, 3])
    marks = [True, False, True, True]
    skipping = FlowRollout(objective, reward, groups=2, steps=5, stochastic=marks)
    np.testing.assert_array_equal(skipping.selected, [0, 2, 3])  # never the deterministic one
    first_two = FlowRollout(objective, reward, groups=2, steps=5, train_steps=2, stochastic=marks)
    np.testing.assert_array_equal(first_two.selected, [0, 2])
    with pytest.raises(ValueError, match="train_steps is 4; expected None or an int >= 1 and <= 3"):
        FlowRollout(objective, reward, groups=2, steps=5, train_steps=4, stochastic=marks)
    with pytest.raises(ValueError, match="groups is 1; expected an int >= 2"):
        FlowRollout(objective, reward, groups=1, steps=5)
    quiet = FlowGRPOObjective(
        _dit(), presets.Flow(noise_level=0.0)(), InputSpec(Field("image", (4, 4, 1)))
    )
    with pytest.raises(ValueError, match="has no stochastic transition"):
        FlowRollout(quiet, reward, groups=2, steps=5)
    with pytest.raises(TypeError, match="expected a FlowGRPOObjective"):
        FlowRollout(object(), reward, groups=2, steps=5)


def test_rollout_refuses_bad_rewards_naming_the_sample():
    objective = _objective()
    params = objective.init(jax.random.key(0))
    source = {"image": np.zeros((1, 4, 4, 1), np.uint8)}
    for values, error, message in [
        ([0.0, np.nan], ValueError, "reward returned nan for sample 1; expected finite scores"),
        ([0.0], ValueError, r"reward returned shape \(1,\); expected \(2,\)"),
        (["a", "b"], TypeError, "reward returned dtype <U1"),
    ]:
        rollout = FlowRollout(objective, lambda images, batch, v=values: v, groups=2, steps=3)
        with pytest.raises(error, match=message):
            rollout(_State(params), source, jax.random.key(1))


# ---------------------------------------------------------------------------- the loss


def _reference_loss(objective, params, ema, batch, beta, eps):
    """Flow-GRPO's loss from the paper's equations (module docstring), in jnp for autodiff."""
    model = objective.model
    rows, steps = batch["states"].shape[:2]
    x = batch["states"].reshape(rows * steps, 4, 4, 1)
    y = batch["next_states"].reshape(rows * steps, 4, 4, 1)
    t, s, sigma = (batch[k].reshape(-1, 1, 1, 1) for k in ("times", "next_times", "sigmas"))
    std = sigma * jnp.sqrt(t - s)

    def mean_of(variables):
        v = model.apply({"params": variables["params"]["model"]}, x, t.reshape(-1))
        return x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * (s - t)

    mean = mean_of(params)
    log_p = jnp.mean(
        -((y - mean) ** 2) / (2 * std**2) - jnp.log(std) - 0.5 * jnp.log(2 * jnp.pi), axis=(1, 2, 3)
    )
    ratio = jnp.exp(log_p.reshape(rows, steps) - batch["old_log_probs"])
    a = batch["advantages"][:, None]
    value = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps, 1 + eps) * a)
    if beta:
        reference = jax.lax.stop_gradient(mean_of(ema))
        kl = jnp.mean(
            jnp.log(std / std) + (std**2 + (mean - reference) ** 2) / (2 * std**2) - 0.5,
            axis=(1, 2, 3),
        )
        value = value - beta * kl.reshape(rows, steps)
    m = batch["transition_mask"]
    return -(m * value).sum() / m.sum()


@pytest.mark.parametrize("beta", [pytest.param(0.0, marks=pytest.mark.slow), 0.3])
def test_loss_and_gradients_match_the_paper_reference(beta):
    eps = 0.05
    objective = _objective(beta=beta, clip=eps)
    variables = objective.init(jax.random.key(0))
    params, ema = _perturbed(variables, 1), _perturbed(variables, 2)
    rng = np.random.default_rng(3)
    rows, steps = 3, 2
    times = np.array([[1.0, 0.75], [0.75, 0.5], [0.5, 0.25]], np.float32)
    next_times = times - 0.25
    sigmas = np.array([[_sigma(t, 0.75) for t in row] for row in times], np.float32)
    batch = {
        "states": rng.normal(size=(rows, steps, 4, 4, 1)).astype(np.float32),
        "next_states": rng.normal(size=(rows, steps, 4, 4, 1)).astype(np.float32),
        "times": times,
        "next_times": next_times,
        "sigmas": sigmas,
        "old_log_probs": np.zeros((rows, steps), np.float32),
        "advantages": np.array([1.5, -0.7, 0.4], np.float32),
        "transition_mask": np.array([[1, 1], [1, 0], [1, 1]], np.float32),
    }
    # old log-probs near the current ones, so some ratios fall inside the clip and some out
    per_coordinate = _log_probs(objective, params, batch)
    batch["old_log_probs"] = (per_coordinate + rng.uniform(-0.1, 0.1, (rows, steps))).astype(
        np.float32
    )
    objective.validate(batch)

    loss_fn = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    (loss, metrics), grads = loss_fn(params, batch, jax.random.key(0), ema if beta else None)
    reference = jax.jit(
        jax.value_and_grad(lambda p: _reference_loss(objective, p, ema, batch, beta, eps))
    )
    ref_loss, ref_grads = reference(params)
    assert 0.0 < float(metrics["clip_fraction"]) < 1.0
    assert float(metrics["transitions"]) == 5.0
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-7)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
    if beta:
        assert float(metrics["kl"]) > 0.0
        without = FlowGRPOObjective(_dit(), presets.Flow()(), objective.inputs, beta=0.0, clip=eps)
        plain, _ = without.loss(params, batch, jax.random.key(0), None)
        assert abs(float(plain) - float(loss)) > 1e-4  # the KL term is in the loss


def _log_probs(objective, params, batch):
    mean = jax.jit(objective.transition_means)(params, batch)
    h = batch["times"] - batch["next_times"]
    std = (batch["sigmas"] * np.sqrt(h)).reshape(-1)
    following = batch["next_states"].reshape(mean.shape)
    return np.asarray(transition_log_density(following, mean, std)).reshape(h.shape) / 16


def test_validate_names_the_field_at_fault():
    objective = _objective()
    good = {
        "states": np.zeros((2, 1, 4, 4, 1), np.float32),
        "next_states": np.zeros((2, 1, 4, 4, 1), np.float32),
        "times": np.ones((2, 1), np.float32),
        "next_times": np.full((2, 1), 0.5, np.float32),
        "sigmas": np.ones((2, 1), np.float32),
        "old_log_probs": np.zeros((2, 1), np.float32),
        "transition_mask": np.ones((2, 1), np.float32),
        "advantages": np.zeros(2, np.float32),
    }
    objective.validate(good)
    with pytest.raises(
        ValueError, match=r"'states' has shape \(2, 1, 4, 4\); expected \(N, T, 4, 4, 1\)"
    ):
        objective.validate({**good, "states": np.zeros((2, 1, 4, 4))})
    with pytest.raises(ValueError, match=r"'advantages' has shape \(3,\); expected \(2,\)"):
        objective.validate({**good, "advantages": np.zeros(3)})
    with pytest.raises(ValueError, match="no field 'sigmas'"):
        objective.validate({k: v for k, v in good.items() if k != "sigmas"})
    with pytest.raises(ValueError, match=r"'transition_mask' holds \[0.5\]"):
        objective.validate({**good, "transition_mask": np.full((2, 1), 0.5)})
    with pytest.raises(ValueError, match="transition 0 of row 0 is masked in but has no noise"):
        objective.validate({**good, "sigmas": np.zeros((2, 1), np.float32)})
    with pytest.raises(ValueError, match="beta is -1.0; expected a finite float >= 0"):
        FlowGRPOObjective(_dit(), presets.Flow()(), objective.inputs, beta=-1.0)


# ---------------------------------------------------------------------------- the spec's example

SPEC_EXAMPLE = """
import itertools
import jax
import numpy as np
import optax
from dew_pipe import Field, InputSpec, Trainer, models, presets
from dew_pipe.data import Dataset
from dew_pipe.objectives.rl import FlowGRPOObjective, FlowRollout

inputs = InputSpec(Field("image", (4, 4, 1)))
model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8,
                         num_layers=1, num_heads=2, mlp_ratio=2)
objective = FlowGRPOObjective(model, presets.Flow()(), inputs,
                              guidance=None, beta=0.01, steps=5)

def brightness(images, batch):
    return images.mean(axis=(1, 2, 3))

rollout = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)
batch = {"image": np.zeros((2, 4, 4, 1), dtype=np.uint8)}
data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=2, batch=2)
trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout)
state = trainer.fit(data, steps=2, log_every=1)
print(int(state.updates))
"""


@pytest.mark.slow
def test_spec_example_runs_two_updates_and_keeps_the_reference_frozen():
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(SPEC_EXAMPLE, "flow_grpo_example", "exec"), namespace)
    assert out.getvalue() == "2\n"
    state, trainer = namespace["state"], namespace["trainer"]
    start = trainer.initial_state().params
    # beta > 0: the EMA slot holds the starting policy, bit for bit, after two updates
    for frozen, initial in zip(jax.tree.leaves(state.ema), jax.tree.leaves(start), strict=True):
        np.testing.assert_array_equal(frozen, initial)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start), strict=True)
    ]
    assert any(moved)
    rollout = namespace["rollout"]
    assert set(rollout.metrics()) == {"reward/mean", "reward/std", "advantage/zero", "transitions"}
    # beta = 0 keeps no reference
    objective = namespace["FlowGRPOObjective"](
        namespace["model"], presets.Flow()(), namespace["inputs"], guidance=None, beta=0.0
    )
    assert objective.ema_decay is None
    assert Trainer(objective, optax.adam(1e-3), key=jax.random.key(0)).initial_state().ema is None


# ---------------------------------------------------------------------------- conditioned runs


class _PromptEncoder(nn.Module):
    """Mean of the prompt's token embeddings (pad id 0 left out)."""

    @nn.compact
    def __call__(self, ids):
        embedded = nn.Embed(8, 8)(ids)
        keep = (ids != 0)[..., None]
        return (embedded * keep).sum(axis=1) / jnp.maximum(keep.sum(axis=1), 1)


@pytest.mark.slow
def test_conditioned_run_rolls_out_evaluates_and_previews_from_prompts_alone():
    words = {"dark": 1, "light": 2, "square": 3}
    inputs = InputSpec(
        Field("image", (4, 4, 1)),
        Field("prompt", (2,), tokenizer=lambda text: [words[w] for w in text.split()]),
    )

    def mean_pixel(images, batch):
        return images.mean(axis=(1, 2, 3))

    objective = FlowGRPOObjective(
        _dit(),
        presets.Flow()(),
        inputs,
        guidance=1.5,
        beta=0.0,
        steps=3,
        encoders={"prompt": _PromptEncoder()},
        eval_metrics={"brightness": mean_pixel},
    )
    prompts = inputs.tokenize(["light square", "dark"])  # no image field
    assert list(prompts) == ["prompt"]

    def reward(images, batch):
        wants_light = batch["prompt"][:, 0] == 2
        return np.where(wants_light, 1.0, -1.0) * images.mean(axis=(1, 2, 3))

    rollout = FlowRollout(objective, reward, groups=2, steps=3)
    data = Dataset(
        train=lambda partition: itertools.repeat(prompts),
        val=lambda partition: [prompts],
        records=None,
        batch=2,
    )
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout)
    state = trainer.fit(data, steps=2, log_every=2)
    assert int(state.updates) == 2 and state.ema is None
    out = rollout(state, prompts, jax.random.key(1))
    # the rollout repeats the conditions with their rows, contiguously per group
    np.testing.assert_array_equal(out["prompt"], np.repeat(prompts["prompt"], 2, axis=0))
    assert out["states"].shape == (4, 2, 4, 4, 1)  # train_steps=None: both transitions
    # evaluation samples from the prompts with the live policy and averages the metric
    results = trainer.evaluate(state, data)
    images = np.asarray(jax.jit(objective.sample)(state.params, jax.random.key(5), prompts))
    assert images.shape == (2, 4, 4, 1)
    assert set(results) == {"brightness"} and -1.0 <= results["brightness"] <= 1.0
    with pytest.raises(ValueError, match="no sample field 'image'"):
        objective.diffusion.loss(state.params, prompts, jax.random.key(0), None)
