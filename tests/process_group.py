"""Worker scripts run as one ``jax.distributed`` group on localhost (the multi-process tests).

Each worker is started as ``python WORKER PROCESS_ID NUM_PROCESSES PORT OUT [ARGS...]`` with
``JAX_PLATFORMS=cpu``; with one process it is the single-process reference run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_group(
    worker: Path, outs: list[Path], *args: str, env: dict[str, str] | None = None
) -> None:
    """Runs one worker per path in ``outs`` (process ``i`` writes ``outs[i]``) and checks that
    each exits 0 within 240 s; on a timeout every worker is killed."""
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    port = str(free_port())
    count = str(len(outs))
    workers = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), count, port, str(out), *args],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i, out in enumerate(outs)
    ]
    for process in workers:
        try:
            output, _ = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for w in workers:
                w.kill()
            raise
        assert process.returncode == 0, output.decode()[-3000:]
