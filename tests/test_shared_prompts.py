"""`pack(..., share_prompts=True)`: a group's prompt written once for all its completions.

The layout against the plain one, chain by chain; the GRPO loss, metrics and gradients
against the plain rows' (the plain layout is the reference: every completion alone behind
its own copy of the prompt); what does not share; the checks of the new column; and
`SampledRollout(share_prompts=True)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from grpo_helpers import CHAIN, OPTIONS, VOCAB, draw, perturbed, tiny_decoder
from grpo_helpers import loss_and_grads as run

from dew_pipe.batches import packed_from_arrow, validate_packed
from dew_pipe.objectives.rl import GRPOObjective, SampledRollout
from dew_pipe.objectives.rl.critic import packed_values
from dew_pipe.objectives.rl.packing import chain_lengths, pack, rows_needed
from dew_pipe.objectives.rl.sessions import Call, Session
from dew_pipe.sampling import Sampling

PLAIN = 12  # wide enough for any one completion below
SHARED = 24  # a prompt and several completions


def decoder(num_layers: int = 1):
    return tiny_decoder(num_layers, max_seq_len=SHARED)


def group_sessions(seed: int, tasks: int = 3, samples: int = 4, *, support: bool = False):
    """``tasks`` groups of ``samples`` one-call sessions; a group's calls share a prompt."""
    rng = np.random.default_rng(seed)
    sessions = []
    for task in range(tasks):
        prompt = rng.integers(1, VOCAB, int(rng.integers(3, 7)))
        for sample in range(samples):
            call = draw(rng, prompt, int(rng.integers(1, 5)), support=support)
            reward = float(rng.normal())
            sessions.append(Session(task, 0, sample, 0, [call], "COMPLETED", reward=reward))
    return sessions


def completions(batch: dict) -> dict[int, dict[str, np.ndarray]]:
    """Each session's whole chain read back from a batch: its columns over the chain's ids,
    in order. In shared rows the prompt's ids come from its shared segment."""
    segments = batch["text_segment_ids"]
    shared = batch.get("text_prefix_segments", np.zeros_like(segments))
    out = {}
    for r in range(segments.shape[0]):
        for s in np.unique(segments[r][segments[r] > 0]):
            own = np.flatnonzero(segments[r] == s)
            sessions = batch["session_index"][r, own]
            if (sessions < 0).all():
                continue  # a shared prompt: read with its completions
            prefix = shared[r, own[0]]
            columns = own if prefix == 0 else np.r_[np.flatnonzero(segments[r] == prefix), own]
            chain = {name: batch[name][r, columns] for name in batch if batch[name].ndim == 2}
            chain["own"] = own
            out[int(sessions[sessions >= 0][0])] = chain
    return out


# ---------------------------------------------------------------------------- the layout


def test_each_completion_reads_the_plain_chain_back():
    sessions = group_sessions(0)
    plain = completions(pack(sessions, PLAIN))
    batch = pack(sessions, SHARED, share_prompts=True)
    shared = completions(batch)
    assert sorted(shared) == sorted(plain) == list(range(len(sessions)))
    for i, chain in shared.items():
        reference = plain[i]
        prompt = sessions[i].calls[0].prompt_ids.size
        for name in ("input_ids", "text_positions", "response_mask"):
            np.testing.assert_array_equal(chain[name], reference[name], err_msg=name)
        for name in ("behavior_log_probs", "old_log_probs", "versions", "session_index"):
            np.testing.assert_array_equal(chain[name], reference[name], err_msg=name)
        for name in ("advantages", "session_weights"):
            # on the completion's own ids as in plain rows; 0 on the shared prompt's
            np.testing.assert_array_equal(chain[name][prompt - 1 :], reference[name][prompt - 1 :])
            assert not chain[name][: prompt - 1].any(), name
    # one copy of each prompt: 3 groups of 4 completions in 3 rows instead of 12 chains
    assert batch["input_ids"].shape[0] == 3
    assert (batch["text_prefix_segments"] > 0).sum() == sum(
        s.calls[0].length - s.calls[0].prompt_ids.size + 1 for s in sessions
    )


def test_lengths_and_rows_match_what_pack_places():
    sessions = group_sessions(1, tasks=5, samples=3)
    for width in (10, 12, SHARED):
        pieces = chain_lengths(sessions, width, share_prompts=True)
        batch = pack(sessions, width, share_prompts=True)
        assert rows_needed(pieces, width) == batch["input_ids"].shape[0]
        assert pieces.sum() == (batch["text_segment_ids"] > 0).sum()
        assert pieces.sum() < chain_lengths(sessions, width).sum()


