"""Compiled batch generation with the decoder's key/value cache.

`generate` samples up to ``R`` ids for each of ``B`` left-padded prompts in one compiled
call:

1. **Prefill, packed.** The padded ``[B, P]`` batch goes through the decoder once. Row b's
   real ids (its last ``n_b`` columns) are written to cache slots ``[0, n_b)`` with
   positions ``0 .. n_b - 1``; its padding is given negative slots, which the decoder drops.
   So prompts of any valid lengths share one compiled shape, and row b's ``t``-th sampled id
   later lands in slot ``n_b + t``. Only the last column's hidden state goes through the
   output projection.
2. **Decode loop.** A ``lax.while_loop`` feeds each row's last sampled id, one position per
   step (`dew_pipe.inference.decoding`), and stops as soon as every row has finished (EOS
   or its budget): no Python runs per token and nothing goes back to the host until the
   end. A finished row writes nothing more to its cache; its later outputs are ``pad_id``
   with log-probabilities 0.
3. **Sampling** is `dew_pipe.sampling.sample`, so every id comes with its raw model
   log-probability and its behavior log-probability.

The cache holds ``P + R - 1`` slots (the last sampled id never goes through the model). One
compile serves each (model, B, P, R, sampling, support, pad_id); jit caches it. Rows may
have their own budgets below ``R`` (enforced inside the loop), which is how callers reuse
one compiled ``R`` for several budgets. ``benchmarks/generate.py`` measures tokens/s against
transformers' ``generate``.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.decoding import decode_step
from dew_pipe.sampling import Sampling, sample

__all__ = ["Generated", "generate", "generate_in_chunks"]


class Generated(NamedTuple):
    """What `generate` returns for ``B`` prompts and a budget of ``R`` ids.

    Attributes:
        ids: ``[B, R]`` int32 sampled ids; row b's first ``lengths[b]`` are real (EOS
            included on a natural stop), the rest ``pad_id``.
        log_probs: ``[B, R]`` float32 raw model log-probabilities of the ids (0 on padding).
        behavior_log_probs: ``[B, R]`` float32 log-probabilities under the sampling
            distribution (0 under greedy decoding and on padding).
        lengths: ``[B]`` int32 number of sampled ids per row, in ``[1, R]``.
        stopped: ``[B]`` bool, True where EOS ended the row, False where the budget did.
        support: ``[B, R, V]`` bool kept ids of each step, or None unless asked for.
    """

    ids: jax.Array
    log_probs: jax.Array
    behavior_log_probs: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    support: jax.Array | None


def _check_prompts(model: Any, prompts: Any, prompt_lengths: Any) -> tuple[np.ndarray, int]:
    """Host-side checks of the prompt batch (before any compile); returns the lengths."""
    shape = np.shape(prompts)
    dtype = getattr(prompts, "dtype", None) or np.asarray(prompts).dtype
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"prompts has shape {shape}; expected [batch, prompt_len] with both >= 1")
    if not np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_):
        raise TypeError(f"prompts has dtype {dtype}; expected integer token ids")
    lengths = np.asarray(prompt_lengths)
    if not np.issubdtype(lengths.dtype, np.integer) or np.issubdtype(lengths.dtype, np.bool_):
        raise TypeError(f"prompt_lengths has dtype {lengths.dtype}; expected integers")
    if lengths.shape != (shape[0],):
        raise ValueError(f"prompt_lengths has shape {lengths.shape}; expected [{shape[0]}]")
    if lengths.min() < 1 or lengths.max() > shape[1]:
        raise ValueError(
            f"prompt_lengths has values in [{lengths.min()}, {lengths.max()}]; expected each "
            f"in [1, {shape[1]}] (a prompt needs at least one id)"
        )
    if isinstance(prompts, np.ndarray):
        # Device arrays are not pulled back just to check them; ids out of range there
        # would embed garbage (jnp.take clamps), so callers with host data get the check.
        vocab = model.config.vocab_size
        real = np.arange(shape[1])[None, :] >= (shape[1] - lengths)[:, None]
        used = prompts[real]
        if used.size and (used.min() < 0 or used.max() >= vocab):
            raise ValueError(
                f"prompts holds ids in [{used.min()}, {used.max()}]; expected ids in "
                f"[0, {vocab}) (vocab_size)"
            )
    return lengths, int(shape[1])


def generate(
    model: Any,
    variables: Any,
    prompts: Any,
    prompt_lengths: Any,
    max_new_tokens: Any,
    key: jax.Array,
    sampling: Sampling | None = None,
    *,
    support: bool = False,
    pad_id: int = 0,
    capacity: int | None = None,
    lanes: int = 1,
    repeats: int = 1,
) -> Generated:
    """Samples up to ``max_new_tokens`` ids for each left-padded prompt, in one compiled call.

    Args:
        model: a decoder with the `CausalTransformer` call forms (``features``/``logits``
            methods, ``init_cache``) and a ``config`` with ``vocab_size``/``max_seq_len``.
        variables: its ``{"params": ...}``.
        prompts: ``[B, P]`` int token ids, left padded (row b's ids are its last
            ``prompt_lengths[b]`` columns; the padding values are ignored).
        prompt_lengths: ``[B]`` int, each in ``[1, P]``.
        max_new_tokens: the budget, an int >= 1 or ``[B]`` per-row budgets.
        key: a PRNG key; step t draws with ``fold_in(key, t)``, row b with row b's noise.
        sampling: the controls (default `Sampling()`: temperature 1, no EOS).
        support: also return each step's kept ids (``[B, R, V]`` bool; costs memory).
        pad_id: the id written after a row has finished.
        capacity: the compiled budget ``R`` (the outputs' width), at least every row's
            budget; None means the largest budget. ``P + R - 1`` must fit ``max_seq_len``.
        lanes: split the rows into this many contiguous lanes of ``ceil(B / lanes)`` rows
            (the last one padded with copies of its first row, so one compile serves them
            all; fewer lanes where the rows run out) and run the lanes' compiled calls at
            once, each on a thread of its own. At small batches XLA's CPU backend keeps a
            decode step on one core, so two lanes use both (1.2-1.6x on two cores at
            batches 16-256, ``benchmarks/generate.py``). Lane ``l`` draws
            with ``fold_in(key, l)`` when ``lanes > 1``, so sampled ids depend on ``lanes``
            (greedy ones do not, up to float rounding across batch shapes); each lane stops
            when its own rows have finished. With ``repeats``, lanes split the prompts,
            each lane taking whole groups of ``repeats`` rows.
        repeats: ``G``, rows sampled per prompt (a GRPO group): the outputs have ``B * G``
            rows, row ``b * G + g`` being draw ``g`` of prompt ``b``. Each prompt goes
            through the decoder once and its cache is copied to its ``G`` rows, so the
            prefill costs ``B`` rows instead of ``B * G``; the draws are those of
            `generate` on the prompts repeated ``G`` times (``np.repeat(prompts, G, 0)``,
            the same key), up to float rounding across batch shapes. A per-row
            ``max_new_tokens`` then has ``B * G`` budgets.

    Returns:
        A `Generated` of device arrays.

    Raises:
        TypeError / ValueError: bad shapes, dtypes, lengths or budgets, ids out of the
            vocabulary, EOS ids out of the vocabulary, ``P + R - 1 > max_seq_len``,
            ``lanes`` outside ``[1, B]`` or ``repeats`` below 1.

    Example:
        >>> out = generate(model, variables, prompts, lengths, 8, jax.random.key(0),
        ...                Sampling(eos_id=2, temperature=0))   # doctest: +SKIP
        >>> out.ids.shape   # doctest: +SKIP
        (4, 8)
    """
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
    lengths, width = _check_prompts(model, prompts, prompt_lengths)
    repeats = check_int("repeats", repeats, minimum=1)
    limits = _budgets(max_new_tokens, len(lengths) * repeats)
    room = int(limits.max()) if capacity is None else check_int("capacity", capacity, minimum=1)
    if room < limits.max():
        raise ValueError(f"capacity is {room}; expected at least the largest budget {limits.max()}")
    cfg = model.config
    sampling.check_vocab(cfg.vocab_size)
    pad_id = check_int("pad_id", pad_id, minimum=0)
    if width + room - 1 > cfg.max_seq_len:
        raise ValueError(
            f"prompt_len ({width}) + max_new_tokens ({room}) - 1 = {width + room - 1} "
            f"exceeds the model's max_seq_len={cfg.max_seq_len}"
        )
    lanes = check_int("lanes", lanes, minimum=1, maximum=len(lengths))
    options = dict(
        budget=room, sampling=sampling, support=bool(support), pad_id=int(pad_id), repeats=repeats
    )
    if lanes == 1:
        return _compiled(
            model,
            variables,
            model.init_cache(len(lengths), width + room - 1),
            jnp.asarray(prompts, jnp.int32),
            jnp.asarray(lengths, jnp.int32),
            jnp.asarray(limits),
            key,
            **options,
        )
    return _in_lanes(
        model, variables, prompts, lengths, limits, key, lanes, width + room - 1, options
    )


def _in_lanes(
    model: Any,
    variables: Any,
    prompts: Any,
    lengths: np.ndarray,
    limits: np.ndarray,
    key: jax.Array,
    lanes: int,
    slots: int,
    options: dict[str, Any],
) -> Generated:
    """`generate`'s rows as ``lanes`` equal calls running at once, joined row-wise
    (with ``repeats``, each lane takes whole prompts and their groups of rows)."""
    rows, repeats = len(lengths), options["repeats"]
    size = -(-rows // lanes)  # prompts per lane; ceil(rows / size) lanes have real ones
    prompts = jnp.asarray(prompts, jnp.int32)

    def lane(index: int) -> Generated:
        take = np.arange(index * size, (index + 1) * size)
        take = np.where(take < rows, take, index * size)  # padding: the lane's first prompt
        grouped = (take[:, None] * repeats + np.arange(repeats)).reshape(-1)
        out = _compiled(
            model,
            variables,
            model.init_cache(size, slots),
            prompts[take],
            jnp.asarray(lengths[take], jnp.int32),
            jnp.asarray(limits[grouped]),
            jax.random.fold_in(key, index),
            **options,
        )
        return jax.block_until_ready(out)  # on this lane's thread, so the calls overlap

    used = -(-rows // size)
    with ThreadPoolExecutor(used, thread_name_prefix="dew-generate-lane") as pool:
        parts = list(pool.map(lane, range(used)))

    def joined(field: str) -> jax.Array | None:
        values = [getattr(part, field) for part in parts]
        return None if values[0] is None else jnp.concatenate(values)[: rows * repeats]

    return Generated(*(joined(field) for field in Generated._fields))


def generate_in_chunks(
    model: Any,
    variables: Any,
    prompts: Any,
    prompt_lengths: Any,
    max_new_tokens: int,
    key: jax.Array,
    sampling: Sampling | None = None,
    *,
    batch: int,
    pad_id: int = 0,
) -> list[np.ndarray]:
    """`generate` over any number of prompts, ``batch`` at a time: each row's sampled ids.

    The last chunk is padded to ``batch`` rows with copies of the first prompt, so one
    compile serves every call; chunk ``c`` draws with ``fold_in(key, c)``.

    Returns:
        One int32 array per prompt: its sampled ids (EOS included on a natural stop).

    Raises:
        As `generate`; ValueError for a ``batch`` below 1.

    Example:
        >>> rows = generate_in_chunks(model, variables, prompts, lengths, 8, jax.random.key(0),
        ...                           Sampling(eos_id=2, temperature=0), batch=64)  # doctest: +SKIP
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch is {batch!r}; expected an int >= 1")
    prompts, prompt_lengths = np.asarray(prompts), np.asarray(prompt_lengths)
    count = len(prompts)
    fill = -count % batch
    prompts = np.concatenate([prompts, np.repeat(prompts[:1], fill, axis=0)])
    prompt_lengths = np.concatenate([prompt_lengths, np.repeat(prompt_lengths[:1], fill)])
    rows: list[np.ndarray] = []
    for call, start in enumerate(range(0, count + fill, batch)):
        out = generate(
            model,
            variables,
            prompts[start : start + batch],
            prompt_lengths[start : start + batch],
            max_new_tokens,
            jax.random.fold_in(key, call),
            sampling,
            pad_id=pad_id,
        )
        ids, used = np.asarray(out.ids), np.asarray(out.lengths)
        rows.extend(row[:k] for row, k in zip(ids, used, strict=True))
    return rows[:count]


def _budgets(value: Any, rows: int) -> np.ndarray:
    """``[rows]`` int32 budgets from an int or a per-row array (each >= 1)."""
    if np.ndim(value) == 0:
        return np.full(rows, check_int("max_new_tokens", value, minimum=1), np.int32)
    array = np.asarray(value)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"max_new_tokens has dtype {array.dtype}; expected integers")
    if array.shape != (rows,):
        raise ValueError(f"max_new_tokens has shape {array.shape}; expected an int or [{rows}]")
    if array.min() < 1:
        raise ValueError(f"max_new_tokens has a budget of {array.min()}; expected each >= 1")
    return array.astype(np.int32)


