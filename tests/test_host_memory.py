"""dew_pipe.host_memory: the malloc policy `import dew_pipe` applies, and its opt-out.

Each case runs in a fresh interpreter, since the policy is per process and must be set
before threads start allocating.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# A worker thread (started after the import, like XLA's) allocates, touches and frees a
# 96 MiB block five times; the page faults of each round show whether the pages were reused.
PROBE = """
import ctypes, json, resource, threading
import dew_pipe, dew_pipe.host_memory as host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
SIZE = 96 << 20
faults = []
def work():
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(SIZE)
        libc.memset(block, 1, SIZE)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps({"status": host_memory.status(), "faults": faults}))
"""


def _run(value: str | None, code: str = PROBE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEW_PIPE_HOST_MEMORY"}
    if value is not None:
        env["DEW_PIPE_HOST_MEMORY"] = value
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_keeps_freed_memory_for_reuse():
    result = json.loads(_run(None).stdout)
    assert result["status"] == "reuse"
    pages = (96 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert result["faults"][0] >= pages // 2  # the first round maps the block
    assert max(result["faults"][1:]) < pages // 20  # later rounds reuse it


def test_system_keeps_glibc_defaults():
    result = json.loads(_run("system").stdout)
    assert result["status"] == "system (DEW_PIPE_HOST_MEMORY=system)"
    pages = (96 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert min(result["faults"]) >= pages // 2  # every round maps fresh pages


def test_bad_setting_fails_the_import_naming_it():
    result = _run("always", "import dew_pipe")
    assert result.returncode != 0
    assert "DEW_PIPE_HOST_MEMORY='always'; expected one of reuse, system" in result.stderr


def test_late_application_is_reported():
    code = (
        "import jax, jax.numpy as jnp\n"
        "jnp.ones(2).block_until_ready()\n"
        "import dew_pipe.host_memory as host_memory\n"
        "print(host_memory.status())\n"
    )
    assert _run("reuse", code).stdout.startswith("reuse (applied after JAX's backend started")
