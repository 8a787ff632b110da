"""Checks of the batches :class:`~dew_pipe.objectives.rl.grpo.GRPOObjective` reads.

Two levels. ``check_*_layout`` look only at field names and shapes, so they also run
while the loss is traced (a wrong batch fails before anything compiles, under ``jit``
too). ``validate_*`` read the values on the host, and are what the Trainer calls before
a batch reaches a compiled function. Every error names the field, the offending value
or shape (with its row and column) and what was expected.

Packed rows: ``[N, W]`` columns with ``W = seq_len + 1`` (see
:mod:`dew_pipe.objectives.rl.packing` for their meaning). Prompt batches (validation
only): ``prompt [B, P]`` left padded with ``P <= seq_len + 1`` and ``prompt_length [B]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dew_pipe.objectives.rl.policy import PolicyOptions

__all__ = [
    "check_packed_layout",
    "check_prompt_layout",
    "validate_packed",
    "validate_prompts",
]

_CHAINS = ("input_ids", "text_segment_ids", "text_positions")
_POLICY = ("response_mask", "behavior_log_probs", "advantages")
_ALIGNED = (
    *_CHAINS,
    *_POLICY,
    "old_log_probs",
    "versions",
    "session_index",
    "call_index",
    "session_weights",
    "text_prefix_segments",
)
_INTEGER = (
    "input_ids",
    "text_segment_ids",
    "text_positions",
    "response_mask",
    "session_index",
    "text_prefix_segments",
)
_FLOAT = ("behavior_log_probs", "old_log_probs", "advantages")


def _missing(batch: Mapping[str, Any], name: str, why: str) -> ValueError:
    return ValueError(f"batch has no field {name!r}; {why} (fields are {sorted(batch)})")


def check_packed_layout(
    batch: Mapping[str, Any],
    seq_len: int,
    options: PolicyOptions,
    *,
    require_policy: bool = True,
    proximal_in_step: bool = False,
) -> None:
    """Names and shapes of a packed batch; runs under tracing.

    Args:
        batch: the packed columns.
        seq_len: the objective's ``seq_len``; rows are ``seq_len + 1`` wide.
        options: the policy options (they decide which optional fields are required).
        require_policy: also require the fields the loss reads (not only the chains).
        proximal_in_step: the loss takes ``old_log_probs`` from its own forward pass, so
            the batch needs none (a TIS cap has its proximal likelihoods).

    Raises:
        ValueError: a missing field or a shape other than ``[N, seq_len + 1]``.
    """
    if "input_ids" not in batch and "prompt" in batch:
        raise ValueError(
            "batch holds prompts ('prompt', 'prompt_length') but GRPOObjective trains packed "
            "rows; pass a rollout (SampledRollout) to the Trainer to sample and pack them"
        )
    required = _CHAINS + (_POLICY if require_policy else ())
    for name in required:
        if name not in batch:
            raise _missing(batch, name, "GRPOObjective trains packed rows (see pack)")
    width = seq_len + 1
    shape = tuple(np.shape(batch["input_ids"]))
    if len(shape) != 2 or shape[1] != width:
        raise ValueError(
            f"batch field 'input_ids' has shape {shape}; GRPOObjective(seq_len={seq_len}) "
            f"expects packed rows [N, {width}]"
        )
    for name in _ALIGNED:
        if name in batch and tuple(np.shape(batch[name])) != shape:
            raise ValueError(
                f"batch field {name!r} has shape {tuple(np.shape(batch[name]))}; expected "
                f"it aligned with input_ids, {shape}"
            )
    if ("support_ids" in batch) != ("support_columns" in batch):
        present = "support_ids" if "support_ids" in batch else "support_columns"
        raise ValueError(f"batch has {present!r} without its partner; support needs both columns")
    if "support_ids" in batch:
        ids, columns = np.shape(batch["support_ids"]), np.shape(batch["support_columns"])
        if len(ids) != 2 or ids[0] != shape[0] or ids != columns:
            raise ValueError(
                f"batch fields 'support_ids' {tuple(ids)} and 'support_columns' "
                f"{tuple(columns)}; expected both [{shape[0]}, support_capacity]"
            )
    if not require_policy:
        return
    if options.aggregation == "session-mean" and "session_index" not in batch:
        raise _missing(batch, "session_index", "aggregation='session-mean' groups tokens by it")
    if options.truncation_cap is not None and not proximal_in_step and "old_log_probs" not in batch:
        raise _missing(
            batch,
            "old_log_probs",
            f"behavior_importance={options.truncation_cap} (a TIS cap) weights old over "
            "behavior; without recorded old log-probs the ratio already is current over "
            "behavior and the cap would correct twice",
        )


def _first(where: np.ndarray) -> tuple[int, int]:
    row, column = np.argwhere(where)[0]
    return int(row), int(column)


def _check_dtypes(batch: Mapping[str, Any]) -> None:
    for name in _INTEGER:
        if name in batch and np.asarray(batch[name]).dtype.kind not in "iu":
            raise ValueError(
                f"batch field {name!r} has dtype {np.asarray(batch[name]).dtype}; expected integers"
            )
    for name in _FLOAT:
        if name in batch and np.asarray(batch[name]).dtype.kind != "f":
            raise ValueError(
                f"batch field {name!r} has dtype {np.asarray(batch[name]).dtype}; expected floats"
            )


def _check_ids(name: str, ids: np.ndarray, vocab: int | None) -> None:
    if ids.size and (ids.min() < 0 or (vocab is not None and ids.max() >= vocab)):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(
            f"batch field {name!r} holds token id {int(bad)}; expected ids in [0, {vocab or 'vocab_size'})"
        )


def _check_chains(batch: Mapping[str, Any], width: int) -> np.ndarray:
    """Segment ids, positions and the response mask; returns the mask as bool."""
    segments = np.asarray(batch["text_segment_ids"])
    if segments.size and (segments.min() < 0 or segments.max() >= width):
        bad = segments.min() if segments.min() < 0 else segments.max()
        raise ValueError(
            f"batch field 'text_segment_ids' holds {int(bad)}; expected chain numbers in [0, {width})"
        )
    positions = np.asarray(batch["text_positions"])
    if positions.size and positions.min() < 0:
        raise ValueError(
            f"batch field 'text_positions' holds {int(positions.min())}; expected >= 0"
        )
    mask = np.asarray(batch["response_mask"])
    if not np.isin(mask, (0, 1)).all():
        r, c = _first(~np.isin(mask, (0, 1)))
        raise ValueError(
            f"batch field 'response_mask' holds {mask[r, c]} at row {r}, column {c}; expected 0 or 1"
        )
    mask = mask.astype(bool)
    if "text_prefix_segments" in batch:
        _check_prefix_segments(np.asarray(batch["text_prefix_segments"]), segments)
    prefix = np.zeros_like(mask)
    prefix[:, 1:] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    if (mask & ~prefix).any():
        r, c = _first(mask & ~prefix)
        raise ValueError(
            f"batch field 'response_mask' marks row {r}, column {c} as sampled, but that id "
            f"{'is padding' if segments[r, c] == 0 else 'starts its chain'}; a sampled id "
            "needs a prefix in its own chain"
        )
    return mask


def _check_prefix_segments(shared: np.ndarray, segments: np.ndarray) -> None:
    """Each id that reads a shared prompt names a segment of its row that ends before the
    id's own segment starts, and is not padding; every id of a segment names the same."""
    if not shared.any():
        return
    width = segments.shape[1]
    if shared.min() < 0 or shared.max() >= width:
        r, c = _first((shared < 0) | (shared >= width))
        raise ValueError(
            f"batch field 'text_prefix_segments' holds {shared[r, c]} at row {r}, column {c}; "
            f"expected 0 or the segment of a shared prompt, in [0, {width})"
        )
    on = shared > 0
    if (on & (segments == 0)).any():
        r, c = _first(on & (segments == 0))
        raise ValueError(
            f"batch field 'text_prefix_segments' is {shared[r, c]} at row {r}, column {c}, "
            "which is padding (text_segment_ids 0); expected 0 there"
        )
    if (on & (shared == segments)).any():
        r, c = _first(on & (shared == segments))
        raise ValueError(
            f"batch field 'text_prefix_segments' at row {r}, column {c} names the id's own "
            f"segment {shared[r, c]}; expected the segment of an earlier shared prompt"
        )
    columns = np.arange(width)
    for r in np.flatnonzero(on.any(axis=1)).tolist():
        row, named = segments[r], shared[r]
        last = np.full(width + 1, -1)  # last column of each segment in this row
        first = np.full(width + 1, width)
        np.maximum.at(last, row, columns)
        np.minimum.at(first, row, columns)
        bad = on[r] & ((last[named] < 0) | (last[named] >= first[row]))
        changed = (row > 0) & (named != named[first[row]])
        bad |= changed
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"batch field 'text_prefix_segments' is {named[c]} at row {r}, column {c}; "
                f"expected the segment of a prompt that ends before segment {row[c]} starts "
                "in the same row, the same for every id of that segment"
            )


