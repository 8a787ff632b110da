"""Sampling controls and the per-step sampler shared by every native generation path.

`Sampling` holds the controls (EOS ids, temperature, top-k, top-p, min-p) and validates
them when built. `sample` is the pure per-step function: given raw logits ``[B, V]`` and a
key it draws one id per row and reports two likelihoods for it,

- the *raw* model log-probability, ``log_softmax(logits)[id]``, which GRPO's PPO ratio
  compares against (``old_log_probs``), and
- the *behavior* log-probability: the log-probability of the id under the distribution the
  sampler actually drew from (temperature, then the filters, renormalised over the kept
  ids). It is 0.0 under greedy decoding, where the chosen id is certain.

Filter order (as transformers' and SGLang's samplers): divide by the temperature, keep the
``top_k`` largest logits (ties at the k-th value are all kept), keep the shortest prefix of
the remaining ids sorted by probability whose mass reaches ``top_p`` (ties broken towards the
lower id), then drop ids whose probability is below ``min_p`` times the largest. The min-p
test is scale free, so it does not matter that it reads renormalised probabilities.

``Sampling`` is a frozen, hashable dataclass: compiled generation takes it as a static
argument, so one compile serves every call with equal controls.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Sampled", "Sampling", "argmax", "filtered_logits", "sample"]


def _eos(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        if value < 0:
            raise ValueError(f"Sampling.eos_id is {value}; expected a nonnegative token id")
        return int(value)
    if isinstance(value, tuple | list):
        ids = tuple(_eos(v) if not isinstance(v, tuple | list) else None for v in value)
        if not ids or any(i is None for i in ids):
            raise ValueError(
                f"Sampling.eos_id is {value!r}; expected a token id or a nonempty tuple of ids"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"Sampling.eos_id is {value!r}; expected distinct ids")
        return ids
    raise TypeError(f"Sampling.eos_id is {value!r}; expected None, an int or a tuple of ints")


def _number(name: str, value: Any, low: float, high: float, *, open_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"Sampling.{name} is {value!r}; expected a number")
    value = float(value)
    ok = math.isfinite(value) and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = "(" if open_low else "["
        raise ValueError(
            f"Sampling.{name} is {value!r}; expected a number in {bound}{low}, {high}]"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How ids are drawn from the model's logits.

    Args:
        eos_id: the id, or tuple of ids, that ends a response (it is kept in the response);
            None never stops early.
        temperature: logits are divided by it before sampling; 0 means greedy (argmax of
            the raw logits, filters ignored since the argmax survives all of them).
        top_k: keep the k largest logits (None: no limit; a k above the vocabulary keeps all).
        top_p: keep the smallest most-likely set whose probability reaches top_p, in (0, 1]
            (None or 1: no limit).
        min_p: drop ids less likely than min_p times the most likely one, in [0, 1]
            (None or 0: no limit).

    Raises:
        TypeError: a field of the wrong type (a bool or float id, a float top_k...).
        ValueError: a value out of range, named with the expected range.

    Example:
        >>> Sampling(eos_id=(2, 7), temperature=0.7, top_k=40).eos_ids
        (2, 7)
        >>> Sampling(temperature=0).greedy
        True
    """

    eos_id: int | tuple[int, ...] | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "eos_id", _eos(self.eos_id))
        put(
            self,
            "temperature",
            _number("temperature", self.temperature, 0.0, math.inf, open_low=False),
        )
        if self.top_k is not None:
            k = self.top_k
            if isinstance(k, bool) or not isinstance(k, int | np.integer):
                raise TypeError(f"Sampling.top_k is {k!r}; expected None or a positive int")
            if k < 1:
                raise ValueError(f"Sampling.top_k is {k}; expected None or a positive int")
            put(self, "top_k", int(k))
        if self.top_p is not None:
            put(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, open_low=True))
        if self.min_p is not None:
            put(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0, open_low=False))

    @property
    def greedy(self) -> bool:
        """True when the temperature is 0 (argmax decoding)."""
        return self.temperature == 0.0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The EOS ids as a tuple (empty when ``eos_id`` is None)."""
        if self.eos_id is None:
            return ()
        return self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)

    @property
    def transforms(self) -> bool:
        """True when the behavior distribution differs from the raw model's.

        Greedy decoding, a temperature other than 1 or any active filter transform it.
        """
        return (
            self.temperature != 1.0
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.min_p is not None and self.min_p > 0.0)
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses EOS ids outside ``[0, vocab_size)``.

        Raises:
            ValueError: an EOS id not below ``vocab_size``.
        """
        for eos in self.eos_ids:
            if eos >= vocab_size:
                raise ValueError(
                    f"Sampling.eos_id contains {eos}; expected ids below vocab_size={vocab_size}"
                )

    def is_eos(self, ids: jax.Array) -> jax.Array:
        """Boolean array, True where ``ids`` is one of the EOS ids (all False without any)."""
        ids = jnp.asarray(ids)
        hit = jnp.zeros(ids.shape, bool)
        for eos in self.eos_ids:
            hit = hit | (ids == eos)
        return hit


