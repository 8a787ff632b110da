"""Readers that turn a training batch into :class:`~dew_pipe.objectives.rl.sessions.Task` s.

A rollout scheduler trains on batches of task rows; its ``tasks`` reader says how a batch
names its tasks:

* :func:`task_ids` reads integer ``task_id`` rows: each task is known by its id alone and
  the source (an environment, a harness) looks up everything else.
* :func:`prompt_tasks` reads the prompt rows of :class:`~dew_pipe.data.Prompts`: each task
  carries its prompt ids and reward metadata, as a ``PromptSource`` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dew_pipe.data.text_columns import decode_text_column
from dew_pipe.objectives.rl.sessions import Task

__all__ = ["prompt_tasks", "task_ids"]

_METADATA = ("data_source", "ground_truth", "extra_info")


def _ids(batch: Mapping[str, Any], rows: int | None) -> np.ndarray:
    ids = np.asarray(batch["task_id"])
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise ValueError(
            f"batch field 'task_id' is {ids.dtype} with shape {ids.shape}; expected integer "
            "ids of shape [B]"
        )
    if rows is not None and ids.shape[0] != rows:
        raise ValueError(f"batch field 'task_id' has {ids.shape[0]} rows; expected {rows}")
    return ids


def task_ids(batch: Mapping[str, Any]) -> list[Task]:
    """One id-only task per row of ``batch["task_id"]`` (``[B]`` integers).

    Raises:
      ValueError: no ``task_id`` field, or one that is not a 1-D integer array.

    Example:
      >>> task_ids({"task_id": np.array([4, 9])})
      [Task(id=4, data=None), Task(id=9, data=None)]
    """
    if not isinstance(batch, Mapping) or "task_id" not in batch:
        fields = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"batch has no field 'task_id' (fields: {fields}); expected [B] ids")
    return [Task(int(i)) for i in _ids(batch, None)]


def prompt_tasks(batch: Mapping[str, Any]) -> list[Task]:
    """One task per prompt row, carrying its prompt ids and reward metadata.

    Reads ``prompt`` ``[B, P]`` (left padded) and ``prompt_length`` ``[B]``, and, when
    present, ``data_source``, ``ground_truth``, ``extra_info`` (``[B, M]`` UTF-8 bytes) and
    ``task_id`` ``[B]``; without ``task_id`` a row's index in the batch is its id.

    Returns:
      ``Task(id, {"prompt": int32 ids, "data_source": str, "ground_truth": str,
      "extra_info": str})`` per row.

    Raises:
      ValueError: a missing or misshapen field, or a row without prompt ids.

    Example:
      >>> rows = {"prompt": np.array([[0, 5, 6]]), "prompt_length": np.array([2]),
      ...         "ground_truth": np.array([[100, 111, 103]])}
      >>> task = prompt_tasks(rows)[0]
      >>> task.data["prompt"].tolist(), task.data["ground_truth"]
      ([5, 6], 'dog')
    """
    for name in ("prompt", "prompt_length"):
        if not isinstance(batch, Mapping) or name not in batch:
            raise ValueError(f"batch has no field {name!r}; prompt_tasks reads Prompts rows")
    prompt = np.asarray(batch["prompt"])
    lengths = np.asarray(batch["prompt_length"])
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu":
        raise ValueError(
            f"batch field 'prompt' is {prompt.dtype} {prompt.shape}; expected [B, P] ids"
        )
    rows, width = prompt.shape
    if lengths.shape != (rows,) or lengths.dtype.kind not in "iu":
        raise ValueError(
            f"batch field 'prompt_length' is {lengths.dtype} {lengths.shape}; expected [{rows}] ints"
        )
    if rows and (lengths.min() < 1 or lengths.max() > width):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > width))[0])
        raise ValueError(
            f"batch field 'prompt_length' is {int(lengths[bad])} in row {bad}; expected a "
            f"length in [1, {width}] (a task needs prompt ids)"
        )
    ids = _ids(batch, rows) if "task_id" in batch else np.arange(rows)
    text = {
        name: decode_text_column(batch[name], field=name) if name in batch else [""] * rows
        for name in _METADATA
    }
    return [
        Task(
            int(ids[b]),
            {
                "prompt": prompt[b, width - int(lengths[b]) :].astype(np.int32),
                **{name: text[name][b] for name in _METADATA},
            },
        )
        for b in range(rows)
    ]
