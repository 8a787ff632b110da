"""A tiny decoder and independent references for the rollout-server and rollout-source tests.

Imported by tests/test_rollout_servers.py and tests/test_rollout_sources.py; it must not
import pytest. Both files build the same model and the same greedy bfloat16 setup, so in
one pytest process the server's compiled functions are shared between them.
"""

from __future__ import annotations

import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from test_sampling import log_softmax, reference_filtered

from dew_pipe import models
from dew_pipe.inference import Server, generate
from dew_pipe.inference.servers.engine_setup import served_model
from dew_pipe.sampling import Sampling

CONFIG = dict(
    vocab_size=32,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=48,
    max_seq_len=32,
    qk_norm=True,
    tie_embeddings=True,
    init_std=0.3,  # spread logits: greedy choices far from ties
)
PROBES = ([5, 9, 2, 17, 30, 4], [11, 3, 8], [21], [7, 7, 1, 29], [14, 2])
GREEDY_STEPS = 8


def tiny_model(seed: int = 0):
    """The test decoder and its float32 variables from ``jax.random.key(seed)``."""
    model = models.build("causal_transformer", **CONFIG)
    return model, jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))


@jax.jit
def other_weights(variables):
    """Different weights of the same shapes (a stand-in for a training update)."""

    def move(x):
        wave = jnp.sin(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
        return 1.3 * x + 0.1 * wave

    return jax.tree.map(move, variables)


class Reference:
    """Uncached forward passes of one model: the likelihoods a draw should report."""

    def __init__(self, model) -> None:
        self.forward = jax.jit(lambda v, t, s: model.apply(v, t, s))

        def cached(v, tokens, segments, cache, index):
            return model.apply(v, tokens, segments, cache=cache, cache_index=index)

        self.init_cache = model.init_cache
        self.cached = jax.jit(cached)

    def logits(self, variables, ids) -> np.ndarray:
        """``[len(ids), V]`` float64 logits of one sequence (right padded to one shape)."""
        tokens = np.zeros((1, CONFIG["max_seq_len"]), np.int32)
        segments = np.zeros_like(tokens)
        tokens[0, : len(ids)], segments[0, : len(ids)] = ids, 1
        return np.asarray(self.forward(variables, tokens, segments), np.float64)[0, : len(ids)]

    def draw(self, variables, prompt, sampled, sampling: Sampling):
        """Raw and behavior log-probabilities of ``sampled`` after ``prompt``, and supports."""
        sampled = [int(i) for i in sampled]
        ids = [*prompt, *sampled[:-1]]
        logits = self.logits(variables, ids)[len(prompt) - 1 :]
        cols = np.arange(len(sampled))
        raw = log_softmax(logits)[cols, sampled]
        behavior = reference_filtered(logits, sampling.temperature, sampling.top_k)
        support = [np.flatnonzero(np.isfinite(row)) for row in behavior]
        return raw, behavior[cols, sampled], support

    def switched(self, old, new, prompt, sampled, fed_old: int) -> np.ndarray:
        """Raw log-probabilities of ``sampled`` when weights change in the middle of a draw.

        The prompt and the first ``fed_old`` sampled ids went through ``old`` (their keys
        and values stay in the cache); the later ids are fed through ``new``, attending to
        that cache. Returns the raw log-probabilities of ``sampled[fed_old + 1:]``. Both
        cached calls take one right-padded shape (padding is segment 0), so one compile.
        """
        sampled = [int(i) for i in sampled]
        head = [*prompt, *sampled[:fed_old]]
        tail = sampled[fed_old:-1]
        cache = self.init_cache(1, CONFIG["max_seq_len"])
        _, cache = self.cached(old, *self._padded(head), cache, np.zeros(1, np.int32))
        logits, _ = self.cached(new, *self._padded(tail), cache, np.full(1, len(head), np.int32))
        logits = np.asarray(logits, np.float64)[0, : len(tail)]
        return log_softmax(logits)[np.arange(len(tail)), sampled[fed_old + 1 :]]

    @staticmethod
    def _padded(ids):
        tokens = np.zeros((1, 16), np.int32)
        tokens[0, : len(ids)] = ids
        return tokens, (np.arange(16) < len(ids)).astype(np.int32)[None]


def left_padded(prompts, width=None, pad=0):
    width = width or max(map(len, prompts))
    out = np.full((len(prompts), width), pad, np.int32)
    for b, p in enumerate(prompts):
        out[b, width - len(p) :] = p
    return out, np.array([len(p) for p in prompts], np.int32)


def bfloat16_model(model):
    """The test decoder as a bfloat16 server serves it: bfloat16 weights, computing in
    bfloat16 on accelerators and in float32 (matmuls reading bfloat16) on a CPU."""
    return served_model(model, jnp.bfloat16, jax.devices()[0].platform)[0]


def greedy_references(model, variables, prompts=PROBES, steps=GREEDY_STEPS) -> list[list[int]]:
    """Greedy continuations from `generate` (no EOS), one list per prompt."""
    padded, lengths = left_padded(prompts)
    out = generate(
        model, variables, padded, lengths, steps, jax.random.key(0), Sampling(temperature=0)
    )
    return [list(map(int, row)) for row in np.asarray(out.ids)]


def choose_eos(refs: list[list[int]]) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """An EOS pair (a, b) and three probe indices: one stops on a, one on b, one never.

    Each stopping probe samples at least two ids before its EOS.
    """
    vocab = range(CONFIG["vocab_size"])
    for a, b in itertools.permutations(vocab, 2):
        hits = [_first({a, b}, ref) for ref in refs]
        first = [i for i, h in enumerate(hits) if h is not None and h[1] == a and h[0] >= 2]
        second = [i for i, h in enumerate(hits) if h is not None and h[1] == b and h[0] >= 2]
        never = [i for i, h in enumerate(hits) if h is None]
        if first and second and never:
            return (a, b), (first[0], second[0], never[0])
    raise AssertionError(f"no EOS pair splits the greedy probes {refs}")


def _first(eos: set[int], ids: list[int]):
    for i, t in enumerate(ids):
        if t in eos:
            return i, t
    return None


def until_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    """``ids`` cut after the first EOS (all of them when none occurs)."""
    hit = _first(set(eos), ids)
    return ids if hit is None else ids[: hit[0] + 1]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Polls ``predicate`` until it holds; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


class GatedServer(Server):
    """A `Server` whose decode calls each wait for a permit: tests choose the interleaving.

    ``permits.release(n)`` lets ``n`` more calls run; ``parked`` counts the calls that
    reached the gate (the thread is past its queue and reload checks once a call is
    parked); ``fail_with`` makes the next call raise it instead (a failure inside the
    server thread).
    """

    def __init__(self, *args, **kwargs) -> None:
        self.permits = threading.Semaphore(0)
        self.parked = 0
        self.fail_with: BaseException | None = None
        super().__init__(*args, **kwargs)

    def _advance(self) -> None:
        self.parked += 1
        self.permits.acquire()
        if self.fail_with is not None:
            raise self.fail_with
        super()._advance()
