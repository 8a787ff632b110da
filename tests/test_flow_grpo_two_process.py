"""Flow-GRPO on two JAX processes (CPU, ``jax.distributed`` on localhost) against one.

Each process of the pair reads one of the two source rows. The check: the rows each process
returns are exactly its block of the one-process batch (whole groups of its own source row,
rewards bit for bit in float64), the reward ran on rank zero alone over all eight samples,
and one update on the assembled batch gives the one-process loss and parameters (to float32
reduction order). It does not measure throughput on a cluster.
"""

from pathlib import Path

import numpy as np
import pytest
from process_group import run_group

WORKER = Path(__file__).resolve().parent / "flow_grpo_worker.py"


def _run(processes: int, tmp_path: Path) -> list[dict]:
    outs = [tmp_path / f"p{processes}_{i}.npz" for i in range(processes)]
    run_group(WORKER, outs)
    return [dict(np.load(out)) for out in outs]


@pytest.mark.slow
def test_two_processes_own_their_rows_and_match_one_process_update(tmp_path):
    (single,) = _run(1, tmp_path)
    pair = _run(2, tmp_path)
    # the reward ran once, on rank zero, over all B * G = 8 samples
    assert single["calls"].tolist() == [8]
    assert pair[0]["calls"].tolist() == [8] and pair[1]["calls"].tolist() == []
    names = [k for k in single if k.startswith("batch/")]
    assert {"batch/states", "batch/rewards", "batch/advantages"} <= set(names)
    for rank, rows in enumerate(pair):
        for name in names:
            assert rows[name].shape[0] == 4, name  # one source row: one whole group
            np.testing.assert_array_equal(rows[name], single[name][4 * rank : 4 * rank + 4], name)
    rewards = np.concatenate([rows["batch/rewards"] for rows in pair])
    assert rewards.dtype == np.float64
    np.testing.assert_array_equal(rewards.view(np.uint64), single["batch/rewards"].view(np.uint64))
    np.testing.assert_allclose(pair[0]["loss"], single["loss"], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(pair[1]["loss"], single["loss"], rtol=1e-5, atol=1e-8)
    assert (single["batch/advantages"] != 0).all()
    # one update moved the parameters, the same way in both runs
    params = [k for k in single if k.startswith("param/")]
    moved = [
        name
        for name in params
        if np.abs(single[name] - single["initial/" + name[len("param/") :]]).max() > 1e-4
    ]
    # (from the adaLN-Zero start only the output projection has a gradient)
    assert "param/['params']['model']['final']['kernel']" in moved, moved
    for name in params:
        for rows in pair:
            np.testing.assert_allclose(rows[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
