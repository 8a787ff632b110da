"""PPO with a critic: GAE, the value loss and the composite objective against verl; the rollout.

``TokenFeatures`` lives here because the spec's PPO example imports it (``PYTHONPATH=tests``):
trainable token features, the critic's backbone in the small tool-episode setting of
``tests/test_tool_episodes.py``.

Parity (fixture ``tests/parity/fixtures/verl_ppo.npz`` from ``tests/parity/record_verl_ppo.py``,
verl 0.9.1): GAE advantages and returns over multi-turn episodes packed across chains and rows,
and the composite loss ``pg + beta * kl + c * vf`` with its parameter gradients through a
bigram policy and a token-feature critic. The bars are the spec's: composite loss 3.3e-08,
parameter gradients 1.5e-08, GAE advantages 2.4e-07, returns 6e-08. Dropping any one term
(critic, KL, clipping) must fail the composite comparison.

The rollout is checked against an independent NumPy GAE over the collected episodes; the
Trainer runs show updates that move both subtrees while the reference stays, a cohort with
nothing to train that makes no update even under Adam, and targets stored in Parquet trained
for several epochs.
"""

from __future__ import annotations

import doctest
import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_tool_episodes import (  # the tool episodes' fixtures (tests/ is on the path)
    BUDGET,
    PROMPT,
    SAMPLING,
    TURNS,
    VOCAB,
    Harness,
    ScriptedPolicy,
    ToolPolicy,
    verify,
)

from dew_pipe import Dataset, Trainer
from dew_pipe.batches import packed_from_arrow, packed_to_arrow, read_parquet, write_parquet
from dew_pipe.objectives.rl import (
    Call,
    EpisodeRollout,
    EpisodeStatus,
    PPOObjective,
    PPORollout,
    Session,
    ValueHead,
    pack,
)
from dew_pipe.objectives.rl import critic as critic_module
from dew_pipe.objectives.rl import gae as gae_module
from dew_pipe.objectives.rl import ppo as ppo_module
from dew_pipe.objectives.rl.gae import episode_gae

FIXTURE = Path(__file__).parent / "parity" / "fixtures" / "verl_ppo.npz"
ROOT = Path(__file__).resolve().parent.parent
BARS = {"loss": 3.3e-08, "grad": 1.5e-08, "advantages": 2.4e-07, "returns": 6e-08}
SEQ_LEN = PROMPT + BUDGET - 1  # the tool episodes' rows
PARITY_WIDTH = 16  # rows of the recorded episodes (their longest chain is 15 ids)


class TokenFeatures(nn.Module):
    """Trainable token features: the hidden state after id ``t`` is row ``t`` of a table.

    The critic's backbone in the tool-episode tests (``ValueHead(TokenFeatures())``): like
    the bigram policy it reads only the current id, so a value is ``embedding[t] @ kernel +
    bias``, easy to check by hand.
    """

    vocab_size: int = VOCAB
    width: int = 4

    def setup(self) -> None:
        size = (self.vocab_size, self.width)
        self.embedding = self.param("embedding", nn.initializers.normal(1.0), size)

    def __call__(self, tokens, segment_ids=None, positions=None):
        return self.features(tokens, segment_ids, positions)

    def features(self, tokens, segment_ids=None, positions=None):
        return jnp.take(self.embedding, jnp.asarray(tokens, jnp.int32), axis=0)


# ---------------------------------------------------------------------------- parity helpers


@pytest.fixture(scope="module")
def verl() -> tuple[dict[str, np.ndarray], dict]:
    with np.load(FIXTURE) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(arrays["meta"].tobytes().decode())


def sessions_of(episodes: list[dict], rerendered: tuple[int, ...] = ()) -> list[Session]:
    """The recorded episodes as sessions, one call per turn.

    An episode in ``rerendered`` gets a context that does not extend its last chain (its
    history re-rendered behind a marker id), so each of its turns starts a new chain.
    """
    out = []
    for index, episode in enumerate(episodes):
        context, calls = list(episode["prompt"]), []
        for step in episode["turns"]:
            action = step["action"]
            raw = [-0.2] * len(action)
            calls.append(Call(context, action, [-0.1] * len(action), "stop", 0, log_probs=raw))
            context = context + action + step["observation"]
            if index in rerendered:
                context = [1, *context]
        out.append(Session(0, index, 0, 0, calls, "COMPLETED", reward=episode["reward"]))
    return out


