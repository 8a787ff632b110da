"""A stage's ``sample`` previews: completions of its own prompts by its final policy.

Each kind of stage data has prompts of its own: the part of a conversation before its first
assistant token (``ChatMessages``), the prompt a preference pair shares before its first
completion token (``PreferencePairs``), a GRPO prompt (``Prompts``). :func:`write_samples`
takes the first ``stage.sample`` of them from the training data, draws ``max_new_tokens`` ids
for each at temperature 1 with no stop id (as the chain's GRPO rollouts draw), and writes one
JSON line per prompt::

    {"prompt": [ids], "completion": [ids], "text": "12 7 9", "reward": 1.0}

``text`` is the token-ID text a chain's reward reads; ``reward`` is there for GRPO stages
(with the prompt's ``data_source``, ``ground_truth`` and ``extra_info``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dew_pipe._files import write_atomic
from dew_pipe.data.chat import Role
from dew_pipe.data.text_columns import decode_text_column
from dew_pipe.inference.generation import generate
from dew_pipe.inference.reward_function import join_ids

__all__ = ["stage_prompts", "write_samples"]


def _first(flags: np.ndarray) -> int:
    hits = np.flatnonzero(flags)
    return int(hits[0]) if hits.size else len(flags)


def stage_prompts(stage: Any, count: int) -> tuple[list[np.ndarray], list[tuple[str, str, str]]]:
    """The first ``count`` prompts of a stage's training data and their reward metadata.

    Returns:
        ``(prompts, metadata)``: int32 id arrays, and per prompt ``(data_source,
        ground_truth, extra_info)`` (empty strings for SFT and DPO data).

    Raises:
        ValueError: a prompt with no ids (a conversation that starts with its answer, a
            pair whose mask marks its first id), naming it.
    """
    objective = stage.objective
    metadata: list[tuple[str, str, str]] = []
    if objective == "sft":
        rows = stage.data.tokenized("train")[:count]
        prompts = [ids[: _first(roles == Role.ASSISTANT)] for ids, roles in rows]
    elif objective == "dpo":
        pairs = stage.data.pairs("train")
        ids, mask = pairs["input_ids"][:count, 0], pairs["completion_mask"][:count, 0]
        prompts = [row[: _first(m != 0)] for row, m in zip(ids, mask, strict=True)]
    else:
        arrays = stage.data.arrays("train")
        width = arrays["prompt"].shape[1]
        prompts = [
            row[width - int(n) :]
            for row, n in zip(
                arrays["prompt"][:count], arrays["prompt_length"][:count], strict=True
            )
        ]
        columns = [
            decode_text_column(arrays[name][:count]) if name in arrays else [""] * len(prompts)
            for name in ("data_source", "ground_truth", "extra_info")
        ]
        metadata = list(zip(*columns, strict=True))
    for number, prompt in enumerate(prompts):
        if prompt.size == 0:
            raise ValueError(
                f"stage {stage.name!r}: training row {number} has no prompt ids before its "
                "answer; expected each row to start with a prompt"
            )
    return [np.asarray(p, np.int32) for p in prompts], metadata


def write_samples(path: Path, model: Any, variables: Any, stage: Any, key: jax.Array) -> Path:
    """Draw the stage's ``sample`` previews under ``variables`` and write them to ``path``.

    The file appears whole or not at all (:func:`dew_pipe._files.write_atomic`).

    Raises:
        ValueError: as :func:`stage_prompts`, or a prompt too long for the model's
            ``max_seq_len`` with ``max_new_tokens`` more.
    """
    prompts, metadata = stage_prompts(stage, stage.sample)
    width = max(p.size for p in prompts)
    batch = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        batch[row, width - prompt.size :] = prompt
    lengths = np.array([p.size for p in prompts], np.int32)
    out = jax.device_get(generate(model, variables, batch, lengths, stage.max_new_tokens, key))
    lines = []
    for row, prompt in enumerate(prompts):
        completion = [int(i) for i in out.ids[row, : int(out.lengths[row])]]
        line: dict[str, Any] = {
            "prompt": prompt.tolist(),
            "completion": completion,
            "text": join_ids(completion),
        }
        if metadata:
            source, truth, extra = metadata[row]
            line["reward"] = float(stage.reward(source, line["text"], truth, extra))
        lines.append(json.dumps(line))
    text = "\n".join(lines) + "\n"
    return write_atomic(path, lambda temporary: Path(temporary).write_text(text))
