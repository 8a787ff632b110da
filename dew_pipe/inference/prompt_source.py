"""`PromptSource`: single-turn sessions drawn from a `RolloutServer` and scored as they finish.

Each submitted sample is one draw: the task's prompt ids go to the server with a budget of
``max_new_tokens``, and when the draw finishes its decoded text is scored on a thread pool
by ``reward(data_source, completion, ground_truth, extra_info)``, so verification overlaps
generation and training. The session has one `Call` (stamped with the draw's version, the
oldest weights that produced any of its ids) and a status:

- COMPLETED: an EOS id ended the draw; scored.
- TRUNCATED: the budget ended it; scored all the same (``pack(truncation="score")`` trains
  on it, the default ``"mask"`` drops it).
- INFRA_ERROR: the draw failed, or decoding or the reward raised or returned something that
  is not a finite number; ``detail`` says what. Schedulers retry these.
- CANCELLED: `PromptSource.cancel` stopped it (the draw leaves the server's queue or row).

A task's payload is what `dew_pipe.objectives.rl.prompt_tasks` builds from prompt rows:
``{"prompt": ids, "data_source": str, "ground_truth": str, "extra_info": str}`` (missing
metadata reads as ""); a plain id sequence is a prompt without metadata.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import functools
import hashlib
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from dew_pipe._pool import WorkerPool
from dew_pipe._validate import check_int
from dew_pipe.inference.reward_function import RewardFunction, join_ids
from dew_pipe.inference.servers.interface import Draw
from dew_pipe.objectives.rl.session_records import Call, assemble
from dew_pipe.objectives.rl.sessions import Session, Status, Task

__all__ = ["PromptSource"]

_METADATA = ("data_source", "ground_truth", "extra_info")


def _payload(task: Any) -> tuple[np.ndarray, dict[str, str]]:
    """The prompt ids and reward metadata a task carries."""
    if not isinstance(task, Task):
        raise TypeError(f"task is {type(task).__name__}; expected a sessions.Task")
    data = task.data
    if isinstance(data, Mapping):
        if "prompt" not in data:
            raise ValueError(
                f"task {task.id}: data has keys {sorted(map(str, data))}; expected 'prompt' "
                "ids (and data_source, ground_truth, extra_info strings), as prompt_tasks builds"
            )
        metadata = {name: data.get(name, "") for name in _METADATA}
        for name, value in metadata.items():
            if not isinstance(value, str):
                raise TypeError(f"task {task.id}: data[{name!r}] is {value!r}; expected a str")
        data = data["prompt"]
    else:
        metadata = dict.fromkeys(_METADATA, "")
    prompt = np.asarray(data)
    if prompt.dtype == np.bool_ or not np.issubdtype(prompt.dtype, np.integer):
        raise TypeError(f"task {task.id}: prompt has dtype {prompt.dtype}; expected token ids")
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"task {task.id}: prompt has shape {prompt.shape}; expected 1-D ids")
    return prompt.astype(np.int32), metadata


def _seed(*parts: int) -> int:
    """A 32-bit seed fixed by ints such as a submission's (base, task, group, sample,
    attempt): the same in every process."""
    text = repr(tuple(parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


class _Pending:
    __slots__ = ("attempt", "draw", "future", "group", "metadata", "sample", "task")

    def __init__(
        self, task: Task, metadata: dict[str, str], group: int, sample: int, attempt: int
    ) -> None:
        self.task, self.metadata = task, metadata
        self.group, self.sample, self.attempt = group, sample, attempt
        self.future: cf.Future[Session] = cf.Future()
        self.draw: cf.Future[Draw] | None = None

    def scored(self, status: Status, call: Call, reward: float) -> Session:
        """The session of a scored draw, built without re-running Session's checks: every
        field is one this source made or checked already (ints at submission, the Call,
        a Status, a finite float reward)."""
        fields = {
            "task": self.task.id,
            "group": self.group,
            "sample": self.sample,
            "attempt": self.attempt,
            "calls": (call,),
            "status": status,
            "reward": reward,
            "components": {},
            "detail": "",
        }
        return assemble(Session, fields)

    def session(self, status: Status, calls=(), reward=None, detail: str = "") -> Session:
        return Session(
            self.task.id,
            self.group,
            self.sample,
            self.attempt,
            calls,
            status,
            reward,
            detail=detail,
        )


class PromptSource:
    """A `SessionSource` of one-call sessions drawn from a `RolloutServer`.

    Args:
        server: the `RolloutServer` to draw from (not closed by `close`: it may be
            shared, and it is often the scheduler's weights publisher too).
        reward: ``reward(data_source, completion, ground_truth, extra_info) -> float``,
            called on a worker thread with the decoded completion.
        decode: ids to the completion text the reward reads; it receives the sampled ids
            without the EOS that ended the draw. Default `join_ids` (space-separated
            numbers); pass a tokenizer's ``decode`` for text.
        max_new_tokens: ``R``, the budget of every draw.
        workers: threads scoring finished draws.
        seed: mixed into every draw's seed, which is otherwise fixed by the submission's
            task, group, sample and attempt (a resubmitted attempt draws afresh).

    Raises:
        TypeError / ValueError: a server without ``submit``, a reward or decode that is not
            callable, a bad budget or worker count.

    Example:
        >>> source = PromptSource(server, reward, decode=tokenizer.decode, max_new_tokens=16)  # doctest: +SKIP
        >>> task = Task(0, {"prompt": [5, 9], "data_source": "arith", "ground_truth": "14",
        ...                 "extra_info": ""})   # doctest: +SKIP
        >>> session = source.submit(task, group=0, sample=0, attempt=0).result()  # doctest: +SKIP
        >>> session.status, session.reward, session.calls[0].version   # doctest: +SKIP
    """

    def __init__(
        self,
        server: Any,
        reward: RewardFunction,
        *,
        decode: Callable[[np.ndarray], str] | None = None,
        max_new_tokens: int,
        workers: int = 4,
        seed: int = 0,
    ) -> None:
        if not callable(getattr(server, "submit", None)):
            raise TypeError(f"server is {type(server).__name__}; expected a RolloutServer")
        if not callable(reward):
            raise TypeError(f"reward is {reward!r}; expected a callable")
        decode = join_ids if decode is None else decode
        if not callable(decode):
            raise TypeError(f"decode is {decode!r}; expected a callable (ids -> str)")
        self.server, self.reward, self.decode = server, reward, decode
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        self.workers = check_int("workers", workers, minimum=1)
        self.seed = check_int("seed", seed)
        self._pool = WorkerPool(self.workers, name="prompt-reward")  # daemons: see _pool
        self._lock = threading.Lock()
        # Finished draws waiting to be scored, and how many pool jobs drain them (under
        # _lock): a job scores until the queue is empty, so a wave of draws finishing
        # together costs a few pool submissions, not one each.
        self._arrived: collections.deque[tuple[_Pending, cf.Future[Draw]]] = collections.deque()
        self._drainers = 0
        self._pending: dict[cf.Future, _Pending] = {}
        self._closed = False
        # The task last submitted, with its prompt and metadata: read once per group.
        self._last_payload: tuple[Task, np.ndarray, dict[str, str]] | None = None

    def submit(self, task: Task, *, group: int, sample: int, attempt: int) -> cf.Future[Session]:
        """Draws one completion of ``task``'s prompt; returns the future session at once.

        Raises:
            TypeError / ValueError: a task without prompt ids, bad identity fields.
            RuntimeError: the source is closed, or the server refuses the request (closed or
                failed: a broken source, not a failed sample).
        """
        entry, prompt, seed = self._entry(task, group, sample, attempt)
        self._register([entry])
        try:
            entry.draw = self.server.submit(prompt, self.max_new_tokens, seed=seed)
        except BaseException:
            self._forget([entry])
            raise
        entry.draw.add_done_callback(lambda draw: self._drawn(entry, draw))
        return entry.future

    def submit_many(
        self, requests: Sequence[tuple[Task, int, int, int]]
    ) -> list[cf.Future[Session]]:
        """`submit` for each ``(task, group, sample, attempt)`` in order, queued together.

        The draws reach the server in one ``submit_many`` call when it has one (a
        `NativeRolloutServer` does), so a task batch starts in full prefills and the
        per-request cost is lower; otherwise one ``submit`` each. The sessions are the
        ones `submit` would give (the same seeds).

        Returns:
            One future session per request, in order.

        Raises:
            TypeError / ValueError: a request that is not a 4-tuple, a task without prompt
                ids, bad identity fields (named by index); nothing is submitted then.
            RuntimeError: the source is closed, or the server refuses the requests; the
                draws already queued are cancelled.
        """
        entries, prompts, seeds = [], [], []
        for i, request in enumerate(requests):
            if not isinstance(request, tuple) or len(request) != 4:
                raise TypeError(
                    f"requests[{i}] is {request!r}; expected a (task, group, sample, attempt) tuple"
                )
            try:
                entry, prompt, seed = self._entry(*request)
            except (TypeError, ValueError) as error:
                raise type(error)(f"requests[{i}]: {error}") from None
            entries.append(entry)
            prompts.append(prompt)
            seeds.append(seed)
        self._register(entries)
        many = getattr(self.server, "submit_many", None)
        draws: list[cf.Future[Draw]] = []
        try:
            if callable(many):
                draws = many(prompts, self.max_new_tokens, seeds=seeds)
                if len(draws) != len(entries):
                    raise RuntimeError(
                        f"server.submit_many returned {len(draws)} futures for "
                        f"{len(entries)} prompts"
                    )
            else:
                for prompt, seed in zip(prompts, seeds, strict=True):
                    draws.append(self.server.submit(prompt, self.max_new_tokens, seed=seed))
        except BaseException:
            for draw in draws:
                draw.cancel()
            self._forget(entries)
            raise
        for entry, draw in zip(entries, draws, strict=True):
            entry.draw = draw
            draw.add_done_callback(functools.partial(self._drawn, entry))
        return [entry.future for entry in entries]

    def cancel(self, future: cf.Future[Session]) -> None:
        """Stops the session behind ``future``; it resolves CANCELLED at once.

        A draw still queued leaves the server's queue, one decoding is stopped at the
        server's next step; a reward already running finishes unheard. Unknown or finished
        futures are left alone.
        """
        with self._lock:
            entry = self._pending.pop(future, None)
        if entry is None:
            return
        if entry.draw is not None:
            entry.draw.cancel()
        self._set(entry, entry.session(Status.CANCELLED, detail="cancelled by the caller"))

    def close(self) -> None:
        """Cancels unfinished sessions and waits for running rewards; the server stays up."""
        with self._lock:
            self._closed = True
            futures = list(self._pending)
        for future in futures:
            self.cancel(future)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> PromptSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _entry(
        self, task: Task, group: int, sample: int, attempt: int
    ) -> tuple[_Pending, np.ndarray, int]:
        """A checked submission: its pending entry, prompt ids and draw seed."""
        last = self._last_payload  # a group's samples come one after another
        if last is not None and last[0] is task:
            prompt, metadata = last[1], last[2]
        else:
            prompt, metadata = _payload(task)
            self._last_payload = (task, prompt, metadata)
        group = check_int("group", group)
        sample = check_int("sample", sample, minimum=0)
        attempt = check_int("attempt", attempt, minimum=0)
        entry = _Pending(task, metadata, group, sample, attempt)
        return entry, prompt, _seed(self.seed, task.id, group, sample, attempt)

    def _register(self, entries: list[_Pending]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the PromptSource is closed")
            for entry in entries:
                self._pending[entry.future] = entry

    def _forget(self, entries: list[_Pending]) -> None:
        with self._lock:
            for entry in entries:
                self._pending.pop(entry.future, None)

    def _drawn(self, entry: _Pending, draw: cf.Future[Draw]) -> None:
        """Runs on the server's thread: queues the finished draw for the scoring pool."""
        if entry.future.done():
            return
        self._arrived.append((entry, draw))
        with self._lock:
            if self._drainers >= self.workers:
                return  # a running job will reach it
            self._drainers += 1
        try:
            self._pool.submit(self._drain)
        except RuntimeError:  # the pool is shut down: close() is cancelling everything
            self._drain()

    def _drain(self) -> None:
        """A scoring job: scores queued draws until none is left."""
        while True:
            try:
                entry, draw = self._arrived.popleft()
            except IndexError:
                with self._lock:
                    if not self._arrived:  # one queued after the pop is seen here
                        self._drainers -= 1
                        return
                continue
            self._score(entry, draw)

    def _score(self, entry: _Pending, draw: cf.Future[Draw]) -> None:
        try:
            if draw.cancelled():
                session = entry.session(Status.CANCELLED, detail="the draw was cancelled")
            elif draw.exception() is not None:
                error = draw.exception()
                detail = f"draw failed: {type(error).__name__}: {error}"
                session = entry.session(Status.INFRA_ERROR, detail=detail)
            else:
                session = self._scored(entry, draw.result())
        except BaseException as error:  # a bug here breaks the source: say so to the caller
            with self._lock:
                self._pending.pop(entry.future, None)
            with contextlib.suppress(cf.InvalidStateError):
                entry.future.set_exception(error)
            return
        with self._lock:
            self._pending.pop(entry.future, None)
        self._set(entry, session)

    def _scored(self, entry: _Pending, draw: Draw) -> Session:
        try:
            call = draw.call()
        except (TypeError, ValueError) as error:  # e.g. non-finite likelihoods from the engine
            detail = f"draw failed: {type(error).__name__}: {error}"
            return entry.session(Status.INFRA_ERROR, detail=detail)
        status = Status.COMPLETED if draw.stopped else Status.TRUNCATED
        ids = draw.sampled_ids[:-1] if draw.stopped else draw.sampled_ids
        metadata = entry.metadata
        try:
            completion = self.decode(ids)
            if not isinstance(completion, str):
                raise TypeError(f"decode returned {type(completion).__name__}; expected a str")
            value = self.reward(
                metadata["data_source"],
                completion,
                metadata["ground_truth"],
                metadata["extra_info"],
            )
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"reward returned {value!r}; expected a finite float")
            if not math.isfinite(float(value)):
                raise ValueError(f"reward returned {value!r}; expected a finite float")
        except Exception as error:  # noqa: BLE001 - a failed verifier is an infra failure
            detail = f"reward failed: {type(error).__name__}: {error}"
            return entry.session(Status.INFRA_ERROR, (call,), detail=detail)
        return entry.scored(status, call, float(value))

    @staticmethod
    def _set(entry: _Pending, session: Session) -> None:
        # Resolved already (cancelled), or cancelled by whoever holds the future.
        with contextlib.suppress(cf.InvalidStateError):
            entry.future.set_result(session)