def draw_order(batch: dict, session: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns of a session's sampled ids, in the order they were drawn."""
    rows, cols = np.nonzero((batch["response_mask"] == 1) & (batch["session_index"] == session))
    order = np.lexsort((cols, rows, batch["call_index"][rows, cols]))
    return rows[order], cols[order]


def scatter(batch: dict, recorded: np.ndarray, mask: np.ndarray, count: int) -> np.ndarray:
    """Recorded ``[B, T]`` response values (mask 1 on actions) placed at the packed ids."""
    out = np.zeros(batch["input_ids"].shape, np.float32)
    for s in range(count):
        rows, cols = draw_order(batch, s)
        columns = np.flatnonzero(mask[s])
        assert columns.size == rows.size
        out[rows, cols] = recorded[s, columns]
    return out


def model_batch(arrays: dict, meta: dict) -> dict:
    episodes = meta["model_episodes"]
    batch = pack(sessions_of(episodes), PARITY_WIDTH)
    mask = arrays["model.mask"]
    columns = {
        "old_log_probs": "old_log_prob",
        "behavior_log_probs": "rollout_log_prob",
        "advantages": "advantages",
        "old_values": "old_values",
        "returns": "returns",
    }
    for column, recorded in columns.items():
        batch[column] = scatter(batch, arrays[f"model.{recorded}"], mask, len(episodes))
    return batch


def model_variables(arrays: dict) -> tuple[dict, dict]:
    j = lambda name: jnp.asarray(arrays[f"model.{name}"])  # noqa: E731
    critic = {
        "backbone": {"embedding": j("features")},
        "head": {"kernel": j("kernel"), "bias": j("bias")},
    }
    variables = {"policy": {"params": {"table": j("table")}}, "critic": {"params": critic}}
    return variables, {"params": {"table": j("reference")}}


def case_objective(case: list, **change) -> PPOObjective:
    _, low, high, dual, beta, coefficient, clip, cap = case
    settings = dict(
        value_coefficient=coefficient,
        value_clip=clip,
        beta=beta,
        epsilon_low=low,
        epsilon_high=high,
        dual_clip=dual,
        behavior_importance=cap,
    )
    settings.update(change)
    critic = ValueHead(TokenFeatures())
    return PPOObjective(ToolPolicy(), PARITY_WIDTH - 1, critic=critic, **settings)


def no_less_accurate(ours, verl32, exact) -> bool:
    ours, verl32, exact = (np.asarray(a, np.float64) for a in (ours, verl32, exact))
    slack = 2 * np.spacing(np.float32(np.abs(exact).max()))
    return np.abs(ours - exact).max() <= np.abs(verl32 - exact).max() + slack


def grads_by_name(grads: dict) -> dict[str, np.ndarray]:
    head = grads["critic"]["params"]["head"]
    return {
        "table": np.asarray(grads["policy"]["params"]["table"]),
        "features": np.asarray(grads["critic"]["params"]["backbone"]["embedding"]),
        "kernel": np.asarray(head["kernel"]),
        "bias": np.asarray(head["bias"]),
    }


# ---------------------------------------------------------------------------- GAE parity


def test_gae_over_multi_turn_episodes_matches_verl(verl):
    arrays, meta = verl
    episodes = meta["gae_episodes"]
    sessions = sessions_of(episodes, rerendered=(1, 3))
    # A truncated episode packs no rows (masked): it must change neither the targets nor
    # the whitening statistics of the others.
    cut = Session(0, 99, 0, 0, sessions[1].calls, "TRUNCATED", reward=5.0)
    batch = pack([*sessions, cut], 18)
    assert not (batch["session_index"] == len(sessions)).any()
    # The layout this test is about: turns in several chains, an episode over several rows.
    rows_of = {s: set(draw_order(batch, s)[0].tolist()) for s in range(len(episodes))}
    assert max(len(r) for r in rows_of.values()) >= 2
    mask = arrays["gae.mask"]
    values = scatter(batch, arrays["gae.values"], mask, len(episodes))
    rewards = np.where(batch["response_mask"] == 1, 0.0, 0.0).astype(np.float32)
    for s, episode in enumerate(episodes):
        rows, cols = draw_order(batch, s)
        rewards[rows, cols] = episode["reward"]
    for i, (gamma, lam) in enumerate(meta["gae_settings"]):
        advantages, returns = episode_gae(batch, values, rewards, gamma=gamma, lam=lam)
        for s in range(len(episodes)):
            rows, cols = draw_order(batch, s)
            columns = np.flatnonzero(mask[s])
            adv_gap = np.abs(advantages[rows, cols] - arrays[f"gae.{i}.advantages"][s, columns])
            ret_gap = np.abs(returns[rows, cols] - arrays[f"gae.{i}.returns"][s, columns])
            assert adv_gap.max() <= BARS["advantages"], (gamma, lam, s, adv_gap.max())
            assert ret_gap.max() <= BARS["returns"], (gamma, lam, s, ret_gap.max())
        off = batch["response_mask"] == 0
        assert not advantages[off].any() and not returns[off].any()


def test_gae_refusals_and_the_empty_cohort():
    sessions = sessions_of(
        [{"prompt": [2, 3], "turns": [{"action": [4], "observation": []}], "reward": 1.0}]
    )
    batch = pack(sessions, 4)
    ones = np.where(batch["response_mask"] == 1, 1.0, 0.0).astype(np.float32)
    with pytest.raises(ValueError, match="at least two trainable action ids; got 1"):
        episode_gae(batch, ones, ones, gamma=1.0, lam=0.95)
    advantages, returns = episode_gae(batch, ones, ones, gamma=1.0, lam=0.95, whiten=False)
    assert advantages.sum() == 0.0 and returns.sum() == 1.0  # reward 1, value 1: no surprise
    with pytest.raises(ValueError, match="values has shape"):
        episode_gae(batch, ones[:, :2], ones, gamma=1.0, lam=0.95)
    with pytest.raises(ValueError, match="values is nan at row 0"):
        episode_gae(batch, ones * np.nan, ones, gamma=1.0, lam=0.95)
    two = pack(
        sessions_of(
            [{"prompt": [2], "turns": [{"action": [4, 5], "observation": []}], "reward": 1.0}]
        ),
        4,
    )
    uneven = np.where(two["response_mask"] == 1, 1.0, 0.0).astype(np.float32)
    uneven[0, 2] = 2.0
    with pytest.raises(ValueError, match="rewards differ within session 0"):
        episode_gae(two, uneven, uneven, gamma=1.0, lam=0.95)
    empty = {k: np.zeros_like(v) for k, v in batch.items()}
    advantages, returns = episode_gae(empty, ones, ones, gamma=1.0, lam=0.95)
    assert not advantages.any() and not returns.any()


# ---------------------------------------------------------------------------- composite parity


def test_composite_loss_and_parameter_gradients_match_verl(verl):
    arrays, meta = verl
    batch = model_batch(arrays, meta)
    variables, ema = model_variables(arrays)
    for case in meta["cases"]:
        name = case[0]
        objective = case_objective(case)
        objective.validate(batch)
        (loss, metrics), grads = jax.value_and_grad(objective.loss, has_aux=True)(
            variables, batch, jax.random.key(0), ema
        )
        key = f"model.{name}"
        assert abs(float(loss) - float(arrays[f"{key}.loss"])) <= BARS["loss"], name
        for part in ("pg_loss", "kl_loss", "value_loss"):
            assert abs(float(metrics[part]) - float(arrays[f"{key}.{part}"])) <= BARS["loss"]
        for fraction in ("pg_clipfrac", "value_clipfrac"):
            recorded = float(arrays[f"{key}.{fraction}"])
            assert 0 < recorded < 1 and abs(float(metrics[fraction]) - recorded) < 1e-6
        # No less accurate than verl's own float32: no further from the float64 result of
        # the same verl code than verl's float32 is, give or take two float32 ulps.
        assert no_less_accurate(loss, arrays[f"{key}.loss"], arrays[f"{key}.f64.loss"])
        for param, grad in grads_by_name(grads).items():
            recorded = arrays[f"{key}.grad.{param}"]
            assert grad.shape == recorded.shape and np.abs(recorded).max() > 0
            assert np.abs(grad - recorded).max() <= BARS["grad"], (name, param)
            assert no_less_accurate(grad, recorded, arrays[f"{key}.f64.grad.{param}"]), param


@pytest.mark.parametrize(
    "change",
    [
        {"value_coefficient": 0.0},  # no critic term
        {"beta": 0.0},  # no KL term
        {"epsilon_low": 0.999, "epsilon_high": 1e3, "dual_clip": None},  # no policy clipping
        {"value_clip": None},  # no value clipping
    ],
    ids=["critic", "kl", "policy-clip", "value-clip"],
)
def test_removing_a_term_fails_the_composite_comparison(verl, change):
    arrays, meta = verl
    batch = model_batch(arrays, meta)
    variables, ema = model_variables(arrays)
    for case in meta["cases"]:
        objective = case_objective(case, **change)
        loss, _ = objective.loss(
            variables, batch, jax.random.key(0), ema if objective.beta else None
        )
        gap = abs(float(loss) - float(arrays[f"model.{case[0]}.loss"]))
        assert gap > 1e3 * BARS["loss"], (case[0], change, gap)


# ---------------------------------------------------------------------------- objective


def test_docstring_examples_run():
    for module, examples in ((critic_module, 3), (gae_module, 5), (ppo_module, 10)):
        failed, attempted = doctest.testmod(module, raise_on_error=False)
        assert failed == 0 and attempted >= examples


def test_value_loss_without_clip_is_half_the_squared_error():
    values = jnp.array([[0.5, -1.0, 3.0]])
    returns = jnp.array([[1.0, 1.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])  # the third id is not an action: never counted
    loss, clipfrac = critic_module.value_loss(values, returns, values + 5.0, mask, clip=None)
    assert float(loss) == pytest.approx(0.5 * (0.25 + 4.0) / 2) and float(clipfrac) == 0.0
    # The recorded values sit 5 away, so the clipped predictions (5.4, 3.9) are the larger
    # errors on both counted ids.
    loss, clipfrac = critic_module.value_loss(values, returns, values + 5.0, mask, clip=0.1)
    assert float(loss) == pytest.approx(0.5 * ((5.4 - 1.0) ** 2 + (3.9 - 1.0) ** 2) / 2)
    assert float(clipfrac) == 1.0


def test_variables_reference_and_policy_binding(tool_objective):
    objective, variables = tool_objective
    assert sorted(variables) == ["critic", "policy"]
    assert objective.reference(variables) is variables["policy"]
    assert objective.ema_decay == 1.0
    head = variables["critic"]["params"]["head"]
    assert not np.asarray(head["kernel"]).any()  # a zero head: the critic starts at 0
    # The critic is initialized from its own key: its features are not the policy table.
    policy = objective.policy(variables)
    other = jax.tree.map(lambda x: x + 1.0, variables)
    policy.bind(types.SimpleNamespace(params=other))
    bound = policy.policy.variables["params"]["table"]
    assert np.array_equal(np.asarray(bound), np.asarray(other["policy"]["params"]["table"]))
    with pytest.raises(ValueError, match="expected PPO variables"):
        policy.bind({"params": {}})


def test_constructor_and_batch_refusals(tool_objective):
    objective, variables = tool_objective
    critic = ValueHead(TokenFeatures())
    for change, message in [
        ({"sequence_mask": (0.5, 2.0)}, "sequence_mask"),
        ({"geometric_mask": (0.5, 2.0)}, "geometric_mask"),
        ({"aggregation": "session-mean"}, "aggregation"),
        ({"behavior_importance": (0.5, 2.0)}, "IcePop"),
        ({"value_clip": 0.0}, "value_clip is 0.0"),
        ({"value_coefficient": -1.0}, "value_coefficient is -1.0"),
        ({"epsilon_low": 1.5}, "epsilon_low"),
    ]:
        with pytest.raises(ValueError, match=message):
            PPOObjective(ToolPolicy(), SEQ_LEN, critic=critic, **change)
    with pytest.raises(TypeError, match="expected a Flax module"):
        PPOObjective(ToolPolicy(), SEQ_LEN, critic=object())
    with pytest.raises(ValueError, match="critic's max_seq_len=8"):
        small = ToolPolicy(config=dataclasses_replace(ToolPolicy().config, max_seq_len=8))
        PPOObjective(ToolPolicy(), SEQ_LEN, critic=ValueHead(small))
    batch = scripted_batch(objective, variables)
    del batch["returns"]
    with pytest.raises(ValueError, match="no field 'returns'"):
        objective.validate(batch)
    batch = scripted_batch(objective, variables)
    rows, cols = np.nonzero(batch["response_mask"])
    batch["old_values"][rows[0], cols[0]] = np.inf
    with pytest.raises(ValueError, match=f"'old_values' is inf at row {rows[0]}"):
        objective.validate(batch)


def dataclasses_replace(config, **change):
    import dataclasses

    return dataclasses.replace(config, **change)


# ---------------------------------------------------------------------------- the rollout


@pytest.fixture(scope="module")
def tool_objective():
    objective = PPOObjective(ToolPolicy(), SEQ_LEN, critic=ValueHead(TokenFeatures()), beta=0.03)
    return objective, objective.init(jax.random.key(19))


def episodes_for(objective, variables, policy=None, **settings) -> EpisodeRollout:
    kw = dict(
        max_prompt_tokens=PROMPT,
        max_new_tokens=BUDGET,
        max_turns=TURNS,
        groups=4,
        sampling=SAMPLING,
    )
    kw.update(settings)
    harness = kw.pop("harness", Harness())
    chosen = objective.policy(variables) if policy is None else policy
    return EpisodeRollout(chosen, harness, verify, **kw)


def state_of(variables, step: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(step=np.int32(step), updates=np.int32(step), params=variables)


def scripted_batch(objective, variables) -> dict:
    """One cohort of the scripted (right) tool script: two turns per episode."""
    rollout = PPORollout(objective, episodes_for(objective, variables, policy=ScriptedPolicy()))
    return rollout(state_of(variables), {"task_id": np.array([1, 2], np.int32)}, jax.random.key(0))


def reference_targets(episodes, critic_params, gamma: float, lam: float) -> dict:
    """Independent GAE in float64 from the episodes themselves: per action id, the value
    before it (``embedding[prev] @ kernel + bias``), the reward after the last one."""
    emb = np.asarray(critic_params["backbone"]["embedding"], np.float64)
    kernel = np.asarray(critic_params["head"]["kernel"], np.float64)[:, 0]
    bias = float(np.asarray(critic_params["head"]["bias"])[0])
    out = {}
    for index, episode in enumerate(episodes):
        if episode.status is not EpisodeStatus.COMPLETED:
            continue
        values = []
        for action in episode.actions:
            history = [*action.context.tolist(), *action.tokens.tolist()]
            for prev in history[action.context.size - 1 : -1]:
                values.append(emb[prev] @ kernel + bias)
        values = np.array(values)
        rewards = np.zeros_like(values)
        rewards[-1] = episode.reward
        advantages, last = np.zeros_like(values), 0.0
        for t in range(values.size - 1, -1, -1):
            following = values[t + 1] if t + 1 < values.size else 0.0
            last = rewards[t] + gamma * following - values[t] + gamma * lam * last
            advantages[t] = last
        out[index] = (values, advantages, advantages + values)
    flat = np.concatenate([a for _, a, _ in out.values()])
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + 1e-8)
    return {k: (v, (a - mean) / std, r) for k, (v, a, r) in out.items()}


def test_rollout_targets_match_an_independent_gae_over_the_episodes(tool_objective):
    objective, variables = tool_objective
    rng = np.random.default_rng(0)
    critic = jax.tree.map(
        lambda x: x + rng.normal(size=x.shape).astype(np.float32) * 0.5, variables["critic"]
    )
    variables = {"policy": variables["policy"], "critic": critic}
    episodes = episodes_for(objective, variables)
    rollout = PPORollout(objective, episodes, gamma=0.97, lam=0.9)
    batch = rollout(state_of(variables), {"task_id": np.array([2, 3], np.int32)}, jax.random.key(4))
    assert batch["input_ids"].shape == (2 * 4 * TURNS, PROMPT + BUDGET)
    for name in ("old_log_probs", "behavior_log_probs", "response_mask"):
        assert name in batch
    for name in ("old_values", "advantages", "returns"):
        assert batch[name].shape == batch["input_ids"].shape and batch[name].dtype == np.float32
        assert not batch[name][batch["response_mask"] == 0].any()
    expected = reference_targets(episodes.last_episodes, critic["params"], 0.97, 0.9)
    multi = [i for i in expected if len(episodes.last_episodes[i].actions) >= 2]
    assert multi, "the fixed key should give a completed multi-turn episode"
    for index, (values, advantages, returns) in expected.items():
        rows, cols = draw_order(batch, index)
        np.testing.assert_allclose(batch["old_values"][rows, cols], values, rtol=0, atol=2e-6)
        np.testing.assert_allclose(batch["advantages"][rows, cols], advantages, rtol=0, atol=2e-5)
        np.testing.assert_allclose(batch["returns"][rows, cols], returns, rtol=0, atol=2e-6)
    trained = {int(s) for s in np.unique(batch["session_index"][batch["response_mask"] == 1])}
    assert trained == set(expected)  # truncated episodes are masked, not bootstrapped
    metrics = rollout.metrics()
    assert metrics["ppo/actions"] == batch["response_mask"].sum() and "reward/mean" in metrics


def test_one_action_is_refused_and_none_trains_nothing(tool_objective):
    objective, variables = tool_objective

    def answer(context, budget):  # one id, EOS: the episode completes with one action id
        return [1]

    one = PPORollout(
        objective, episodes_for(objective, variables, policy=ScriptedPolicy(answer), groups=1)
    )
    with pytest.raises(ValueError, match="exactly one trainable action id"):
        one(state_of(variables), {"task_id": np.array([0], np.int32)}, jax.random.key(0))
    cut = PPORollout(
        objective, episodes_for(objective, variables, policy=ScriptedPolicy(), max_turns=1)
    )
    empty = cut(state_of(variables), {"task_id": np.array([1], np.int32)}, jax.random.key(0))
    assert not empty["response_mask"].any()
    for name in ("old_values", "advantages", "returns"):
        assert not empty[name].any()
    # Under Adam, after one real update, the empty cohort must move nothing at all.
    trainer = Trainer(objective, optax.adam(0.05), key=jax.random.key(1), progress=False)
    state, metrics = trainer.train_step(
        trainer.initial_state(), scripted_batch(objective, variables)
    )
    assert bool(metrics["committed"]) and int(state.updates) == 1
    before = jax.tree.map(np.array, (state.params, state.opt_state))
    state, metrics = trainer.train_step(state, empty)
    assert not bool(metrics["committed"]) and float(metrics["trainable"]) == 0.0
    assert int(state.updates) == 1 and int(state.step) == 2
    after = jax.tree.map(np.array, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert a.tobytes() == b.tobytes()


def test_rollout_refusals(tool_objective):
    objective, variables = tool_objective
    episodes = episodes_for(objective, variables, policy=ScriptedPolicy())
    with pytest.raises(ValueError, match="gamma is 1.5"):
        PPORollout(objective, episodes, gamma=1.5)
    with pytest.raises(ValueError, match="lam is -0.1"):
        PPORollout(objective, episodes, lam=-0.1)
    with pytest.raises(ValueError, match="rows 10 ids wide"):
        PPORollout(
            objective,
            episodes_for(objective, variables, policy=ScriptedPolicy(), max_prompt_tokens=7),
        )
    with pytest.raises(TypeError, match="expected a PPOObjective"):
        PPORollout(object(), episodes)


def test_checkpoints_reach_the_wrapped_episodes(tool_objective):
    """The Trainer calls rollout.checkpointed(step); PPORollout must pass it on, or the
    episodes' journal would never be pruned."""
    objective, variables = tool_objective
    episodes = episodes_for(objective, variables, policy=ScriptedPolicy())
    seen = []
    episodes.checkpointed = seen.append
    PPORollout(objective, episodes).checkpointed(7)
    assert seen == [7]


# ---------------------------------------------------------------------------- the trainer


def test_two_updates_move_policy_and_critic_lower_the_error_and_keep_the_reference(
    tool_objective,
):
    objective, _ = tool_objective
    seen = []

    class Keep(PPORollout):
        def __call__(self, state, batch, key):
            out = super().__call__(state, batch, key)
            seen.append({k: np.array(v) for k, v in out.items()})
            return out

    trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(7), progress=False)
    start = jax.tree.map(np.array, trainer.initial_state().params)
    episodes = episodes_for(objective, start)
    trainer.rollout = Keep(objective, episodes, gamma=0.97, lam=0.9)
    data = Dataset(
        train=lambda p: itertools.repeat({"task_id": np.array([1, 2], np.int32)}),
        val=None,
        records=None,
        batch=2,
    )
    state = trainer.fit(data, steps=2, log_every=1)
    assert int(state.updates) == 2
    end = jax.tree.map(np.array, state.params)
    for subtree in ("policy", "critic"):
        moved = [
            not np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(start[subtree]), jax.tree.leaves(end[subtree]), strict=True
            )
        ]
        assert any(moved), subtree
    # The reference is the starting policy, bit for bit, and only the policy.
    reference = jax.tree.map(np.array, state.ema)
    assert jax.tree.structure(reference) == jax.tree.structure(start["policy"])
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(start["policy"]), strict=True):
        assert a.tobytes() == b.tobytes()
    values = jax.jit(objective.values)
    first = seen[0]
    mask = first["response_mask"] == 1
    error = [
        float(np.square(np.asarray(values(p, first))[mask] - first["returns"][mask]).mean())
        for p in (start, end)
    ]
    assert error[1] < error[0], error


