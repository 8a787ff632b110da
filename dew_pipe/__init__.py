"""dew_pipe: post-training for JAX models on a streaming graph of typed stages.

The top-level names resolve lazily (module ``__getattr__``), so ``import dew_pipe`` does
not import JAX until one of them is used.

Importing the package sets the process's host memory policy (`dew_pipe.host_memory`):
glibc keeps freed memory for reuse, which spares XLA's CPU backend from faulting in its
scratch memory on every call. Import dew_pipe before running JAX computations for it to
take effect; ``DEW_PIPE_HOST_MEMORY=system`` keeps glibc's defaults. It also drops
transformers' "PyTorch was not found" notice (`dew_pipe._notices`): dew_pipe uses transformers
for tokenizers and templates only, so the notice says nothing to its users.

Example:
    >>> import dew_pipe
    >>> dew_pipe.Loading(workers=0, threads=1, read_buffer=2).read_buffer
    2
"""

from __future__ import annotations

from dew_pipe import _notices
from dew_pipe import host_memory as _host_memory
from dew_pipe._lazy import lazy_exports

_host_memory.apply_default()
_notices.silence_torch_notice()  # before anything imports transformers (dew_pipe/_notices.py)

# name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "Trainer": ("dew_pipe.training.trainer", "Trainer"),
    "TrainState": ("dew_pipe.training.step", "TrainState"),
    "Dataset": ("dew_pipe.data.dataset", "Dataset"),
    "Loading": ("dew_pipe.data.dataset", "Loading"),
    "LMObjective": ("dew_pipe.objectives.lm", "LMObjective"),
    "Sampling": ("dew_pipe.sampling", "Sampling"),
    "models": ("dew_pipe.models", None),
    # generative objectives: what they read, and the rectified-flow process presets
    "Field": ("dew_pipe.inputs", "Field"),
    "InputSpec": ("dew_pipe.inputs", "InputSpec"),
    "presets": ("dew_pipe.presets", None),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
