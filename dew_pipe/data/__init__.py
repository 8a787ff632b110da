"""Data sources for training: datasets, loading settings and loaders.

Names resolve lazily (module ``__getattr__``) so ``import dew_pipe.data`` stays cheap and
loaders that need heavy libraries load only when used. To export a new name, add it to
``_LAZY`` with the module that defines it.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "Dataset": "dew_pipe.data.dataset",
    "Loading": "dew_pipe.data.dataset",
    "Partition": "dew_pipe.data.dataset",
    "Prefetch": "dew_pipe.data.dataset",
    "ChatMessages": "dew_pipe.data.chat",
    "PreferencePairs": "dew_pipe.data.preference",
    "Role": "dew_pipe.data.chat",
    "Prompts": "dew_pipe.data.prompts",
    "PassRateCurriculum": "dew_pipe.data.curriculum",
    "decode_text_column": "dew_pipe.data.text_columns",
    "encode_text_column": "dew_pipe.data.text_columns",
    "build_tokenizer": "dew_pipe.data.tokenizer",
    "digit_preferences": "dew_pipe.data.synthetic",
    "generate_stories": "dew_pipe.data.stories",
    "story_tokenizer": "dew_pipe.data.stories",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
