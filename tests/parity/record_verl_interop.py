"""Record verl 0.9.1's own agent-loop rows and its GSM8K tool-agent parquet layout.

Runs only in the reference environment (``benchmarks/reference_env.sh`` builds it as
``.reference-venv/``; verl 0.9.1 from PyPI, installed ``--no-deps``, with the modules its
agent loop imports). dew_pipe never imports verl or torch. From the repository root:

    .reference-venv/bin/python tests/parity/record_verl_interop.py

It writes into ``tests/parity/fixtures/verl_interop/``:

* ``gsm8k_tool_agent_loop.parquet``: four rows in the layout of verl's
  ``examples/data_preprocess/gsm8k_tool_agent_loop.py`` (read at volcengine/verl commit
  030a519ae51a9916b9debd99c6def5f4d83f991f; the example is not part of the wheel, so its
  ``process_fn`` is restated below field for field), written by ``datasets`` as that script
  does. The GSM8K data itself cannot be downloaded here, so the four problems are written
  in its style (question, worked answer ending in ``#### N``).
* ``agent_loop_outputs.json``: three ``AgentLoopOutput`` objects verl built, each as
  ``row`` (``model_dump()``, arrays as lists) and ``as_dict`` (verl's own tensor mapping,
  each tensor as dtype, shape and values):

  - ``tool_loop_0`` and ``tool_loop_1``: two samples (``rollout.n = 2``) of verl's real
    ``ToolAgentLoop`` on the first parquet row's prompt, with the project's ChatML test
    tokenizer (``tests/parity/fixtures/chat_tokenizer``), the ``hermes`` tool parser and a
    ``FunctionTool``. A scripted engine stands in for vLLM: it answers each turn with fixed
    text (a tool call, then a final answer), seeded log-probabilities, routed experts for
    every position it read ([context + draw - 1, 2 layers, top-2]) and the weight version
    (3 on the first turn, 4 on the second, as after a weight push between turns). The
    reward is verl's own ``gsm8k.compute_score`` of the decoded response (one sample is
    right, one wrong).
  - ``video_turn``: one turn whose ``multi_modal_data`` holds a video and whose
    ``mm_processor_output`` comes from verl's ``AgentLoopBase.build_sglang_video_payload``
    (tensors written as lists).

``tests/test_verl_interop.py`` reads these files: it imports the rows with
``dew_pipe.objectives.rl.verl.from_verl``, writes them back out unchanged, checks that
``pack`` lays them out as ``as_dict`` does, and reads the parquet with ``Prompts``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
)
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import gsm8k
from verl.workers.rollout.replica import TokenOutput

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "parity" / "fixtures"
OUT = FIXTURES / "verl_interop"
TOKENIZER = FIXTURES / "chat_tokenizer"

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
PROBLEMS = [
    (
        "Tom has 8 boxes with 9 apples in each. How many apples does he have?",
        "Tom has 8 * 9 = <<8*9=72>>72 apples.\n#### 72",
    ),
    (
        "A train travels 60 km each hour for 3 hours, then 45 km more. How far does it go?",
        "In 3 hours it goes 60 * 3 = <<60*3=180>>180 km.\nIn all 180 + 45 = <<180+45=225>>225 km."
        "\n#### 225",
    ),
    (
        "Mia buys 4 pens at $3 each and a bike for $1,007. What does she pay?",
        "The pens cost 4 * 3 = <<4*3=12>>12 dollars.\nShe pays 12 + 1007 = <<12+1007=1019>>1019."
        "\n#### 1,019",
    ),
    (
        "There are 1,200 seats and 350 are empty. How many are taken?",
        "1,200 - 350 = <<1200-350=850>>850 seats are taken.\n#### 850",
    ),
]


def extract_solution(answer: str) -> str:
    """The number after ``####``, commas removed (verl's ``extract_solution``)."""
    return answer.split("#### ")[1].replace(",", "")


def gsm8k_row(split: str, index: int, question_raw: str, answer_raw: str) -> dict[str, Any]:
    """One row exactly as verl's ``gsm8k_tool_agent_loop.py`` ``process_fn`` builds it."""
    question = question_raw + " " + INSTRUCTION
    solution = extract_solution(answer_raw)
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer_raw,
            "question": question_raw,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }


def calc_gsm8k_reward(answer: str) -> str:
    """The tool the agent calls: whether its answer parses (verl's Gsm8kTool, as a function)."""
    return f"Current parsed answer={answer}"


TOOL_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "string",
                        "description": "The model's answer to the question",
                    }
                },
                "required": ["answer"],
            },
        },
    }
)


