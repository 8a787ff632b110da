"""WorkerPool: a thread pool whose threads never keep the process alive.

``concurrent.futures.ThreadPoolExecutor`` joins its worker threads when the interpreter
exits (an exit hook waits for every pool ever started), so one call that never returns — a
hung verifier, a stuck socket — keeps the process alive forever after everything else has
stopped. Python cannot kill a thread; what it can do is not wait for one. ``WorkerPool`` is
an ``Executor`` with the same ``submit``/``shutdown`` contract whose threads are daemons and
are not registered in any exit hook: a stuck call is abandoned at exit.

Every pool the library starts on behalf of a pipeline (a ``Map`` stage's workers, hence the
reward stage; ``PromptSource``'s reward threads) is a ``WorkerPool``. It lives at the ground
floor so that both the flow runtime and the inference layer below it can use it.

Threads start lazily, one per ``submit`` while none is idle, up to ``workers``; each is named
``<name>_<i>``.

Example:
    >>> with WorkerPool(2, name="square") as pool:
    ...     futures = [pool.submit(lambda x: x * x, i) for i in range(4)]
    ...     [f.result() for f in futures]
    [0, 1, 4, 9]
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any

from dew_pipe._validate import check_int

__all__ = ["WorkerPool"]


class WorkerPool(cf.Executor):
    """An executor of ``workers`` daemon threads (see the module docstring).

    Args:
      workers: the most threads running calls at once (an int >= 1).
      name: prefix of the threads' names.

    Raises:
      TypeError / ValueError: ``workers`` is not an int >= 1.
    """

    def __init__(self, workers: int, *, name: str = "worker") -> None:
        self.workers = check_int("workers", workers, minimum=1)
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per thread waiting for a job
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        """Schedules ``fn(*args, **kwargs)``; returns its future.

        Raises:
          RuntimeError: the pool was shut down.
        """
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"pool {self.name!r} is shut down; cannot submit")
            future: cf.Future = cf.Future()
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(timeout=0) and len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops accepting calls; the threads end once the queued calls are done.

        Args:
          wait: block until every thread has ended (a stuck call blocks it too).
          cancel_futures: cancel the calls that have not started.
        """
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in threads:
            self._jobs.put(None)  # one stop sign per thread, behind the queued calls
        if wait:
            for thread in threads:
                thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)
            del future, fn, args, kwargs  # do not hold the last call's objects while idle
            self._idle.release()
