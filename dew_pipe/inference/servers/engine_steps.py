"""The compiled halves of the continuous-batching `Server`: join rows, advance rows, reload.

The server keeps ``S`` rows of decoder cache (``C`` slots each; for the decoder's
layer-split step one head-major array per layer, a `dew_pipe.inference.decoding.LayerCache`,
kept between calls so no call copies it into another layout) and a `Slots`
record of every row's decoding state on the device. Compiled functions change them, each
donating the cache or the slots it rewrites so XLA updates them in place:

- `prefill` starts ``J`` new requests in chosen rows, in three compiled steps. `encode`
  runs the ``U`` distinct prompts among them, left padded ``[U, P]``, through the decoder
  into a fresh ``[U, C]`` cache (real ids at slots ``0 .. n - 1``, padding dropped, as
  `dew_pipe.inference.generate` packs them) and the logits after each: one compile per
  (U bucket, P bucket). `place` copies each request's prompt cache into its row, in the
  row cache's layout (one light compile per (J bucket, U bucket)), and `begin` samples
  each request's first id from its prompt's logits and sets its row's state (one compile
  per J bucket). A GRPO group's ``G`` draws of one prompt that join together so share one
  prefill. Rows not named are untouched, so the running batch is not disturbed.
- `advance` runs up to ``steps`` decode steps over all rows in a ``lax.while_loop``
  (`dew_pipe.inference.decoding.decode_step`), feeding each active row's last id and
  sampling its next; a row stops on EOS or on its budget. Given ``join`` (> 0) it also
  stops after the step by which that many rows have finished in the call, so waiting
  requests can take their rows. One compile per server.
- `copy_into` writes new weights into the served buffers (donated), casting each floating
  leaf to the served dtype.

**Randomness.** Row b's ``t``-th id is drawn with ``fold_in(key(seed_b), t)``: the draw
depends on its own seed and position only, never on which row it sits in, which other
requests share the batch or how the steps are grouped into calls.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe.inference.decoding import LayerCache, decode_step, head_major
from dew_pipe.inference.generation import prefill_prompts
from dew_pipe.sampling import Sampled, Sampling, sample

__all__ = ["Slots", "advance", "begin", "copy_into", "empty_slots", "encode", "place", "prefill"]


class Slots(NamedTuple):
    """Every row's decoding state (``[S]`` each)."""

    last: jax.Array  # int32: the last sampled id, fed at the next step
    position: jax.Array  # int32: that id's position (and cache slot)
    count: jax.Array  # int32: ids sampled so far
    limit: jax.Array  # int32: the row's budget (max_new_tokens)
    seed: jax.Array  # uint32: the request's seed
    active: jax.Array  # bool: still decoding


class Advanced(NamedTuple):
    """What one `advance` call produced (host reads it after the call)."""

    ids: jax.Array  # [S, steps] int32, row b's new ids in columns 0 .. new_b - 1
    log_probs: jax.Array  # [S, steps] float32 raw
    behavior_log_probs: jax.Array  # [S, steps] float32
    support: jax.Array | None  # [S, steps, V] bool, when recorded
    steps: jax.Array  # int32: decode steps run
    active_rows: jax.Array  # [steps] int32: rows decoded by each step


def empty_slots(rows: int) -> Slots:
    """State of ``rows`` idle rows."""
    # Separate buffers: the slots are donated, and one buffer cannot be donated twice.
    return Slots(
        *(jnp.zeros((rows,), jnp.int32) for _ in range(4)),
        jnp.zeros((rows,), jnp.uint32),
        jnp.zeros((rows,), bool),
    )


def sample_rows(
    logits: jax.Array, seeds: jax.Array, counts: jax.Array, sampling: Sampling, support: bool
) -> Sampled:
    """`sample` per row with key ``fold_in(key(seed), count)`` (see the module docstring)."""

    def one(row: jax.Array, seed: jax.Array, count: jax.Array) -> Sampled:
        key = jax.random.fold_in(jax.random.key(seed), count)
        drawn = sample(row[None], key, sampling, support=support)
        return jax.tree.map(lambda x: x[0], drawn)

    return jax.vmap(one)(logits, seeds, counts)


