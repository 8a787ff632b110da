"""A per-machine disk cache of XLA's compiled programs, so a second run skips the compiles.

A small job spends much of its time compiling: the embedded arithmetic job's seeds 0-4 ran
in 92-181 s cold and in 62-150 s with their programs found in this cache, with the same
results (``benchmarks/RESULTS.md``).

JAX has the cache (``jax_compilation_cache_dir``); this module picks where it lives and
turns it on. ``dew-pipe run`` calls :func:`enable` before it loads the pipeline file.

Where: ``--compile-cache DIR`` or ``$DEW_PIPE_COMPILE_CACHE`` (``off`` turns it off), else
``$XDG_CACHE_HOME/dew_pipe/xla`` (``~/.cache`` when unset), always in a subdirectory per
machine kind (:func:`machine_key`). XLA compiles for the host's instruction set, and a home
directory shared by an AVX2 and an AVX-512 machine must not hand one the other's programs.
JAX's own key covers the program, the compile options and the jax/jaxlib versions. A user
who set ``JAX_COMPILATION_CACHE_DIR`` (or the config value) keeps that cache; this module
then changes nothing.

It covers the ``dew-pipe run`` process only: a process the job starts (a
``ProcessRolloutServer``) compiles without it unless its environment sets
``JAX_COMPILATION_CACHE_DIR``.

The cache is trusted code: JAX runs what it finds there. Keep it in a directory only you
can write to.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

OFF = "off"
ENV = "DEW_PIPE_COMPILE_CACHE"


def machine_key() -> str:
    """``<machine>-<12 hex>``: the architecture and a digest of the CPU's flags.

    Example:
        >>> machine_key().split("-")[0] == platform.machine()
        True
    """
    from dew_pipe.inference.servers.engine_setup import cpu_flags

    flags = " ".join(sorted(cpu_flags()))
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def default_root() -> Path:
    """``$XDG_CACHE_HOME/dew_pipe/xla``, with ``~/.cache`` for an unset or empty variable."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dew_pipe" / "xla"


def resolve(requested: str | os.PathLike | None = None) -> Path | None:
    """The directory to cache in: ``requested`` (a root, or ``"off"``), else
    ``$DEW_PIPE_COMPILE_CACHE``, else :func:`default_root`, plus :func:`machine_key`; None
    for off.

    Raises:
        ValueError: an empty ``requested`` or variable.
    """
    source, value = "compile cache", requested
    if value is None:
        source, value = ENV, os.environ.get(ENV)
        if value is None:
            return default_root() / machine_key()
    text = os.fspath(value)
    if not text.strip():
        raise ValueError(f"{source} is {text!r}; expected a directory or {OFF!r}")
    if text == OFF:
        return None
    return Path(text).expanduser() / machine_key()


def enable(requested: str | os.PathLike | None = None) -> Path | None:
    """Turns JAX's persistent compilation cache on in :func:`resolve`'s directory.

    Call it before the first compile. Every program is cached, however quick its compile
    (a job's many small compiles add up). Nothing changes when the cache resolves to off or
    when JAX already has a cache directory (``JAX_COMPILATION_CACHE_DIR``).

    Returns:
        The directory in use (the user's own when JAX had one), or None when off.

    Raises:
        ValueError: as :func:`resolve`; or the directory cannot be made (names it and why).
    """
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    directory = resolve(requested)
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"compile cache {directory}: cannot create it ({error.strerror}); "
            f"pass --compile-cache DIR or {OFF!r}"
        ) from error
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory
