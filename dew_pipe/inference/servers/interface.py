"""The rollout-server interface: token ids in, a future `Draw` out, weights pushed by version.

A `RolloutServer` is what a session source samples from. Every backend (the native
continuous-batching `NativeRolloutServer`, engines behind HTTP) answers the same three
requests:

- ``submit(prompt_ids, max_new_tokens, seed=...)`` returns at once with a future `Draw`;
- ``load(variables, version)`` pushes new weights and makes ``version`` the served one; it
  returns a future resolved with ``version`` once they serve, and need not wait for that:
  the push is ordered before every later ``submit``;
- ``close()`` releases the server's threads and devices.

A draw in flight when weights are pushed keeps going on the new weights, so its tokens may
come from several versions. `Draw.version` is the oldest of them, the one its lag must be
counted from; `Draw.submitted_version` is the version served when it was submitted.

A backend may also offer ``submit_many(prompts, max_new_tokens, seeds=...)``, a list of
futures equal to ``submit`` on each prompt in order, queued together (`NativeRolloutServer`
and `ProcessRolloutServer` do; the latter sends the batch as one message);
`dew_pipe.inference.PromptSource` uses it when it is there.

To stop a draw, cancel its future (``future.cancel()``): a server drops it from its queue,
or stops it at its next step, and the future stays cancelled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from dew_pipe._validate import check_int

if TYPE_CHECKING:
    from dew_pipe.objectives.rl.sessions import Call

__all__ = ["FINISH_REASONS", "Draw", "RolloutServer"]

#: ``"stop"``: an EOS id ended the draw (it is the last sampled id); ``"length"``: the
#: ``max_new_tokens`` budget did.
FINISH_REASONS = ("stop", "length")


@functools.cache
def _call_type() -> type[Call]:
    """`Call`, imported on first use (sessions imports this module's callers)."""
    from dew_pipe.objectives.rl.sessions import Call

    return Call


def _call_ready(
    prompt_ids: np.ndarray,
    sampled_ids: np.ndarray,
    behavior_log_probs: np.ndarray,
    log_probs: np.ndarray | None,
) -> bool:
    """Whether server-built arrays already pass every check `Call` makes of them: int32
    ids >= 0 (a nonempty prompt), float32 likelihoods that are finite, one per sampled id."""
    n = sampled_ids.size
    likelihoods = [behavior_log_probs] if log_probs is None else [behavior_log_probs, log_probs]
    return (
        prompt_ids.dtype == np.int32
        and sampled_ids.dtype == np.int32
        and prompt_ids.ndim == 1
        and sampled_ids.ndim == 1
        and prompt_ids.size > 0
        and all(a.dtype == np.float32 and a.shape == (n,) for a in likelihoods)
        and prompt_ids.min() >= 0
        and (n == 0 or sampled_ids.min() >= 0)
        and bool(np.isfinite(np.concatenate(likelihoods)).all())
    )


def _array(name: str, value: Any, dtype: Any, length: int | None) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or (length is not None and array.size != length):
        expected = "a 1-D array" if length is None else f"shape ({length},)"
        raise ValueError(f"Draw.{name} has shape {array.shape}; expected {expected}")
    out = array.astype(dtype, copy=False).view()
    out.flags.writeable = False
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Draw:
    """One completion a `RolloutServer` drew for one prompt.

    Args:
        prompt_ids: ``[P]`` int32, the ids the model read.
        sampled_ids: ``[S]`` int32, the ids drawn, ``1 <= S <= max_new_tokens``; an EOS
            that ended the draw is the last one.
        behavior_log_probs: ``[S]`` float32 log-probability of each id under the
            distribution it was drawn from (temperature and filters applied; 0 under
            greedy decoding).
        finish_reason: one of `FINISH_REASONS`.
        version: the oldest weights version that produced any of the ids (the draw's
            version for staleness).
        submitted_version: the version served when the request was submitted.
        log_probs: ``[S]`` float32 raw model log-probabilities (``log_softmax`` of the
            logits), when the backend reports them; None otherwise.
        support: one int32 array per sampled id holding the ids the sampler kept, when the
            backend records them; None otherwise.
        seed: the seed the draw was sampled with, when known.
        routed_experts: ``[n, layers, top_k]`` integer expert ids per position of the
            prompt then the sampled ids (``n <= P + S``), when the engine reports routing
            (routing replay); None otherwise.

    Raises:
        TypeError: a version that is not an int.
        ValueError: misaligned arrays, an unknown finish reason or a negative version.

    Example:
        >>> draw = Draw([4, 5], [7, 2], [-0.1, -0.2], "stop", version=3, submitted_version=3)
        >>> draw.stopped, draw.call().version
        (True, 3)
    """

    prompt_ids: np.ndarray
    sampled_ids: np.ndarray
    behavior_log_probs: np.ndarray
    finish_reason: str
    version: int
    submitted_version: int
    log_probs: np.ndarray | None = None
    support: tuple[np.ndarray, ...] | None = None
    seed: int | None = None
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "prompt_ids", _array("prompt_ids", self.prompt_ids, np.int32, None))
        sampled = _array("sampled_ids", self.sampled_ids, np.int32, None)
        put(self, "sampled_ids", sampled)
        n = sampled.size
        put(
            self,
            "behavior_log_probs",
            _array("behavior_log_probs", self.behavior_log_probs, np.float32, n),
        )
        if self.log_probs is not None:
            put(self, "log_probs", _array("log_probs", self.log_probs, np.float32, n))
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Draw.finish_reason is {self.finish_reason!r}; expected one of {FINISH_REASONS}"
            )
        for name in ("version", "submitted_version"):
            put(self, name, check_int(f"Draw.{name}", getattr(self, name), minimum=0))
        if self.support is not None:
            if isinstance(self.support, np.ndarray) or not isinstance(self.support, Sequence):
                raise ValueError("Draw.support: expected a sequence of id arrays, one per id")
            if len(self.support) != n:
                raise ValueError(
                    f"Draw.support has {len(self.support)} entries; expected one per sampled "
                    f"id ({n})"
                )
            put(
                self,
                "support",
                tuple(
                    _array(f"support[{i}]", s, np.int32, None) for i, s in enumerate(self.support)
                ),
            )

        if self.routed_experts is not None:
            routed = np.asarray(self.routed_experts)
            if routed.ndim != 3 or not np.issubdtype(routed.dtype, np.integer):
                raise ValueError(
                    f"Draw.routed_experts has shape {routed.shape} and dtype {routed.dtype}; "
                    f"expected [positions, layers, top_k] integer expert ids"
                )
            put(self, "routed_experts", routed)

    @property
    def stopped(self) -> bool:
        """True when an EOS id ended the draw."""
        return self.finish_reason == "stop"

    def call(self) -> Call:
        """This draw as a session `Call` stamped with `version` (the oldest weights).

        Example:
            >>> Draw([1], [3], [-0.5], "length", 0, 0).call().finish_reason
            'length'
        """
        ready = self.__dict__.get("_call_ready")
        if ready and self.support is None and self.routed_experts is None:
            # `server_draw` found every check Call makes passing (in the server's process,
            # where it costs the trainer's core nothing): build it without running them.
            from dew_pipe.objectives.rl.session_records import _frozen, assemble

            fields = {
                "prompt_ids": _frozen(self.prompt_ids),
                "sampled_ids": _frozen(self.sampled_ids),
                "behavior_log_probs": _frozen(self.behavior_log_probs),
                "finish_reason": self.finish_reason,
                "version": self.version,
                "log_probs": None if self.log_probs is None else _frozen(self.log_probs),
                "routed_experts": None,
                "support": None,
            }
            return assemble(_call_type(), fields)
        return _call_type()(
            self.prompt_ids,
            self.sampled_ids,
            self.behavior_log_probs,
            self.finish_reason,
            self.version,
            log_probs=self.log_probs,
            routed_experts=self.routed_experts,
            support=self.support,
        )


