"""The ``dew-pipe`` sub-commands that look at runs and data: ``plot`` and ``audit``.

``plot RUN_DIR...`` draws the curves of runs' ``metrics.jsonl`` (:func:`dew_pipe.curves.plot_runs`)
into a PNG: loss, reward, accuracy, lag and queue waits; several runs overlaid, or side by side.

``audit template --tokenizer DIR`` reports, per turn shape, whether a tokenizer's chat template
keeps agent histories append-only (:func:`dew_pipe.data.template_audit.audit_template`);
``audit sessions TRACES.jsonl...`` measures calls per chain on recorded sessions and why the
others split (:func:`dew_pipe.objectives.rl.chain_audit.audit_sessions`).

:func:`add_parsers` registers them on the command's sub-parsers and :func:`dispatch` runs one;
errors are :class:`ToolError` (a one-line message and an exit status), which ``dew_pipe.cli``
prints like its own. Exit status: 0 done (an audit that finds splits has still done its job),
1 bad data (a malformed line, named; an empty metrics file, or one with nothing to draw),
2 bad arguments (a missing run, file, output folder or tokenizer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "ToolError", "add_parsers", "dispatch"]

EXIT_BAD_DATA, EXIT_USAGE = 1, 2
COMMANDS = ("plot", "audit")


class ToolError(Exception):
    """Ends a sub-command with a one-line message and an exit status."""

    def __init__(self, message: str, code: int, cause: BaseException | None = None):
        super().__init__(message)
        self.code = code
        self.cause = cause


def add_parsers(sub: Any) -> None:
    """Add ``plot`` and ``audit`` to the ``dew-pipe`` sub-parsers ``sub``."""
    raw = argparse.RawDescriptionHelpFormatter
    plot = sub.add_parser(
        "plot",
        help="draw runs' curves (loss, reward, accuracy, lag, queue waits) into a PNG",
        formatter_class=raw,
        description=(
            "Draw the curves of one or more runs from their metrics.jsonl: loss, reward,\n"
            "accuracy, lag and queue waits, whichever the records hold. Several runs are\n"
            "overlaid in each panel for comparison, or drawn side by side, one column each."
        ),
        epilog=(
            "examples:\n"
            "  dew-pipe plot runs/arithmetic-20250101-120000\n"
            "  dew-pipe plot runs/a runs/b --output compare.png\n"
            "  dew-pipe plot runs/chain/sft runs/chain/dpo runs/chain/grpo --side-by-side\n"
            "exit status: 0 done, 1 a metrics file that is malformed, empty or has nothing to\n"
            "plot, 2 no such run or output folder"
        ),
    )
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                      help="a run directory (or its metrics.jsonl)")  # fmt: skip
    plot.add_argument(
        "--output",
        type=Path,
        metavar="PNG",
        help="the PNG to write (default: RUN_DIR/curves.png for one run, curves.png here "
        "for several)",
    )
    plot.add_argument("--side-by-side", action="store_true", help="one column per run")
    plot.add_argument("--debug", action="store_true", help="show tracebacks")

    audit = sub.add_parser(
        "audit",
        help="audit a chat template, or calls per chain in recorded sessions",
        formatter_class=raw,
        description=(
            "template: whether a tokenizer's chat template keeps histories append-only, per\n"
            "turn shape (reasoning or not; no tool call, arguments as a JSON string or as an\n"
            "object; the observation as a tool or a user message). The sampled turn is what\n"
            "the template writes for a final assistant turn.\n"
            "sessions: calls per chain on recorded sessions (JSON lines, one session each),\n"
            "and where each new chain leaves the previous one."
        ),
        epilog=(
            "examples:\n"
            "  dew-pipe audit template --tokenizer path/to/tokenizer\n"
            "  dew-pipe audit sessions traces.jsonl\n"
            "exit status: 0 audited, 1 a malformed traces line, 2 bad arguments"
        ),
    )
    kinds = audit.add_subparsers(dest="audit", metavar="WHAT", required=True)
    template = kinds.add_parser("template", help="audit a tokenizer's chat template")
    template.add_argument("--tokenizer", required=True, metavar="DIR",
                          help="a tokenizer directory (or a Hub name in the local cache)")  # fmt: skip
    template.add_argument("--json", action="store_true", help="print JSON instead of text")
    template.add_argument("--debug", action="store_true", help="show tracebacks")
    sessions = kinds.add_parser("sessions", help="measure calls per chain on recorded sessions")
    sessions.add_argument("traces", nargs="+", type=Path, metavar="TRACES.jsonl",
                          help="recorded sessions, one JSON object per line")  # fmt: skip
    sessions.add_argument("--json", action="store_true", help="print JSON instead of text")
    sessions.add_argument("--debug", action="store_true", help="show tracebacks")


def dispatch(args: argparse.Namespace) -> int:
    """Run the sub-command ``args`` names; returns the exit status or raises ToolError."""
    if args.command == "plot":
        return _plot(args)
    if args.audit == "template":
        return _audit_template(args)
    return _audit_sessions(args)


def _plot(args: argparse.Namespace) -> int:
    from dew_pipe.curves import plot_runs

    runs: list[Path] = args.runs
    out = args.output
    if out is None:
        out = runs[0] / "curves.png" if len(runs) == 1 and runs[0].is_dir() else Path("curves.png")
    try:
        written = plot_runs(runs, out, side_by_side=args.side_by_side)
    except FileNotFoundError as e:
        raise ToolError(str(e), EXIT_USAGE, e) from e
    except ValueError as e:  # a malformed or empty file, or nothing to draw
        raise ToolError(str(e), EXIT_BAD_DATA, e) from e
    print(f"dew-pipe: wrote {written} ({len(runs)} run{'s' * (len(runs) > 1)})")
    return 0


def _audit_template(args: argparse.Namespace) -> int:
    from dew_pipe.data.template_audit import audit_template

    name = args.tokenizer
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise ToolError(f"--tokenizer {name}: no such directory", EXIT_USAGE)
    try:
        audit = audit_template(str(Path(name).expanduser()) if name.startswith("~") else name)
    except (ValueError, TypeError) as e:
        raise ToolError(str(e).splitlines()[0], EXIT_USAGE, e) from e
    if args.json:
        verdicts = [v.to_json() for v in audit.verdicts]
        print(json.dumps({"tokenizer": audit.tokenizer, "append_only": audit.append_only,
                          "verdicts": verdicts}, indent=2))  # fmt: skip
    else:
        print(audit.report())
    return 0


def _audit_sessions(args: argparse.Namespace) -> int:
    from dew_pipe.objectives.rl.chain_audit import audit_sessions, read_traces

    sessions = []
    for path in args.traces:
        try:
            sessions += read_traces(path)
        except FileNotFoundError as e:
            raise ToolError(str(e), EXIT_USAGE, e) from e
        except ValueError as e:
            raise ToolError(str(e), EXIT_BAD_DATA, e) from e
    audit = audit_sessions(sessions)
    source = ", ".join(map(str, args.traces))
    print(json.dumps({"traces": source, **audit.to_json()}, indent=2) if args.json
          else audit.report(source))  # fmt: skip
    return 0
