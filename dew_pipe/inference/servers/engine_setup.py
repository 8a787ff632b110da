"""Construction helpers of `dew_pipe.inference.Server`: the task it serves and its options.

`ServeTask` is the plain description `Server.from_task` reads: a model, its variables and
the sampling controls. Any object with ``model`` and ``variables`` attributes will do (a
`TextGeneration`, a `Pretrained`); the helpers here check the options and work out the
served model and precision before the server thread starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_pipe._validate import check_int
from dew_pipe.sampling import Sampling

__all__ = ["ServeTask", "served_precision"]


@dataclasses.dataclass(frozen=True)
class ServeTask:
    """What a `Server` serves: a decoder, its variables and how ids are drawn.

    Args:
        model: a decoder with the `CausalTransformer` call forms.
        variables: its ``{"params": ...}``.
        sampling: the controls every draw uses.

    Example:
        >>> from dew_pipe.sampling import Sampling
        >>> ServeTask(model=None, variables={"params": {}}, sampling=Sampling(eos_id=2)).sampling.eos_ids
        (2,)
    """

    model: Any
    variables: Any
    sampling: Sampling = dataclasses.field(default_factory=Sampling)


def variables_of(value: Any, name: str) -> Mapping[str, Any]:
    """``value`` itself when it is ``{"params": ...}``, else its ``params`` attribute."""
    variables = getattr(value, "params", value)  # a TrainState carries its variables
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError(
            f"{name} is {type(value).__name__}; expected a variables mapping {{'params': ...}} "
            "(or an object whose .params is one)"
        )
    return variables


def check_options(model: Any, sampling: Any, **options: Any) -> dict[str, int]:
    """Checks the integer options of a server against ``model``; returns them as ints."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size") or not hasattr(config, "max_seq_len"):
        raise TypeError(
            f"model is {type(model).__name__}; expected a decoder whose config has vocab_size "
            "and max_seq_len"
        )
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling is {sampling!r}; expected a dew_pipe.sampling.Sampling")
    sampling.check_vocab(int(config.vocab_size))
    out = {
        name: check_int(name, options[name], minimum=1)
        for name in ("slots", "capacity", "queue", "steps_per_call", "join_rows")
    }
    for name in ("version", "seed", "pad_id"):
        out[name] = check_int(name, options[name], minimum=0)
    if out["capacity"] > config.max_seq_len:
        raise ValueError(
            f"capacity is {out['capacity']}; expected at most the model's "
            f"max_seq_len={config.max_seq_len}"
        )
    if out["join_rows"] > out["slots"]:
        raise ValueError(f"join_rows is {out['join_rows']}; expected at most slots={out['slots']}")
    if out["pad_id"] >= config.vocab_size:
        raise ValueError(f"pad_id is {out['pad_id']}; expected an id below {config.vocab_size}")
    return out