def prefill_prompts(
    model: Any, variables: Any, cache: dict[str, jax.Array], prompts: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Logits after each prompt ``[B, V]`` and the cache holding its ids at slots ``[0, n_b)``
    (traced inside a compiled caller: `generate`, and the server's ``engine_steps.encode``)."""
    width = prompts.shape[1]
    start = width - lengths
    columns = jnp.arange(width, dtype=jnp.int32)[None, :]
    real = columns >= start[:, None]
    hidden, cache = model.apply(
        variables,
        prompts,
        real.astype(jnp.int32),
        jnp.where(real, columns - start[:, None], 0),
        cache=cache,
        cache_index=-start,  # padding lands at negative slots, which the decoder drops
        method="features",
    )
    return model.apply(variables, hidden[:, -1], method="logits"), cache


def _record(out: dict[str, jax.Array], drawn: Any, active: jax.Array, t: Any, pad_id: int):
    """Writes step ``t``'s draws into the ``[B, R, ...]`` outputs (padding where inactive)."""
    values = {
        "ids": jnp.where(active, drawn.ids, pad_id),
        "log_probs": jnp.where(active, drawn.log_probs, 0.0),
        "behavior_log_probs": jnp.where(active, drawn.behavior_log_probs, 0.0),
    }
    if "support" in out:
        values["support"] = drawn.support & active[:, None]
    return {k: jax.lax.dynamic_update_index_in_dim(out[k], values[k], t, 1) for k in out}


@functools.partial(
    jax.jit,
    static_argnames=("model", "budget", "sampling", "support", "pad_id", "repeats"),
)
def _compiled(
    model: Any,
    variables: Any,
    cache: dict[str, jax.Array],
    prompts: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    key: jax.Array,
    *,
    budget: int,
    sampling: Sampling,
    support: bool,
    pad_id: int,
    repeats: int,
) -> Generated:
    logits, cache = prefill_prompts(model, variables, cache, prompts, lengths)
    if repeats > 1:  # each prompt's cache and last logits copied to its group of rows
        logits, lengths = jnp.repeat(logits, repeats, 0), jnp.repeat(lengths, repeats)
        cache = {
            "key": jnp.repeat(cache["key"], repeats, 1),
            "value": jnp.repeat(cache["value"], repeats, 1),
            "positions": jnp.repeat(cache["positions"], repeats, 0),
        }
    batch = logits.shape[0]
    first = sample(logits, jax.random.fold_in(key, 0), sampling, support=support)
    out = {
        "ids": jnp.full((batch, budget), pad_id, jnp.int32),
        "log_probs": jnp.zeros((batch, budget), jnp.float32),
        "behavior_log_probs": jnp.zeros((batch, budget), jnp.float32),
    }
    if support:
        out["support"] = jnp.zeros((batch, budget, logits.shape[-1]), bool)
    step_fn = decode_step(model, variables)
    count = jnp.ones((batch,), jnp.int32)
    stopped = sampling.is_eos(first.ids)
    state = dict(
        step=jnp.int32(1),
        decode=step_fn.start(cache),
        last=first.ids,
        stopped=stopped,
        done=stopped | (count >= limits),
        count=count,
        out=_record(out, first, jnp.ones((batch,), bool), 0, pad_id),
    )

    def running(state: dict[str, Any]) -> jax.Array:
        return (state["step"] < budget) & ~jnp.all(state["done"])

    def step(state: dict[str, Any]) -> dict[str, Any]:
        t, active = state["step"], ~state["done"]
        # Row b feeds the id it sampled last, at position (and slot) n_b + t - 1.
        position = lengths + t - 1
        logits, decode = step_fn(state["decode"], state["last"], position, position, active)
        drawn = sample(logits, jax.random.fold_in(key, t), sampling, support=support)
        count = state["count"] + active.astype(jnp.int32)
        stopped = state["stopped"] | (active & sampling.is_eos(drawn.ids))
        return dict(
            step=t + 1,
            decode=decode,
            last=jnp.where(active, drawn.ids, state["last"]),
            stopped=stopped,
            done=stopped | (count >= limits),
            count=count,
            out=_record(state["out"], drawn, active, t, pad_id),
        )

    state = jax.lax.while_loop(running, step, state)
    out = state["out"]
    return Generated(
        ids=out["ids"],
        log_probs=out["log_probs"],
        behavior_log_probs=out["behavior_log_probs"],
        lengths=state["count"],
        stopped=state["stopped"],
        support=out.get("support"),
    )
