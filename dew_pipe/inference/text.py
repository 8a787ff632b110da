"""`TextGeneration`: a token-in, token-out policy over compiled generation.

A policy is bound to one snapshot of the weights (`TextGeneration.bind`) and then called
with the exact context ids of a turn, a budget, a key and `Sampling`; it returns a
`Generation` holding the sampled ids with their raw and behavior log-probabilities, as
tool-episode collection records them (no retokenisation anywhere).

Compiles are bounded by bucketing: a context of ``n`` ids is left-padded to the smallest
bucket ``>= n`` (powers of two from 16 up to the model's ``max_seq_len`` by default, or
the ``buckets`` given), and a budget of ``r`` ids runs in the smallest power of two
``>= r`` with the real budget enforced inside the loop. So contexts of any length share
about ``log2(max_seq_len)`` prompt shapes; when a bucketed pair would overflow
``max_seq_len``, the exact sizes are used instead. `batch` also rounds the number of rows
up to a power of two (padding rows are dropped from the result). Padding never changes a
row's result: padded columns are masked out of attention and positions start at each
row's first real id.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.generation import Generated, generate
from dew_pipe.sampling import Sampling

__all__ = ["Generation", "TextGeneration"]


@dataclasses.dataclass(frozen=True, eq=False)
class Generation:
    """One sampled response to one context.

    Attributes:
        context_ids: ``[P]`` int32 the ids the model read.
        ids: ``[S]`` int32 the sampled ids, EOS included when EOS ended the response.
        log_probs: ``[S]`` float32 raw model log-probability of each sampled id
            (``log_softmax`` of the logits).
        behavior_log_probs: ``[S]`` float32 log-probability under the distribution the id
            was drawn from (temperature and filters applied; 0 under greedy decoding).
        finish_reason: ``"stop"`` (EOS sampled) or ``"length"`` (the budget ran out).
        support: one ``[k]`` int32 array per sampled id: the ids the sampler kept (top-k/
            top-p/min-p support), when the policy records them; else None.
    """

    context_ids: np.ndarray
    ids: np.ndarray
    log_probs: np.ndarray
    behavior_log_probs: np.ndarray
    finish_reason: str
    support: tuple[np.ndarray, ...] | None = None

    @property
    def stopped(self) -> bool:
        """True when EOS ended the response."""
        return self.finish_reason == "stop"

    def call(self, version: int) -> Any:
        """This generation as a `dew_pipe.objectives.rl.sessions.Call` served at ``version``."""
        from dew_pipe.objectives.rl.sessions import Call

        return Call(
            self.context_ids,
            self.ids,
            self.behavior_log_probs,
            self.finish_reason,
            version,
            log_probs=self.log_probs,
            support=self.support,
        )


def _pow2_at_least(n: int, floor: int = 1) -> int:
    size = max(floor, 1)
    while size < n:
        size *= 2
    return size


def _signature(variables: Any) -> tuple[Any, list[tuple[tuple[int, ...], str]]]:
    leaves, tree = jax.tree.flatten(variables)
    return tree, [(np.shape(a), str(getattr(a, "dtype", type(a).__name__))) for a in leaves]


def _variables(snapshot: Any) -> Mapping[str, Any]:
    variables = getattr(snapshot, "params", snapshot)  # a TrainState binds its params
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError(
            f"snapshot is {type(snapshot).__name__}; expected a variables mapping "
            "{'params': ...} (or an object whose .params is one)"
        )
    return variables


class TextGeneration:
    """A sampling policy over a decoder: context ids in, a `Generation` out.

    Args:
        model: a decoder with the `CausalTransformer` call forms.
        variables: its ``{"params": ...}`` (replaced by `bind`).
        buckets: increasing context widths to pad to; None means powers of two from 16 up
            to ``max_seq_len`` (the largest always included).
        record_support: also record each sampled id's kept ids (costs ``[B, R, V]``
            booleans per call).
        pad_id: the id used for left padding (never attended).

    Raises:
        TypeError / ValueError: bad variables or buckets.

    Example:
        >>> policy = TextGeneration(model, variables).bind(state.params)   # doctest: +SKIP
        >>> out = policy([1, 5, 9], 16, jax.random.key(0), Sampling(eos_id=2))   # doctest: +SKIP
        >>> out.ids, out.finish_reason   # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        variables: Any,
        *,
        buckets: Sequence[int] | None = None,
        record_support: bool = False,
        pad_id: int = 0,
    ) -> None:
        self.model = model
        cfg = model.config
        self._max_len = int(cfg.max_seq_len)
        self._vocab = int(cfg.vocab_size)
        self._lock = threading.Lock()
        self._variables = _variables(variables)
        self._shapes = _signature(self._variables)
        self.buckets = self._buckets(buckets)
        self.record_support = bool(record_support)
        self.pad_id = check_int("pad_id", pad_id, minimum=0, maximum=self._vocab - 1)

    def _buckets(self, buckets: Sequence[int] | None) -> tuple[int, ...]:
        if buckets is None:
            sizes, size = [], 16
            while size < self._max_len:
                sizes.append(size)
                size *= 2
            return (*sizes, self._max_len)
        values = tuple(buckets)
        ok = values and all(
            isinstance(b, int | np.integer) and not isinstance(b, bool) and b > 0 for b in values
        )
        if not ok or list(values) != sorted(set(values)) or values[-1] > self._max_len:
            raise ValueError(
                f"buckets is {buckets!r}; expected increasing positive ints up to "
                f"max_seq_len={self._max_len}"
            )
        return tuple(int(b) for b in values)

    @property
    def variables(self) -> Mapping[str, Any]:
        """The variables calls currently use."""
        return self._variables

    def bind(self, snapshot: Any) -> TextGeneration:
        """Uses ``snapshot`` for every later call and returns this policy.

        Calls already running keep the variables they started with.

        Args:
            snapshot: ``{"params": ...}`` with the same structure and shapes as the
                variables given at construction, or an object whose ``params`` is one (a
                `TrainState`).

        Raises:
            TypeError / ValueError: a snapshot that does not match the model's variables.
        """
        variables = _variables(snapshot)
        if _signature(variables) != self._shapes:
            raise ValueError(
                "snapshot does not match the model's variables: expected the tree structure, "
                "shapes and dtypes the policy was built with"
            )
        with self._lock:
            self._variables = variables
        return self

    def __call__(
        self,
        context_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        key: jax.Array,
        sampling: Sampling,
    ) -> Generation:
        """Samples one response to ``context_ids``.

        Args:
            context_ids: the exact ids the model reads (nonempty, within the vocabulary).
            max_new_tokens: the response budget (>= 1).
            key: a PRNG key.
            sampling: the controls (EOS ids, temperature, filters).

        Returns:
            A `Generation`.

        Raises:
            TypeError / ValueError: bad ids, budget or sampling; a context plus budget
                longer than ``max_seq_len``.
        """
        return self.batch([context_ids], max_new_tokens, key, sampling)[0]

    def batch(
        self,
        contexts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        key: jax.Array,
        sampling: Sampling,
    ) -> list[Generation]:
        """Samples one response per context in one compiled call (rows drawn independently).

        Row b's random draws depend on the key and on b only, never on the other rows.
        Contexts are padded to the bucket of the longest, so a context's result can differ
        from a call on its own by float rounding of the other matmul shapes.

        Raises:
            TypeError / ValueError: as `__call__`, naming the context index.
        """
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
        sampling.check_vocab(self._vocab)
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        if isinstance(contexts, np.ndarray | str) or not isinstance(contexts, Sequence):
            raise TypeError(f"contexts is {type(contexts).__name__}; expected a list of id lists")
        if not contexts:
            raise ValueError("contexts is empty; expected at least one context")
        ids = [self._context(i, c) for i, c in enumerate(contexts)]
        longest = max(c.size for c in ids)
        if longest + budget - 1 > self._max_len:
            raise ValueError(
                f"a context of {longest} ids with max_new_tokens={budget} needs "
                f"{longest + budget - 1} positions; the model's max_seq_len is {self._max_len}"
            )
        width, room = self._shape(longest, budget)
        rows = _pow2_at_least(len(ids))
        prompts = np.full((rows, width), self.pad_id, np.int32)
        lengths = np.ones(rows, np.int32)  # padding rows: one pad id, a budget of 1
        limits = np.ones(rows, np.int32)
        for b, c in enumerate(ids):
            prompts[b, width - c.size :] = c
            lengths[b], limits[b] = c.size, budget
        with self._lock:
            variables = self._variables
        out = generate(
            self.model,
            variables,
            prompts,
            lengths,
            limits,
            key,
            sampling,
            support=self.record_support,
            pad_id=self.pad_id,
            capacity=room,
        )
        return self._unpack(ids, jax.device_get(out))

    def _context(self, index: int, context: Any) -> np.ndarray:
        array = np.asarray(context)
        if array.dtype == np.bool_ or not (
            np.issubdtype(array.dtype, np.integer) or array.size == 0
        ):
            raise TypeError(
                f"contexts[{index}] has dtype {array.dtype}; expected integer token ids"
            )
        if array.ndim != 1 or array.size == 0:
            raise ValueError(
                f"contexts[{index}] has shape {array.shape}; expected a nonempty 1-D id list"
            )
        if array.min() < 0 or array.max() >= self._vocab:
            raise ValueError(
                f"contexts[{index}] holds ids in [{array.min()}, {array.max()}]; expected ids "
                f"in [0, {self._vocab}) (vocab_size)"
            )
        return array.astype(np.int32)

    def _shape(self, longest: int, budget: int) -> tuple[int, int]:
        """(padded context width, compiled budget) for these sizes; see the module docstring."""
        width = (
            next(b for b in self.buckets if b >= longest)
            if longest <= self.buckets[-1]
            else longest
        )
        room = _pow2_at_least(budget)
        if width + room - 1 > self._max_len:
            room = budget
        if width + room - 1 > self._max_len:
            width = longest
        return width, room

    def _unpack(self, contexts: list[np.ndarray], out: Generated) -> list[Generation]:
        results = []
        for b, context in enumerate(contexts):
            n = int(out.lengths[b])
            support = None
            if out.support is not None:
                support = tuple(
                    np.flatnonzero(out.support[b, i]).astype(np.int32) for i in range(n)
                )
            results.append(
                Generation(
                    context_ids=context,
                    ids=np.asarray(out.ids[b, :n], np.int32),
                    log_probs=np.asarray(out.log_probs[b, :n], np.float32),
                    behavior_log_probs=np.asarray(out.behavior_log_probs[b, :n], np.float32),
                    finish_reason="stop" if bool(out.stopped[b]) else "length",
                    support=support,
                )
            )
        return results