class Sampled(NamedTuple):
    """One sampler step for ``B`` rows.

    Attributes:
        ids: ``[B]`` int32 drawn ids.
        log_probs: ``[B]`` float32 raw model log-probabilities of the ids.
        behavior_log_probs: ``[B]`` float32 log-probabilities under the sampled distribution
            (0.0 under greedy decoding).
        support: ``[B, V]`` bool kept ids, or None when not asked for (greedy: the argmax).
    """

    ids: jax.Array
    log_probs: jax.Array
    behavior_log_probs: jax.Array
    support: jax.Array | None


def filtered_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Temperature-scaled float32 logits with ``-inf`` outside the kept ids.

    Args:
        logits: ``[..., V]`` raw logits.
        sampling: non-greedy controls (temperature > 0).

    Returns:
        ``[..., V]`` float32; ``log_softmax`` of it is the behavior distribution.

    Raises:
        ValueError: greedy ``sampling`` (it has no distribution to filter).
    """
    if sampling.greedy:
        raise ValueError("filtered_logits: sampling is greedy (temperature 0); expected > 0")
    x = jnp.asarray(logits).astype(jnp.float32) / jnp.float32(sampling.temperature)
    vocab = x.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        # The k-th value as the minimum of the k largest, not their last column: XLA turns
        # a slice of top_k's values into a full sort of the row (about 10x slower on CPU
        # for k=40 of 1024), and a minimum keeps its TopK kernel. Same value either way.
        kth = jnp.min(jax.lax.top_k(x, sampling.top_k)[0], axis=-1, keepdims=True)
        x = jnp.where(x >= kth, x, -jnp.inf)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        x = _top_p(x, sampling.top_p)
    if sampling.min_p is not None and sampling.min_p > 0.0:
        top = jnp.max(x, axis=-1, keepdims=True)
        x = jnp.where(x >= top + jnp.float32(math.log(sampling.min_p)), x, -jnp.inf)
    return x


def _top_p(x: jax.Array, top_p: float) -> jax.Array:
    """Keeps the shortest descending-probability prefix whose mass reaches ``top_p``."""
    order = jnp.argsort(-x, axis=-1, stable=True)
    ranked = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    # An id is kept when the mass strictly before it is still short of top_p; the first id
    # always is. Computing "before" as an exclusive sum keeps the first id at exactly 0.
    before = before.at[..., 0].set(0.0)
    keep_ranked = before < jnp.float32(top_p)
    keep = jnp.put_along_axis(jnp.zeros(x.shape, bool), order, keep_ranked, axis=-1, inplace=False)
    return jnp.where(keep, x, -jnp.inf)


def sample(
    logits: jax.Array, key: jax.Array, sampling: Sampling, *, support: bool = False
) -> Sampled:
    """Draws one id per row and reports its raw and behavior log-probabilities.

    Pure and traceable: call it inside ``jit`` with ``sampling`` static.

    Args:
        logits: ``[B, V]`` raw model logits.
        key: a PRNG key (unused under greedy decoding).
        sampling: the controls.
        support: also return the ``[B, V]`` kept ids.

    Returns:
        A `Sampled`.

    Example:
        >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
        >>> out = sample(logits, jax.random.key(0), Sampling(temperature=0))
        >>> int(out.ids[0]), float(out.behavior_log_probs[0])
        (0, 0.0)
    """
    logits = jnp.asarray(logits).astype(jnp.float32)
    if sampling.greedy:
        ids = argmax(logits)
        behavior = jnp.zeros(ids.shape, jnp.float32)
        kept = jax.nn.one_hot(ids, logits.shape[-1], dtype=bool) if support else None
    else:
        x = filtered_logits(logits, sampling)
        # Gumbel-max: the argmax of logits plus Gumbel noise is a draw from their softmax;
        # filtered ids sit at -inf and are never drawn.
        ids = argmax(x + jax.random.gumbel(key, x.shape, jnp.float32))
        behavior = _log_prob(x, ids)
        kept = jnp.isfinite(x) if support else None
    return Sampled(ids, _log_prob(logits, ids), behavior, kept)


def argmax(x: jax.Array) -> jax.Array:
    """Index of the largest value on the last axis (the first on ties), int32.

    Same result as ``jnp.argmax`` for finite inputs, written as a max and a min over an
    index mask: XLA's CPU backend runs those two plain reductions about twice as fast as
    the paired value/index reduction ``jnp.argmax`` lowers to, which matters once per
    decode step on a ``[B, V]`` row. A row holding NaN gives the last id.
    """
    vocab = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(vocab, dtype=jnp.int32)
    first = jnp.min(jnp.where(x == top, index, vocab), axis=-1)
    return jnp.minimum(first, vocab - 1).astype(jnp.int32)


def _log_prob(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """``log_softmax(logits)[ids]`` without materialising the whole log-softmax."""
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    norm = top[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    return jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0] - norm