def _check_likelihoods(
    batch: Mapping[str, Any], mask: np.ndarray, options: PolicyOptions, proximal_in_step: bool
) -> None:
    behavior = np.asarray(batch["behavior_log_probs"])
    if not np.isfinite(behavior[mask]).all():
        r, c = _first(mask & ~np.isfinite(behavior))
        raise ValueError(
            f"batch field 'behavior_log_probs' is {behavior[r, c]} at sampled row {r}, column "
            f"{c}; expected the engine's finite log-probability of every sampled id"
        )
    off = ~mask & (behavior != 0)
    if off.any():
        r, c = _first(off)
        raise ValueError(
            f"batch field 'behavior_log_probs' holds {behavior[r, c]} at row {r}, column {c}, "
            "where response_mask is 0; the likelihoods are misaligned with input_ids "
            "(expected 0 off the sampled ids)"
        )
    advantages = np.asarray(batch["advantages"])
    if not np.isfinite(advantages).all():
        r, c = _first(~np.isfinite(advantages))
        raise ValueError(
            f"batch field 'advantages' is {advantages[r, c]} at row {r}, column {c}; expected finite"
        )
    if proximal_in_step or "old_log_probs" not in batch:
        return  # in-step proximal likelihoods replace whatever the batch holds
    old = np.asarray(batch["old_log_probs"])
    if not np.isfinite(old[mask]).all():
        r, c = _first(mask & ~np.isfinite(old))
        raise ValueError(
            f"batch field 'old_log_probs' is {old[r, c]} at sampled row {r}, column {c}; "
            "expected a finite log-probability"
        )
    if options.truncation_cap is not None and mask.any() and (old[mask] == behavior[mask]).all():
        raise ValueError(
            f"behavior_importance={options.truncation_cap} (a TIS cap): 'old_log_probs' equals "
            "'behavior_log_probs' on every sampled id, so no raw or proximal likelihoods were "
            "recorded and the behavior ones stand in; the cap would correct twice (use a "
            "(low, high) band, or record or rescore old_log_probs)"
        )


