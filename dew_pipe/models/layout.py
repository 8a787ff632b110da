"""Operand layouts that keep XLA's CPU matmuls on their bfloat16 kernels.

XLA's CPU backend multiplies bfloat16 operands on its bfloat16 kernels only when both are
row-major and contracted as ``[M, K] @ [K, N]``; any other product (a transposed operand,
a contraction over the first axis) is widened to float32 first and runs at the float32
rate or below. Backward passes written for bfloat16 compute transpose one operand of such
products into a row-major copy with `row_major_transpose`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["row_major_transpose", "weight_gradient"]


def row_major_transpose(a: jax.Array) -> jax.Array:
    """``a`` with its last two axes swapped, as a row-major array of its own.

    A plain transpose is only a layout change, which XLA folds into the product that reads
    it (so that product is no longer row-major); flattening it behind an optimization
    barrier makes the copy happen.

    Example:
        >>> import jax.numpy as jnp
        >>> row_major_transpose(jnp.arange(6).reshape(2, 3)).tolist()
        [[0, 3], [1, 4], [2, 5]]
    """
    *lead, rows, columns = a.shape
    flat = jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2).reshape(-1))
    return flat.reshape(*lead, columns, rows)


def weight_gradient(inputs: jax.Array, d_out: jax.Array) -> jax.Array:
    """``inputs^T @ d_out``, ``[in, out]`` in float32, on the bfloat16 kernels.

    The gradient of the kernel of a ``[N, in] @ [in, out]`` product, from bfloat16
    ``inputs [N, in]`` and ``d_out [N, out]``. The narrower operand is copied into its
    row-major transpose (`row_major_transpose`), so the copy is cheap; when that is
    ``d_out``, the product comes out ``[out, in]`` and is transposed behind a barrier, so
    the product itself stays row-major.

    Example:
        >>> x = jnp.ones((4, 2), jnp.bfloat16); d = jnp.ones((4, 3), jnp.bfloat16)
        >>> weight_gradient(x, d).tolist(), weight_gradient(d, x).shape
        ([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]], (3, 2))
    """
    if inputs.shape[-1] > d_out.shape[-1]:
        product = jnp.dot(row_major_transpose(d_out), inputs, preferred_element_type=jnp.float32)
        return jax.lax.optimization_barrier(product).T
    return jnp.dot(row_major_transpose(inputs), d_out, preferred_element_type=jnp.float32)
