"""Records SGLang's completions wire format from SGLang's own serving code (SGLang cannot run here).

SGLang's wheels need CUDA, so no SGLang server runs on these machines. Its OpenAI layer is
plain Python, though, and SGLang unit-tests it on CPU by mocking the GPU modules
(test/registered/openai_server/basic/test_return_token_ids.py) and handing
``OpenAIServingCompletion`` a mocked ``TokenizerManager``
(test/registered/openai_server/basic/test_serving_completions.py). This script does the
same with sglang 0.5.23 from PyPI and records, for the request bodies dew_pipe's
``OpenAICompletion(provider="sglang")`` sends:

* ``requests``: each body validated by SGLang's ``CompletionRequest``
  (python/sglang/srt/entrypoints/openai/protocol.py), the fields it did not declare, and the
  ``GenerateReqInput`` its ``_convert_to_internal_request`` hands the engine (input ids,
  sampling params, log-prob settings, whether prompt ids come back);
* ``responses``: the JSON answers its ``_build_completion_response`` builds from engine
  outputs shaped as ``TokenizerManager`` returns them (``output_ids``; ``meta_info`` with
  ``output_token_logprobs`` as ``(logprob, id, text)`` triples, ``finish_reason`` as
  ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``,
  ``weight_version``), serialized as its non-streaming handler returns them
  (``model_dump()``).

tests/test_sglang_wire.py checks dew_pipe's requests and its parsing against this fixture.
Run it in an isolated environment (dew_pipe never imports SGLang)::

    python3 -m venv /tmp/sgl-env
    /tmp/sgl-env/bin/pip install --no-deps sglang==0.5.23
    /tmp/sgl-env/bin/pip install torch pydantic openai==2.8.0 msgspec fastapi orjson numpy \
        psutil pybase64 requests pillow pyzmq tqdm ipython aiohttp dill pyyaml packaging
    /tmp/sgl-env/bin/python tests/parity/record_sglang_wire.py tests/parity/fixtures/sglang_wire.json

(torch is only imported, by sglang's utilities; PyPI's default build is several GB.)

The request bodies below are written out literally (not imported from dew_pipe) so the
fixture records what SGLang makes of exactly these bytes; the test asserts that dew_pipe
still sends them.
"""

import json
import sys
import types
from importlib import metadata
from unittest.mock import Mock


# serving_completions.py runs as SGLang ships it. Two of its imports pull SGLang's GPU stack
# (scheduler, kernels) and are stood in for: ``serving_base.OpenAIServingBase``, whose
# request helpers answer as for a request without routing headers or LoRA, and
# ``io_struct.GenerateReqInput``, which records the fields the completions layer hands the
# engine. Everything the wire format depends on (protocol.py, utils.py's log-prob
# conversion, usage_processor.py, weight_versions.py) is SGLang's own module.
class _ServingBase:
    def __init__(self, tokenizer_manager, template_manager=None):
        self.tokenizer_manager, self.template_manager = tokenizer_manager, template_manager

    def extract_custom_labels(self, raw_request):
        return None

    def extract_routed_dp_rank_from_header(self, raw_request, body_value=None):
        return body_value

    def extract_routing_key(self, raw_request):
        return None

    def _resolve_lora_path(self, model, lora_path):
        return lora_path


class _GenerateReqInput:
    def __init__(self, **fields):
        self.fields = fields


