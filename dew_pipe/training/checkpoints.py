"""Training checkpoints: a TrainState plus JSON run metadata, through orbax.

Layout under the run directory::

    checkpoints/<step>/state/   orbax StandardSave of the state's arrays
    checkpoints/<step>/meta/    JSON: data position, skipped batches, key implementation

The typed PRNG key is stored as its raw ``key_data`` (uint32) with the name of its
implementation in the metadata, so it comes back bit for bit.

Restoring tells two failures apart, and every message names the step's directory:

* :class:`CheckpointMismatchError`: the files read, but hold another setup's state (the
  stored arrays' paths, shapes or dtypes differ from this trainer's; another key
  implementation; another format). Only this one suggests the objective or optimizer changed.
* :class:`CheckpointError`: the step cannot be read at all (empty or garbage metadata, an
  empty step directory, missing or truncated array files). The message says whether an
  older complete checkpoint exists and how to resume from it: ``fit`` resumes from the
  newest step directory, so moving the broken one out of ``checkpoints/`` selects the
  older one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew_pipe.training.step import TrainState

__all__ = ["CheckpointError", "CheckpointMismatchError", "Checkpoints"]

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be restored: its files are missing, incomplete or corrupted."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's contents do not fit the trainer that tries to restore it."""


def _to_tree(state: TrainState) -> dict[str, Any]:
    tree = {
        "step": state.step,
        "updates": state.updates,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": jax.random.key_data(state.rng),
    }
    if state.ema is not None:  # orbax stores no None leaves
        tree["ema"] = state.ema
    return tree


Layout = dict[str, tuple[int, ...] | None]  # "params/params/w" -> shape (None: not recorded)

# orbax's tree metadata file inside an item directory: the tree's paths and array shapes.
_TREE_METADATA = "_METADATA"


def _layout(tree: Any) -> Layout:
    """The arrays of a tree by path and shape: what a checkpoint must hold to restore into it.

    Paths are spelled as in orbax's tree metadata (dict keys, sequence indices, named-tuple
    fields), and empty leaves (``None``) are dropped.
    """
    out: Layout = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        names = []
        for entry in path:
            for field in ("key", "idx", "name"):
                if hasattr(entry, field):
                    names.append(str(getattr(entry, field)))
                    break
        out["/".join(names)] = tuple(leaf.shape)
    return out


def _stored_layout(item: Path) -> Layout:
    """The layout a saved item holds, from its tree metadata file alone.

    Only that JSON file is read: no array data, and no tensorstore (whose reads, failing on
    a damaged checkpoint, print "Event loop is closed" tracebacks after the event loop orbax
    ran them on is gone).
    """
    entries = json.loads((item / _TREE_METADATA).read_text(encoding="utf-8"))["tree_metadata"]
    out: Layout = {}
    for entry in entries.values():
        value = entry["value_metadata"]
        if value.get("value_type") == "None":  # an empty leaf (optax's EmptyState)
            continue
        shape = value.get("write_shape")
        path = "/".join(str(key["key"]) for key in entry["key_metadata"])
        out[path] = None if shape is None else tuple(shape)
    return out


