"""PPO in the pipeline view: the values stage in the graph, and pipelines/ppo_tools.py.

The graph test runs tasks → rollout (an EnvironmentSource on a real NativeRolloutServer,
multi-turn append-only episodes) → reward → pack → values → update (Train) for three
updates, watches every batch the values stage prepares and checks it against independent
computations: the rewards pack laid on the ids, the critic's and the policy's scores under
the weights of that update, and a float64 GAE written out per episode. The pipeline file
is checked by its dry run, its refusals and (slow) a tiny run through ``dew-pipe run``.
"""

from __future__ import annotations

import doctest
import itertools
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from test_environment_source_native import (
    NATIVE_EOS,
    NATIVE_P,
    NATIVE_R,
    NATIVE_T,
    Counter,
    counting_reward,
)

from dew_pipe import Dataset, Trainer, models
from dew_pipe.inference import EnvironmentSource, NativeRolloutServer, Server, ServeTask
from dew_pipe.objectives.rl import PPOObjective, ValueHead
from dew_pipe.sampling import Sampling
from dew_pipe.stages import GraphSettings, PolicyWeights, TaskBatches, Values, build_graph
from dew_pipe.stages import values as values_module

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "ppo_tools.py"
# Multi-turn append-only episodes on the tiny native server (test_environment_source_native).
EOS, P, R, T = NATIVE_EOS, NATIVE_P, NATIVE_R, NATIVE_T


def reference_gae(batch: dict, values: np.ndarray, gamma: float, lam: float):
    """Float64 GAE per session over its sampled ids in draw order, then whitened."""
    mask = batch["response_mask"] == 1
    out = {}
    for session in np.unique(batch["session_index"][mask]):
        rows, cols = np.nonzero(mask & (batch["session_index"] == session))
        order = np.lexsort((cols, rows, batch["call_index"][rows, cols]))
        rows, cols = rows[order], cols[order]
        v = values[rows, cols].astype(np.float64)
        final = float(batch["advantages"][rows[-1], cols[-1]])  # the reward pack laid there
        advantages, last = np.zeros_like(v), 0.0
        for t in range(v.size - 1, -1, -1):
            following = v[t + 1] if t + 1 < v.size else 0.0
            paid = final if t == v.size - 1 else 0.0
            last = paid + gamma * following - v[t] + gamma * lam * last
            advantages[t] = last
        out[int(session)] = (rows, cols, advantages, advantages + v)
    flat = np.concatenate([a for _, _, a, _ in out.values()])
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + 1e-8)
    return {s: (r, c, (a - mean) / std, ret) for s, (r, c, a, ret) in out.items()}


