"""The machine a benchmark figure was measured on, printed beside every figure.

These machines differ (some have AVX-512 with BF16, some AVX2 only), and a ratio from one
says little about the other, so every benchmark starts its report with one line naming the
CPU, its core count and the vector-extension flags that decide XLA's and PyTorch's kernels.
The model name of a virtual machine's CPU is often only the brand ("AMD EPYC"), so the line
also gives the CPU family and model numbers, which tell the generations apart (AMD family 25
is Zen 3/Zen 4, model 17 a Zen 4 EPYC; family 26 is Zen 5).

Example:
    >>> line = describe()
    >>> line.startswith("machine: ") and "cores" in line
    True
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

# The flags that change which matmul and attention kernels run; the rest of /proc/cpuinfo's
# list does not move these benchmarks.
FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
)


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name (with its family and model numbers, where /proc/cpuinfo gives
    them) and flags (Linux; elsewhere what `platform` knows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    fields: dict[str, str] = {}
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model") and key not in fields:
            fields[key] = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    model = fields.get("model name", platform.machine())
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    return model, flags


def describe() -> str:
    """One line: CPU model, usable cores, and which of `FLAGS` the CPU has."""
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    present = [flag for flag in FLAGS if flag in flags]
    return f"machine: {model}; {cores} cores; flags: {' '.join(present) or 'none of ' + ' '.join(FLAGS)}"


def print_machine() -> None:
    """Prints `describe()` to stderr, so workers' JSON on stdout stays parseable.

    A benchmark's own worker processes (started with ``--worker``, ``--trl-worker``,
    ``--torch-worker``) print nothing: their parent has said it already.
    """
    if any(arg.split("=")[0].endswith("-worker") for arg in sys.argv[1:]):
        return
    print(describe(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(describe())
