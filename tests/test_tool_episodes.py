"""Tool episodes: a small policy calls a square tool, reads the result and answers.

The spec's fixtures live here, and the spec's PPO example imports them with
``PYTHONPATH=tests``: :class:`ToolPolicy` (a bigram policy, a Flax module with the decoder's
call forms), :class:`Harness` (the environment factory of the in-memory square tool),
:func:`verify` (1 for the right final answer after a tool call) and :data:`SAMPLING`.

The episode: ``reset`` shows ``[USER, q(x)]`` (x = task % 4). A turn ``[CALL, EOS]`` calls
the square tool, whose result comes back appended: ``... CALL EOS RESULT d(x*x)``. Any other
finished turn is the final answer, ``[d(x*x), EOS]`` when right. A bigram cannot learn much
of this; the fixtures check the lifecycle and the numbers, not a useful model.

Numbers are checked against independent NumPy computations from the bigram table (raw and
behavior log-probabilities, the categorical policy gradient); rules with a scripted NumPy
policy that needs no compile (truncation, failures, cancellation, cleanup, projection).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import doctest
import itertools
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_pipe import Dataset, Sampling, Trainer
from dew_pipe.inference import Generation, TextGeneration
from dew_pipe.objectives.rl import (
    Action,
    EpisodeCancelled,
    EpisodeFailure,
    EpisodeRollout,
    EpisodeStatus,
    GRPOObjective,
    Observation,
    compute_advantages,
    pack_episodes,
    session_of,
)
from dew_pipe.objectives.rl import episode_rollout as rollout_module
from dew_pipe.objectives.rl import episode_sessions as sessions_module
from dew_pipe.objectives.rl import episodes as episodes_module
from dew_pipe.objectives.rl.sessions import Status

# ---------------------------------------------------------------------------- the fixtures

PAD, EOS, USER, CALL, RESULT = 0, 1, 2, 3, 4
Q0 = 5  # q(x) = Q0 + x for the question's x in 0..3
D0 = 9  # d(n) = D0 + n for a digit n in 0..9
VOCAB = D0 + 10
SAMPLING = Sampling(eos_id=EOS, temperature=0.8)
PROMPT, BUDGET, TURNS = 8, 3, 3  # rows are PROMPT + BUDGET = 11 ids: seq_len 10


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """What generation and the objectives read of a model's configuration."""

    vocab_size: int = VOCAB
    max_seq_len: int = 32


def _prior(strength: float):
    """Table initializer: noise plus a nudge towards the tool script (call, then copy)."""

    def init(key: jax.Array, shape: tuple[int, int], dtype: Any = jnp.float32) -> jax.Array:
        table = 0.5 * jax.random.normal(key, shape, dtype)
        nudge = np.zeros(shape, np.float32)
        nudge[Q0 : Q0 + 4, CALL] = strength  # after the question: call the tool
        nudge[CALL, EOS] = strength  # a call is one id
        for digit in range(D0, D0 + 10):
            nudge[digit, digit] = strength  # after the result: repeat it...
            nudge[digit, EOS] = strength  # ...and stop
        return table + jnp.asarray(nudge, dtype)

    return init