def served_model(model: Any, dtype: Any, platform: str = "cpu") -> tuple[Any, Any]:
    """The model to serve and the dtype its floating parameters are kept in.

    With ``dtype`` None the parameters follow the model's compute dtype and the model is
    served as it is. ``"auto"`` takes `served_precision` for ``platform``. Otherwise a
    decoder whose dataclass ``config`` has ``dtype``/``param_dtype`` is cloned with
    ``param_dtype=dtype``, and computes in ``dtype`` too except on a CPU, where a narrower
    ``dtype`` keeps float32 activations and key/value cache: the matmuls still read the
    weights as stored (`dew_pipe.models.transformer.matmul_dtype`), which is where the
    bytes are, while XLA's CPU backend would emulate 16-bit elementwise ops and scatters
    by converting whole arrays to float32 and back.

    Example:
        >>> from dew_pipe import models
        >>> model = models.build("causal_transformer", vocab_size=8, emb_features=8,
        ...                      num_layers=1, num_heads=2, mlp_features=16, max_seq_len=8)
        >>> served, dtype = served_model(model, "bfloat16", "cpu")
        >>> str(dtype), str(served.config.param_dtype), str(served.config.dtype)
        ('bfloat16', 'bfloat16', 'float32')
    """
    config = model.config
    if dtype is None:
        current = getattr(config, "dtype", None)
        return model, None if current is None else np.dtype(current)
    if isinstance(dtype, str) and dtype == "auto":
        dtype = served_precision(platform)
    try:
        dtype = np.dtype(dtype)
    except TypeError as error:
        raise TypeError(f"dtype is {dtype!r}; expected a floating dtype or 'auto'") from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype is {dtype}; expected a floating dtype (float32, bfloat16)")
    fields = (
        {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else ()
    )
    if {"dtype", "param_dtype"} <= set(fields) and hasattr(model, "clone"):
        compute = dtype
        if platform == "cpu" and dtype.itemsize < 4:
            compute = np.dtype(np.float32)
        model = model.clone(config=dataclasses.replace(config, dtype=compute, param_dtype=dtype))
    return model, dtype


# CPU flags under which XLA's bfloat16 matmul kernels run natively (not emulated).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The flags of this machine's first CPU in ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def served_precision(platform: str = "cpu", flags: frozenset[str] | None = None) -> np.dtype:
    """The precision to serve weights in on ``platform``: what ``dtype="auto"`` picks.

    bfloat16 on accelerators, and on CPUs whose flags include AVX512-BF16 or AMX-BF16,
    where XLA's bfloat16 matmuls read half the bytes at full speed; float32 on other CPUs
    (AVX2 only), where bfloat16 arithmetic is emulated.

    Args:
        platform: the serving device's platform (``jax.Device.platform``).
        flags: the CPU flags; None reads them (`cpu_flags`).

    Example:
        >>> str(served_precision("cpu", frozenset({"avx2", "fma"})))
        'float32'
        >>> str(served_precision("cpu", frozenset({"avx512f", "avx512_bf16"})))
        'bfloat16'
        >>> str(served_precision("gpu"))
        'bfloat16'
    """
    if platform != "cpu":
        return np.dtype(jnp.bfloat16)
    flags = cpu_flags() if flags is None else flags
    native = any(flag in flags for flag in _BF16_FLAGS)
    return np.dtype(jnp.bfloat16 if native else np.float32)


def prompt_buckets(buckets: Sequence[int] | None, capacity: int) -> tuple[int, ...]:
    """Prefill widths: the given increasing widths (the last at most ``capacity``, which is
    appended when missing), or powers of two from 16 below ``capacity`` and ``capacity``."""
    if buckets is None:
        sizes, size = [], 16
        while size < capacity:
            sizes.append(size)
            size *= 2
        return (*sizes, capacity)
    values = tuple(buckets)
    ok = bool(values) and all(
        isinstance(b, int | np.integer) and not isinstance(b, bool) and b > 0 for b in values
    )
    if not ok or list(values) != sorted(set(values)) or values[-1] > capacity:
        raise ValueError(
            f"buckets is {buckets!r}; expected increasing positive ints up to capacity={capacity}"
        )
    values = tuple(int(b) for b in values)
    return values if values[-1] == capacity else (*values, capacity)


def bucket(n: int, limit: int) -> int:
    """The smallest power of two ``>= n``, capped at ``limit``."""
    size = 1
    while size < n:
        size *= 2
    return min(size, limit)


def from_task_arguments(
    task: Any, sampling: Sampling | None, options: dict[str, Any]
) -> tuple[Any, Any, Sampling, dict[str, Any]]:
    """``(model, variables, sampling, options)`` for `Server` from a task object."""
    if not hasattr(task, "model") or not hasattr(task, "variables"):
        raise TypeError(
            f"task is {type(task).__name__}; expected an object with model and variables "
            "(a ServeTask, a TextGeneration or a Pretrained)"
        )
    if sampling is None:
        sampling = getattr(task, "sampling", None) or Sampling()
    options = dict(options)
    # A TextGeneration's recording and padding choices carry over unless given here.
    if "record_support" not in options and isinstance(getattr(task, "record_support", None), bool):
        options["record_support"] = task.record_support
    pad_id = getattr(task, "pad_id", None)
    if "pad_id" not in options and isinstance(pad_id, int) and not isinstance(pad_id, bool):
        options["pad_id"] = pad_id
    return task.model, task.variables, sampling, options


SEED_LIMIT = 2**32  # a draw's seed becomes a uint32 on the device


def request_seed(seed: Any) -> int | None:
    """``seed`` as an int in ``[0, 2**32)``, or None (ValueError for anything else, a bool too)."""
    if seed is None:
        return None
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not 0 <= seed < SEED_LIMIT
    ):
        raise ValueError(f"seed is {seed!r}; expected None or an int in [0, 2**32)")
    return int(seed)


