"""The ``dew-pipe`` command: ``dew-pipe run FILE.py [--set key=value ...] [--run-dir DIR]``.

``run`` loads a pipeline file (ordinary Python), finds a module-level ``pipeline`` (a flow
``Pipeline``, or a function returning one) or a ``main`` function, calls the function with
its settings (keyword parameters; ``--set`` overrides them, converted by annotation), and
runs the result: a ``Pipeline`` with per-stage and per-queue progress, or any object with a
``run(context)`` method, which gets a ``RunContext``. It writes the run directory:
``config.json`` (the resolved settings), ``metrics.jsonl`` and ``run.json`` (file, outcome,
seconds). XLA's compiled programs are kept between runs (:mod:`dew_pipe.compile_cache`;
``--compile-cache DIR`` or ``off``).

Exit status: 0 done, 1 the run failed, 2 nothing to run (bad file, setting or wiring),
130 cancelled by Ctrl-C (a second Ctrl-C exits at once). Errors are one line on stderr;
``--debug`` adds the traceback.

``pack`` (``dew-pipe pack --input PATTERN --output DIR --width W ...``) runs the offline
Apache Beam pack job of :mod:`dew_pipe.beam` on recorded sessions; its output appears whole
or not at all. Exit status: 0 done, 1 bad data (the line names the session) or a failed job,
2 bad arguments.

``plot`` (curves of runs' ``metrics.jsonl``) and ``audit`` (``audit template``: is a chat
template append-only; ``audit sessions``: calls per chain of recorded sessions) live in
:mod:`dew_pipe.cli_tools`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from dew_pipe import cli_tools, compile_cache

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Exit(Exception):  # noqa: N818 - control flow to main()
    """Ends the command with a one-line message and an exit status."""

    def __init__(self, message: str, code: int, cause: BaseException | None = None):
        super().__init__(message)
        self.code = code
        self.cause = cause


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dew-pipe",
        description="Post-training for JAX models on a streaming graph of typed stages.",
        epilog="Run 'dew-pipe COMMAND --help' for a command's arguments and examples.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a pipeline file",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run a pipeline file. The file defines `pipeline` (a dew_pipe.flow.Pipeline, or a\n"
            "function returning one) or `main`. The function's keyword parameters are the\n"
            "settings; --set overrides them (int, float, bool, str, Path, enums, literals,\n"
            "optional values, comma-separated tuples/lists). A function may also return an\n"
            "object with run(context), which receives a dew_pipe.flow.RunContext."
        ),
        epilog=(
            "examples:\n"
            "  dew-pipe run pipelines/demo.py\n"
            "  dew-pipe run pipelines/demo.py --set batches=40 --set slow_ms=20\n"
            "  dew-pipe run pipelines/demo.py --dry-run   # show settings and graph\n"
            "exit status: 0 done, 1 failed, 2 nothing to run, 130 interrupted"
        ),
    )
    run.add_argument("file", type=Path, help="pipeline file (.py)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting (repeatable)",
    )
    run.add_argument(
        "--run-dir", type=Path, help="where to write config.json and metrics.jsonl "
        "(default: runs/<file stem>-<time>)",
    )  # fmt: skip
    run.add_argument(
        "--metrics-every", type=float, default=1.0, metavar="S",
        help="seconds between metrics records (default 1)",
    )  # fmt: skip
    run.add_argument(
        "--dry-run", action="store_true", help="print the settings and the graph, run nothing"
    )
    run.add_argument(
        "--compile-cache", metavar="DIR",
        help="keep XLA's compiled programs under DIR (a subdirectory per machine kind) so "
        "later runs skip those compiles; 'off' for none (default: $DEW_PIPE_COMPILE_CACHE, "
        "else ~/.cache/dew_pipe/xla; a JAX_COMPILATION_CACHE_DIR of your own wins)",
    )  # fmt: skip
    run.add_argument("--debug", action="store_true", help="show tracebacks")
    _pack_parser(sub)
    cli_tools.add_parsers(sub)
    return parser


def _pack_parser(sub: Any) -> None:
    pack = sub.add_parser(
        "pack",
        help="pack recorded sessions into Parquet training batches (Apache Beam)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Pack recorded sessions (.jsonl or .parquet of the sessions schema) into packed-row\n"
            "training batches with an Apache Beam job: group by (task, group), compute\n"
            "advantages, cut batches of --groups-per-batch groups in sorted key order, pack\n"
            "each as dew_pipe's pack does. Writes OUTPUT/packed-BBBBB-of-NNNNN.parquet (one\n"
            "training batch each), OUTPUT/manifest-*.parquet (one row per session) and\n"
            "OUTPUT/_SUCCESS, all at once when the job succeeds: a failed job leaves OUTPUT\n"
            "as it was. --format verl reads JSON lines of verl AgentLoopOutput rows instead."
        ),
        epilog=(
            "examples:\n"
            "  dew-pipe pack --input 'runs/x/sessions-*.parquet' --output packed --width 4096\n"
            "  dew-pipe pack --input traces.jsonl --output packed --width 2048 --rows 64 \\\n"
            "      --groups-per-batch 32 --estimator rloo --workers 2\n"
            "  dew-pipe pack --format verl --samples 8 --input 'rollouts/*.jsonl' \\\n"
            "      --output packed --width 4096\n"
            "exit status: 0 done, 1 bad data or a failed job, 2 bad arguments"
        ),
    )
    add = pack.add_argument
    add(
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="PATTERN",
        help="sessions files, globs allowed (repeatable)",
    )
    add("--output", required=True, metavar="DIR", help="folder for packed files and manifest")
    add(
        "--format",
        dest="input_format",
        choices=("sessions", "verl"),
        default="sessions",
        help="sessions (default: .jsonl/.parquet sessions) or verl (.jsonl AgentLoopOutput rows)",
    )
    add(
        "--samples",
        type=int,
        metavar="N",
        help="with --format verl: verl's rollout.n, the rows of one prompt (native verl rows)",
    )
    add("--width", type=int, required=True, metavar="W", help="ids per row")
    add("--rows", type=int, metavar="N", help="rows per batch (default: as many as needed)")
    add(
        "--groups-per-batch",
        type=int,
        metavar="G",
        help="(task, group) groups per batch (default: all in one batch)",
    )
    add("--estimator", default="group", help="group (GRPO), mean (Dr.GRPO) or rloo")
    add("--truncation", default="mask", help="TRUNCATED sessions: mask, score or zero")
    add(
        "--support-capacity",
        type=int,
        metavar="C",
        help="support entries per row (when calls recorded supports)",
    )
    add("--runner", default="DirectRunner", help="Beam runner (default DirectRunner, local)")
    add("--workers", type=int, default=1, help="local worker processes (default 1)")
    add(
        "--beam-arg",
        dest="beam_args",
        action="append",
        default=[],
        metavar="ARG",
        help="a Beam pipeline option, e.g. --beam-arg=--temp_location=gs://b/t (repeatable)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="replace an earlier job's files in DIR (once this job has succeeded)",
    )
    add("--debug", action="store_true", help="show tracebacks and Beam's logs")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dew-pipe`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if args.command in cli_tools.COMMANDS:
            return cli_tools.dispatch(args)
        return _pack(args) if args.command == "pack" else _run(args)
    except (_Exit, cli_tools.ToolError) as e:
        if args.debug and e.cause is not None:
            traceback.print_exception(e.cause)
        print(f"dew-pipe: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("dew-pipe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------- loading


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_file(path: Path) -> ModuleType:
    """Import a pipeline file as a fresh module (its folder goes first on ``sys.path``)."""
    if not path.is_file():
        raise _Exit(f"{path}: no such file", EXIT_USAGE)
    if path.suffix != ".py":
        raise _Exit(f"{path}: expected a Python file (.py)", EXIT_USAGE)
    name = "dew_pipe_run_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise _Exit(f"could not load {path}: {_one_line(e)}", EXIT_USAGE, e) from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def find_entry(module: ModuleType, path: Path) -> tuple[str, Any]:
    """``("pipeline" | "main", object)``: what the file offers to run."""
    from dew_pipe.flow import Pipeline

    entry = getattr(module, "pipeline", None)
    if entry is not None:
        if isinstance(entry, Pipeline) or callable(entry):
            return "pipeline", entry
        raise _Exit(
            f"{path}: `pipeline` is a {type(entry).__name__}; expected a dew_pipe.flow."
            "Pipeline or a function returning one",
            EXIT_USAGE,
        )
    if callable(getattr(module, "main", None)):
        return "main", module.main
    raise _Exit(
        f"{path} defines no `pipeline` (a Pipeline, or a function returning one) and no "
        "`main` function; nothing to run",
        EXIT_USAGE,
    )


def _build(entry: Any, overrides: list[str], path: Path) -> tuple[Any, dict[str, Any]]:
    from dew_pipe.flow import BuildError, Pipeline
    from dew_pipe.flow.config import ConfigError, resolve

    if isinstance(entry, Pipeline):
        if overrides:
            raise _Exit(
                f"{path} defines a Pipeline object, which has no settings; make `pipeline` a "
                "function with keyword parameters to accept --set",
                EXIT_USAGE,
            )
        return entry, {}
    try:
        config = resolve(entry, overrides)
    except ConfigError as e:
        raise _Exit(str(e), EXIT_USAGE, e) from e
    try:
        target = entry(**config)
    except (BuildError, ValueError, TypeError) as e:
        raise _Exit(
            f"{entry.__name__}() refused its settings: {_one_line(e)}", EXIT_USAGE, e
        ) from e
    except Exception as e:
        raise _Exit(f"{entry.__name__}() failed: {_one_line(e)}", EXIT_FAILED, e) from e
    if not isinstance(target, Pipeline) and not callable(getattr(target, "run", None)):
        raise _Exit(
            f"{entry.__name__}() returned a {type(target).__name__}; expected a dew_pipe.flow."
            "Pipeline or an object with a run(context) method",
            EXIT_USAGE,
        )
    return target, config


# ---------------------------------------------------------------------------- pack


def _pack(args: argparse.Namespace) -> int:
    """``dew-pipe pack``: run dew_pipe.beam.run_pack_job and print what it did."""
    import logging

    beam_args = list(args.beam_args)
    quiet = contextlib.nullcontext() if args.debug else _stderr_discarded()
    if not args.debug:  # Beam logs every worker failure with its stack; the one line says it
        logging.getLogger().setLevel(logging.ERROR)
        logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
        beam_args.append("--default_sdk_harness_log_level=CRITICAL")
    from dew_pipe.beam import SessionDataError, run_pack_job

    try:
        with quiet:
            s = run_pack_job(
                args.inputs,
                args.output,
                width=args.width,
                rows=args.rows,
                groups_per_batch=args.groups_per_batch,
                estimator=args.estimator,
                truncation=args.truncation,
                support_capacity=args.support_capacity,
                runner=args.runner,
                workers=args.workers,
                beam_args=beam_args,
                overwrite=args.overwrite,
                input_format=args.input_format,
                samples=args.samples,
            )
    except SessionDataError as e:
        raise _Exit(str(e), EXIT_FAILED, e) from e
    except ValueError as e:
        raise _Exit(str(e), EXIT_USAGE, e) from e
    except Exception as e:  # the runner failed for another reason: its last line says why
        lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        raise _Exit(f"pack job failed: {lines[-1].strip()}", EXIT_FAILED, e) from e
    print(
        f"dew-pipe: packed {s.sessions} sessions of {s.groups} groups ({s.trained} train, "
        f"{s.sessions - s.trained} do not: see the manifest) into {s.batches} batches, "
        f"{s.rows} rows x {s.width} ({s.fill:.1%} real ids), in {s.seconds:.1f} s; "
        f"output {args.output}"
    )
    return 0


@contextlib.contextmanager
def _stderr_discarded() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null, for this process and the workers it starts.

    Beam's worker processes log to the stderr they inherit (their start-up, and every
    failure with its stack); the command reports the outcome in one line instead.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(sink, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(sink)


# ---------------------------------------------------------------------------- running


def _run_dir(requested: Path | None, stem: str) -> Path:
    """Create the run directory; a path that cannot be one (a file, or under a file, or not
    writable) is a usage error naming it."""
    if requested is not None:
        candidate = requested
    else:
        base = Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        candidate, n = base, 1
        while candidate.exists():  # two runs in one second: keep both
            candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    label = f"--run-dir {candidate}" if requested is not None else f"run directory {candidate}"
    if candidate.exists() and not candidate.is_dir():
        raise _Exit(f"{label}: exists and is not a directory", EXIT_USAGE)
    try:
        candidate.mkdir(parents=True, exist_ok=requested is not None)
    except OSError as e:
        reason = e.strerror or _one_line(e)
        raise _Exit(f"{label}: cannot create the directory: {reason}", EXIT_USAGE, e) from e
    return candidate


def _run(args: argparse.Namespace) -> int:
    from dew_pipe.flow import BuildError, Pipeline
    from dew_pipe.flow.config import to_json

    path: Path = args.file
    if not args.dry_run:  # before the file's code, which may compile as it builds
        try:
            compile_cache.enable(args.compile_cache)
        except ValueError as e:
            raise _Exit(str(e), EXIT_USAGE, e) from e
    module = load_file(path)
    kind, entry = find_entry(module, path)
    target, config = _build(entry, args.overrides, path)
    if isinstance(target, Pipeline):
        try:
            target.check()
        except BuildError as e:
            raise _Exit(f"{path}: {e}", EXIT_USAGE, e) from e
    if args.dry_run:
        print(json.dumps(to_json(config), indent=2))
        print(target.describe() if isinstance(target, Pipeline) else repr(target))
        return 0
    if not args.metrics_every > 0:
        raise _Exit(f"--metrics-every {args.metrics_every}: expected seconds > 0", EXIT_USAGE)
    run_dir = _run_dir(args.run_dir, path.stem)
    try:
        (run_dir / "config.json").write_text(json.dumps(to_json(config), indent=2) + "\n")
    except OSError as e:
        raise _Exit(
            f"run directory {run_dir}: cannot write config.json: {e.strerror}", EXIT_USAGE, e
        ) from e
    record = {"file": str(path), "entry": kind, "argv": sys.argv, "started": time.time()}
    start = time.monotonic()
    code, message, cause = _execute(target, config, run_dir, args, path)
    record["seconds"] = round(time.monotonic() - start, 3)
    record["status"] = {0: "done", EXIT_INTERRUPTED: "cancelled"}.get(code, "failed")
    record["error"] = message if code else None
    (run_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    if code:
        raise _Exit(message, code, cause)
    print(f"dew-pipe: {message}; run directory {run_dir}")
    return 0


def _execute(
    target: Any, config: dict, run_dir: Path, args: argparse.Namespace, path: Path
) -> tuple[int, str, BaseException | None]:
    """Run ``target`` under a SIGINT handler: ``(exit status, one-line message, error)``."""
    from dew_pipe.flow import Cancelled, FlowSnapshot, Pipeline, StageFailed
    from dew_pipe.flow.display import Display
    from dew_pipe.flow.job import RunContext
    from dew_pipe.flow.metrics import MetricsWriter

    cancel = threading.Event()
    start = time.monotonic()

    def seconds() -> str:
        return f"{time.monotonic() - start:.1f}"

    restore = _install_sigint(cancel)
    try:
        with (
            MetricsWriter(run_dir / "metrics.jsonl") as metrics,
            Display(title=path.stem) as display,
        ):
            context = RunContext(run_dir, config, metrics, display, cancel)
            try:
                if isinstance(target, Pipeline):
                    result = context.run_pipeline(target, metrics_every=args.metrics_every)
                else:
                    result = target.run(context)
            except (Cancelled, StageFailed, Exception) as e:
                if cancel.is_set() and isinstance(e, Cancelled):
                    return EXIT_INTERRUPTED, f"cancelled by Ctrl-C after {seconds()} s", e
                if isinstance(e, StageFailed | Cancelled):
                    return EXIT_FAILED, str(e), e
                return EXIT_FAILED, f"{path.name} failed: {_one_line(e)}", e
            if cancel.is_set():
                return EXIT_INTERRUPTED, f"cancelled by Ctrl-C after {seconds()} s", None
            message = f"finished in {seconds()} s"
            if isinstance(result, FlowSnapshot) and result.dropped:
                message += f" ({result.dropped} items dropped by consumers that finished early)"
            return 0, message, None
    finally:
        restore()


def _install_sigint(cancel: threading.Event) -> Callable[[], None]:
    """First Ctrl-C sets ``cancel``; a second exits at once. Returns the restorer."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        if cancel.is_set():
            os.write(2, b"\ndew-pipe: interrupted twice; exiting now\n")
            os._exit(EXIT_INTERRUPTED)
        cancel.set()
        os.write(2, b"\ndew-pipe: cancelling (Ctrl-C again to exit at once)\n")

    previous = signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