def test_stored_targets_train_several_epochs_without_sampling(tool_objective, tmp_path):
    objective, variables = tool_objective
    batch = scripted_batch(objective, variables)
    path = tmp_path / "ppo.parquet"
    write_parquet(path, packed_to_arrow(batch))
    (stored,) = (packed_from_arrow(b) for b in read_parquet(path).combine_chunks().to_batches())
    for name in ("old_values", "advantages", "returns", "old_log_probs"):
        assert stored[name].tobytes() == batch[name].tobytes()
    data = Dataset(
        train=lambda p: itertools.repeat(dict(stored)),
        val=None,
        records=None,
        batch=stored["input_ids"].shape[0],
    )
    log = []
    trainer = Trainer(
        objective, optax.sgd(0.2), key=jax.random.key(3), log=log.append, progress=False
    )
    state = trainer.fit(data, steps=3, log_every=1)
    assert int(state.updates) == 3
    losses = [r["value_loss"] for r in log]
    assert losses[0] > losses[1] > losses[2]  # the same targets, three epochs: the critic fits


@pytest.mark.slow
def test_the_specs_example_runs_from_a_checkout():
    example = """
import itertools
import jax
import numpy as np
import optax
from dew_pipe import Trainer
from dew_pipe.data import Dataset
from dew_pipe.objectives.rl import EpisodeRollout, PPOObjective, PPORollout, ValueHead
from test_tool_episodes import ToolPolicy, Harness, verify, SAMPLING
from test_ppo import TokenFeatures

key = jax.random.key(19)
objective = PPOObjective(ToolPolicy(), seq_len=10,
                         critic=ValueHead(TokenFeatures()), beta=.03)
episodes = EpisodeRollout(objective.policy(objective.init(key)), Harness(), verify,
                          max_prompt_tokens=8, max_new_tokens=3, max_turns=3,
                          groups=4, sampling=SAMPLING)
trainer = Trainer(objective, optax.sgd(.05), key=key,
                  rollout=PPORollout(objective, episodes, gamma=.97, lam=.9))
data = Dataset(train=lambda partition: itertools.repeat({
    "task_id": np.arange(jax.device_count(), dtype=np.int32)}),
    val=None, records=None, batch=jax.device_count())
state = trainer.fit(data, steps=2, log_every=1)
assert int(state.updates) == 2
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", example],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