def _same_shape(stored: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    """Whether a stored ``write_shape`` is the wanted shape: equal, or one replica's slice.

    On several devices orbax writes a replicated array replica-parallel: each of its r
    replicas writes 1/r of the first axis that r divides, and ``write_shape`` is that
    slice's shape (a replicated (2,) key on two devices records (1,)).

    Example:
        >>> _same_shape((1,), (2,)), _same_shape((4, 3), (8, 3)), _same_shape((8, 1), (8, 4))
        (True, True, False)
    """
    if stored == wanted:
        return True
    differ = [i for i, (s, w) in enumerate(zip(stored, wanted, strict=False)) if s != w]
    if len(stored) != len(wanted) or len(differ) != 1:
        return False
    axis = differ[0]
    part, whole = stored[axis], wanted[axis]
    if part < 1 or whole % part or whole // part < 2:
        return False
    replicas = whole // part
    return axis == next(i for i, n in enumerate(wanted) if n % replicas == 0)


def _differences(stored: Layout, wanted: Layout, limit: int = 3) -> str:
    """One line naming the first few arrays that differ between two layouts."""
    parts = []
    for path in sorted(set(stored) | set(wanted)):
        if path not in stored:
            parts.append(f"{path} is missing from the checkpoint")
        elif path not in wanted:
            parts.append(f"{path} is in the checkpoint but not in this trainer's state")
        elif stored[path] is not None and not _same_shape(stored[path], wanted[path]):
            parts.append(f"{path} has shape {stored[path]} there, {wanted[path]} here")
    more = f" (and {len(parts) - limit} more)" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


def _one_line(error: BaseException) -> str:
    """``Type: first line`` of an error, without tensorstore's long spec dump."""
    lines = str(error).strip().splitlines()
    text = re.split(r" \[tensorstore_spec", lines[0])[0] if lines else ""
    return f"{type(error).__name__}: {text}"


def _is_closed_loop_callback(unraisable: Any) -> bool:
    """Whether an unraisable error is a late tensorstore read reporting to a closed loop."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return any(frame.name == "call_soon_threadsafe" for frame in frames)


def _quiet_closed_loop_callbacks() -> None:
    """Keep orbax's failed reads from printing "Event loop is closed" tracebacks.

    When one array of a restore fails to read, orbax closes the event loop its reads ran
    on while tensorstore still has the others in flight; each of those, finishing, reports
    to the closed loop from tensorstore's thread, and Python prints it as an unraisable
    error at some later moment. The failure itself is already raised as a
    :class:`CheckpointError`, so this drops exactly that message (installed once, by the
    first restore of arrays) and passes every other unraisable error to the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_dew_pipe_quiet_closed_loop", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook._dew_pipe_quiet_closed_loop = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _is_unretrieved_orbax_read(record: logging.LogRecord) -> bool:
    """Whether an asyncio log record is a failed orbax array read nobody awaited."""
    if not str(record.msg).startswith("Task exception was never retrieved"):
        return False
    if not record.exc_info or record.exc_info[2] is None:
        return False
    frames = traceback.extract_tb(record.exc_info[2])
    return any(
        frame.name == "async_deserialize" and "orbax" in Path(frame.filename).parts
        for frame in frames
    )


class _QuietUnretrievedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports of orbax array reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_unretrieved_orbax_read(record)


def _quiet_unretrieved_reads() -> None:
    """Keep the other failed reads of a damaged checkpoint from logging tracebacks.

    The same race as :func:`_quiet_closed_loop_callbacks`, seen from asyncio: a read task
    that failed after orbax stopped waiting for it is collected with its exception never
    retrieved, and asyncio logs that with a traceback. The restore has already raised the
    first failure as a :class:`CheckpointError`; this drops exactly those reports (tasks
    whose traceback passes through orbax's ``async_deserialize``), installed once.
    """
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietUnretrievedReads) for f in logger.filters):
        logger.addFilter(_QuietUnretrievedReads())