def _stand_in(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


_stand_in("sglang.srt.entrypoints.openai.serving_base", OpenAIServingBase=_ServingBase)
_stand_in("sglang.srt.managers.io_struct", GenerateReqInput=_GenerateReqInput)

import sglang.srt.entrypoints.openai.serving_completions as serving_completions  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import CompletionRequest  # noqa: E402

# The server's published runtime config, read for one flag: cache reports are off by default.
serving_completions.get_serving = lambda: types.SimpleNamespace(enable_cache_report=False)
OpenAIServingCompletion = serving_completions.OpenAIServingCompletion

# What OpenAICompletion(provider="sglang").body(...) sends (tests/test_sglang_wire.py checks it).
REQUESTS = {
    "eos_and_temperature": {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.6,
        "logprobs": 0, "seed": 11, "return_token_ids": True, "stop_token_ids": [2],
    },
    "no_eos": {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 1.0,
        "logprobs": 0, "seed": 12, "return_token_ids": True, "ignore_eos": True,
    },
    "two_rows": {
        "model": "m", "prompt": [[4, 5], [6]], "max_tokens": 2, "temperature": 1.0,
        "logprobs": 0, "return_token_ids": True, "stop_token_ids": [2, 3],
    },
}  # fmt: skip

# Engine outputs as TokenizerManager hands them to the completions layer. Their finish
# reasons are what sglang/srt/managers/schedule_batch.py's FINISH_MATCHED_TOKEN, FINISH_LENGTH
# and FINISH_ABORT serialize to (to_json); a draw stopped by a stop id keeps that id in
# output_ids (Req._check_token_based_finish sets finished_len = matched position + 1).
ENGINE_OUTPUTS = {
    "stopped_on_eos": (
        "eos_and_temperature",
        [{
            "text": "+9", "output_ids": [14, 12, 2], "prompt_token_ids": [5, 6, 7],
            "meta_info": {
                "id": "cmpl-1", "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": 2},
                "output_token_logprobs": [[-0.25, 14, "+"], [-1.5, 12, "9"], [-0.125, 2, "</s>"]],
                "output_top_logprobs": [None, None, None],
                "weight_version": "7",
            },
        }],
    ),
    "hit_the_budget": (
        "no_eos",
        [{
            "text": "123", "output_ids": [5, 6, 7], "prompt_token_ids": [5, 6, 7],
            "meta_info": {
                "id": "cmpl-2", "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 3},
                "output_token_logprobs": [[-2.0, 5, "1"], [-0.5, 6, "2"], [-3.25, 7, "3"]],
                "output_top_logprobs": [None, None, None],
                "weight_version": "default",
            },
        }],
    ),
    "aborted": (
        "no_eos",
        [{
            "text": "", "output_ids": [], "prompt_token_ids": [5, 6, 7],
            "meta_info": {
                "id": "cmpl-3", "prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0,
                "finish_reason": {"type": "abort", "message": "Abort before prefill",
                                  "status_code": None, "err_type": None},
                "output_token_logprobs": [], "output_top_logprobs": [],
                "weight_version": "default",
            },
        }],
    ),
}  # fmt: skip


def _serving() -> OpenAIServingCompletion:
    """The completions layer over a mocked TokenizerManager (as SGLang's unit tests build it)."""
    manager = Mock()
    manager.tokenizer = Mock()
    manager.tokenizer.decode.return_value = "decoded"
    manager.tokenizer.bos_token_id = 1
    manager.model_config = Mock(is_multimodal=False)
    manager.server_args = Mock(enable_cache_report=False)
    templates = Mock(chat_template_name=None, jinja_template_content_format=None)
    templates.completion_template_name = None
    return OpenAIServingCompletion(manager, templates)


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def main(out: str) -> None:
    serving = _serving()
    record = {
        "source": {
            "package": "sglang",
            "version": metadata.version("sglang"),
            "modules": [
                "sglang/srt/entrypoints/openai/protocol.py (CompletionRequest, CompletionResponse)",
                "sglang/srt/entrypoints/openai/serving_completions.py "
                "(_convert_to_internal_request, _build_completion_response)",
            ],
            "method": "serving_completions.py as shipped, over a mocked TokenizerManager (as "
            "SGLang's unit tests build it); serving_base and io_struct stood in (see the script)",
        },
        "declared_request_fields": sorted(CompletionRequest.model_fields),
        "requests": {},
        "responses": {},
    }
    for name, body in REQUESTS.items():
        request = CompletionRequest.model_validate(body)
        internal, _ = serving._convert_to_internal_request(request)
        fields = internal.fields
        record["requests"][name] = {
            "body": body,
            "undeclared": sorted(set(body) - set(CompletionRequest.model_fields)),
            "engine_input": _plain({
                key: fields.get(key)
                for key in ("input_ids", "text", "sampling_params", "return_logprob",
                            "top_logprobs_num", "logprob_start_len", "return_prompt_token_ids")
            }),
        }  # fmt: skip
    for name, (request_name, outputs) in ENGINE_OUTPUTS.items():
        request = CompletionRequest.model_validate(REQUESTS[request_name])
        response = serving._build_completion_response(request, outputs, 1_800_000_000)
        record["responses"][name] = {
            "request": request_name,
            "engine_output": outputs,
            "answer": _plain(response.model_dump()),
        }
    with open(out, "w") as file:
        json.dump(record, file, indent=1, sort_keys=True)
        file.write("\n")
    print(f"wrote {out}: {len(record['requests'])} requests, {len(record['responses'])} answers")


if __name__ == "__main__":
    main(sys.argv[1])