def server_draw(
    prompt_ids: np.ndarray,
    sampled_ids: np.ndarray,
    behavior_log_probs: np.ndarray,
    finish_reason: str,
    version: int,
    submitted_version: int,
    log_probs: np.ndarray | None = None,
    *,
    support: tuple[np.ndarray, ...] | None = None,
    seed: int | None = None,
) -> Draw:
    """A `Draw` of arrays a server built itself, without `Draw`'s checks and copies.

    For servers only: the ids are int32 and the likelihoods float32 1-D arrays the caller
    owns and no longer writes (they are made read-only here), one likelihood per sampled
    id, ``finish_reason`` one of `FINISH_REASONS`, the versions ints >= 0. A draw built
    from anything else goes through `Draw`.

    The checks `Call` makes of the arrays (ids >= 0, finite likelihoods) run here, in
    the server's process; a draw that passes them is marked, and its `Draw.call` then
    builds the Call without repeating them (about 20 us a draw on the trainer's side). A
    draw that fails them (non-finite likelihoods from the model, say) is left unmarked,
    so its `call` raises as a caller-built draw's would.
    """
    for array in (prompt_ids, sampled_ids, behavior_log_probs, log_probs, *(support or ())):
        if array is not None:
            array.flags.writeable = False
    draw = object.__new__(Draw)
    fields = (
        ("prompt_ids", prompt_ids),
        ("sampled_ids", sampled_ids),
        ("behavior_log_probs", behavior_log_probs),
        ("finish_reason", finish_reason),
        ("version", int(version)),
        ("submitted_version", int(submitted_version)),
        ("log_probs", log_probs),
        ("support", support),
        ("seed", seed),
        ("routed_experts", None),
    )
    for name, value in fields:
        object.__setattr__(draw, name, value)
    ready = support is None and int(version) >= 0
    if ready and _call_ready(prompt_ids, sampled_ids, behavior_log_probs, log_probs):
        # Travels with the draw (pickled in its __dict__): `call` may skip Call's checks.
        object.__setattr__(draw, "_call_ready", True)
    return draw


@runtime_checkable
class RolloutServer(Protocol):
    """Samples completions of token-id prompts under versioned weights.

    Implementations: `dew_pipe.inference.NativeRolloutServer` (in-process continuous
    batching). Attribute ``version`` is the version served now (an int >= 0).

    Example:
        >>> server = NativeRolloutServer(Server.from_task(task, slots=8, capacity=256))  # doctest: +SKIP
        >>> draw = server.submit([1, 5, 9], 16, seed=3).result()   # doctest: +SKIP
        >>> server.load(state.params, int(state.updates)).result()   # doctest: +SKIP
        1
    """

    @property
    def version(self) -> int:
        """The weights version new submissions are served under."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        seed: int | None = None,
    ) -> Future[Draw]:
        """Starts one draw of at most ``max_new_tokens`` ids; returns its future at once."""
        ...

    def load(self, variables: Any, version: int) -> Future[int]:
        """Serves ``variables`` as ``version`` from now on (draws in flight continue).

        Returns a future resolved with ``version`` once the weights serve, or failed with
        the push's error; a backend whose push completes inside the call returns it done.
        Draws submitted after the call come from the new weights, and ``version`` reads
        the new version at once. The caller may donate ``variables`` once it returns.
        """
        ...

    def close(self) -> None:
        """Stops serving; draws not finished fail."""
        ...
