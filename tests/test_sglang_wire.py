"""OpenAICompletion(provider="sglang") against SGLang's own completions layer (it cannot run here).

The fixture, tests/parity/fixtures/sglang_wire.json, was recorded by
tests/parity/record_sglang_wire.py from sglang 0.5.23's serving_completions.py and
protocol.py (PyPI wheel), run as shipped over a mocked tokenizer manager the way SGLang's own
unit tests build it. It holds what SGLang makes of the request bodies dew_pipe sends (the
fields its ``CompletionRequest`` declares, the controls its engine then receives) and the
JSON answers SGLang builds from engine outputs: a draw stopped on EOS, one that hit its
budget, and an aborted one. Here: dew_pipe still sends exactly those bodies, SGLang's engine
reads them as the spec says (the sampled ids' log-probabilities only, prompt ids back, no
filter, EOS as stop ids unless there is none), and SGLang's answers parse into the draws
they describe (the engine's ids, their log-probabilities) or are refused (an abort).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dew_pipe.inference import EngineError, OpenAICompletion
from dew_pipe.inference.servers.openai_completions import draw_of
from dew_pipe.sampling import Sampling

FIXTURE = json.loads((Path(__file__).parent / "parity/fixtures/sglang_wire.json").read_text())
SGLANG = OpenAICompletion("m", "http://127.0.0.1:1/v1", provider="sglang")

# How dew_pipe makes each recorded body: prompt, budget, sampling, seed.
BODIES = {
    "eos_and_temperature": ([5, 6, 7], 4, Sampling(eos_id=2, temperature=0.6), 11),
    "no_eos": ([5, 6, 7], 3, Sampling(), 12),
    "two_rows": ([[4, 5], [6]], 2, Sampling(eos_id=(2, 3)), None),
}


def test_the_fixture_names_its_source():
    assert FIXTURE["source"]["package"] == "sglang" and FIXTURE["source"]["version"] == "0.5.23"
    assert set(FIXTURE["requests"]) == set(BODIES)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_dew_pipe_sends_the_recorded_bodies(name):
    prompt, budget, sampling, seed = BODIES[name]
    assert (
        SGLANG.body(prompt, max_tokens=budget, sampling=sampling, seed=seed)
        == (FIXTURE["requests"][name]["body"])
    )


@pytest.mark.parametrize("name", sorted(BODIES))
def test_sglang_declares_every_field_and_reads_the_controls(name):
    recorded = FIXTURE["requests"][name]
    body, engine = recorded["body"], recorded["engine_input"]
    _, budget, sampling, seed = BODIES[name]
    assert recorded["undeclared"] == []
    assert set(body) <= set(FIXTURE["declared_request_fields"])
    assert engine["input_ids"] == body["prompt"] and engine["text"] is None  # ids, no text
    assert engine["return_logprob"] is True and engine["top_logprobs_num"] == 0
    assert engine["logprob_start_len"] == -1  # no prompt log-probabilities
    assert engine["return_prompt_token_ids"] is True
    params = engine["sampling_params"]
    assert params["temperature"] == sampling.temperature and params["max_new_tokens"] == budget
    assert (params["top_k"], params["top_p"], params["min_p"]) == (-1, 1.0, 0.0)  # no filter
    assert params["sampling_seed"] == seed
    if sampling.eos_ids:
        assert params["stop_token_ids"] == list(sampling.eos_ids)
        assert params["ignore_eos"] is False  # SGLang's ignore_eos would disable stop ids too
    else:
        assert params["stop_token_ids"] is None and params["ignore_eos"] is True


def _answer(name):
    recorded = FIXTURE["responses"][name]
    request = FIXTURE["requests"][recorded["request"]]["body"]
    return recorded["answer"], recorded["engine_output"][0], request


@pytest.mark.parametrize("name", ["stopped_on_eos", "hit_the_budget"])
def test_sglang_answers_parse_into_the_draws_they_describe(name):
    answer, output, request = _answer(name)
    (choice,) = SGLANG.parse(answer).choices
    logprobs = [entry[0] for entry in output["meta_info"]["output_token_logprobs"]]
    assert choice.tokens.tolist() == output["output_ids"]
    np.testing.assert_array_equal(choice.log_probs, np.float32(logprobs))
    assert choice.finish_reason == output["meta_info"]["finish_reason"]["type"]
    eos = request.get("stop_token_ids")
    sampling = Sampling(eos_id=tuple(eos)) if eos else Sampling()
    draw = draw_of(
        "http://sglang/v1/completions", np.asarray(request["prompt"]), choice.tokens,
        choice.log_probs, choice.finish_reason, budget=request["max_tokens"],
        sampling=sampling, version=3, submitted=3, seed=request["seed"],
    )  # fmt: skip
    assert draw.sampled_ids.tolist() == output["output_ids"]
    assert draw.stopped == (name == "stopped_on_eos")  # the EOS id is the last sampled id
    assert draw.log_probs is None and draw.version == 3  # no raw likelihood from SGLang


def test_an_aborted_sglang_draw_is_refused():
    answer, _, request = _answer("aborted")
    (choice,) = SGLANG.parse(answer).choices
    assert choice.finish_reason == "abort" and choice.tokens.size == 0
    with pytest.raises(EngineError, match="finished with 'abort'"):
        draw_of(
            "http://sglang/v1/completions", np.asarray(request["prompt"]), choice.tokens,
            choice.log_probs, choice.finish_reason, budget=request["max_tokens"],
            sampling=Sampling(), version=0, submitted=0, seed=0,
        )  # fmt: skip


def test_sglang_reports_its_weight_version_beside_the_choices():
    answer, output, _ = _answer("stopped_on_eos")
    assert answer["metadata"] == {"weight_version": output["meta_info"]["weight_version"]}
    assert "token_ids" in answer["choices"][0] and "prompt_token_ids" in answer["choices"][0]