def test_a_group_wider_than_a_row_splits_with_a_prompt_per_part():
    prompt = [3, 4, 5, 6]
    calls = [Call(prompt, [7, 8, 9], [-0.1] * 3, "stop", 0) for _ in range(5)]
    sessions = [Session(0, 0, k, 0, [c], "COMPLETED", float(k)) for k, c in enumerate(calls)]
    # a part holds the 3 shared ids and at most 2 completions of 4 ids in 12 columns
    batch = pack(sessions, 12, share_prompts=True)
    assert chain_lengths(sessions, 12, share_prompts=True).tolist() == [11, 11, 7]
    assert batch["input_ids"].shape[0] == 3
    rows = [r for r in range(3) if (batch["text_prefix_segments"][r] > 0).any()]
    assert len(rows) == 2  # the fifth completion is a plain chain of its own
    for r in rows:
        assert batch["input_ids"][r, :3].tolist() == prompt[:3]
    assert sorted(completions(batch)) == list(range(5))


def test_what_does_not_share_stays_plain():
    a = Call([3, 4, 5], [6], [-0.1], "stop", 0)
    b = Call([3, 4, 5], [7], [-0.2], "stop", 0)
    other = Call([3, 4, 9], [7], [-0.2], "stop", 0)
    one = Call([3], [7, 8], [-0.2, -0.3], "stop", 0)
    two_chains = [Call([3, 4, 5], [6], [-0.1], "stop", 0), Call([8, 8], [6], [-0.1], "stop", 0)]
    pairs = {  # (task, group, calls) of two sessions, sample 0 and sample 1
        "other task": ((0, 0, [a]), (1, 0, [b])),
        "other group": ((0, 0, [a]), (0, 1, [b])),
        "other prompt": ((0, 0, [a]), (0, 0, [other])),
        "a one-id prompt": ((0, 0, [one]), (0, 0, [one])),
        "two chains": ((0, 0, two_chains), (0, 0, [b])),
    }
    cases = {
        name: [
            Session(task, group, sample, 0, calls, "COMPLETED", float(sample))
            for sample, (task, group, calls) in enumerate(pair)
        ]
        for name, pair in pairs.items()
    }
    for name, sessions in cases.items():
        batch = pack(sessions, 16, share_prompts=True)
        plain = pack(sessions, 16)
        assert not batch["text_prefix_segments"].any(), name
        for column, values in plain.items():
            np.testing.assert_array_equal(batch[column], values, err_msg=f"{name}: {column}")


def test_failed_and_flat_groups_keep_out_of_the_blocks():
    sessions = group_sessions(2, tasks=3, samples=4)
    sessions[1] = dataclasses.replace(sessions[1], status="INFRA_ERROR")
    for k in range(4, 8):  # the second group: all rewards equal, so advantages all 0
        sessions[k] = dataclasses.replace(sessions[k], reward=0.5)
    batch = pack(sessions, SHARED, share_prompts=True, drop_zero_advantage=True)
    kept = set(completions(batch))
    assert kept == {0, 2, 3, 8, 9, 10, 11}
    plain = completions(pack(sessions, PLAIN, drop_zero_advantage=True))
    for i in kept:
        np.testing.assert_array_equal(
            completions(batch)[i]["advantages"][-1], plain[i]["advantages"][-1]
        )


def test_support_routing_and_arrow_follow_the_completions():
    sessions = group_sessions(3, support=True)
    rng = np.random.default_rng(3)
    prompt_routing = {}  # the engine routes a group's common prompt alike
    for k, s in enumerate(sessions):
        call = s.calls[0]
        size = call.prompt_ids.size
        head = prompt_routing.setdefault(s.task, rng.integers(0, 8, (size, 2, 2)))
        tail = rng.integers(0, 8, (call.length - size, 2, 2))
        routed = np.concatenate([head, tail]).astype(np.int32)
        sessions[k] = dataclasses.replace(
            s, calls=[dataclasses.replace(call, routed_experts=routed)]
        )
    batch = pack(sessions, SHARED, share_prompts=True, support_capacity=64)
    for i, chain in completions(batch).items():
        call = sessions[i].calls[0]
        np.testing.assert_array_equal(chain["input_ids"], np.r_[call.prompt_ids, call.sampled_ids])
        r = int(np.flatnonzero((batch["session_index"] == i).any(axis=1))[0])
        sampled = np.flatnonzero(batch["session_index"][r] == i)
        kept = batch["support_ids"][r][np.isin(batch["support_columns"][r], sampled)]
        np.testing.assert_array_equal(kept, np.concatenate(call.support))
        columns = np.r_[
            np.flatnonzero(
                batch["text_segment_ids"][r] == batch["text_prefix_segments"][r, chain["own"][0]]
            ),
            chain["own"],
        ]
        np.testing.assert_array_equal(batch["routed_experts"][r, columns], call.routed_experts)
    record = pack(sessions, SHARED, share_prompts=True, support_capacity=64, arrow=True)
    assert "text_prefix_segments" in record.schema.names
    back = packed_from_arrow(record)
    for name, values in batch.items():
        np.testing.assert_array_equal(back[name], values, err_msg=name)
    validate_packed(record, width=SHARED)


