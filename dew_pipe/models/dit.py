"""SimpleDiT: a small diffusion transformer (Peebles & Xie 2023) in Flax linen.

``model.apply(variables, x, t, cond=None) -> velocity`` maps images ``x [B, H, W, C]``, times
``t [B]`` in ``[0, 1]`` and an optional conditioning vector ``cond [B, emb_features]`` to an
output of shape ``[B, H, W, output_channels]``.

1. Patchify: non-overlapping ``patch_size x patch_size`` patches, each projected to
   ``emb_features``, plus a learned position embedding per patch.
2. Conditioning ``c``: a sinusoidal embedding of ``1000 * t`` through a two-layer SiLU MLP,
   plus ``cond`` when given (a condition encoder's output; zeros are "no condition").
3. ``num_layers`` DiT blocks with adaLN-Zero: from ``c`` each block computes a shift, scale
   and gate for its attention and its MLP (``mlp_ratio * emb_features`` hidden units); the
   modulation layers start at zero, so every block starts as the identity.
4. A final adaLN layer and a zero-initialised projection back to patches, then unpatchify.
   The model therefore predicts zero everywhere at initialisation.

Example:
    >>> model = SimpleDiT(output_channels=1, patch_size=2, emb_features=8, num_layers=1,
    ...                   num_heads=2, mlp_ratio=2)
    >>> x, t = jnp.zeros((3, 4, 4, 1)), jnp.full((3,), 0.5)
    >>> variables = model.init(jax.random.key(0), x, t)
    >>> model.apply(variables, x, t).shape
    (3, 4, 4, 1)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew_pipe._validate import check_float, check_int

__all__ = ["SimpleDiT", "timestep_embedding"]


def timestep_embedding(t: jax.Array, features: int, max_period: float = 10_000.0) -> jax.Array:
    """Sinusoidal embedding ``[cos(1000 t f_i), sin(1000 t f_i)]`` of times ``t [B]``."""
    half = features // 2
    frequencies = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = 1000.0 * t.astype(jnp.float32)[:, None] * frequencies[None, :]
    embedding = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if features % 2:
        embedding = jnp.pad(embedding, ((0, 0), (0, 1)))
    return embedding


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return x * (1.0 + scale[:, None, :]) + shift[:, None, :]


class _Block(nn.Module):
    """One DiT block: adaLN-Zero attention, then an adaLN-Zero MLP."""

    features: int
    num_heads: int
    mlp_features: int

    @nn.compact
    def __call__(self, h: jax.Array, c: jax.Array) -> jax.Array:
        modulation = nn.Dense(6 * self.features, kernel_init=nn.initializers.zeros, name="adaln")
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(modulation(nn.silu(c)), 6, axis=-1)
        norm = nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)
        attention = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, name="attention")
        y = _modulate(norm(h), shift1, scale1)
        h = h + gate1[:, None, :] * attention(y, y)
        y = _modulate(norm(h), shift2, scale2)
        y = nn.Dense(self.features, name="mlp_out")(
            nn.gelu(nn.Dense(self.mlp_features, name="mlp_in")(y), approximate=True)
        )
        return h + gate2[:, None, :] * y


class SimpleDiT(nn.Module):
    """A small diffusion transformer over image patches (see the module docstring).

    Attributes:
        output_channels: channels of the output (the image's channels for velocity).
        patch_size: side of the square patches; must divide the image's height and width.
        emb_features: width of the token and conditioning embeddings.
        num_layers: DiT blocks.
        num_heads: attention heads; must divide ``emb_features``.
        mlp_ratio: MLP hidden width as a multiple of ``emb_features``.

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range (when built), an
            image whose sides ``patch_size`` does not divide or a ``cond`` of the wrong
            width (when called).
    """

    output_channels: int
    patch_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        for name in ("output_channels", "patch_size", "emb_features", "num_heads"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("num_layers", self.num_layers, minimum=0)
        check_float("mlp_ratio", self.mlp_ratio, above=0.0)
        if self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features ({self.emb_features}) is not divisible by num_heads "
                f"({self.num_heads}); expected whole attention heads"
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array | None = None) -> jax.Array:
        rows, height, width, channels = x.shape
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(
                f"image is {height}x{width}; expected sides divisible by patch_size ({p})"
            )
        grid_h, grid_w = height // p, width // p
        patches = x.reshape(rows, grid_h, p, grid_w, p, channels)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(rows, grid_h * grid_w, -1)
        h = nn.Dense(self.emb_features, name="patch_embed")(patches)
        position = self.param(
            "position", nn.initializers.normal(0.02), (grid_h * grid_w, self.emb_features)
        )
        h = h + position[None]

        c = timestep_embedding(jnp.broadcast_to(t, (rows,)), self.emb_features)
        c = nn.Dense(self.emb_features, name="time_in")(c)
        c = nn.Dense(self.emb_features, name="time_out")(nn.silu(c))
        if cond is not None:
            if cond.shape != (rows, self.emb_features):
                raise ValueError(
                    f"cond has shape {cond.shape}; expected ({rows}, {self.emb_features})"
                )
            c = c + cond

        mlp_features = max(1, int(round(self.mlp_ratio * self.emb_features)))
        for i in range(self.num_layers):
            h = _Block(self.emb_features, self.num_heads, mlp_features, name=f"block_{i}")(h, c)

        shift, scale = jnp.split(
            nn.Dense(2 * self.emb_features, kernel_init=nn.initializers.zeros, name="final_adaln")(
                nn.silu(c)
            ),
            2,
            axis=-1,
        )
        h = _modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6)(h), shift, scale)
        out = nn.Dense(
            p * p * self.output_channels, kernel_init=nn.initializers.zeros, name="final"
        )(h)
        out = out.reshape(rows, grid_h, grid_w, p, p, self.output_channels)
        return out.transpose(0, 1, 3, 2, 4, 5).reshape(rows, height, width, self.output_channels)
