"""`Server`: continuous batching of draws over one decoder, on a background thread.

The server owns ``slots`` rows of key/value cache, ``capacity`` positions each. Requests wait
in a bounded queue; between two decode calls the server thread

1. applies the pending weight pushes (`Server.reload`; only the newest is copied), so the
   next ids come from the new weights while draws in flight keep their rows and caches. A
   push need not wait for this: it is ordered before every later submission (those start
   on its weights), and `version` moves at once, while the version each id is recorded
   with is the one the buffers held when it was drawn;
2. releases the rows of cancelled draws;
3. starts waiting requests in free rows (`engine_steps.prefill`: compiled shapes per
   bucket of distinct prompts, of joining requests and of prompt width, running rows
   untouched; requests with the same prompt share its prefill); an idle server
   may first wait up to ``gather_s`` for more requests, so a burst submitted one request at
   a time starts in one prefill;
4. advances every busy row by up to ``steps_per_call`` ids in one compiled call of a fixed
   shape (`engine_steps.advance`), stopping early once ``join_rows`` rows have finished
   while requests wait (by default the first row to finish is handed on at once).

A finished row resolves its future with a `Draw` (`interface.py`). Each draw is
sampled from its own seed (``fold_in(key(seed), t)`` for its ``t``-th id), so given the
seed it is the same whichever requests share the batch. What the thread does is counted
(`Server.counters`).

Failure and shutdown: `close` stops the thread, fails every unfinished future and joins
the thread; an exception inside the thread fails every future and is raised (as the cause)
by the next `submit` or `reload`.

Measured on the shared 2-core CPU machine (a 4-layer, 128-wide decoder): 4 rows gave 2.6k
ids/s at ``steps_per_call=1`` and 6.1k at 8; the gap is each call's host round trip.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import jax
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.inference.decoding import LayerCache, serving_cache
from dew_pipe.inference.servers import engine_steps
from dew_pipe.inference.servers.engine_records import Reload, Request, ServerCounters, resolve
from dew_pipe.inference.servers.engine_setup import (
    SEED_LIMIT,
    ServeTask,
    batch_requests,
    bucket,
    check_options,
    check_tree,
    from_task_arguments,
    prompt_array,
    prompt_buckets,
    prompt_problem,
    request_seed,
    served_copy,
    served_model,
    signature,
    variables_of,
)
from dew_pipe.inference.servers.interface import Draw, server_draw
from dew_pipe.sampling import Sampling

__all__ = ["Server", "ServerCounters", "ServeTask"]


class Server:
    """Continuous-batching sampler over a decoder, run by a background thread.

    Args:
        model: a decoder with the `CausalTransformer` call forms (``features``/``logits``
            methods, ``init_cache``, ``config.vocab_size``/``max_seq_len``).
        variables: its ``{"params": ...}`` (copied; the caller's arrays are never reused).
        sampling: the controls every draw uses (default `Sampling()`: temperature 1, no
            EOS). Static: part of the compiled step.
        slots: ``S``, rows decoded together.
        capacity: ``C``, cache positions per row: a request needs
            ``len(prompt) + max_new_tokens - 1 <= C``. At most the model's ``max_seq_len``.
        dtype: served precision. Floating parameters are kept (and reloaded) in it, and a
            decoder whose ``config`` has ``dtype``/``param_dtype`` reads them in it in its
            matmuls; it computes in it too, except on a CPU, where a 16-bit precision
            keeps float32 activations and cache (`engine_setup.served_model`). ``"auto"``:
            the machine's `served_precision` (bfloat16 where the CPU multiplies bfloat16
            natively or on accelerators, float32 on AVX2-only CPUs). None: the model's
            compute dtype (``config.dtype``), so a float32 model is served in float32 and
            a bfloat16-compute model with bfloat16 weights.
        queue: most requests waiting for a row; `submit` blocks while it is full, so a
            producer that outruns the server waits instead of growing memory. The default
            is far above what a scheduler keeps in flight (tasks x samples x ahead).
        steps_per_call: most decode steps one compiled call runs. 1 gives every step back
            to the host (the finest interleaving of joins and reloads); more saves the
            per-call dispatch, and the call still ends early when a row finishes while
            requests wait.
        record_support: also record each id's kept ids (``Draw.support``); costs an
            ``[S, steps_per_call, V]`` boolean transfer per call.
        buckets: increasing prompt widths to pad prefills to; None: powers of two from 16
            below ``capacity``, then ``capacity``.
        version: the version the initial variables are served as.
        seed: seeds the stream that gives a seed to requests submitted without one.
        pad_id: the id left padding is filled with (never attended).
        device: where the weights, the cache and the decoding run (default: this
            process's first device, ``jax.local_devices()[0]``). Everything the server
            holds is committed to it, so each compiled function keeps one compile.
        gather_s: seconds an idle server waits, from the arrival of the oldest waiting
            request, for more requests before it starts them (it starts at once when they
            fill every free row). A scheduler submits a task batch one request at a time;
            without a window the first few start alone and the rest join one decode call
            later, so the batch takes ``steps_per_call`` more steps and prefills in more
            shapes. 0 (default) starts at once. A busy server never waits: requests join
            at the next call.
        join_rows: how many rows must finish before a decode call stops early for the
            requests waiting (or as many as wait, when fewer do). 1 (default) hands each
            row on as soon as it finishes: the lowest latency per request, and the right
            choice when lengths differ widely (tool turns, long completions). ``slots``
            lets every row of a wave finish before the next wave joins in one prefill:
            for short completions of similar length (a batch of RL draws of a few ids)
            that is fewer prefill calls and shapes to compile, and fewer decode calls
            when a wave fits in one, at the cost of rows idling while the longest of
            their wave finishes. A busy server holds waiting requests back until that
            many rows are free; an idle one starts them at once (see ``gather_s``).
        warm_up: compile every shape the server may call before the constructor returns:
            the decode call, and the prefill's steps (`engine_steps`) for every bucket
            (powers of two up to ``slots``) of joining rows and of distinct prompts among
            them, and every prompt width (``buckets``). Without it each shape compiles
            the first time a join needs it, and every row waits meanwhile (1-2 s per
            prefill shape for a small decoder on 2 CPU cores); which shapes a run needs
            depends on when requests arrive, so those stalls land at unpredictable
            times. The warm-up runs each prefill once on padding entries only, which
            write nothing.

    Raises:
        TypeError / ValueError: a bad option, named with what was expected.

    Example:
        >>> server = Server(model, variables, Sampling(eos_id=2), slots=4, capacity=64)  # doctest: +SKIP
        >>> draw = server.submit([5, 9, 3], 16, seed=0).result()   # doctest: +SKIP
        >>> draw.sampled_ids, draw.finish_reason, server.counters().steps   # doctest: +SKIP
        >>> server.close()   # doctest: +SKIP
    """

    def __init__(
        self,
        model: Any,
        variables: Any,
        sampling: Sampling | None = None,
        *,
        slots: int,
        capacity: int,
        dtype: Any = None,
        queue: int = 1024,
        steps_per_call: int = 8,
        record_support: bool = False,
        buckets: Sequence[int] | None = None,
        version: int = 0,
        seed: int = 0,
        pad_id: int = 0,
        device: jax.Device | None = None,
        gather_s: float = 0.0,
        join_rows: int = 1,
        warm_up: bool = False,
    ) -> None:
        sampling = Sampling() if sampling is None else sampling
        if (
            isinstance(gather_s, bool)
            or not isinstance(gather_s, int | float)
            or not 0 <= gather_s < float("inf")
        ):
            raise ValueError(f"gather_s is {gather_s!r}; expected seconds >= 0")
        if not isinstance(warm_up, bool):
            raise TypeError(f"warm_up is {warm_up!r}; expected a bool")
        options = check_options(
            model,
            sampling,
            slots=slots,
            capacity=capacity,
            queue=queue,
            steps_per_call=steps_per_call,
            version=version,
            seed=seed,
            pad_id=pad_id,
            join_rows=join_rows,
        )
        self.join_rows = options["join_rows"]
        self.sampling = sampling
        self.slots, self.capacity, self.queue = options["slots"], options["capacity"], queue
        self.steps_per_call = options["steps_per_call"]
        self.record_support = bool(record_support)
        self.buckets = prompt_buckets(buckets, self.capacity)
        self.pad_id = options["pad_id"]
        self.gather_s = float(gather_s)
        self._vocab = int(model.config.vocab_size)
        self._eos = np.asarray(sampling.eos_ids, np.int32)
        self._eos_ids = frozenset(int(e) for e in self._eos)  # per-draw checks, no numpy
        # this process's first device: on a multi-process job jax.devices()[0] may be another's
        device = jax.local_devices()[0] if device is None else device
        if not isinstance(device, jax.Device):
            raise TypeError(f"device is {device!r}; expected a jax.Device")
        self.device = device
        self.model, dtype = served_model(model, dtype, device.platform)
        self.dtype = dtype
        self._variables = served_copy(variables_of(variables, "variables"), dtype, device)
        self._signature = signature(self._variables)
        cache = serving_cache(self.model, self.model.init_cache(self.slots, self.capacity))
        self._cache = jax.device_put(cache, device)
        keys = cache.keys[0] if isinstance(cache, LayerCache) else cache["key"]
        self._fresh = dict(length=self.capacity, dtype=keys.dtype)  # `encode`'s cache
        self._state = jax.device_put(engine_steps.empty_slots(self.slots), device)
        self._version = options["version"]  # what new requests are stamped with
        self._served = self._version  # what the buffers hold (lags it while a push waits)
        self._seeds = np.random.default_rng(options["seed"])
        self._rows: list[Request | None] = [None] * self.slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._reloads: collections.deque[Reload] = collections.deque()
        self._cond = threading.Condition()
        self._cancels = 0  # cancelled futures not yet dropped (under _cond)
        self._closing = False
        self._error: BaseException | None = None
        self._counts = collections.Counter()
        self._histogram: collections.Counter[int] = collections.Counter()
        if warm_up:
            self._warm_up()
        self._thread = threading.Thread(target=self._loop, name="dew-rollout-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_task(
        cls,
        task: Any,
        *,
        slots: int,
        capacity: int,
        sampling: Sampling | None = None,
        **options: Any,
    ) -> Server:
        """A server for what ``task`` describes: a model, its variables and sampling.

        ``task`` is any object with ``model`` and ``variables`` attributes: a `ServeTask`
        (which also carries ``sampling``), a `dew_pipe.inference.TextGeneration` (its
        ``record_support`` carries over) or a `dew_pipe.models.Pretrained`.

        Args:
            task: the task.
            slots: rows decoded together.
            capacity: cache positions per row.
            sampling: the controls; None takes ``task.sampling`` when it has one, else
                `Sampling()`.
            **options: the other keyword arguments of `Server`.

        Raises:
            TypeError: ``task`` without ``model`` and ``variables``; bad options as `Server`.

        Example:
            >>> task = ServeTask(model, variables, Sampling(eos_id=2, temperature=0.8))  # doctest: +SKIP
            >>> server = Server.from_task(task, slots=8, capacity=128)   # doctest: +SKIP
        """
        model, variables, sampling, options = from_task_arguments(task, sampling, options)
        return cls(model, variables, sampling, slots=slots, capacity=capacity, **options)

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """The weights version new requests are served under."""
        return self._version

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        *,
        seed: int | None = None,
    ) -> Future[Draw]:
        """Queues one draw and returns its future (blocks while the queue is full).

        Args:
            prompt_ids: the ids the model reads (1-D integers).
            max_new_tokens: the budget (>= 1).
            seed: ``[0, 2**32)``; None takes the next seed of the server's own stream.

        Returns:
            A future `Draw`. It fails with ValueError when the prompt is empty, holds ids
            outside the vocabulary or does not fit ``capacity`` with the budget; with
            RuntimeError when the server closes or fails first. ``future.cancel()``
            withdraws the request, or stops its row at the next step.

        Raises:
            TypeError / ValueError: a bad budget, seed or prompt dtype.
            RuntimeError: the server is closed, or its thread failed (chained from the
                thread's exception).
        """
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        return self._enqueue([prompt_array(prompt_ids)], budget, [request_seed(seed)])[0]

    def submit_many(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        max_new_tokens: int,
        *,
        seeds: Sequence[int | None] | None = None,
    ) -> list[Future[Draw]]:
        """Queues several draws at once; the same as `submit` on each in order, cheaper.

        The requests enter the queue under one lock (in chunks, when they do not fit its
        room), so an idle server sees them together: a burst starts in full prefills
        instead of one or two rows at a time, and the thread is woken once per chunk, not
        once per request. Draws, seeds taken from the server's stream and version stamps
        are those of the same calls to `submit`.

        Args:
            prompts: the prompts, each 1-D integer ids.
            max_new_tokens: the budget of every draw (>= 1).
            seeds: one per prompt (entries ``[0, 2**32)`` or None); None: every draw takes
                the next seed of the server's stream.

        Returns:
            One future `Draw` per prompt, in order; each fails as `submit`'s would.

        Raises:
            TypeError / ValueError: a bad budget, a prompt of a non-integer dtype, a bad
                seed, or ``seeds`` of another length; nothing is queued then.
            RuntimeError: the server is closed or failed; or a full queue, when called
                from the server's own thread (a draw's done callback).

        Example:
            >>> futures = server.submit_many([[5, 9, 3], [7, 1]], 16, seeds=[0, 1])  # doctest: +SKIP
            >>> [f.result().sampled_ids for f in futures]   # doctest: +SKIP
        """
        budget = check_int("max_new_tokens", max_new_tokens, minimum=1)
        arrays, checked = batch_requests(prompts, seeds)
        return self._enqueue(arrays, budget, checked)

    def _enqueue(
        self, prompts: list[np.ndarray], budget: int, seeds: list[int | None]
    ) -> list[Future[Draw]]:
        """Queues checked requests in order, waiting for room while the queue is full."""
        futures: list[Future[Draw]] = [Future() for _ in prompts]
        with self._cond:
            self._check_open()
            added = False
            for future, prompt, seed in zip(futures, prompts, seeds, strict=True):
                problem = prompt_problem(prompt, budget, self._vocab, self.capacity)
                if problem is not None:
                    self._counts["failed"] += 1
                    future.set_exception(ValueError(problem))
                    continue
                if len(self._waiting) >= self.queue:
                    if threading.current_thread() is self._thread:  # a draw's done callback
                        raise RuntimeError(
                            f"the rollout server's queue is full ({self.queue} requests) "
                            "and submit was called from the server's own thread, which "
                            "cannot wait for itself to make room"
                        )
                    if added:
                        self._cond.notify_all()
                        added = False
                    while len(self._waiting) >= self.queue:
                        self._cond.wait()
                        self._check_open()
                if seed is None:
                    seed = int(self._seeds.integers(SEED_LIMIT))
                request = Request(future, prompt, budget, seed, self._version)
                request.arrived = time.monotonic()
                self._waiting.append(request)
                added = True
            if added:
                self._cond.notify_all()
        for future in futures:
            if not future.done():
                future.add_done_callback(self._on_done)
        return futures

    def reload(
        self, variables: Any, version: int | None = None, *, wait: bool = True
    ) -> Future[int]:
        """Serves ``variables`` from the next step on, copied over the served weights.

        The push is ordered before every later submission: a request submitted after this
        call starts on the new weights, and `version` moves to the new version at once.
        Draws in flight continue on the new weights from the next decode step; their
        `Draw.version` stays the oldest that produced any of their ids. Floating leaves
        are cast to the served dtype into a copy of the server's own before this returns,
        so the caller may donate its arrays right after, whether or not it waits.

        Args:
            variables: ``{"params": ...}`` with the served tree's structure and shapes (or
                an object whose ``params`` is one, such as a ``TrainState``).
            version: the version it is served as; None: the version new requests are
                served under plus one.
            wait: block until the server thread has applied it between two steps (at
                once when idle); False returns at once.

        Returns:
            A future resolved with ``version`` once the weights serve (done when
            ``wait``), or failed if the server closes or fails first. Pushes queued at one
            step boundary all resolve there; only the newest is copied.

        Raises:
            TypeError / ValueError: a tree that does not match, naming the leaf; a bad
                version.
            RuntimeError: the server is closed or failed, or called from its own thread;
                with ``wait``, the push failed.

        Example:
            >>> server.reload(state.params, 3, wait=False).result()   # doctest: +SKIP
            3
        """
        variables = variables_of(variables, "variables")
        check_tree(self._signature, variables)
        if version is not None:
            check_int("version", version, minimum=0)
        if threading.current_thread() is self._thread:
            raise RuntimeError("Server.reload was called from the server's own thread")
        # The server's own copy, dispatched now: the caller's arrays may be donated later.
        copy = served_copy(variables, self.dtype, self.device)
        with self._cond:
            self._check_open()
            target = self._version + 1 if version is None else int(version)
            request = Reload(copy, target)
            self._reloads.append(request)
            self._version = target
            self._cond.notify_all()
        if wait:
            try:
                request.future.result()
            except BaseException as error:
                raise RuntimeError(f"Server.reload to version {target} failed") from error
        return request.future

    def counters(self) -> ServerCounters:
        """A consistent snapshot of the counters (see `ServerCounters`)."""
        with self._cond:
            c = self._counts
            return ServerCounters(
                steps=c["steps"],
                calls=c["calls"],
                prefills=c["prefills"],
                joined=c["joined"],
                joined_mid_flight=c["joined_mid_flight"],
                prompts_prefilled=c["prompts_prefilled"],
                finished=c["finished"],
                cancelled=c["cancelled"],
                failed=c["failed"],
                reloads=c["reloads"],
                rows_per_step=dict(self._histogram),
                active=sum(r is not None for r in self._rows),
                waiting=len(self._waiting),
                version=self._served,
            )

    @property
    def variables(self) -> Any:
        """The served variables (the server's own buffers; replaced by each reload)."""
        return self._variables

    def close(self) -> None:
        """Stops the thread after its current call, fails unfinished draws, joins it.

        Idempotent. Futures still queued or decoding fail with RuntimeError.

        Raises:
            RuntimeError: called from the server's own thread.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("Server.close was called from the server's own thread")
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._abandon(RuntimeError("the rollout server was closed before this request finished"))

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the rollout server's thread failed: {type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._closing:
            raise RuntimeError("the rollout server is closed")

    # ------------------------------------------------------------------ server thread

    def _on_done(self, future: Future) -> None:
        if future.cancelled():  # wake the thread so it frees the row or queue entry
            with self._cond:
                self._cancels += 1
                self._cond.notify_all()

    def _loop(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as error:  # noqa: BLE001 - reported to every caller
            with self._cond:
                self._error = error
                self._cond.notify_all()
            self._abandon(
                RuntimeError(
                    f"the rollout server's thread failed: {type(error).__name__}: {error}"
                ),
                cause=error,
            )

    def _serve_once(self) -> bool:
        with self._cond:
            while True:
                if self._closing:
                    return False
                self._drop_cancelled()
                free = [r for r, req in enumerate(self._rows) if req is None]
                busy = len(free) < self.slots
                if self._reloads or busy:
                    break
                if self._waiting and self._gathered(len(free)):
                    break
                self._cond.wait(self._gather_left())
            reloads = list(self._reloads)
            self._reloads.clear()
            # Joining requests take their rows now, so a failure from here on finds them.
            # A busy server lets them join once join_rows rows are free (or all wait); an
            # idle one once they are gathered: a push that wakes it mid-window must not
            # start the few that have arrived and leave the rest to join mid-flight.
            joining = []
            if self._gathered(len(free)) if not busy else len(free) >= self._join_target():
                for r in free[: len(self._waiting)]:
                    self._rows[r] = self._waiting.popleft()
                    joining.append(r)
            if joining:
                self._cond.notify_all()  # room in the queue for blocked submitters
        if reloads:
            self._apply_reloads(reloads)
        if joining:
            self._start(joining, busy)
        if any(req is not None for req in self._rows):
            self._advance()
        return True

    def _join_target(self) -> int:
        """Free rows the waiting requests join in together (called under the lock)."""
        return min(self.join_rows, len(self._waiting))

    def _gather_left(self) -> float | None:
        """Seconds left of the oldest waiting request's window (None: nothing to time)."""
        if not self._waiting or self.gather_s <= 0:
            return None
        return max(0.0, self._waiting[0].arrived + self.gather_s - time.monotonic())

    def _gathered(self, free: int) -> bool:
        """Whether an idle server starts its waiting requests now (called under the lock)."""
        if len(self._waiting) >= free:
            return True
        left = self._gather_left()
        return left is None or left <= 0

    def _drop_cancelled(self) -> None:
        """Forgets cancelled requests, queued or decoding (a freed row is reused at once).

        Scans only after a cancellation was seen (`_on_done` counts them): a scan of a full
        queue at every step was a per-step cost in the length of the queue.
        """
        if not self._cancels:
            return
        self._cancels = 0
        kept = [req for req in self._waiting if not req.future.cancelled()]
        dropped = len(self._waiting) - len(kept)
        self._waiting = collections.deque(kept)
        for r, req in enumerate(self._rows):
            if req is not None and req.future.cancelled():
                self._rows[r] = None
                dropped += 1
        self._counts["cancelled"] += dropped

    def _apply_reloads(self, requests: list[Reload]) -> None:
        """Copies the newest pending push over the served buffers; resolves them all."""
        last = requests[-1]
        try:
            self._variables = engine_steps.copy_into(self._variables, last.variables)
            jax.block_until_ready(self._variables)
        except BaseException as error:
            for request in requests:
                resolve(request.future, error=error)
            raise
        with self._cond:
            self._served = last.version
            self._counts["reloads"] += len(requests)
        for request in requests:
            resolve(request.future, request.version)

    def _warm_up(self) -> None:
        """Compiles the decode call and every prefill shape on inputs that change nothing:
        prefill entries all aimed at an out-of-range row, a decode call with no busy row."""
        sizes = sorted({bucket(n, self.slots) for n in range(1, self.slots + 1)})
        encoded = {}  # distinct prompts -> an `encode` output of that many (any width)
        for width in self.buckets:
            for unique in sizes:
                encoded[unique] = engine_steps.encode(
                    self.model,
                    self._variables,
                    np.full((unique, width), self.pad_id, np.int32),
                    np.ones(unique, np.int32),
                    **self._fresh,
                )
        for size in sizes:  # joining entries x distinct prompts among them
            ones, rows = np.ones(size, np.int32), np.full(size, self.slots, np.int32)
            for unique in (u for u in sizes if u <= size):
                self._cache, logits = engine_steps.place(
                    self._cache, *encoded[unique], np.zeros(size, np.int32), rows
                )
            self._state, _ = engine_steps.begin(
                self._state,
                logits,
                rows,
                ones,
                ones,
                np.zeros(size, np.uint32),
                sampling=self.sampling,
                support=self.record_support,
            )
        self._cache, self._state, _ = engine_steps.advance(
            self.model,
            self._variables,
            self._cache,
            self._state,
            np.zeros(self.slots, bool),
            np.int32(0),
            steps=self.steps_per_call,
            sampling=self.sampling,
            support=self.record_support,
        )
        jax.block_until_ready((self._cache, self._state))

    def _start(self, joining: list[int], mid_flight: bool) -> None:
        """Prefills the requests just placed in rows ``joining`` (one compiled call)."""
        requests = [self._rows[r] for r in joining]
        entries = bucket(len(joining), self.slots)
        width = next(b for b in self.buckets if b >= max(req.prompt.size for req in requests))
        # Requests with the same prompt (a group's draws) share its prefill.
        distinct: dict[bytes, int] = {}
        source = np.zeros(entries, np.int32)
        for j, req in enumerate(requests):
            source[j] = distinct.setdefault(req.prompt.tobytes(), len(distinct))
        unique = bucket(len(distinct), self.slots)
        prompts = np.full((unique, width), self.pad_id, np.int32)
        prompt_lengths = np.ones(unique, np.int32)
        rows = np.full(entries, self.slots, np.int32)  # out of range: a padding entry
        lengths, limits = np.ones(entries, np.int32), np.ones(entries, np.int32)
        seeds = np.zeros(entries, np.uint32)
        for j, (r, req) in enumerate(zip(joining, requests, strict=True)):
            rows[j] = r
            prompts[source[j], width - req.prompt.size :] = req.prompt
            prompt_lengths[source[j]] = req.prompt.size
            lengths[j], limits[j], seeds[j] = req.prompt.size, req.budget, req.seed
        # Host arrays: the calls copy them to the device of the committed cache.
        self._cache, self._state, first = engine_steps.prefill(
            self.model,
            self._variables,
            self._cache,
            self._state,
            rows,
            prompts,
            lengths,
            limits,
            seeds,
            sampling=self.sampling,
            support=self.record_support,
            unique=prompt_lengths,
            source=source,
        )
        first = jax.device_get(first)
        finished = []
        with self._cond:
            self._counts["prefills"] += 1
            self._counts["prompts_prefilled"] += len(distinct)
            self._counts["joined"] += len(joining)
            self._counts["joined_mid_flight"] += len(joining) if mid_flight else 0
            for j, (r, req) in enumerate(zip(joining, requests, strict=True)):
                support = None if first.support is None else first.support[j : j + 1]
                req.record(
                    self._served,
                    first.ids[j : j + 1],
                    first.log_probs[j : j + 1],
                    first.behavior_log_probs[j : j + 1],
                    support,
                )
                if self._done(req):
                    if self._rows[r] is req:
                        self._rows[r] = None
                    finished.append(req)
        self._finish(finished)

    def _advance(self) -> None:
        """One compiled decode call over the busy rows; finished rows resolve."""
        keep = np.array([req is not None for req in self._rows])
        # Stop early once enough rows are free for the waiting requests to join (0: never);
        # rows already free count, but the call makes at least one step.
        with self._cond:
            target, free = self._join_target(), int(np.sum(~keep))
        join = max(1, target - free) if target else 0
        self._cache, self._state, out = engine_steps.advance(
            self.model,
            self._variables,
            self._cache,
            self._state,
            keep,
            np.int32(join),
            steps=self.steps_per_call,
            sampling=self.sampling,
            support=self.record_support,
        )
        out, counts, active = jax.device_get((out, self._state.count, self._state.active))
        steps = int(out.steps)
        finished = []
        with self._cond:
            self._counts["calls"] += 1
            self._counts["steps"] += steps
            self._histogram.update(int(n) for n in out.active_rows[:steps])
            for r, req in enumerate(self._rows):
                if req is None:
                    continue
                new = int(counts[r]) - req.count
                if new:
                    support = None if out.support is None else out.support[r, :new]
                    req.record(
                        self._served,
                        out.ids[r, :new],
                        out.log_probs[r, :new],
                        out.behavior_log_probs[r, :new],
                        support,
                    )
                if not active[r]:
                    self._rows[r] = None
                    finished.append(req)
        self._finish(finished)

    def _done(self, req: Request) -> bool:
        return req.count >= req.budget or int(req.ids[-1][-1]) in self._eos_ids

    def _finish(self, requests: list[Request]) -> None:
        """Resolves finished requests (outside the lock: callbacks run here)."""
        for req in requests:
            ids = np.concatenate(req.ids)
            stopped = int(ids[-1]) in self._eos_ids
            # The arrays are the server's own (int32 ids, float32 likelihoods of one length
            # each), so the draw skips the checks a caller-built Draw goes through.
            draw = server_draw(
                req.prompt,
                ids,
                np.concatenate(req.behavior),
                "stop" if stopped else "length",
                req.version,
                req.submitted_version,
                np.concatenate(req.log_probs),
                support=tuple(req.support) if self.record_support else None,
                seed=req.seed,
            )
            try:
                req.future.set_result(draw)
                key = "finished"
            except InvalidStateError:  # cancelled while its last call ran
                key = "cancelled"
            with self._cond:
                self._counts[key] += 1

    def _abandon(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Fails every queued and running request and pending reloads with ``error``."""
        with self._cond:
            requests = [*self._waiting, *(req for req in self._rows if req is not None)]
            self._waiting.clear()
            self._rows = [None] * self.slots
            reloads = list(self._reloads)
            self._reloads.clear()
            self._cond.notify_all()
        if cause is not None:
            error.__cause__ = cause
        for req in requests:
            try:
                req.future.set_exception(error)
            except InvalidStateError:
                continue
            with self._cond:
                self._counts["failed"] += 1
        for reload in reloads:
            resolve(reload.future, error=error)