def test_share_prompts_must_be_a_bool():
    with pytest.raises(TypeError, match="share_prompts: expected True or False, got 1"):
        pack(group_sessions(0), SHARED, share_prompts=1)
    with pytest.raises(TypeError, match="share_prompts: expected True or False"):
        chain_lengths(group_sessions(0), SHARED, share_prompts="yes")


# ------------------------------------------------------------------------ the loss


def assert_same(ours, theirs):
    """The loss and metrics as `grpo_helpers.assert_same` holds them; each gradient within
    1e-5 of its tensor's largest entry. The shared rows sum a prompt's gradient in another
    order (once, from every completion's attention, against once per row): measured 4.7e-6
    of the scale in float32, and 4.6e-7 with the decoder computing in float64 (the logits
    stay float32), so it is rounding; reading the wrong keys moves log-probs by 1e-2."""
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = ours, theirs
    np.testing.assert_allclose(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert set(metrics_a) == set(metrics_b)
    for name in metrics_b:
        np.testing.assert_allclose(metrics_a[name], metrics_b[name], atol=1e-5, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b), strict=True):
        scale = float(jnp.abs(y).max())
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5 * scale, rtol=0)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grad_a)) > 1e-3


@pytest.fixture(scope="module")
def setup():
    model = decoder(num_layers=2)
    variables = model.init(jax.random.key(0), jnp.zeros((1, SHARED - 1), jnp.int32))
    policy = perturbed(variables, 0.3, seed=1)
    sessions = near_policy(group_sessions(4), model, policy)
    return model, variables, policy, sessions


def near_policy(sessions, model, params):
    """The sessions with behavior (and raw) log-probs near the policy's own at 0.8, so that
    the sequence masks keep some chains and reject others."""
    batch = pack(sessions, PLAIN)
    scorer = GRPOObjective(model, PLAIN - 1, sampling_temperature=0.8)
    scored = completions(
        dict(batch, old_log_probs=np.asarray(scorer.packed_log_probs(params, batch)))
    )
    rng = np.random.default_rng(7)
    out = []
    for i, session in enumerate(sessions):
        call = session.calls[0]
        own = scored[i]["old_log_probs"][call.prompt_ids.size :]
        noise = rng.normal(0.0, 0.15 if i % 3 else 1.5, own.size)  # every third far off
        behavior = (own + noise).astype(np.float32)
        raw = (own + rng.normal(0.0, 0.05, own.size)).astype(np.float32)
        call = Call(call.prompt_ids, call.sampled_ids, behavior, "stop", 0, log_probs=raw)
        out.append(dataclasses.replace(session, calls=[call]))
    return out


@pytest.mark.parametrize(
    "options",
    [OPTIONS, {**OPTIONS, **CHAIN}, {**OPTIONS, "response_columns": True}],
    ids=["token-mean", "chains", "response-columns"],
)
def test_the_loss_and_its_gradient_are_the_plain_rows(setup, options):
    model, variables, policy, sessions = setup
    plain = pack(sessions, PLAIN)
    shared = pack(sessions, SHARED, share_prompts=True)
    plain_options, extra = dict(options), ()
    if "response_columns" in options:  # each row's sampled ids, gathered: 4 against a group's
        plain_options["response_columns"] = int(plain["response_mask"].sum(axis=1).max())
        options = {**options, "response_columns": int(shared["response_mask"].sum(axis=1).max())}
        extra = ("response_columns_overflow",)
    theirs = run(GRPOObjective(model, PLAIN - 1, **plain_options), policy, plain, variables)
    ours = run(GRPOObjective(model, SHARED - 1, **options), policy, shared, variables)
    if extra:
        theirs[1]["response_columns_overflow"] = 0.0  # the plain rows fit their columns too
    assert_same(ours, theirs)
    if extra:
        assert ours[1]["response_columns_overflow"] == 0.0