def prompt_array(prompt_ids: Any) -> np.ndarray:
    """``prompt_ids`` as int32 (TypeError unless they are integers)."""
    array = np.asarray(prompt_ids)
    if array.size == 0 and array.dtype != np.bool_:
        return array.astype(np.int32)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"prompt_ids has dtype {array.dtype}; expected integer token ids")
    return array.astype(np.int32)


def batch_requests(
    prompts: Sequence[Any], seeds: Sequence[int | None] | None
) -> tuple[list[np.ndarray], list[int | None]]:
    """``submit_many``'s prompts as int32 arrays and its seeds checked, each error naming
    its index (``prompts[i]``, ``seeds[i]``); ``seeds=None`` gives None for every prompt."""
    arrays = []
    for i, ids in enumerate(prompts):
        try:
            arrays.append(prompt_array(ids))
        except TypeError as error:
            raise TypeError(f"prompts[{i}]: {error}") from None
    if seeds is None:
        return arrays, [None] * len(arrays)
    seeds = list(seeds)
    if len(seeds) != len(arrays):
        raise ValueError(
            f"seeds has {len(seeds)} entries for {len(arrays)} prompts; expected one "
            "per prompt (or seeds=None)"
        )
    checked: list[int | None] = []
    for i, seed in enumerate(seeds):
        try:
            checked.append(request_seed(seed))
        except ValueError as error:
            raise ValueError(f"seeds[{i}]: {error}") from None
    return arrays, checked


def prompt_problem(prompt: np.ndarray, budget: int, vocab: int, capacity: int) -> str | None:
    """Why a prompt cannot be served with ``budget`` new ids, or None when it can."""
    if prompt.ndim != 1 or prompt.size == 0:
        return f"prompt_ids has shape {prompt.shape}; expected a nonempty 1-D id list"
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= vocab:
        return f"prompt_ids holds ids in [{low}, {high}]; expected ids in [0, {vocab}) (vocab_size)"
    need = prompt.size + budget - 1
    if need > capacity:
        return (
            f"a prompt of {prompt.size} ids with max_new_tokens={budget} needs {need} cache "
            f"positions; the server's capacity is {capacity} (a prompt may have at most "
            f"capacity - max_new_tokens + 1 = {capacity - budget + 1} ids)"
        )
    return None


Signature = tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]


def signature(variables: Any) -> Signature:
    """The tree structure and the (shape, dtype) of each leaf."""
    leaves, tree = jax.tree.flatten(variables)
    return tree, [
        (tuple(np.shape(x)), np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype))
        for x in leaves
    ]


def check_tree(served: Signature, variables: Any) -> None:
    """Refuses ``variables`` unless they can be copied over the served tree.

    Same structure and shapes; a floating leaf for each floating served leaf (it is cast),
    the exact dtype for the others.
    """
    tree, leaves = signature(variables)
    if tree != served[0]:
        raise ValueError(
            f"variables has tree structure {tree}; expected the served structure {served[0]}"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(variables)]
    for path, (shape, dtype), (want, kind) in zip(paths, leaves, served[1], strict=True):
        if shape != want:
            raise ValueError(f"variables{path} has shape {shape}; expected {want}")
        floating = jnp.issubdtype(kind, jnp.floating)
        if floating and not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"variables{path} has dtype {dtype}; expected a floating dtype")
        if not floating and dtype != kind:
            raise TypeError(f"variables{path} has dtype {dtype}; expected {kind}")


def served_copy(variables: Any, dtype: Any, device: Any) -> Any:
    """A fresh copy of ``variables`` committed to ``device``, floating leaves in ``dtype``
    (None keeps each leaf's dtype). Fresh, because the server later donates it."""

    def leaf(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        target = dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jnp.array(x, dtype=target, copy=True)

    return jax.device_put(jax.tree.map(leaf, variables), device)
