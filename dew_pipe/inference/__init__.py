"""Inference: compiled generation with the decoder's cache, text policies, rollout servers.

- ``decoding.py``, ``generation.py``: one compiled decode step over the decoder's cache, and
  `generate`, which samples a whole batch with it.
- ``text.py``: `TextGeneration`, a policy that turns token contexts into `Generation` records.
- ``sampled_rollout.py``: `SampledRollout`, the trainer's synchronous GRPO rollout hook.
- ``prompt_source.py``: `PromptSource`, sessions sampled from a rollout server and scored.
- ``environment_source.py``: `EnvironmentSource`, multi-turn tool episodes whose turns are
  drawn from a rollout server.
- ``reward_function.py``: `RewardFunction`, the per-completion reward both of them call.
- ``flow_sampling.py``, ``flow_rollout.py``: `sample_trajectory` (a rectified-flow model's SDE
  paths with their transition densities, as a `FlowTrajectory`) and `FlowRollout`, the
  trainer's Flow-GRPO rollout hook.
- ``servers/``: the `RolloutServer` interface and its backends (the continuous-batching
  `Server`, `NativeRolloutServer`, `ProcessRolloutServer`; over HTTP `OpenAIRolloutServer`
  and `VLLMGenerateServer`) and the weight pushes into engines (`SafetensorsReload`,
  `NCCLPush`, `Publication`); see its docstring.

Names resolve lazily (module ``__getattr__``), so importing the package stays cheap. Add a
name by adding one line to ``_LAZY``.

Example:
    >>> from dew_pipe.inference import TextGeneration   # doctest: +SKIP
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

# name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    # rollout servers (servers/: the interface, the continuous-batching engine, backends)
    "Draw": ("dew_pipe.inference.servers.interface", "Draw"),
    "RolloutServer": ("dew_pipe.inference.servers.interface", "RolloutServer"),
    "NativeRolloutServer": ("dew_pipe.inference.servers.native", "NativeRolloutServer"),
    "ProcessRolloutServer": ("dew_pipe.inference.servers.process", "ProcessRolloutServer"),
    "Server": ("dew_pipe.inference.servers.engine", "Server"),
    "ServerCounters": ("dew_pipe.inference.servers.engine_records", "ServerCounters"),
    "ServeTask": ("dew_pipe.inference.servers.engine_setup", "ServeTask"),
    "served_precision": ("dew_pipe.inference.servers.engine_setup", "served_precision"),
    # engines behind HTTP (servers/: OpenAI completions, vLLM's token route, weight pushes)
    "OpenAICompletion": ("dew_pipe.inference.servers.openai_completions", "OpenAICompletion"),
    "OpenAIRolloutServer": (
        "dew_pipe.inference.servers.openai_completions",
        "OpenAIRolloutServer",
    ),
    "Completion": ("dew_pipe.inference.servers.openai_completions", "Completion"),
    "VLLMGenerateServer": ("dew_pipe.inference.servers.vllm_generate", "VLLMGenerateServer"),
    "SafetensorsReload": ("dew_pipe.inference.servers.publication", "SafetensorsReload"),
    "NCCLPush": ("dew_pipe.inference.servers.nccl_push", "NCCLPush"),
    "Publication": ("dew_pipe.inference.servers.publication", "Publication"),
    "EngineError": ("dew_pipe.inference.servers.http_json", "EngineError"),
    "JSONClient": ("dew_pipe.inference.servers.http_json", "JSONClient"),
    "PromptSource": ("dew_pipe.inference.prompt_source", "PromptSource"),
    "EnvironmentSource": ("dew_pipe.inference.environment_source", "EnvironmentSource"),
    "DecodeStep": ("dew_pipe.inference.decoding", "DecodeStep"),
    "decode_step": ("dew_pipe.inference.decoding", "decode_step"),
    "Generated": ("dew_pipe.inference.generation", "Generated"),
    "generate": ("dew_pipe.inference.generation", "generate"),
    "Generation": ("dew_pipe.inference.text", "Generation"),
    "TextGeneration": ("dew_pipe.inference.text", "TextGeneration"),
    "SampledRollout": ("dew_pipe.inference.sampled_rollout", "SampledRollout"),
    "RewardFunction": ("dew_pipe.inference.reward_function", "RewardFunction"),
    "FlowRollout": ("dew_pipe.inference.flow_rollout", "FlowRollout"),
    "FlowTrajectory": ("dew_pipe.inference.flow_sampling", "FlowTrajectory"),
    "sample_trajectory": ("dew_pipe.inference.flow_sampling", "sample_trajectory"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
