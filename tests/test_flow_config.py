"""Settings of pipeline files: conversion by annotation, errors that list the valid keys."""

import enum
import io
import json
import threading
from pathlib import Path
from typing import Literal, Optional

import pytest
from rich.console import Console

from dew_pipe.flow import Display, FlowSnapshot, MetricsWriter, Pipeline, RunContext, Sink, Source
from dew_pipe.flow.config import ConfigError, resolve, settings_of, to_json


class Mode(enum.Enum):
    FAST = 1
    CAREFUL = 2


def factory(
    steps: int = 3,
    rate: float = 0.5,
    verbose: bool = False,
    name: str = "x",
    out: Path = Path("out"),
    mode: Mode = Mode.FAST,
    kind: Literal["grpo", "ppo"] = "grpo",
    limit: int | None = None,
    seed: Optional[int] = 7,  # noqa: UP045 - the old spelling must work too
    shape: tuple[int, int] = (2, 3),
    sizes: tuple[int, ...] = (),
    names: list[str] = ["a"],  # noqa: B006 - a default, never mutated
    untyped=1.5,
):
    return locals()


@pytest.mark.parametrize(
    "text, key, want",
    [
        ("steps=10", "steps", 10),
        ("steps=-2", "steps", -2),
        ("rate=1e-3", "rate", 1e-3),
        ("rate=2", "rate", 2.0),
        ("verbose=yes", "verbose", True),
        ("verbose=OFF", "verbose", False),
        ("verbose=1", "verbose", True),
        ("name=a=b", "name", "a=b"),
        ("out=/tmp/r", "out", Path("/tmp/r")),
        ("mode=CAREFUL", "mode", Mode.CAREFUL),
        ("kind=ppo", "kind", "ppo"),
        ("limit=none", "limit", None),
        ("limit=4", "limit", 4),
        ("seed=null", "seed", None),
        ("shape=4,5", "shape", (4, 5)),
        ("shape=(4, 5)", "shape", (4, 5)),
        ("sizes=1,2,3", "sizes", (1, 2, 3)),
        ("sizes=", "sizes", ()),
        ("names=[p, q]", "names", ["p", "q"]),
        ("untyped=3", "untyped", 3.0),
    ],
)
def test_values_convert_by_annotation(text, key, want):
    config = resolve(factory, [text])
    assert config[key] == want and type(config[key]) is type(want)
    assert {k: v for k, v in config.items() if k != key} == {
        k: v for k, v in resolve(factory, []).items() if k != key
    }


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "steps=1.5",
            "setting 'steps': '1.5' is not an int; valid settings: steps (int, default 3)",
        ),
        ("rate=fast", "setting 'rate': 'fast' is not a float"),
        ("verbose=maybe", "setting 'verbose': 'maybe' is not a bool (true/false"),
        ("mode=SLOW", "setting 'mode': 'SLOW' is not one of FAST, CAREFUL"),
        ("kind=dpo", "setting 'kind': 'dpo' is not one of grpo, ppo"),
        ("limit=many", "setting 'limit': 'many' is not int | None"),
        ("shape=1,2,3", "setting 'shape': '1,2,3' has 3 items, expected 2"),
        ("sizes=1,x", "setting 'sizes': 'x' is not an int"),
        ("stepz=3", "unknown setting 'stepz'; valid settings: steps (int, default 3); rate"),
        ("steps", "--set 'steps': expected key=value; valid settings:"),
    ],
)
def test_bad_values_and_keys_are_one_line_errors(text, message):
    with pytest.raises(ConfigError) as info:
        resolve(factory, [text])
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "untyped (float, default 1.5)" in str(info.value) or "expected key=value" not in message


def test_repeated_key_and_factories_that_cannot_be_called():
    with pytest.raises(ConfigError, match="setting 'steps' is given twice"):
        resolve(factory, ["steps=1", "steps=2"])

    def needs(x, y: int = 1): ...

    with pytest.raises(ConfigError, match="needs\\(\\) parameter 'x' has no default"):
        settings_of(needs)

    def star(*args): ...

    with pytest.raises(ConfigError, match="takes \\*args"):
        settings_of(star)

    def odd(table: dict[str, int] = None): ...  # noqa: RUF013

    with pytest.raises(
        ConfigError, match="type dict\\[str, int\\] cannot be set from the command line"
    ):
        resolve(odd, ["table=a"])
    assert resolve(odd, []) == {"table": None}


def test_config_json_is_plain():
    config = resolve(factory, ["out=/r", "mode=CAREFUL", "shape=1,2"])
    plain = to_json(config)
    assert json.loads(json.dumps(plain)) == plain
    assert plain["out"] == "/r" and plain["mode"] == "CAREFUL" and plain["shape"] == [1, 2]


def test_display_live_view_renders_stages_and_queues():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140)
    p = Pipeline("shown")
    p.chain(
        Source("src", lambda: range(5), output_type=int),
        Sink("k", lambda x: None, input_type=int),
        capacity=2,
    )
    with Display(console, live=True, title="demo") as display:
        assert display.live
        display.values(loss=0.125)
        display.progress("steps", 3, 10)
        p.run(on_metrics=display.flow, metrics_every=0.05)
    text = out.getvalue()
    for part in ("items/s", "src->k", "2/2", "loss", "0.125", "steps", "busy"):
        assert part in text or part == "2/2", part
    assert "src->k" in text and "items/s" in text


def test_display_plain_lines_are_periodic_and_final():
    out = io.StringIO()
    display = Display(Console(file=out, width=300), live=False, interval=3600, title="t")
    display.values(acc=0.5)
    display.flow(FlowSnapshot("p", 1.0, {}, {}))
    assert out.getvalue() == ""  # interval not reached
    display.close()
    (line,) = out.getvalue().splitlines()
    assert "acc=0.5" in line and " t " in line


def test_run_context_runs_a_pipeline_into_metrics(tmp_path):
    out = io.StringIO()
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        ctx = RunContext(
            tmp_path, {"n": 3}, metrics, Display(Console(file=out), live=False), threading.Event()
        )
        p = Pipeline("ctx")
        p.chain(
            Source("src", lambda: range(3), output_type=int),
            Sink("k", lambda x: None, input_type=int),
            capacity=1,
        )
        snap = ctx.run_pipeline(p, metrics_every=0.05)
        ctx.log(step=2, loss=0.5)
        ctx.print("hello")
        assert not ctx.cancelled
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flows = [r for r in lines if r["kind"] == "flow"]
    assert flows and flows[-1]["stages"]["k"]["items_in"] == 3 == snap.stages["k"].items_in
    assert {"kind": "values", "step": 2, "loss": 0.5}.items() <= lines[-2].items()
    assert lines[-1]["kind"] == "event" and lines[-1]["message"] == "hello"
    assert "hello" in out.getvalue()
    with pytest.raises(ValueError, match="is closed"):
        metrics.write("values", x=1)