class Checkpoints:
    """A bounded series of training checkpoints in ``directory``.

    Args:
        directory: where step folders go (created if missing).
        keep: how many recent checkpoints to keep, at least 1; older ones are deleted.
        asynchronous: write in a background thread. The state is copied off the
            device buffers before :meth:`save` returns, so the update may then donate
            them.

    Raises:
        NotADirectoryError: when ``directory``, or a folder above it, is a file.

    Example:
        >>> checkpoints = Checkpoints(run_dir / "checkpoints", keep=2)  # doctest: +SKIP
        >>> checkpoints.save(state, {"data": {"consumed": 3}})  # doctest: +SKIP
    """

    def __init__(self, directory: str | Path, *, keep: int, asynchronous: bool = True) -> None:
        self.directory = Path(directory)
        # Checked here: orbax would only fail in its background save thread, and that
        # thread then keeps the process from exiting.
        for path in (self.directory, *self.directory.parents):
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(
                    f"checkpoint directory {self.directory}: {path} is a file; expected a "
                    "directory (or nothing) there"
                )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=asynchronous
        )
        self._manager = ocp.CheckpointManager(
            self.directory.absolute(), options=options, item_names=("state", "meta")
        )

    def latest(self) -> int | None:
        """The newest saved step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        """Save ``state`` under its step, with JSON-serializable ``meta``."""
        step = int(state.step)
        meta = dict(meta, format=FORMAT, step=step, rng_impl=str(jax.random.key_impl(state.rng)))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_tree(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(
        self, template: TrainState, sharding: jax.sharding.Sharding, rng_impl: str
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restore the newest checkpoint into the structure of ``template``.

        Args:
            template: a state with the expected structure (arrays or
                ``jax.ShapeDtypeStruct``), e.g. from ``jax.eval_shape``.
            sharding: where every restored array is placed.
            rng_impl: the PRNG implementation name the key must have.

        Returns:
            The restored state and its metadata.

        Raises:
            FileNotFoundError: when there is no checkpoint.
            CheckpointMismatchError: when the checkpoint does not fit ``template``.
            CheckpointError: when the newest step cannot be read (naming its directory,
                and the older complete step to resume from, if there is one).
        """
        step = self.latest()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; expected a saved step")
        where = f"checkpoint {self.directory / str(step)} (step {step})"
        meta = self._meta(step)
        if meta.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"{where} has format {meta.get('format')!r}; expected {FORMAT}"
            )
        if meta.get("rng_impl") != rng_impl:
            raise CheckpointMismatchError(
                f"{where} holds a {meta.get('rng_impl')!r} key; "
                f"expected {rng_impl!r} (the trainer's key)"
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(_to_tree, template),
        )
        differences = _differences(self._layout(step), _layout(abstract))
        if differences:
            raise CheckpointMismatchError(
                f"{where} does not match this trainer's state (objective, optimizer, "
                f"ema_decay or accumulate changed?): {differences}"
            )
        _quiet_closed_loop_callbacks()  # before: late reports can come at any moment
        _quiet_unretrieved_reads()
        try:
            tree = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
            )["state"]
        except Exception as error:  # tensorstore's errors for bad bytes vary
            # The layout matched, so what failed is reading the arrays themselves.
            raise CheckpointError(
                self._unreadable(step, f"its arrays cannot be read ({_one_line(error)})")
            ) from error
        state = TrainState(
            step=tree["step"],
            updates=tree["updates"],
            params=tree["params"],
            opt_state=tree["opt_state"],
            ema=tree.get("ema"),
            rng=jax.random.wrap_key_data(tree["rng"], impl=rng_impl),
        )
        return state, meta

    def _meta(self, step: int) -> dict[str, Any]:
        """The step's JSON metadata, or :class:`CheckpointError` naming what is wrong."""
        try:
            meta = self._read_meta(step)
        except Exception as error:  # orbax: KeyError, JSON, OS errors...
            raise CheckpointError(
                self._unreadable(step, f"its metadata cannot be read ({_one_line(error)})")
            ) from error
        if not isinstance(meta, dict) or "format" not in meta:
            raise CheckpointError(
                self._unreadable(
                    step, f"its metadata is {type(meta).__name__} without a 'format' field"
                )
            )
        return meta

    def _read_meta(self, step: int) -> Any:
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return self._manager.restore(step, args=args)["meta"]

    def _layout(self, step: int) -> Layout:
        """The stored arrays' paths and shapes, or :class:`CheckpointError`."""
        try:
            return self._read_layout(step)
        except Exception as error:  # missing file, bad JSON, unexpected fields...
            raise CheckpointError(
                self._unreadable(step, f"its array metadata cannot be read ({_one_line(error)})")
            ) from error

    def _read_layout(self, step: int) -> Layout:
        return _stored_layout(self.directory / str(step) / "state")

    def _complete(self, step: int) -> bool:
        """Whether a step's metadata and array metadata both read (arrays are not read)."""
        try:
            meta = self._read_meta(step)
            return (
                isinstance(meta, dict)
                and meta.get("format") == FORMAT
                and bool(self._read_layout(step))
            )
        except Exception:  # any failure means "not complete"
            return False

    def _unreadable(self, step: int, what: str) -> str:
        """The message for a step that cannot be read: what failed and how to go on."""
        broken = self.directory / str(step)
        older = next(
            (
                s
                for s in sorted(self._manager.all_steps(), reverse=True)
                if s < step and self._complete(s)
            ),
            None,
        )
        if older is None:
            advice = (
                f"no older complete checkpoint exists in {self.directory}; remove {broken} to "
                "train from the start (or pass fit(state=...))"
            )
        else:
            advice = (
                f"an older complete checkpoint exists, step {older} ({self.directory / str(older)}): "
                f"move {broken} out of {self.directory} and fit resumes from step {older}"
            )
        return f"checkpoint {broken} (step {step}) cannot be restored: {what}; {advice}"

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        self._manager.close()
