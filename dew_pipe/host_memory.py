"""Host memory policy: keep freed memory for reuse, so XLA's CPU backend stops faulting it in.

Why: XLA's CPU client allocates the scratch space of a compiled function (every
intermediate buffer; a few hundred MiB for a small model's training step) anew on each
call, from its worker threads. With glibc's default policy such a block comes from a fresh
``mmap`` (a worker thread's arena cannot hold it) and goes back to the kernel with
``munmap`` when the call ends, so every call faults in and zeroes each 4 KiB page again:
at the shape of ``benchmarks/train_step.py`` about 100 thousand page faults, roughly a
quarter of the step's CPU time.

What `keep_freed_memory` changes, with ``mallopt``, for the whole process:

* ``M_ARENA_MAX = 1``: threads share the main heap, which can grow to any size, instead of
  per-thread arenas that hand anything over 64 MiB to ``mmap``;
* ``M_MMAP_MAX = 0``: large blocks come from the heap too;
* ``M_TRIM_THRESHOLD = 2 GiB``: freed memory at the top of the heap stays mapped (up to 2
  GiB of it) instead of going back to the kernel after every call.

So the next call's scratch block reuses pages that are already mapped: no faults, no
zeroing. The cost: the process keeps its peak heap size (much as JAX's GPU allocator keeps
device memory), and all threads share one malloc arena.

``import dew_pipe`` applies this by default (`apply_default`). It only works if it runs
before JAX starts its CPU backend (the first JAX computation creates the worker threads,
and a thread keeps the arena it started with), so import dew_pipe before running JAX code.
Opt out with the environment variable ``DEW_PIPE_HOST_MEMORY=system`` (glibc's defaults);
``DEW_PIPE_HOST_MEMORY=reuse`` is the default. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__ = ["ENVIRONMENT", "apply_default", "keep_freed_memory", "status"]

ENVIRONMENT = "DEW_PIPE_HOST_MEMORY"
_CHOICES = ("reuse", "system")

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM = 2**31 - 1  # mallopt takes an int

_status = "not applied"


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _backend_started() -> bool:
    """Whether JAX has created its backends already (then the worker threads exist)."""
    if "jax" not in sys.modules:
        return False
    try:  # not public API: report "unknown" as not started rather than fail
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Switches glibc's malloc to the reuse policy described in the module docstring.

    Returns:
        True when every ``mallopt`` call succeeded; False on another C library or
        platform (nothing changed).

    Example:
        >>> keep_freed_memory()  # doctest: +SKIP
        True
    """
    global _status
    libc = _libc()
    if libc is None:
        _status = "unsupported (not glibc on Linux)"
        return False
    late = _backend_started()
    done = all(
        libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) == 1
        for option, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM))
    )
    if not done:
        _status = "mallopt refused a setting"
    elif late:
        _status = "reuse (applied after JAX's backend started: its threads keep their arenas)"
    else:
        _status = "reuse"
    return done


def apply_default() -> str:
    """Applies the policy ``DEW_PIPE_HOST_MEMORY`` names (default ``reuse``).

    Returns:
        `status` afterwards.

    Raises:
        ValueError: when the variable holds anything but ``reuse`` or ``system``.
    """
    global _status
    choice = os.environ.get(ENVIRONMENT, "reuse").strip().lower() or "reuse"
    if choice not in _CHOICES:
        raise ValueError(
            f"{ENVIRONMENT}={os.environ[ENVIRONMENT]!r}; expected one of {', '.join(_CHOICES)}"
        )
    if choice == "system":
        _status = f"system ({ENVIRONMENT}=system)"
    else:
        keep_freed_memory()
    return _status


def status() -> str:
    """What this process runs with: ``"reuse"``, ``"system (...)"`` or why neither applied.

    Example:
        >>> import dew_pipe.host_memory as host_memory
        >>> isinstance(host_memory.status(), str)
        True
    """
    return _status