class ToolPolicy(nn.Module):
    """A bigram policy: the logits after id t are row t of one trainable table.

    It has the decoder's call forms (``apply(v, tokens, segment_ids, positions)``,
    ``features``/``logits``, ``init_cache``/``reset_cache``), so ``generate``,
    ``TextGeneration`` and the objectives use it like a transformer. A bigram reads only
    the current id, so its cache holds nothing but the slot count.
    """

    config: ToolConfig = ToolConfig()
    prior: float = 3.0

    def setup(self) -> None:
        size = (self.config.vocab_size, self.config.vocab_size)
        self.table = self.param("table", _prior(self.prior), size)

    def __call__(self, tokens, segment_ids=None, positions=None, *, cache=None, cache_index=None):
        out = self.features(tokens, segment_ids, positions, cache=cache, cache_index=cache_index)
        if cache is None:
            return self.logits(out)
        return self.logits(out[0]), out[1]

    def features(self, tokens, segment_ids=None, positions=None, *, cache=None, cache_index=None):
        hidden = jnp.take(self.table, jnp.asarray(tokens, jnp.int32), axis=0)
        return hidden if cache is None else (hidden, cache)

    def logits(self, hidden):
        return jnp.asarray(hidden, jnp.float32)

    @nn.nowrap
    def init_cache(self, batch: int, length: int) -> dict[str, jax.Array]:
        return {"positions": jnp.full((batch, length), -1, jnp.int32)}

    @nn.nowrap
    def reset_cache(self, cache: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
        return cache


class SquareEnvironment:
    """One episode of the square tool; records its lifecycle for the tests."""

    def __init__(self, harness: Harness, episode_id: Any) -> None:
        self.harness, self.id = harness, episode_id
        self.x = episode_id.task % 4
        self.entered = self.exited = False
        self.exit_error: BaseException | None = None
        self.steps = 0
        self.faulty = harness.fault is not None and episode_id.sample == harness.at

    def _fault(self, where: str) -> None:
        if not self.faulty:
            return
        fault = self.harness.fault
        if fault == where == "reset":
            raise RuntimeError("the sandbox did not start")
        if where == "step":
            if fault == "step":
                raise RuntimeError("the tool crashed")
            if fault == "futures-cancel":
                raise cf.CancelledError()
            if fault == "asyncio-cancel":
                raise asyncio.CancelledError()
            if fault == "interrupt":
                raise KeyboardInterrupt

    def __enter__(self) -> SquareEnvironment:
        self.entered = True
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.exited, self.exit_error = True, exc
        if self.faulty and self.harness.fault == "release":
            raise OSError("could not remove the workspace")

    def reset(self) -> Observation:
        self._fault("reset")
        return Observation([USER, Q0 + self.x])

    def step(self, action) -> Observation:
        assert self.entered and not self.exited
        self.steps += 1
        self._fault("step")
        if self.faulty and self.harness.fault in ("error", "cancelled"):
            return Observation(status=self.harness.fault, detail="the tool server went away")
        tokens = action.tokens.tolist()
        if tokens == [CALL, EOS]:
            self.harness.tool_calls.append(self.id)
            turn = tokens if self.harness.append_only else tokens[:-1]  # re-rendered w/o EOS
            return Observation([*action.context.tolist(), *turn, RESULT, D0 + self.x**2])
        return Observation(status="completed", detail=" ".join(map(str, tokens[:-1])))


class Harness:
    """The environment factory: ``Harness()(episode_id)`` opens a square-tool episode.

    Args:
        append_only: the next context extends the last one by the turn and the result; when
            False the turn is re-rendered without its EOS (a template that is not
            append-only).
        fault: a failure for the episodes of sample ``at``: "reset", "step" (raise),
            "error"/"cancelled" (return that status), "futures-cancel"/"asyncio-cancel"
            (raise that cancellation), "interrupt" (KeyboardInterrupt in ``step``),
            "release" (``__exit__`` raises).
    """

    def __init__(self, append_only: bool = True, fault: str | None = None, at: int = 0) -> None:
        self.append_only, self.fault, self.at = append_only, fault, at
        self.environments: list[SquareEnvironment] = []
        self.tool_calls: list[Any] = []

    def __call__(self, episode_id: Any) -> SquareEnvironment:
        env = SquareEnvironment(self, episode_id)
        self.environments.append(env)
        return env


def verify(episode) -> float:
    """1.0 when the episode completed with the right square after calling the tool."""
    x = int(episode.first.context[-1]) - Q0
    turns = [a.tokens.tolist() for a in episode.actions]
    right = bool(turns) and turns[-1] == [D0 + x * x, EOS] and [CALL, EOS] in turns[:-1]
    return float(episode.status == EpisodeStatus.COMPLETED and right)


# ---------------------------------------------------------------------------- helpers


def scripted(context: list[int], budget: int) -> list[int]:
    """The right script: call the tool after the question, then repeat the result."""
    if Q0 <= context[-1] < D0:
        return [CALL, EOS]
    if len(context) > 1 and context[-2] == RESULT:
        return [context[-1], EOS]
    return [PAD] * budget


class ScriptedPolicy:
    """A NumPy policy (no compile): ids from ``script``, made-up distinct likelihoods."""

    def __init__(self, script=scripted) -> None:
        self.script, self.binds, self.contexts = script, 0, []

    def bind(self, state: Any) -> ScriptedPolicy:
        self.binds += 1
        return self

    def batch(self, contexts, budget, key, sampling) -> list[Generation]:
        out = []
        for context in contexts:
            context = np.asarray(context, np.int32)
            self.contexts.append(context.tolist())
            ids = np.asarray(self.script(context.tolist(), budget), np.int32)
            raw = -0.1 * np.arange(1, ids.size + 1, dtype=np.float32) - 0.01 * context.size
            stop = "stop" if ids[-1] == EOS else "length"
            out.append(Generation(context, ids, raw, raw * np.float32(1.5), stop))
        return out


STATE = types.SimpleNamespace(step=np.int32(4), updates=np.int32(3), params=None)


def episode_rollout(policy: Any, harness: Any, **kw: Any) -> EpisodeRollout:
    settings = dict(
        max_prompt_tokens=PROMPT,
        max_new_tokens=BUDGET,
        max_turns=TURNS,
        groups=4,
        sampling=SAMPLING,
    )
    settings.update(kw)
    verifier = settings.pop("verifier", verify)
    return EpisodeRollout(policy, harness, verifier, **settings)


def tasks(*ids: int) -> dict[str, np.ndarray]:
    return {"task_id": np.asarray(ids, np.int32)}


def sampled_positions(batch: dict[str, np.ndarray], session: int, call: int) -> tuple:
    return np.nonzero(
        (batch["session_index"] == session)
        & (batch["call_index"] == call)
        & (batch["response_mask"] == 1)
    )


# ---------------------------------------------------------------------------- the real policy


@pytest.fixture(scope="module")
def tool_policy():
    """(model, variables, TextGeneration) shared by every test that samples for real."""
    model = ToolPolicy()
    variables = GRPOObjective(model, seq_len=PROMPT + BUDGET - 1).init(jax.random.key(3))
    return model, variables, TextGeneration(model, variables)


class Recording:
    """Forwards to a policy and keeps every Generation it returned, per call."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.returned = policy, []
        self.model = policy.model

    def bind(self, state: Any) -> Recording:
        self.policy.bind(state)
        return self

    def batch(self, contexts, budget, key, sampling):
        out = self.policy.batch(contexts, budget, key, sampling)
        self.returned.append(out)
        return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def collected(tool_policy):
    """One real collection: 2 tasks x 4 samples, append-only harness."""
    _, variables, policy = tool_policy
    recording, harness = Recording(policy), Harness()
    rollout = episode_rollout(recording, harness)
    state = types.SimpleNamespace(step=np.int32(0), updates=np.int32(0), params=variables)
    batch = rollout(state, tasks(2, 3), jax.random.key(4))
    return rollout, recording, harness, batch, variables


def test_raw_and_behavior_probabilities_match_numpy(collected):
    rollout, _, _, _, variables = collected
    table = np.asarray(variables["params"]["table"], np.float64)
    actions = [a for e in rollout.last_episodes for a in e.actions]
    assert len(actions) >= 8
    for action in actions:
        history = [*action.context.tolist(), *action.tokens.tolist()]
        prev = history[action.context.size - 1 : -1]
        raw = log_softmax(table[prev])[np.arange(len(prev)), action.tokens]
        behavior = log_softmax(table[prev] / SAMPLING.temperature)[
            np.arange(len(prev)), action.tokens
        ]
        np.testing.assert_allclose(action.log_probs, raw, rtol=0, atol=2e-5)
        np.testing.assert_allclose(action.behavior_log_probs, behavior, rtol=0, atol=2e-5)
        assert not np.allclose(action.log_probs, action.behavior_log_probs)


def test_records_are_exact_and_chains_merge_when_append_only(collected):
    rollout, recording, _, batch, _ = collected
    returned = [g for call in recording.returned for g in call]
    episodes = rollout.last_episodes
    assert batch["input_ids"].shape == (2 * 4 * TURNS, PROMPT + BUDGET)
    multi = 0
    for i, episode in enumerate(episodes):
        trains = episode.status is EpisodeStatus.COMPLETED
        for j, action in enumerate(episode.actions):
            # the action holds the very arrays the policy returned, byte for byte
            assert any(
                g.context_ids.tobytes() == action.context.tobytes()
                and g.ids.tobytes() == action.tokens.tobytes()
                and g.log_probs.tobytes() == action.log_probs.tobytes()
                and g.behavior_log_probs.tobytes() == action.behavior_log_probs.tobytes()
                for g in returned
            )
            rows, cols = sampled_positions(batch, i, j)
            if not trains:
                assert rows.size == 0
                continue
            assert batch["input_ids"][rows, cols].tobytes() == action.tokens.tobytes()
            assert batch["old_log_probs"][rows, cols].tobytes() == action.log_probs.tobytes()
            assert (
                batch["behavior_log_probs"][rows, cols].tobytes()
                == action.behavior_log_probs.tobytes()
            )
            assert (batch["versions"][rows, cols] == 0).all()
            # the context precedes the sampled ids in the same segment, unchanged
            row, start = rows[0], cols[0]
            segment = batch["text_segment_ids"][row, start]
            in_segment = np.flatnonzero(batch["text_segment_ids"][row] == segment)
            head = batch["input_ids"][row, in_segment[0] : start]
            assert head.tobytes() == action.context.tobytes()
        if trains and len(episode.actions) == 2:
            multi += 1
            first = sampled_positions(batch, i, 0)
            second = sampled_positions(batch, i, 1)
            segments = {int(batch["text_segment_ids"][r, c]) for r, c in zip(*first, strict=True)}
            segments |= {int(batch["text_segment_ids"][r, c]) for r, c in zip(*second, strict=True)}
            assert len(segments) == 1 and first[0][0] == second[0][0]  # one chain
    assert multi >= 1, "the fixed key should give at least one two-turn completed episode"
    # observations are never targets: every sampled position belongs to an action
    assert batch["response_mask"].sum() == sum(
        a.tokens.size for e in episodes if e.status is EpisodeStatus.COMPLETED for a in e.actions
    )


def test_template_that_is_not_append_only_splits_chains(tool_policy):
    _, variables, policy = tool_policy
    harness = Harness(append_only=False)
    rollout = episode_rollout(policy, harness)
    state = types.SimpleNamespace(step=np.int32(0), updates=np.int32(0), params=variables)
    batch = rollout(state, tasks(2, 3), jax.random.key(4))
    split = 0
    for i, episode in enumerate(rollout.last_episodes):
        if episode.status is not EpisodeStatus.COMPLETED or len(episode.actions) < 2:
            continue
        split += 1
        first, second = (sampled_positions(batch, i, j) for j in (0, 1))
        a = (first[0][0], batch["text_segment_ids"][first[0][0], first[1][0]])
        b = (second[0][0], batch["text_segment_ids"][second[0][0], second[1][0]])
        assert a != b  # two chains: the re-rendered context is not spliced onto the first
        second_action = episode.actions[1]
        row, start = second[0][0], second[1][0]
        segment = np.flatnonzero(batch["text_segment_ids"][row] == b[1])
        chain = batch["input_ids"][row, segment]
        expected = [*second_action.context.tolist(), *second_action.tokens.tolist()]
        assert chain.tolist() == expected
        assert CALL in second_action.context.tolist() and EOS not in chain[:-1].tolist()
        assert start == segment[0] + second_action.context.size
    assert split >= 1


def test_categorical_gradient_on_actions_only(collected):
    _, _, _, batch, variables = collected
    objective = GRPOObjective(ToolPolicy(), seq_len=PROMPT + BUDGET - 1)
    objective.validate(batch)
    assert np.abs(batch["advantages"][batch["response_mask"] == 1]).sum() > 0

    def loss(params):
        return objective.loss(params, batch, jax.random.key(0), None)[0]

    grad = np.asarray(jax.jit(jax.grad(loss))(variables)["params"]["table"], np.float64)
    table = np.asarray(variables["params"]["table"], np.float64)
    # Reference: token-mean PPO surrogate -A * ratio per sampled id; at ratio ~ 1 (unclipped)
    # its gradient on row prev is -A * ratio * (onehot(id) - softmax(row)) / tokens.
    expected = np.zeros_like(table)
    rows, cols = np.nonzero(batch["response_mask"])
    tokens = rows.size
    for r, c in zip(rows, cols, strict=True):
        prev, token = batch["input_ids"][r, c - 1], batch["input_ids"][r, c]
        logp = log_softmax(table[prev])
        ratio = np.exp(logp[token] - batch["old_log_probs"][r, c])
        assert abs(ratio - 1) < 1e-4
        onehot = np.eye(VOCAB)[token]
        expected[prev] -= batch["advantages"][r, c] * ratio * (onehot - np.exp(logp)) / tokens
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)
    # rows of ids that only ever precede observation ids get nothing
    for token in (USER, RESULT, PAD):
        assert not grad[token].any()


# ---------------------------------------------------------------------------- rules (scripted)


def test_docstring_examples_run():
    for module, examples in ((episodes_module, 6), (sessions_module, 1), (rollout_module, 0)):
        failed, attempted = doctest.testmod(module, raise_on_error=False)
        assert failed == 0 and attempted >= examples


def test_scripted_episode_lifecycle_and_cleanup():
    harness, policy, seen = Harness(), ScriptedPolicy(), []
    open_while_verifying = []

    def verifier(episode):
        env = next(e for e in harness.environments if e.id == episode.id)
        open_while_verifying.append(env.entered and not env.exited)
        return verify(episode)

    rollout = episode_rollout(policy, harness, verifier=verifier, record=seen.append)
    batch = rollout(STATE, tasks(2), jax.random.key(0))
    episodes = rollout.last_episodes
    assert policy.binds == 1
    assert [e.reward for e in episodes] == [1.0] * 4
    assert all(open_while_verifying) and len(open_while_verifying) == 4
    assert all(env.exited and env.exit_error is None for env in harness.environments)
    assert len(harness.tool_calls) == 4 and seen == episodes
    ids = [e.id for e in episodes]
    assert [i.sample for i in ids] == [0, 1, 2, 3] and {i.task for i in ids} == {2}
    assert {i.step for i in ids} == {4} and len({i.seed for i in ids}) == 4
    assert all(a.policy_step == 3 for e in episodes for a in e.actions)
    assert episodes[0].actions[1].context.tolist() == [USER, Q0 + 2, CALL, EOS, RESULT, D0 + 4]
    # all equal rewards: zero advantages, but every action trains (mask) at version 3
    assert batch["response_mask"].sum() == 4 * 4 and not batch["advantages"].any()
    assert set(np.unique(batch["versions"])) == {-1, 3}
    # lock-step rounds: every slot is a row of each round (finished ones inert)
    assert len(policy.contexts) == 2 * 4
    assert rollout.metrics()["reward/mean"] == 1.0 and rollout.metrics()["episode/turns"] == 2


def test_budget_hit_is_truncated_not_sent_and_left_out_of_the_baseline():
    calls = itertools.count()  # round 1 asks slots 0-3 (n = 0..3), round 2 slots 0-2 and 3 inert

    def script(context, budget):
        n = next(calls)
        if context == [USER, Q0 + 1]:
            return [CALL, CALL, CALL] if n == 3 else [CALL, EOS]  # slot 3 rambles
        return [D0 + (1 if n in (4, 5) else 2), EOS]  # slots 0 and 1 right, slot 2 wrong

    harness = Harness()
    rollout = episode_rollout(ScriptedPolicy(script), harness)
    batch = rollout(STATE, tasks(1), jax.random.key(0))
    episodes = rollout.last_episodes
    cut = episodes[3]
    assert cut.status is EpisodeStatus.TRUNCATED and "without EOS" in cut.detail
    assert harness.environments[3].steps == 0  # never sent to the tool
    assert cut.transitions[0].observation.status is EpisodeStatus.TRUNCATED
    assert cut.reward == 0.0  # still verified
    assert session_of(cut, group=0).status is Status.TRUNCATED
    assert not (batch["session_index"] == 3).any()
    rewards = [e.reward for e in episodes[:3]]
    advantages = compute_advantages(rewards, [0, 0, 0], "group")
    for i in range(3):
        rows, cols = sampled_positions(batch, i, 1)
        assert np.allclose(batch["advantages"][rows, cols], advantages[i])


def test_long_context_and_max_turns_truncate_keeping_the_recorded_input():
    harness = Harness()
    rollout = episode_rollout(ScriptedPolicy(), harness, max_prompt_tokens=5, groups=1)
    rollout(STATE, tasks(3), jax.random.key(0))
    (episode,) = rollout.last_episodes
    assert episode.status is EpisodeStatus.TRUNCATED and "max_prompt_tokens=5" in episode.detail
    assert len(episode.actions) == 1
    assert episode.last.context.tolist() == [USER, Q0 + 3, CALL, EOS, RESULT, D0 + 9]

    harness = Harness()
    rollout = episode_rollout(ScriptedPolicy(), harness, max_turns=1, groups=1)
    batch = rollout(STATE, tasks(3), jax.random.key(0))
    (episode,) = rollout.last_episodes
    assert episode.status is EpisodeStatus.TRUNCATED and "max_turns=1" in episode.detail
    assert batch["input_ids"].shape == (1, PROMPT + BUDGET) and not batch["response_mask"].any()
    assert harness.environments[0].exited


@pytest.mark.parametrize(
    "fault, cancelled_by",
    [("futures-cancel", cf.CancelledError), ("asyncio-cancel", asyncio.CancelledError)],
)
def test_cancellation_raises_episode_cancelled_with_the_original_cause(fault, cancelled_by):
    harness, seen = Harness(fault=fault, at=1), []
    rollout = episode_rollout(ScriptedPolicy(), harness, record=seen.append)
    with pytest.raises(EpisodeCancelled) as caught:
        rollout(STATE, tasks(2), jax.random.key(0))
    error = caught.value
    assert type(error.__cause__) is cancelled_by
    assert error.status is EpisodeStatus.CANCELLED and error.episode.id.sample == 1
    # the partial episode keeps the action step() was handling, closed as CANCELLED
    assert len(error.episode.actions) == 1
    assert error.episode.last.status is EpisodeStatus.CANCELLED
    envs = harness.environments
    assert envs[1].exit_error is error.__cause__  # exited under the original
    assert all(e.exited and e.exit_error is error.__cause__ for e in envs)
    assert len(seen) == 4 and {e.status for e in seen} == {EpisodeStatus.CANCELLED}
    assert rollout.last_episodes == []


def test_cancelled_observation_has_no_source_exception():
    harness = Harness(fault="cancelled", at=2)
    with pytest.raises(EpisodeCancelled) as caught:
        episode_rollout(ScriptedPolicy(), harness)(STATE, tasks(2), jax.random.key(0))
    assert caught.value.__cause__ is None and caught.value.episode.id.sample == 2
    assert caught.value.episode.detail == "the tool server went away"
    assert all(e.exited for e in harness.environments)


@pytest.mark.parametrize("fault", ["step", "reset", "error"])
def test_environment_failures_abort_the_collection_and_release_everything(fault):
    harness, seen = Harness(fault=fault, at=2), []
    with pytest.raises(EpisodeFailure) as caught:
        episode_rollout(ScriptedPolicy(), harness, record=seen.append)(
            STATE, tasks(2), jax.random.key(0)
        )
    error = caught.value
    assert not isinstance(error, EpisodeCancelled)
    assert error.status is EpisodeStatus.ERROR and error.episode.id.sample == 2
    if fault == "error":
        assert error.__cause__ is None and "went away" in str(error)
    else:
        assert isinstance(error.__cause__, RuntimeError)
    if fault == "reset":  # slots after the failing one were never opened
        assert len(harness.environments) == 3
    assert all(e.exited for e in harness.environments)
    assert len(seen) == 4 and len(error.episodes) == 4


def test_verifier_failure_aborts_after_releasing():
    harness = Harness()

    def broken(episode):
        if episode.id.sample == 1:
            raise ZeroDivisionError("bad grader")
        return 1.0

    with pytest.raises(EpisodeFailure) as caught:
        episode_rollout(ScriptedPolicy(), harness, verifier=broken)(
            STATE, tasks(2), jax.random.key(0)
        )
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert caught.value.episode.status is EpisodeStatus.ERROR
    assert all(e.exited for e in harness.environments)
    assert isinstance(harness.environments[1].exit_error, ZeroDivisionError)

    with pytest.raises(EpisodeFailure, match="finite float"):
        episode_rollout(ScriptedPolicy(), Harness(), verifier=lambda e: float("nan"))(
            STATE, tasks(2), jax.random.key(0)
        )


def test_failed_release_throws_the_episode_out():
    harness, seen = Harness(fault="release", at=1), []
    rollout = episode_rollout(ScriptedPolicy(), harness, record=seen.append)
    batch = rollout(STATE, tasks(2), jax.random.key(0))
    thrown = rollout.last_episodes[1]
    assert thrown.status is EpisodeStatus.ERROR and thrown.reward is None
    assert "could not remove the workspace" in thrown.detail
    assert session_of(thrown, group=0).status is Status.INFRA_ERROR
    assert not (batch["session_index"] == 1).any() and (batch["session_index"] == 0).any()
    assert seen[1] == thrown


def test_projection_refuses_two_collection_bindings():
    rollout = episode_rollout(ScriptedPolicy(), Harness())
    first = rollout.collect(STATE, tasks(2), jax.random.key(0))
    second = rollout.collect(STATE, tasks(2), jax.random.key(0))
    assert first == second  # same public records: the origin takes no part in equality
    pack_episodes(first, [0] * 4, width=PROMPT + BUDGET)
    with pytest.raises(ValueError, match="separate collections"):
        pack_episodes([*first[:2], *second[2:]], [0] * 4, width=PROMPT + BUDGET)
    mixed = dataclasses.replace(first[0], transitions=second[0].transitions)
    with pytest.raises(ValueError, match="two collection bindings"):
        session_of(mixed, group=0)


def test_constructor_refuses_bad_settings():
    policy, harness = ScriptedPolicy(), Harness()
    with pytest.raises(TypeError, match="EpisodeJournal"):
        episode_rollout(policy, harness, journal="run/episodes")
    with pytest.raises(ValueError, match="eos"):
        episode_rollout(policy, harness, sampling=Sampling(temperature=1.0))
    with pytest.raises(ValueError, match="max_turns is 0"):
        episode_rollout(policy, harness, max_turns=0)
    with pytest.raises(TypeError, match="bindable"):
        episode_rollout(lambda *a: None, harness)
    with pytest.raises(ValueError, match="task_id"):
        episode_rollout(policy, harness)(STATE, {"prompt": np.zeros((1, 2))}, jax.random.key(0))


def test_interrupts_release_the_environments_and_propagate_unchanged():
    harness = Harness(fault="interrupt", at=1)
    with pytest.raises(KeyboardInterrupt):
        episode_rollout(ScriptedPolicy(), harness)(STATE, tasks(2), jax.random.key(0))
    assert all(
        e.exited and isinstance(e.exit_error, KeyboardInterrupt) for e in harness.environments
    )


def test_a_policy_without_batch_is_called_once_per_running_slot():
    class OneByOne:
        def __init__(self):
            self.inner, self.keys = ScriptedPolicy(), []

        def bind(self, state):
            return self

        def __call__(self, context, budget, key, sampling):
            self.keys.append(jax.random.key_data(key).tolist())
            return self.inner.batch([context], budget, key, sampling)[0]

    policy = OneByOne()
    one = episode_rollout(policy, Harness()).collect(STATE, tasks(2), jax.random.key(0))
    many = episode_rollout(ScriptedPolicy(), Harness()).collect(STATE, tasks(2), jax.random.key(0))
    assert one == many
    assert len(policy.keys) == 8 and len({tuple(k) for k in policy.keys}) == 8  # no inert rows


def test_actions_and_observations_are_validated():
    good = dict(context=[USER, Q0], tokens=[CALL, EOS], log_probs=[-0.1, -0.2])
    good.update(behavior_log_probs=[-0.3, -0.4], stopped=True, policy_step=0)
    Action(**good).check_eos(SAMPLING.eos_ids)
    for change, error, message in [
        ({"context": []}, ValueError, "at least one id"),
        ({"tokens": [True, False]}, TypeError, "integer token ids"),
        ({"tokens": [-1, EOS]}, ValueError, "ids in"),
        ({"tokens": []}, ValueError, "log-probabilities|one entry per sampled id"),
        ({"log_probs": [-0.1]}, ValueError, "one entry per sampled id"),
        ({"behavior_log_probs": [-0.1, float("nan")]}, ValueError, "finite"),
        ({"stopped": 1}, TypeError, "True or False"),
        ({"policy_step": -1}, ValueError, ">= 0"),
    ]:
        with pytest.raises(error, match=message):
            Action(**{**good, **change})
    with pytest.raises(ValueError, match="follow EOS"):
        Action(**{**good, "tokens": [EOS, CALL]}).check_eos([EOS])
    with pytest.raises(ValueError, match="not an EOS id"):
        Action(**{**good, "tokens": [CALL, CALL]}).check_eos([EOS])
    with pytest.raises(ValueError, match="stopped is False"):
        Action(**{**good, "stopped": False}).check_eos([EOS])
    with pytest.raises(ValueError, match="RUNNING observation must carry"):
        Observation()
    with pytest.raises(ValueError, match="expected one of"):
        Observation([USER], status="finished")
    assert Observation(status="COMPLETED").context is None


def test_a_terminal_reset_is_refused():
    class Done(Harness):
        def __call__(self, episode_id):
            env = super().__call__(episode_id)
            env.reset = lambda: Observation(status="completed")
            return env

    with pytest.raises(EpisodeFailure, match="expected RUNNING") as caught:
        episode_rollout(ScriptedPolicy(), Done())(STATE, tasks(2), jax.random.key(0))
    assert isinstance(caught.value.__cause__, ValueError)


def test_a_slots_draws_do_not_depend_on_when_other_episodes_end(tool_policy):
    _, variables, policy = tool_policy

    class Early(Harness):
        def __call__(self, episode_id):
            env = super().__call__(episode_id)
            if episode_id.sample == 0:
                env.step = lambda action: Observation(status="completed", detail="early")
            return env

    state = types.SimpleNamespace(step=np.int32(0), updates=np.int32(0), params=variables)
    usual = episode_rollout(policy, Harness()).collect(state, tasks(2, 3), jax.random.key(4))
    early = episode_rollout(policy, Early()).collect(state, tasks(2, 3), jax.random.key(4))
    ended = [i for i in (0, 4) if len(usual[i].actions) == 2]
    assert ended and all(len(early[i].actions) == 1 for i in ended)
    assert usual[1:4] == early[1:4] and usual[5:] == early[5:]  # the other slots: same draws


def test_size_check_against_the_model(tool_policy):
    _, _, policy = tool_policy
    with pytest.raises(ValueError, match="max_seq_len=32"):
        episode_rollout(policy, Harness(), max_prompt_tokens=30, max_new_tokens=4)


# ---------------------------------------------------------------------------- the trainer


def _trainer(variables, run_dir) -> Trainer:
    objective = GRPOObjective(ToolPolicy(), seq_len=PROMPT + BUDGET - 1)
    rollout = episode_rollout(TextGeneration(ToolPolicy(), variables), Harness())
    return Trainer(
        objective,
        optax.sgd(0.5),
        key=jax.random.key(5),
        rollout=rollout,
        run_dir=run_dir,
        progress=False,
        checkpoint_every=1 if run_dir else None,
    )


def test_trainer_updates_match_with_and_without_a_checkpoint_restore(tool_policy, tmp_path):
    _, variables, _ = tool_policy
    data = Dataset(
        train=lambda partition: (tasks(2 + k % 2, 1) for k in itertools.count()),
        val=None,
        records=None,
        batch=2,
    )
    start = np.asarray(_trainer(variables, None).initial_state().params["params"]["table"])
    straight = _trainer(variables, None).fit(data, steps=2, log_every=1)
    _trainer(variables, tmp_path).fit(data, steps=1, log_every=1)
    resumed = _trainer(variables, tmp_path).fit(data, steps=2, log_every=1)
    assert int(straight.updates) == int(resumed.updates) == 2
    a, b = (np.asarray(s.params["params"]["table"]) for s in (straight, resumed))
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, start)


def test_a_failed_collection_stops_fit_before_its_update():
    logged = []

    def verifier(episode):
        if episode.id.step == 1:
            raise RuntimeError("the grader is down")
        return verify(episode)

    rollout = episode_rollout(ScriptedPolicy(), Harness(), verifier=verifier)
    trainer = Trainer(
        GRPOObjective(ToolPolicy(), seq_len=PROMPT + BUDGET - 1),
        optax.sgd(0.5),
        key=jax.random.key(5),
        rollout=rollout,
        log=logged.append,
        progress=False,
    )
    data = Dataset(train=lambda partition: itertools.repeat(tasks(2, 1)), val=None, batch=2)
    with pytest.raises(EpisodeFailure, match="grader is down"):
        trainer.fit(data, steps=3, log_every=1)
    assert [r["step"] for r in logged] == [1] and logged[0]["updates"] == 1