def _check_support(batch: Mapping[str, Any], mask: np.ndarray, vocab: int | None) -> None:
    ids = np.asarray(batch["support_ids"])
    columns = np.asarray(batch["support_columns"])
    for name, array in (("support_ids", ids), ("support_columns", columns)):
        if array.dtype.kind not in "iu":
            raise ValueError(f"batch field {name!r} has dtype {array.dtype}; expected integers")
    width = mask.shape[1]
    if columns.size and (columns.min() < -1 or columns.max() >= width):
        bad = columns.min() if columns.min() < -1 else columns.max()
        raise ValueError(
            f"batch field 'support_columns' holds {int(bad)}; expected -1 or a column in [0, {width})"
        )
    used = columns >= 0
    rows = np.broadcast_to(np.arange(columns.shape[0])[:, None], columns.shape)
    off = used & ~mask[rows, np.maximum(columns, 0)]
    if off.any():
        r, k = _first(off)
        raise ValueError(
            f"batch field 'support_columns' points entry {k} of row {r} at column "
            f"{columns[r, k]}, which is not a sampled id (response_mask 0)"
        )
    _check_ids("support_ids", ids[used], vocab)


def validate_packed(
    batch: Mapping[str, Any],
    seq_len: int,
    options: PolicyOptions,
    vocab: int | None,
    *,
    proximal_in_step: bool = False,
) -> None:
    """Host-side check of a packed batch for training.

    Raises:
        ValueError: see :meth:`GRPOObjective.validate`.
    """
    check_packed_layout(batch, seq_len, options, proximal_in_step=proximal_in_step)
    _check_dtypes(batch)
    _check_ids("input_ids", np.asarray(batch["input_ids"]), vocab)
    mask = _check_chains(batch, seq_len + 1)
    _check_likelihoods(batch, mask, options, proximal_in_step)
    if options.aggregation == "session-mean":
        sessions = np.asarray(batch["session_index"])
        if mask.any() and sessions[mask].min() < 0:
            r, c = _first(mask & (sessions < 0))
            raise ValueError(
                f"batch field 'session_index' is {sessions[r, c]} at sampled row {r}, column {c}; "
                "expected the session's index (>= 0) on every sampled id"
            )
    if "support_ids" in batch:
        _check_support(batch, mask, vocab)


