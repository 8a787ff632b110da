"""Sessions/s of the offline Beam pack job against the same work done in one process.

The input is the skewed agentic mix of ``benchmarks/packing.py`` (groups of 8 sessions, 90%
short chains, 10% near the width), written once as a Parquet file of the sessions schema.
Three ways to turn it into packed Parquet batches of ``--groups-per-batch`` groups each:

- **in process**: read the file, ``from_arrow``, sort, cut batches, ``pack`` each, write each
  (the same steps as the job, one thread, no Beam);
- **Beam, 1 worker**: ``run_pack_job`` on Beam's FnApiRunner inside this process;
- **Beam, N workers**: the same on ``--workers`` local worker processes (DirectRunner's
  multi-processing mode).

Every number is sessions per wall-clock second of the whole run, start-up included (a Beam
job pays a second or more before the first session). The Beam output is checked against the
in-process output, file for file. ``pack`` alone (sessions already in memory) is shown too.

    python benchmarks/beam_pack.py [--sizes 2000 16000] [--width 2048] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_machine
from packing import skewed_sessions  # noqa: E402  (the mix benchmarks/packing.py measures)

from dew_pipe import batches  # noqa: E402
from dew_pipe.beam import read_packed, run_pack_job  # noqa: E402
from dew_pipe.beam.packing import packed_name  # noqa: E402
from dew_pipe.objectives.rl.sessions import from_arrow, pack, to_arrow  # noqa: E402


def in_process(path: Path, output: Path, width: int, per_batch: int) -> int:
    """The job's steps in one process; returns the number of batches written."""
    sessions = [s for b in batches.read_parquet(path).to_batches() for s in from_arrow(b)]
    sessions.sort(key=lambda s: (s.task, s.group, s.sample, s.attempt))
    keys = sorted({(s.task, s.group) for s in sessions})
    batch_of = {key: rank // per_batch for rank, key in enumerate(keys)}
    count = -(-len(keys) // per_batch)
    members: list[list] = [[] for _ in range(count)]
    for s in sessions:
        members[batch_of[(s.task, s.group)]].append(s)
    output.mkdir(parents=True)
    for index, batch in enumerate(members):
        rows = pack(batch, width, arrow=True)
        batches.write_parquet(output / packed_name(index, count), rows)
    return count


def measure(n: int, width: int, per_batch: int, workers: int, folder: Path) -> dict[str, float]:
    sessions = skewed_sessions(n, width, np.random.default_rng(0))
    path = folder / f"sessions-{n}.parquet"
    batches.write_parquet(path, to_arrow(sessions))
    start = time.perf_counter()
    for k in range(0, n, 256):
        pack(sessions[k : k + 256], width)
    pack_only = time.perf_counter() - start
    times = {"pack only": pack_only}
    start = time.perf_counter()
    in_process(path, folder / f"local-{n}", width, per_batch)
    times["in process"] = time.perf_counter() - start
    for label, w in (("beam 1 worker", 1), (f"beam {workers} workers", workers)):
        out = folder / f"beam-{n}-{w}"
        start = time.perf_counter()
        summary = run_pack_job(
            str(path),
            out,
            width=width,
            groups_per_batch=per_batch,
            workers=w,
            beam_args=["--default_sdk_harness_log_level=ERROR"],
        )
        times[label] = time.perf_counter() - start
        assert summary.sessions == n
        local = sorted((folder / f"local-{n}").glob("packed-*.parquet"))
        assert [Path(f).name for f in summary.files] == [f.name for f in local]
        for ours, theirs in zip(summary.files, local, strict=True):
            a, b = read_packed(ours), read_packed(theirs)
            assert all(np.array_equal(a[k], b[k]) for k in b), ours
        shutil.rmtree(out)
    return {label: n / seconds for label, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 16000])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--groups-per-batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(
        f"width {args.width}, {args.groups_per_batch} groups of 8 per batch, "
        f"{os.cpu_count()} CPUs; sessions/s (wall clock, start-up included)"
    )
    folder = Path(tempfile.mkdtemp(prefix="beam_pack_"))
    try:
        header = None
        for n in args.sizes:
            rates = measure(n, args.width, args.groups_per_batch, args.workers, folder)
            beams = [k for k in rates if k.startswith("beam")]
            if header is None:
                header = f"{'sessions':>8} " + " ".join(f"{k:>15}" for k in rates)
                print(
                    header + "".join(f" {k.replace('beam ', '') + ' / in proc':>21}" for k in beams)
                )
            base = rates["in process"]
            print(
                f"{n:>8} "
                + " ".join(f"{v:>15.0f}" for v in rates.values())
                + "".join(f" {rates[k] / base:>20.2f}x" for k in beams)
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    print_machine()
    main()