class ScriptedEngine:
    """Stands in for verl's server manager: fixed text per turn, seeded numbers."""

    def __init__(self, tokenizer: Any, turns: list[str], seed: int) -> None:
        self.tokenizer, self.turns, self.seed, self.turn = tokenizer, turns, seed, 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], **_: Any) -> TokenOutput:
        ids = self.tokenizer.encode(self.turns[self.turn], add_special_tokens=False)
        rng = np.random.default_rng([self.seed, self.turn])
        log_probs = np.log(rng.uniform(0.05, 1.0, len(ids))).astype(np.float32)
        # vLLM reports routing for every id the model read: the context and the draw but its last
        routed = rng.integers(0, 8, (len(prompt_ids) + len(ids) - 1, 2, 2)).astype(np.int32)
        step = 3 + self.turn
        self.turn += 1
        return TokenOutput(
            token_ids=ids,
            log_probs=log_probs.tolist(),
            routed_experts=routed,
            stop_reason="completed",
            # what verl's LLMServerClient.generate adds from the server's global_steps
            extra_fields={"global_steps": step, "min_global_steps": step, "max_global_steps": step},
        )


def tool_loop(tokenizer: Any, row: dict[str, Any], turns: list[str], seed: int) -> AgentLoopOutput:
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 512,
                    "response_length": 256,
                    "full_determinism": True,
                    "multi_turn": {
                        "max_user_turns": 4,
                        "max_assistant_turns": 4,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 256,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                        "tool_config_path": None,
                    },
                },
                "model": {"path": str(TOKENIZER), "tokenizer_path": str(TOKENIZER)},
            },
            "data": {"tool_config_path": None, "apply_chat_template_kwargs": {}},
        }
    )
    tool = FunctionTool(name="calc_gsm8k_reward", fn=calc_gsm8k_reward, tool_schema=TOOL_SCHEMA)

    async def run() -> AgentLoopOutput:  # the loop binds the running event loop when built
        loop = ToolAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=ScriptedEngine(tokenizer, turns, seed),
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data),
            tools=ToolListWrap([tool]),
        )
        return await loop.run(
            {},
            raw_prompt=row["prompt"],
            tools_kwargs=row["extra_info"]["tools_kwargs"],
            extra_info=row["extra_info"],
        )

    output = asyncio.run(run())
    text = tokenizer.decode(output.response_ids)
    output.reward_score = gsm8k.compute_score(text, row["reward_model"]["ground_truth"])
    return output


def video_turn() -> AgentLoopOutput:
    frames = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4) / 96
    videos = [(frames, {"fps": 2.0, "total_num_frames": 2})]
    mm_inputs = {
        "pixel_values_videos": torch.linspace(-1, 1, 24).reshape(4, 6),
        "video_grid_thw": torch.tensor([[1, 2, 2]]),
    }
    rng = np.random.default_rng(7)
    response = [513, 9, 27, 4]
    return AgentLoopOutput(
        prompt_ids=[3, 846, 203, 851, 851, 851, 851, 4, 203, 3, 760, 203],
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=np.log(rng.uniform(0.1, 1, len(response))).astype(np.float32).tolist(),
        multi_modal_data={"videos": videos},
        reward_score=0.0,
        num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields={"min_global_steps": 5, "max_global_steps": 5},
        mm_processor_kwargs={"fps": 2.0},
        mm_processor_output=AgentLoopBase.build_sglang_video_payload(videos, mm_inputs),
    )


def plain(value: Any) -> Any:
    """Tensors and arrays as lists, tuples as lists: JSON values."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, AgentLoopMetrics):
        return value.model_dump()
    return value


def tensors(mapping: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in mapping.items():
        if isinstance(value, torch.Tensor):
            out[name] = {
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "values": value.tolist(),
            }
        else:
            out[name] = plain(value)
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [gsm8k_row("train", i, q, a) for i, (q, a) in enumerate(PROBLEMS)]
    datasets.Dataset.from_list(rows).to_parquet(str(OUT / "gsm8k_tool_agent_loop.parquet"))

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "%s"}}</tool_call>'
    samples = [  # rollout.n = 2 on the first problem: one right answer, one wrong
        ["8 boxes of 9 apples. " + call % "72" + "<|im_end|>", "So #### 72<|im_end|>"],
        ["Maybe 8 + 9. " + call % "17" + "<|im_end|>", "So #### 17<|im_end|>"],
    ]
    outputs = {}
    for k, turns in enumerate(samples):
        outputs[f"tool_loop_{k}"] = tool_loop(tokenizer, rows[0], turns, seed=k)
    outputs["video_turn"] = video_turn()
    record = {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "rollout_n": 2,
        "eos_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
        # the schemas the tool loop rendered into its prompt, as verl dumps them
        "tool_schemas": [TOOL_SCHEMA.model_dump(exclude_unset=True, exclude_none=True)],
        "outputs": {
            name: {"row": plain(out.model_dump()), "as_dict": tensors(out.as_dict())}
            for name, out in outputs.items()
        },
    }
    path = OUT / "agent_loop_outputs.json"
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    scores = {name: out.reward_score for name, out in outputs.items()}
    print(f"wrote {path} and the parquet (verl {verl.__version__}); rewards {scores}")


if __name__ == "__main__":
    main()