def test_log_probs_are_the_plain_rows(setup):
    model, variables, _, sessions = setup
    plain_batch, shared_batch = pack(sessions, PLAIN), pack(sessions, SHARED, share_prompts=True)
    plain = GRPOObjective(model, PLAIN - 1, sampling_temperature=0.8)
    shared = GRPOObjective(model, SHARED - 1, sampling_temperature=0.8)
    plain_batch["old_log_probs"] = np.asarray(
        jax.jit(plain.packed_log_probs)(variables, plain_batch)
    )
    shared_batch["old_log_probs"] = np.asarray(
        jax.jit(shared.packed_log_probs)(variables, shared_batch)
    )
    a, b = completions(plain_batch), completions(shared_batch)
    for i in a:
        sampled = a[i]["response_mask"] == 1
        np.testing.assert_allclose(
            b[i]["old_log_probs"][sampled], a[i]["old_log_probs"][sampled], rtol=1e-5, atol=1e-6
        )
        assert np.isfinite(b[i]["old_log_probs"]).all()
    # without the shared prompt's keys the completions are scored from the wrong context
    blind = dict(shared_batch)  # without the shared prompt's keys: the wrong context
    blind["text_prefix_segments"] = np.zeros_like(shared_batch["text_prefix_segments"])
    wrong = np.asarray(jax.jit(shared.packed_log_probs)(variables, blind))
    sampled = shared_batch["response_mask"] == 1
    assert np.abs(wrong[sampled] - shared_batch["old_log_probs"][sampled]).max() > 1e-2


# ---------------------------------------------------------------------- the checks


def bad(batch: dict, row: int, column: int, value: int) -> dict:
    shared = batch["text_prefix_segments"].copy()
    shared[row, column] = value
    return dict(batch, text_prefix_segments=shared)


def test_a_wrong_prefix_segment_is_named(setup):
    model, *_, sessions = setup
    objective = GRPOObjective(model, SHARED - 1)
    batch = pack(sessions, SHARED, share_prompts=True)
    objective.validate(batch)
    segments, shared = batch["text_segment_ids"], batch["text_prefix_segments"]
    r, c = (int(x) for x in np.argwhere(shared > 0)[0])
    pad = int(np.flatnonzero(segments[r] == 0)[0]) if (segments[r] == 0).any() else None
    cases = [
        (bad(batch, r, c, -1), "holds -1 at row"),
        (
            bad(batch, r, c, SHARED + 5),
            f"expected 0 or the segment of a shared prompt, in [0, {SHARED})",
        ),
        (bad(batch, r, c, int(segments[r, c])), "names the id's own segment"),
        (
            bad(batch, r, c, int(segments[r].max()) + 1),
            "expected the segment of a prompt that ends before",
        ),
        (
            bad(batch, r, c + 1 if shared[r, c + 1] else c, 0),
            "the same for every id of that segment",
        ),
    ]
    if pad is not None:
        cases.append((bad(batch, r, pad, 1), "which is padding"))
    for case, message in cases:
        with pytest.raises(ValueError, match="'text_prefix_segments'") as error:
            objective.validate(case)
        assert message in str(error.value)