@functools.partial(jax.jit, static_argnames=("model", "length", "dtype"))
def encode(
    model: Any,
    variables: Any,
    prompts: jax.Array,
    lengths: jax.Array,
    *,
    length: int,
    dtype: Any,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """``[U, P]`` left-padded prompts (``lengths`` ``[U]`` int32) through the decoder:
    a fresh ``[U, length]`` cache in ``dtype`` holding them, and the logits ``[U, V]``
    after each."""
    # A barrier: the empty cache is a constant, and XLA would otherwise constant-fold the
    # attention over it (tens of seconds of compile per prefill shape at 128 rows).
    fresh = jax.lax.optimization_barrier(model.init_cache(prompts.shape[0], length, dtype=dtype))
    logits, fresh = prefill_prompts(model, variables, fresh, prompts, lengths)
    return fresh, logits


@functools.partial(jax.jit, donate_argnames=("cache",))
def place(
    cache: dict[str, jax.Array],
    fresh: dict[str, jax.Array],
    logits: jax.Array,
    source: jax.Array,
    rows: jax.Array,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Copies prompt ``source[j]``'s cache from `encode`'s ``fresh`` into row ``rows[j]``
    (``[J]`` int32 each; an out-of-range row marks a padding entry, which writes nothing).
    Returns the cache and each entry's logits ``[J, V]``."""
    if isinstance(cache, LayerCache):  # one scatter per layer into its own array
        pairs = [
            head_major(fresh["key"][i][source], fresh["value"][i][source])
            for i in range(len(cache.keys))
        ]
        cache = LayerCache(
            keys=tuple(
                stored.at[rows].set(k, mode="drop")
                for stored, (k, _) in zip(cache.keys, pairs, strict=True)
            ),
            values=tuple(
                stored.at[rows].set(v, mode="drop")
                for stored, (_, v) in zip(cache.values, pairs, strict=True)
            ),
            positions=cache.positions.at[rows].set(fresh["positions"][source], mode="drop"),
        )
    else:
        cache = {
            "key": cache["key"].at[:, rows].set(fresh["key"][:, source], mode="drop"),
            "value": cache["value"].at[:, rows].set(fresh["value"][:, source], mode="drop"),
            "positions": cache["positions"].at[rows].set(fresh["positions"][source], mode="drop"),
        }
    return cache, logits[source]


@functools.partial(jax.jit, static_argnames=("sampling", "support"), donate_argnames=("slots",))
def begin(
    slots: Slots,
    logits: jax.Array,
    rows: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    seeds: jax.Array,
    *,
    sampling: Sampling,
    support: bool,
) -> tuple[Slots, Sampled]:
    """Samples each placed entry's first id from its ``logits`` ``[J, V]`` with its own
    seed and writes the rows' decoding state. ``rows``, ``lengths``/``limits`` int32 and
    ``seeds`` uint32 are ``[J]``. Returns the slots and the first sampled ids."""
    first = sample_rows(logits, seeds, jnp.zeros_like(lengths), sampling, support)
    done = sampling.is_eos(first.ids) | (limits <= 1)

    def put(column: jax.Array, values: jax.Array) -> jax.Array:
        return column.at[rows].set(values.astype(column.dtype), mode="drop")

    slots = Slots(
        last=put(slots.last, first.ids),
        position=put(slots.position, lengths),
        count=put(slots.count, jnp.ones_like(lengths)),
        limit=put(slots.limit, limits),
        seed=put(slots.seed, seeds),
        active=put(slots.active, ~done),
    )
    return slots, first


def prefill(
    model: Any,
    variables: Any,
    cache: dict[str, jax.Array],
    slots: Slots,
    rows: Any,
    prompts: Any,
    lengths: Any,
    limits: Any,
    seeds: Any,
    *,
    sampling: Sampling,
    support: bool,
    unique: Any = None,
    source: Any = None,
) -> tuple[dict[str, jax.Array], Slots, Sampled]:
    """`encode`, `place` and `begin`: starts requests in ``rows`` ``[J]``.

    ``prompts`` ``[U, P]`` left padded with ``unique`` ``[U]`` int32 lengths, and
    ``source`` ``[J]`` the prompt of each entry; without them (None) ``prompts`` is
    ``[J, P]``, one per entry, with ``lengths``. ``lengths``/``limits`` ``[J]`` int32,
    ``seeds`` ``[J]`` uint32.
    """
    layered = isinstance(cache, LayerCache)
    positions = cache.positions if layered else cache["positions"]
    dtype = cache.keys[0].dtype if layered else cache["key"].dtype
    if unique is None:
        unique, source = lengths, np.arange(len(lengths), dtype=np.int32)
    fresh, logits = encode(
        model, variables, prompts, unique, length=positions.shape[1], dtype=dtype
    )
    cache, logits = place(cache, fresh, logits, source, rows)
    slots, first = begin(
        slots, logits, rows, lengths, limits, seeds, sampling=sampling, support=support
    )
    return cache, slots, first


@functools.partial(
    jax.jit,
    static_argnames=("model", "sampling", "support", "steps"),
    donate_argnames=("cache", "slots"),
)
def advance(
    model: Any,
    variables: Any,
    cache: dict[str, jax.Array],
    slots: Slots,
    keep: jax.Array,
    join: jax.Array,
    *,
    steps: int,
    sampling: Sampling,
    support: bool,
) -> tuple[dict[str, jax.Array], Slots, Advanced]:
    """Runs up to ``steps`` decode steps over the rows active in ``slots`` and ``keep``.

    ``keep`` ``[S]`` bool drops rows the host has released (cancelled); ``join`` (int32
    scalar) stops after the step by which that many rows have finished in this call (0:
    only ``steps`` and the rows' own ends bound the call).
    """
    rows = slots.last.shape[0]
    step_fn = decode_step(model, variables)
    vocab = model.config.vocab_size

    out = {
        "ids": jnp.zeros((rows, steps), jnp.int32),
        "log_probs": jnp.zeros((rows, steps), jnp.float32),
        "behavior_log_probs": jnp.zeros((rows, steps), jnp.float32),
    }
    if support:
        out["support"] = jnp.zeros((rows, steps, vocab), bool)
    state = dict(
        step=jnp.int32(0),
        decode=step_fn.start(cache),
        slots=slots._replace(active=slots.active & keep),
        finished=jnp.int32(0),  # rows that finished in this call
        out=out,
        active_rows=jnp.zeros((steps,), jnp.int32),
    )

    def running(state: dict[str, Any]) -> jax.Array:
        joining = (join > 0) & (state["finished"] >= join)
        return (state["step"] < steps) & jnp.any(state["slots"].active) & ~joining

    def step(state: dict[str, Any]) -> dict[str, Any]:
        i, s = state["step"], state["slots"]
        active = s.active
        logits, decode = step_fn(state["decode"], s.last, s.position, s.position, active)
        drawn = sample_rows(logits, s.seed, s.count, sampling, support)
        values = {
            "ids": jnp.where(active, drawn.ids, 0),
            "log_probs": jnp.where(active, drawn.log_probs, 0.0),
            "behavior_log_probs": jnp.where(active, drawn.behavior_log_probs, 0.0),
        }
        if support:
            values["support"] = drawn.support & active[:, None]
        out = {
            name: jax.lax.dynamic_update_index_in_dim(state["out"][name], values[name], i, 1)
            for name in state["out"]
        }
        moved = active.astype(jnp.int32)
        count = s.count + moved
        finished = active & (sampling.is_eos(drawn.ids) | (count >= s.limit))
        slots = s._replace(
            last=jnp.where(active, drawn.ids, s.last),
            position=s.position + moved,
            count=count,
            active=active & ~finished,
        )
        return dict(
            step=i + 1,
            decode=decode,
            slots=slots,
            finished=state["finished"] + jnp.sum(finished, dtype=jnp.int32),
            out=out,
            active_rows=state["active_rows"].at[i].set(jnp.sum(moved)),
        )

    state = jax.lax.while_loop(running, step, state)
    out = state["out"]
    result = Advanced(
        ids=out["ids"],
        log_probs=out["log_probs"],
        behavior_log_probs=out["behavior_log_probs"],
        support=out.get("support"),
        steps=state["step"],
        active_rows=state["active_rows"],
    )
    # A layered cache goes back as it came: no per-call stacking of the whole cache.
    done = state["decode"]
    cache = step_fn.flush(done) if isinstance(cache, LayerCache) else step_fn.finish(done)
    return cache, state["slots"], result


@functools.partial(jax.jit, donate_argnums=0, keep_unused=True)
def copy_into(served: Any, new: Any) -> Any:
    """``new`` written over the donated ``served`` buffers, each leaf in the served dtype.

    ``keep_unused`` keeps ``served`` an argument although only its dtypes are read, so its
    donated buffers are reused for the result (an in-place copy).
    """
    return jax.tree.map(lambda old, leaf: leaf.astype(old.dtype), served, new)
