"""recipes.chain on a tiny decoder: three stages whose objectives their datasets pick, each
from the previous stage's final weights with a fresh optimizer; DPO's and GRPO's references
are those weights; an existing stage directory restores instead of training; previews; and
the settings a chain refuses."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import optax
import pytest

from dew_pipe import models
from dew_pipe.data import ChatMessages, Loading, PreferencePairs, Prompts
from dew_pipe.recipes import chain
from dew_pipe.recipes.chain import Recipe, Stage
from dew_pipe.tasks.chat_arithmetic import ChatArithmetic

STEPS = {"sft": 4, "dpo": 3, "grpo": 3}
LOAD = Loading(workers=0, threads=1, read_buffer=2)


@pytest.fixture(scope="module")
def chat():
    return ChatArithmetic(seed=0, digits=1, sizes=(40, 16, 16), test_size=8)


@pytest.fixture(scope="module")
def model(chat):
    return models.build("causal_transformer", vocab_size=chat.task.vocab_size, emb_features=16,
                        num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16)  # fmt: skip


def _stages(chat, folder, sample=0, grpo_beta=0.05):
    tokenizer = chat.tokenizer()
    conversations = chat.write_conversations(folder / "conversations.jsonl")
    preview = {"sample": sample, "max_new_tokens": chat.max_new_tokens} if sample else {}
    return (
        Stage("sft", ChatMessages(tokenizer, conversations, seq_len=15, loading=LOAD),
              steps=STEPS["sft"], **preview),
        Stage("dpo", PreferencePairs(records=chat.pair_records(), seq_len=chat.pair_width,
                                     loading=LOAD), steps=STEPS["dpo"], beta=0.1, **preview),
        Stage("grpo", Prompts(records=chat.prompt_records(), tokenizer=tokenizer,
                              max_prompt_len=chat.max_prompt_len), steps=STEPS["grpo"],
              reward=chat.reward, groups=2, max_new_tokens=chat.max_new_tokens, beta=grpo_beta,
              sample=sample),
    )  # fmt: skip


def _host(tree):
    """Host copies of a tree's arrays (keys as their raw data), before donation reuses them."""

    def copy(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        return np.array(a, copy=True)

    return jax.tree.map(copy, tree)


def _recipe(model, stages, output, **options):
    return Recipe(model, optax.adam(1e-2), key=jax.random.key(0), output=output, batch=4,
                  stages=stages, log_every=1, progress=False, **options)  # fmt: skip


@pytest.fixture(scope="module")
def trained(chat, model, tmp_path_factory):
    """One run of the three-stage chain: (output, stages, host copies of the states)."""
    output = tmp_path_factory.mktemp("chain")
    stages = _stages(chat, output, sample=2)
    records: dict[str, list[dict]] = {}
    seen: list[tuple[str, dict]] = []

    def on_stage(stage, state):  # the final state, before the next stage starts
        seen.append((stage.name, _host(state.params)))

    recipe = _recipe(model, stages, output, on_stage=on_stage,
                     log=lambda name, record: records.setdefault(name, []).append(record))  # fmt: skip
    states = [_host(s) for s in recipe.run()]
    return output, stages, states, records, seen


def test_each_dataset_type_picks_its_objective(trained):
    output, stages, states, records, _ = trained
    assert [s.objective for s in stages] == ["sft", "dpo", "grpo"]
    assert {ChatMessages: "sft", PreferencePairs: "dpo", Prompts: "grpo"} == chain.OBJECTIVES
    assert "rewards/accuracies" not in records["sft"][0] and records["sft"][0]["tokens"] > 0
    assert "rewards/accuracies" in records["dpo"][0]  # DPOObjective's metrics
    assert "rollout/reward/mean" in records["grpo"][0]  # SampledRollout ran
    assert states[0].ema is None  # SFT keeps no average
    for stage in stages:
        marker = json.loads((output / stage.name / "stage.json").read_text())
        assert marker["objective"] == stage.objective
        lines = (output / stage.name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, stage.steps + 1))


def test_each_stage_starts_fresh_from_the_previous_final_params(trained):
    _, stages, states, records, seen = trained
    for state, stage in zip(states, stages, strict=True):
        assert int(state.step) == stage.steps  # a step counter per stage, from 0
        counts = [int(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
            state.opt_state)[0] if "count" in jax.tree_util.keystr(path)]  # fmt: skip
        assert counts and set(counts) == {stage.steps}  # a fresh optimizer state per stage
    for before, after in ((states[0], states[1]), (states[1], states[2])):  # the references
        for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.ema), strict=True):
            np.testing.assert_array_equal(a, b)
    # DPO's first step scores the policy against a reference it equals: loss log 2, no margin
    first = records["dpo"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert [name for name, _ in seen] == ["sft", "dpo", "grpo"]
    for (_, params), state in zip(seen, states, strict=True):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_an_existing_stage_directory_restores_instead_of_training(trained, chat, model):
    output, stages, states, _, _ = trained
    records = []
    again = _recipe(model, stages, output, log=lambda name, record: records.append(name))
    restored = [_host(s) for s in again.run()]
    assert records == []  # no stage trained a step
    for before, after in zip(states, restored, strict=True):
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)


