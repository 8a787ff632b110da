"""RolloutScheduler on a two-process trainer (CPU, ``jax.distributed`` on localhost).

Each process runs its own rollout server, PromptSource and scheduler over the prompt rows
its data stream reads (tests/rollout_pool_worker.py). The checks: every process runs only
its own tasks, both push at the same handovers, the pool's batch rescored once gives each
process's rows the likelihoods of the trainer's current weights, and three updates on the
processes' rows put together equal a one-process run on the same two global devices
trained on the same batches (measured: identical to the bit, the assertions allow 1e-6).
A push that fails on one process, and a source that breaks on one process, raise on both
without leaving either waiting. It does not measure throughput on a cluster.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).resolve().parent / "rollout_pool_worker.py"
OWN_TASKS = ([0, 1, 4, 5], [2, 3, 6, 7])  # four prompt rows a step, two per process
TOLERANCE = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _wait(workers: list[subprocess.Popen], timeout: float) -> None:
    for worker in workers:
        try:
            output, _ = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for w in workers:
                w.kill()
            raise
        assert worker.returncode == 0, output.decode()[-3000:]


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        cwd=WORKER.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pool")
    port, outs = str(_free_port()), [folder / f"p{i}.npz" for i in range(2)]
    _wait([_start("pair", str(i), port, str(out)) for i, out in enumerate(outs)], timeout=420)
    pair = [dict(np.load(out)) for out in outs]
    reference = folder / "reference.npz"
    _wait([_start("reference", *map(str, outs), str(reference))], timeout=240)
    return pair, {k: float(v) for k, v in np.load(reference).items()}


@pytest.mark.slow
def test_each_process_runs_its_own_tasks_and_pushes_with_the_others(runs):
    pair, _ = runs
    for rank, saved in enumerate(pair):
        assert saved["tasks"].tolist() == OWN_TASKS[rank]
        assert int(saved["updates"]) == 3
        assert saved["pushes"].tolist() == [1, 2]  # every process calls the push, together
        lags = saved["lags"].tolist()
        assert max(lags) == 1 and lags[0] == 0  # one batch ahead: the next batch ran meanwhile
        rows = saved["rows/0/input_ids"]
        assert rows.shape == (8, 16)  # each process packs its own N rows
        prompts = {tuple((np.arange(5) * 3 + t * 5) % 10 + 3) for t in OWN_TASKS[rank]}
        starts = saved["rows/0/text_positions"] == 0
        segments = saved["rows/0/text_segment_ids"]
        for r, c in zip(*np.nonzero(starts & (segments > 0)), strict=True):
            assert tuple(rows[r, c : c + 5]) in prompts  # every chain is one of its own tasks


@pytest.mark.slow
def test_the_pool_matches_one_process_on_the_same_devices_and_batches(runs):
    pair, reference = runs
    assert reference["pair_agrees"] == 0.0  # both processes hold the same parameters
    for step in range(3):
        assert reference[f"params_error/{step}"] <= TOLERANCE, step
        # rescored once over the pool's batch, under the weights the step trains
        assert reference[f"rescore_error/{step}"] <= TOLERANCE, step
    assert reference["params_error/final"] <= TOLERANCE
    assert reference["moved"] > 1e-2  # three updates changed the parameters
    # after the first update the batch was sampled one version back: rescoring is not the
    # engine's own likelihood
    assert reference["behavior_gap/1"] > 1e-2 and reference["behavior_gap/2"] > 1e-2


@pytest.mark.slow
def test_a_failure_on_one_process_raises_on_both(runs):
    first, second = runs[0]
    assert str(second["error/push"]) == "RuntimeError: engine refused version 2"
    assert str(first["error/push"]) == (
        "RuntimeError: RolloutScheduler: pushing weights version 2 failed on process 1 of 2, "
        "so every process stops: RuntimeError: engine refused version 2"
    )
    lost = "RuntimeError: sandbox lost for task 6"
    assert str(second["error/source"]).startswith("StageFailed: stage 'rollout' failed")
    assert str(second["error/source"]).endswith(lost)
    message = str(first["error/source"])
    assert message.startswith("RuntimeError: RolloutScheduler: admitting batch ")
    assert "failed on process 1 of 2, so every process stops" in message and message.endswith(lost)
