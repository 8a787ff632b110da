"""Inference: compiled generation with the decoder's cache, text policies, rollout servers.

Names resolve lazily (module ``__getattr__``), so importing the package stays cheap. Add a
name by adding one line to ``_LAZY``.

Example:
    >>> from dew_pipe.inference import TextGeneration   # doctest: +SKIP
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

# name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    # rollout servers (the RolloutServer interface, the native continuous-batching server)
    "Draw": ("dew_pipe.inference.rollout", "Draw"),
    "RolloutServer": ("dew_pipe.inference.rollout", "RolloutServer"),
    "NativeRolloutServer": ("dew_pipe.inference.native", "NativeRolloutServer"),
    "ProcessRolloutServer": ("dew_pipe.inference.process_server", "ProcessRolloutServer"),
    "Server": ("dew_pipe.inference.server", "Server"),
    "ServerCounters": ("dew_pipe.inference.server_records", "ServerCounters"),
    "ServeTask": ("dew_pipe.inference.server_setup", "ServeTask"),
    "PromptSource": ("dew_pipe.inference.prompt_source", "PromptSource"),
    "DecodeStep": ("dew_pipe.inference.decoding", "DecodeStep"),
    "decode_step": ("dew_pipe.inference.decoding", "decode_step"),
    "Generated": ("dew_pipe.inference.generation", "Generated"),
    "generate": ("dew_pipe.inference.generation", "generate"),
    "Generation": ("dew_pipe.inference.text", "Generation"),
    "TextGeneration": ("dew_pipe.inference.text", "TextGeneration"),
    "SampledRollout": ("dew_pipe.inference.sampled_rollout", "SampledRollout"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
