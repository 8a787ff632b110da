"""SimpleDiT, Field/InputSpec, the rectified-flow Process and DiffusionObjective's pretraining.

The pretraining check trains a tiny DiT by flow matching on generated 4x4 images (a bright
top half or a bright left half) and asserts on the validation loss: at initialisation the
model predicts zero, so the loss is ``E (eps - x0)^2 = 1 + 1 = 2`` for pixels at +-1; after
training it must have fallen well below the best a data-blind predictor can do.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Field, InputSpec, Trainer, models, presets
from dew_pipe.data import Dataset
from dew_pipe.diffusion import Process
from dew_pipe.objectives import DiffusionObjective


def _dit(**overrides):
    config = dict(
        output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2
    )
    config.update(overrides)
    return models.SimpleDiT(**config)


def _halves(rng: np.random.Generator, rows: int) -> np.ndarray:
    images = np.zeros((rows, 4, 4, 1), np.uint8)
    for i, top in enumerate(rng.integers(0, 2, rows)):
        if top:
            images[i, :2] = 255
        else:
            images[i, :, :2] = 255
    return images


# ---------------------------------------------------------------------------- SimpleDiT


def test_dit_maps_images_to_velocities_and_starts_at_zero():
    model = _dit(output_channels=3)
    x = jax.random.normal(jax.random.key(0), (2, 4, 6, 1))
    t = jnp.array([0.2, 0.9])
    variables = jax.jit(model.init)(jax.random.key(1), x, t)
    apply = jax.jit(model.apply)
    out = apply(variables, x, t)
    assert out.shape == (2, 4, 6, 3)
    np.testing.assert_array_equal(np.asarray(out), 0.0)  # adaLN-Zero and a zero projection
    # once the zero layers move, the output depends on x, t and cond
    leaves, tree = jax.tree.flatten(variables)
    rng = np.random.default_rng(2)  # host noise: no compile per leaf shape
    moved = jax.tree.unflatten(
        tree, [leaf + 0.1 * rng.normal(size=leaf.shape).astype(np.float32) for leaf in leaves]
    )
    base = apply(moved, x, t)
    assert not np.allclose(base, apply(moved, x, t[::-1]))
    assert not np.allclose(base, apply(moved, x + 1.0, t))
    assert not np.allclose(base, apply(moved, x, t, jnp.ones((2, 8))))


def test_dit_patch_order_keeps_each_patch_in_place():
    # A model whose blocks do nothing maps each patch through the same affine map, so a
    # permutation of patches in the input permutes them in the output.
    model = _dit(num_layers=0)
    x = jax.random.normal(jax.random.key(0), (1, 4, 4, 1))
    variables = jax.jit(model.init)(jax.random.key(1), x, jnp.zeros(1))
    params = jax.tree.map(lambda a: np.asarray(a) + 0.3, variables["params"])
    params["position"] = np.zeros_like(params["position"])
    apply = jax.jit(model.apply)
    out = apply({"params": params}, x, jnp.zeros(1))
    swapped = jnp.concatenate([x[:, 2:], x[:, :2]], axis=1)  # swap top and bottom patch rows
    out_swapped = apply({"params": params}, swapped, jnp.zeros(1))
    np.testing.assert_allclose(
        out_swapped, jnp.concatenate([out[:, 2:], out[:, :2]], axis=1), rtol=1e-5, atol=1e-6
    )


def test_dit_refuses_bad_settings_and_inputs():
    with pytest.raises(ValueError, match=r"emb_features \(8\) is not divisible by num_heads \(3\)"):
        _dit(num_heads=3)
    with pytest.raises(ValueError, match="patch_size is 0; expected an int >= 1"):
        _dit(patch_size=0)
    with pytest.raises(TypeError, match="num_layers is 1.5"):
        _dit(num_layers=1.5)
    model = _dit()
    with pytest.raises(ValueError, match=r"image is 3x4; expected sides divisible by patch_size"):
        model.init(jax.random.key(0), jnp.zeros((1, 3, 4, 1)), jnp.zeros(1))
    with pytest.raises(ValueError, match=r"cond has shape \(1, 5\); expected \(1, 8\)"):
        model.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)), jnp.zeros(1), jnp.zeros((1, 5)))


# ---------------------------------------------------------------------------- inputs


def test_input_spec_reads_rows_and_tokenizes_prompts():
    words = {"red": 3, "square": 4, "circle": 5}
    inputs = InputSpec(
        Field("image", (4, 4, 1)),
        Field("prompt", (3,), tokenizer=lambda text: [words[w] for w in text.split()], pad_id=1),
    )
    assert inputs.sample.name == "image" and [f.name for f in inputs.conditions] == ["prompt"]
    tokens = inputs.tokenize(["red square", "red circle red square"])
    assert list(tokens) == ["prompt"]  # no sample field: generation from prompts alone
    np.testing.assert_array_equal(tokens["prompt"], [[3, 4, 1], [3, 5, 3]])
    assert tokens["prompt"].dtype == np.int32
    assert inputs.rows(tokens) == 2
    assert inputs.rows({"image": np.zeros((5, 4, 4, 1)), "prompt": np.zeros((5, 3))}) == 5
    with pytest.raises(
        ValueError, match=r"'image' has shape \(2, 4, 4\); expected \(rows, 4, 4, 1\)"
    ):
        inputs.rows({"image": np.zeros((2, 4, 4))})
    with pytest.raises(ValueError, match=r"expected at least one of \['image', 'prompt'\]"):
        inputs.rows({"label": np.zeros(2)})
    with pytest.raises(TypeError, match=r"prompts\[1\] is 3"):
        inputs.tokenize(["red", 3])


def test_field_and_input_spec_refuse_bad_definitions():
    with pytest.raises(ValueError, match=r"Field 'image' shape\[1\] is 0; expected an int >= 1"):
        Field("image", (4, 0, 1))
    with pytest.raises(TypeError, match="Field name is ''"):
        Field("", (4,))
    with pytest.raises(ValueError, match=r"has a tokenizer and shape \(2, 2\)"):
        Field("prompt", (2, 2), tokenizer=str.split)
    with pytest.raises(ValueError, match=r"repeats field name\(s\) \['image'\]"):
        InputSpec(Field("image", (4,)), Field("image", (4,)))
    with pytest.raises(ValueError, match="first field 'prompt' has a tokenizer"):
        InputSpec(Field("prompt", (3,), tokenizer=str.split))
    with pytest.raises(ValueError, match="tokenize needs a field with a tokenizer"):
        InputSpec(Field("image", (4,))).tokenize(["a"])


# ---------------------------------------------------------------------------- process


def test_flow_preset_grid_noise_scales_and_interpolation():
    process = presets.Flow()()
    assert isinstance(process, Process) and process.prediction == "velocity"
    times = process.timesteps(5)
    np.testing.assert_array_equal(times, [1.0, 0.75, 0.5, 0.25, 0.0])
    # sigma_t = a sqrt(t / (1 - t)), with 1 - t_1 as the denominator at t = 1
    expected = 0.7 * np.sqrt(np.array([1.0 / 0.25, 0.75 / 0.25, 0.5 / 0.5, 0.25 / 0.75]))
    np.testing.assert_allclose(process.sigmas(times), expected, rtol=1e-15)
    shifted = presets.Flow(shift=3.0)().timesteps(3)
    np.testing.assert_allclose(shifted, [1.0, 1.5 / 2.0, 0.0])
    x0, noise = jnp.ones((2, 3)), jnp.full((2, 3), -1.0)
    np.testing.assert_allclose(
        process.noisy(x0, noise, jnp.array([0.0, 0.25])), [[1] * 3, [0.5] * 3]
    )
    np.testing.assert_array_equal(process.target(x0, noise), -2.0)
    with pytest.raises(ValueError, match="steps is 1; expected an int >= 2"):
        process.timesteps(1)
    with pytest.raises(ValueError, match="noise_level is -0.1"):
        presets.Flow(noise_level=-0.1)()
    with pytest.raises(ValueError, match="time_sampling is 'cosine'"):
        presets.Flow(time_sampling="cosine")()


# ---------------------------------------------------------------------------- objective


class _LabelEncoder(nn.Module):
    @nn.compact
    def __call__(self, label):
        return nn.Embed(2, 8)(label[:, 0].astype(jnp.int32))


def test_diffusion_objective_checks_its_parts():
    inputs = InputSpec(Field("image", (4, 4, 1)), Field("label", (1,)))
    process = presets.Flow()()
    with pytest.raises(
        ValueError, match=r"encoders cover fields \[\] but the condition fields are \['label'\]"
    ):
        DiffusionObjective(_dit(), process, inputs)
    with pytest.raises(ValueError, match="guidance is 2.0, but .* has no condition field"):
        DiffusionObjective(_dit(), process, InputSpec(Field("image", (4, 4, 1))), guidance=2.0)
    with pytest.raises(TypeError, match="expected a dew_pipe.diffusion.Process"):
        DiffusionObjective(_dit(), presets.Flow(), inputs, encoders={"label": _LabelEncoder()})
    objective = DiffusionObjective(
        _dit(), process, inputs, encoders={"label": _LabelEncoder()}, guidance=2.0
    )
    variables = jax.jit(objective.init)(jax.random.key(0))
    assert sorted(variables["params"]) == ["encoders", "model"]
    with pytest.raises(ValueError, match=r"no condition field\(s\) \['label'\]"):
        objective.validate({"image": np.zeros((2, 4, 4, 1), np.uint8)})
    # guidance mixes the conditioned and the null-condition velocities
    moved = jax.tree.map(lambda a: np.asarray(a) + 0.05, variables)
    x, t = jnp.ones((2, 4, 4, 1)), jnp.array([0.3, 0.6])

    @jax.jit
    def velocities(params):
        cond = objective.condition(params, {"label": jnp.array([[0], [1]])})
        v_c = objective._apply(params, x, t, cond)
        v_u = objective._apply(params, x, t, jnp.zeros_like(cond))
        return objective.velocity(params, x, t, cond), v_u + 2.0 * (v_c - v_u)

    guided, expected = velocities(moved)
    np.testing.assert_allclose(guided, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_flow_matching_pretraining_learns_generated_images():
    model = _dit(emb_features=16)
    objective = DiffusionObjective(model, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))))

    def train(partition):
        rng = np.random.default_rng(partition.index)
        while True:
            yield {"image": _halves(rng, 32)}

    val = {"image": _halves(np.random.default_rng(99), 64)}
    data = Dataset(train=train, val=lambda partition: [val], records=None, batch=32)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), progress=False)
    before = trainer.evaluate(trainer.initial_state(), data)["loss"]
    # zero prediction: E (eps - x0)^2 = 2 for x0 = +-1 (1024 coordinates: std 0.08)
    assert abs(before - 2.0) < 0.3
    state = trainer.fit(data, steps=120, log_every=120)
    after = trainer.evaluate(state, data)["loss"]
    # a predictor blind to x_t can do no better than E Var(eps - x0) = 1 + mean Var(x0) = 1.5
    assert after < 0.8, (before, after)
    samples = np.asarray(objective.sample(state.params, jax.random.key(3), val))
    assert samples.shape == (64, 4, 4, 1) and np.abs(samples).max() <= 1.0
    # most samples are one of the two shapes (every pixel on the right side of zero)
    top = np.where(np.arange(4)[:, None] < 2, 1.0, -1.0) * np.ones((4, 4))
    shapes = np.stack([top, top.T])[:, None, :, :, None]
    matches = (np.sign(samples)[None] == shapes).all(axis=(2, 3, 4)).any(axis=0)
    assert matches.mean() > 0.5, matches.mean()


def test_uint8_sample_field_maps_onto_unit_range():
    objective = DiffusionObjective(_dit(), presets.Flow()(), InputSpec(Field("image", (4, 4, 1))))
    batch = {"image": np.full((2, 4, 4, 1), 255, np.uint8)}
    np.testing.assert_array_equal(objective.encode(batch), 1.0)
    np.testing.assert_allclose(
        objective.encode({"image": np.full((1, 2, 2, 1), 51, np.uint8)}), -0.6
    )
    np.testing.assert_array_equal(
        objective.encode({"image": np.zeros((1, 4, 4, 1), np.uint8)}), -1.0
    )


class _Pool:
    """A frozen autoencoder: 2x2 mean pooling down, nearest-neighbour upsampling back."""

    def encode(self, images):
        rows, h, w, c = images.shape
        return images.reshape(rows, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))

    def decode(self, latents):
        return 3.0 * jnp.repeat(jnp.repeat(latents, 2, axis=1), 2, axis=2)


def test_autoencoder_sets_the_latent_shape_and_decodes_samples():
    model = _dit()
    objective = DiffusionObjective(
        model, presets.Flow()(), InputSpec(Field("image", (8, 4, 1))), autoencoder=_Pool()
    )
    assert objective.latent_shape == (4, 2, 1) and objective.coordinates == 8
    variables = jax.jit(objective.init)(jax.random.key(0))
    assert variables["params"]["model"]["position"].shape == (2, 8)  # 2x1 patches of 4x2
    batch = {"image": np.full((3, 8, 4, 1), 255, np.uint8)}
    np.testing.assert_array_equal(objective.encode(batch), np.ones((3, 4, 2, 1)))
    images = jax.jit(objective.sample)(variables, jax.random.key(1), batch)
    assert images.shape == (3, 8, 4, 1)
    assert np.abs(images).max() <= 1.0  # decoded, then clipped to [-1, 1]
    with pytest.raises(TypeError, match="expected None or an object with encode"):
        DiffusionObjective(
            model, presets.Flow()(), InputSpec(Field("image", (8, 4, 1))), autoencoder=1
        )


def test_pretrained_variables_start_the_objective_and_are_checked():
    inputs = InputSpec(Field("image", (4, 4, 1)))
    source = DiffusionObjective(_dit(), presets.Flow()(), inputs)
    variables = jax.jit(source.init)(jax.random.key(0))
    variables = jax.tree.map(lambda a: np.asarray(a) + 1.0, variables)
    objective = DiffusionObjective(_dit(), presets.Flow()(), inputs, pretrained=variables)
    copied = objective.init(jax.random.key(7))
    for got, want in zip(jax.tree.leaves(copied), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(got, want)
    wide = DiffusionObjective(_dit(emb_features=16), presets.Flow()(), inputs)
    with pytest.raises(
        ValueError, match=r"pretrained\['params'\]\['model'\]\['block_0'\].* has shape"
    ):
        DiffusionObjective(wide.model, presets.Flow()(), inputs, pretrained=variables)
    with pytest.raises(ValueError, match="expected a full variables mapping"):
        DiffusionObjective(_dit(), presets.Flow()(), inputs, pretrained=variables["params"])


@pytest.mark.slow
def test_docstring_examples_run():
    import doctest
    import importlib

    for name in (
        "dew_pipe.inputs",
        "dew_pipe.diffusion",
        "dew_pipe.presets",
        "dew_pipe.models.dit",
        "dew_pipe.objectives.diffusion",
        "dew_pipe.objectives.rl.flow_grpo",
        "dew_pipe.inference.flow_rollout",
    ):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