def test_stages_write_previews_of_their_own_prompts(trained, chat):
    output, stages, _, _, _ = trained
    tokenizer = chat.tokenizer()
    for stage in stages:
        lines = [
            json.loads(x) for x in (output / stage.name / "samples.jsonl").read_text().splitlines()
        ]
        assert len(lines) == 2
        for line in lines:
            assert len(line["completion"]) == chat.max_new_tokens  # no stop id in a chain
            assert line["text"] == " ".join(map(str, line["completion"]))
            assert tokenizer.decode(line["prompt"]).endswith("=")  # a prompt, no answer
    grpo = [json.loads(x) for x in (output / "grpo" / "samples.jsonl").read_text().splitlines()]
    truths = [r["ground_truth"] for r in chat.prompt_records(2)]
    for line, truth in zip(grpo, truths, strict=True):
        assert line["reward"] == chat.reward(chat.data_source, line["text"], truth, "")


def test_a_directory_of_another_stage_is_refused(trained, chat, model, tmp_path):
    output, stages, _, _, _ = trained
    swapped = (Stage("dpo", stages[0].data, steps=2), Stage("sft", stages[1].data, steps=2))
    with pytest.raises(ValueError, match="holds .* not stage 'dpo' \\(index 0, sft\\)"):
        _recipe(model, swapped, output).run()


def test_grpo_with_beta_zero_keeps_no_reference(chat, model, tmp_path):
    sft, _, grpo = _stages(chat, tmp_path, grpo_beta=0.0)
    (state,) = _recipe(model, (Stage("grpo", grpo.data, steps=1, reward=chat.reward, groups=2,
                                     max_new_tokens=chat.max_new_tokens),), tmp_path).run()  # fmt: skip
    assert state.ema is None and int(state.step) == 1


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda d: Stage("sft", d["sft"], steps=2, beta=0.1), ValueError,
         "stage 'sft': beta is for DPO and GRPO stages"),
        (lambda d: Stage("dpo", d["dpo"], steps=2, reward=len), ValueError,
         "stage 'dpo': reward is for GRPO stages"),
        (lambda d: Stage("dpo", d["dpo"], steps=2, beta=0.0), ValueError,
         "stage 'dpo': beta is 0.0; expected"),
        (lambda d: Stage("grpo", d["grpo"], steps=2, max_new_tokens=2), ValueError,
         "stage 'grpo': reward is None; a GRPO stage needs reward"),
        (lambda d: Stage("grpo", d["grpo"], steps=2, reward=len), ValueError,
         "stage 'grpo': max_new_tokens is missing"),
        (lambda d: Stage("grpo", d["grpo"], steps=2, reward=len, max_new_tokens=2, groups=1),
         ValueError, "stage 'grpo': groups is 1; expected an int >= 2"),
        (lambda d: Stage("sft", d["sft"], steps=2, sample=2), ValueError,
         "sample=2 needs max_new_tokens"),
        (lambda d: Stage("../up", d["sft"], steps=2), ValueError, "stage name '../up'"),
        (lambda d: Stage("sft", d["sft"], steps=0), ValueError, "stage 'sft': steps is 0"),
        (lambda d: Stage("x", {"text": []}, steps=2), TypeError,
         "stage 'x': data is a dict; expected ChatMessages"),
    ],
)  # fmt: skip
def test_stage_settings_are_checked(trained, make, error, match):
    _, stages, _, _, _ = trained
    data = {stage.name: stage.data for stage in stages}
    with pytest.raises(error, match=match):
        make(data)


def test_recipe_settings_are_checked(trained, model, tmp_path):
    _, stages, _, _, _ = trained
    with pytest.raises(ValueError, match="two stages are named 'sft'"):
        _recipe(model, (stages[0], stages[0]), tmp_path)
    with pytest.raises(ValueError, match="stages is \\(\\); expected a non-empty tuple"):
        _recipe(model, (), tmp_path)
    with pytest.raises(TypeError, match="stages holds a str"):
        _recipe(model, ("sft",), tmp_path)
    with pytest.raises(ValueError, match="batch is 0"):
        Recipe(model, optax.adam(1e-3), key=jax.random.key(0), output=tmp_path, batch=0,
               stages=stages)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # nothing was written for a refused recipe