def check_prompt_layout(batch: Mapping[str, Any], seq_len: int) -> None:
    """Names and shapes of a prompt batch; runs under tracing.

    Raises:
        ValueError: a missing field, or prompts wider than ``seq_len + 1``.
    """
    for name in ("prompt", "prompt_length"):
        if name not in batch:
            raise _missing(batch, name, "GRPO validation scores prompt batches (see Prompts)")
    shape = tuple(np.shape(batch["prompt"]))
    if len(shape) != 2 or shape[1] > seq_len + 1:
        raise ValueError(
            f"batch field 'prompt' has shape {shape}; expected [B, P] with P <= seq_len + 1 = {seq_len + 1}"
        )
    if tuple(np.shape(batch["prompt_length"])) != shape[:1]:
        raise ValueError(
            f"batch field 'prompt_length' has shape {tuple(np.shape(batch['prompt_length']))}; "
            f"expected [{shape[0]}]"
        )


def validate_prompts(batch: Mapping[str, Any], seq_len: int, vocab: int | None) -> None:
    """Host-side check of a prompt batch for validation.

    Raises:
        ValueError: shapes, integer dtypes, lengths outside ``[0, P]``, ids outside the vocabulary.
    """
    check_prompt_layout(batch, seq_len)
    for name in ("prompt", "prompt_length"):
        if np.asarray(batch[name]).dtype.kind not in "iu":
            raise ValueError(
                f"batch field {name!r} has dtype {np.asarray(batch[name]).dtype}; expected integers"
            )
    prompt, lengths = np.asarray(batch["prompt"]), np.asarray(batch["prompt_length"])
    width = prompt.shape[1]
    if lengths.size and (lengths.min() < 0 or lengths.max() > width):
        bad = lengths.min() if lengths.min() < 0 else lengths.max()
        raise ValueError(
            f"batch field 'prompt_length' holds {int(bad)}; expected lengths in [0, {width}]"
        )
    real = np.arange(width)[None, :] >= (width - lengths)[:, None]
    _check_ids("prompt", prompt[real], vocab)