def test_the_decoder_takes_prefix_segments_only_uncached():
    model = decoder()
    tokens = jnp.ones((1, 4), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    with pytest.raises(
        ValueError, match=r"prefix_segments has shape \(1, 3\); expected tokens' shape \(1, 4\)"
    ):
        model.apply(variables, tokens, prefix_segments=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(TypeError, match="prefix_segments has dtype float32"):
        model.apply(variables, tokens, prefix_segments=jnp.zeros((1, 4), jnp.float32))
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="prefix_segments applies to uncached calls"):
        model.apply(
            variables,
            tokens,
            cache=cache,
            cache_index=0,
            prefix_segments=jnp.zeros((1, 4), jnp.int32),
        )


def test_the_critic_refuses_shared_rows():
    batch = pack(group_sessions(0), SHARED, share_prompts=True)
    with pytest.raises(ValueError, match="share_prompts=False"):
        packed_values(None, {}, batch)


# ------------------------------------------------------------------ SampledRollout


def reward(data_source, completion, ground_truth, extra_info):
    return float(completion.split()[:1] == [ground_truth])


def test_sampled_rollout_shares_and_trains_as_the_plain_rollout(setup):
    model, variables, policy, _ = setup
    prompts = {
        "prompt": np.array([[0, 3, 4, 5], [6, 7, 8, 9], [0, 0, 2, 4]], np.int32),
        "prompt_length": np.array([3, 4, 2], np.int32),
        "ground_truth": np.frombuffer(b"5\x00\x00\x00" * 3, np.uint8).reshape(3, 4),
    }
    sampling = Sampling(temperature=1.0)
    plain_objective = GRPOObjective(model, 4 + 3 - 1, **OPTIONS)
    shared_objective = GRPOObjective(model, 17, **OPTIONS)  # 3 + 3 * 4 = 15 <= 18: one row each
    state = type("State", (), {"params": policy, "updates": 0})()
    plain = SampledRollout(plain_objective, reward, groups=3, max_new_tokens=3, sampling=sampling)
    shared = SampledRollout(
        shared_objective, reward, groups=3, max_new_tokens=3, sampling=sampling, share_prompts=True
    )
    a = plain(state, prompts, jax.random.key(5))
    b = shared(state, prompts, jax.random.key(5))
    assert a["input_ids"].shape == (9, 7) and b["input_ids"].shape == (3, 18)
    assert plain.metrics().pop("rows") == 9 and shared.metrics().pop("rows") == 3
    assert {k: v for k, v in plain.metrics().items() if k != "rows"} == {
        k: v for k, v in shared.metrics().items() if k != "rows"
    }
    ours = run(shared_objective, policy, b, variables)
    theirs = run(plain_objective, policy, a, variables)
    assert_same(ours, theirs)
    # 2 completions of a full-length prompt per row: ceil(3 / 2) = 2 rows per prompt
    narrow = SampledRollout(
        GRPOObjective(model, 11, **OPTIONS),
        reward,
        groups=3,
        max_new_tokens=3,
        sampling=sampling,
        share_prompts=True,
    )
    assert narrow(state, prompts, jax.random.key(5))["input_ids"].shape == (6, 12)


def test_sampled_rollout_needs_room_for_a_completion():
    model = decoder()
    rollout = SampledRollout(
        GRPOObjective(model, 5), reward, groups=2, max_new_tokens=3, share_prompts=True
    )
    prompts = {"prompt": np.ones((1, 4), np.int32), "prompt_length": np.array([4], np.int32)}
    state = type("State", (), {"params": None, "updates": 0})()
    with pytest.raises(ValueError, match=r"with share_prompts expected seq_len >= P \+ R - 1 = 6"):
        rollout(state, prompts, jax.random.key(0))
    with pytest.raises(TypeError, match="share_prompts is 1; expected a bool"):
        SampledRollout(GRPOObjective(model, 5), reward, groups=2, max_new_tokens=3, share_prompts=1)


# ------------------------------------------------------------------ RolloutScheduler


def test_the_scheduler_packs_shared_prompts_and_rescores_them():
    """Groups of 3 completions of a 5-id prompt: 3 chains of 7 ids need 2 rows of 16 on
    their own, one shared block of 4 + 3 * 3 = 13 ids needs 1; the rescore stage scores the
    shared rows as the objective does."""
    from rollout_fakes import FakeSource, FakeWeights, Outcome, task_data
    from test_rollout_trainer import Checked

    from dew_pipe import Trainer
    from dew_pipe.flow import StageFailed
    from dew_pipe.objectives.rl import RolloutScheduler

    width = 16
    objective = GRPOObjective(decoder(), seq_len=width - 1, behavior_importance=2.0)
    outcome = lambda s: Outcome(prompt=5, sampled=2, reward=float(s.sample))  # noqa: E731
    weights = FakeWeights()
    source = FakeSource(weights, outcome)
    records = []
    scheduler = RolloutScheduler(
        objective, source, weights, width=width, rows=1, groups=3, log=records.append,
        share_prompts=True,
    )  # fmt: skip
    rollout = Checked(scheduler, objective)
    trainer = Trainer(
        objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout, progress=False
    )
    try:
        state = trainer.fit(scheduler.tasks(task_data(4, 1)), steps=3, log_every=3)
    finally:
        scheduler.close()
        source.close()
    assert int(state.updates) == 3
    for _, batch, expected in rollout.seen:
        assert batch["input_ids"].shape == (1, width)
        assert (batch["text_prefix_segments"] > 0).sum() == 3 * 3
        mask = batch["response_mask"] == 1
        assert mask.sum() == 3 * 2
        np.testing.assert_allclose(
            batch["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-6
        )
    assert all(r.admitted_groups == 1 for r in records)

    plain = FakeSource(weights, outcome)
    unshared = RolloutScheduler(objective, plain, weights, width=width, rows=1, groups=3)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=unshared)
    try:
        with pytest.raises(StageFailed, match="need 2 rows of width 16 on their own"):
            trainer.fit(unshared.tasks(task_data(4, 1)), steps=1)
    finally:
        unshared.close()
        plain.close()