class Watched(Values):
    """Values that keeps what it was given and what it put out, per batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple] = []

    def targets(self, params, columns):
        out = super().targets(params, columns)
        self.seen.append((jax.device_get(params), dict(columns), out))
        return out


@pytest.mark.slow
def test_ppo_graph_trains_through_the_values_stage_on_native_episodes():
    from serving_helpers import CONFIG, tiny_model

    model, variables = tiny_model(0)
    sampling = Sampling(eos_id=EOS, temperature=1.0)
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, sampling), slots=8, capacity=P + R - 1, buckets=(P,)
        )
    )
    critic = ValueHead(models.build("causal_transformer", **CONFIG))
    objective = PPOObjective(
        model, P + R - 1, critic=critic, pretrained=variables, behavior_importance=2.0
    )
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), progress=False)
    start = jax.device_get(trainer.initial_state().params)
    source = EnvironmentSource(
        server,
        Counter,
        counting_reward,
        max_prompt_tokens=P,
        max_new_tokens=R,
        max_turns=T,
        workers=8,
    )
    values = Watched(objective, width=P + R, gamma=0.97, lam=0.9)
    settings = GraphSettings(
        width=P + R, rows=2 * 4 * T, groups=4, estimator="reward", truncation="mask"
    )
    data = Dataset(
        train=lambda p: itertools.repeat({"task_id": np.array([3, 8])}), records=2, batch=2
    )
    logged = []
    try:
        pipeline = build_graph(
            settings, tasks=TaskBatches(data), source=source,
            weights=PolicyWeights(server, objective), scorer=None, values=values,
            trainer=trainer, steps=3, owns_source=True,
            log=lambda step, metrics, record: logged.append((metrics, record)),
        )  # fmt: skip
        assert "rescore" not in pipeline.stages and "values" in pipeline.stages
        pipeline.run()
    finally:
        source.close()
        server.close()
    state = pipeline.stages["update"].state
    assert len(values.seen) == 3 and len(logged) == 3
    assert int(state.updates) == sum(m["trainable"] for m, _ in logged) == 3
    score = jax.jit(objective.values)
    log_probs = jax.jit(objective.packed_log_probs)
    multi_turn = 0
    for params, given, out in values.seen:
        mask = given["response_mask"] == 1
        assert mask.sum() > 1
        np.testing.assert_array_equal(out["old_values"], np.where(mask, score(params, given), 0))
        rescored = np.where(mask, log_probs(params, given), 0)
        np.testing.assert_array_equal(out["old_log_probs"], rescored)
        expected = reference_gae(given, out["old_values"], 0.97, 0.9)
        for rows, cols, advantages, returns in expected.values():
            rewards = given["advantages"][rows, cols]
            assert np.all(rewards == rewards[0])  # pack laid the episode's reward on every id
            multi_turn += len(set(given["call_index"][rows, cols].tolist())) > 1
            np.testing.assert_allclose(out["advantages"][rows, cols], advantages, atol=2e-5)
            np.testing.assert_allclose(out["returns"][rows, cols], returns, atol=2e-6)
        assert not out["advantages"][~mask].any() and not out["returns"][~mask].any()
    assert multi_turn > 0
    end = jax.device_get(state.params)
    for subtree in ("policy", "critic"):
        pairs = zip(jax.tree.leaves(start[subtree]), jax.tree.leaves(end[subtree]), strict=True)
        assert any(not np.array_equal(a, b) for a, b in pairs), subtree
    assert server.version == logged[-1][1].served  # the server got the policy subtree pushed


def test_build_graph_refuses_values_beside_a_scorer_or_with_group_advantages():
    class Objective:
        def values(self, params, batch): ...

        def packed_log_probs(self, params, batch): ...

    class Weights:
        version = 0

        def load(self, params, version): ...

    data = Dataset(train=lambda p: itertools.repeat({"task_id": np.array([0])}), batch=1)
    common = dict(tasks=TaskBatches(data), source=object(), weights=Weights())
    stage = Values(Objective(), width=8)
    good = GraphSettings(width=8, rows=4, groups=2, estimator="reward")
    with pytest.raises(ValueError, match="pass scorer=None"):
        build_graph(good, scorer=lambda p, c: None, values=stage, **common)
    group = GraphSettings(width=8, rows=4, groups=2)
    with pytest.raises(ValueError, match="expected estimator='reward' and truncation='mask'"):
        build_graph(group, scorer=None, values=stage, **common)
    with pytest.raises(ValueError, match="gamma is 2"):
        Values(Objective(), width=8, gamma=2)
    with pytest.raises(TypeError, match="expected a PPOObjective"):
        PolicyWeights(Weights(), object())


def test_values_refuses_a_batch_with_one_action_id():
    class Objective:
        def values(self, params, batch):
            return np.zeros(batch["input_ids"].shape, np.float32)

        def packed_log_probs(self, params, batch):
            return np.zeros(batch["input_ids"].shape, np.float32)

    from dew_pipe.objectives.rl import Call, Session, pack

    one = pack([Session(0, 0, 0, 0, [Call([2, 3], [5], [-0.1], "stop", 0)], "COMPLETED", 1.0)], 4)
    stage = Values(Objective(), width=4)
    with pytest.raises(ValueError, match="exactly one trainable action id"):
        stage.targets(None, one)
    none = {k: np.zeros_like(v) for k, v in one.items()}
    out = stage.targets(None, none)
    assert not out["old_values"].any() and not out["advantages"].any()


def test_docstring_examples_run():
    from dew_pipe.cli import load_file

    failed, attempted = doctest.testmod(values_module, raise_on_error=False)
    assert failed == 0 and attempted >= 4
    failed, attempted = doctest.testmod(load_file(PIPELINE), raise_on_error=False)
    assert failed == 0 and attempted >= 3


def _run(*args: str, settings: dict | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("dew-pipe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dew_pipe.cli"]
    command += ["run", str(PIPELINE), *args]
    for key, value in (settings or {}).items():
        command += ["--set", f"{key}={value}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_the_dry_run_lists_the_settings_and_a_bad_one_is_refused(tmp_path):
    done = _run("--run-dir", str(tmp_path / "run"), "--dry-run", settings={"ppo_steps": 7})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ppo_steps" in done.stdout and "lam" in done.stdout and "7" in done.stdout
    bad = _run("--run-dir", str(tmp_path / "bad"), settings={"lam": 1.5})
    assert bad.returncode == 2 and "lam is 1.5" in bad.stderr


@pytest.mark.slow
def test_a_tiny_run_goes_through_sft_and_ppo(tmp_path):
    tiny = {"sft_steps": 20, "ppo_steps": 2, "eval_every": 1, "prompts": 2, "groups": 2,
            "slots": 4, "workers": 4, "test_size": 4}  # fmt: skip
    done = _run("--run-dir", str(tmp_path / "run"), settings=tiny)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["settings"]["ppo_steps"] == 2 and 0.0 <= summary["after"] <= 1.0
    assert f"held-out success after PPO: {summary['after']:.1%}" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if r.get("phase") == "ppo" and "loss" in r] == [1, 2]
