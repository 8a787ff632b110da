"""Wiring is refused at build time, in one line naming both ends, before any stage runs."""

import threading

import pyarrow as pa
import pytest

from dew_pipe.batches import TASKS_SCHEMA, packed_schema
from dew_pipe.flow import BuildError, Map, Pipeline, Port, Sink, Source, Stage


class Recorder(Stage):
    """A stage that records whether it was ever opened or run."""

    def __init__(self, name, inputs=None, outputs=None):
        super().__init__(name, inputs=inputs, outputs=outputs)
        self.opened = self.ran = False

    def open(self):
        self.opened = True

    def run(self, ctx):
        self.ran = True


def _nothing_ran(*stages):
    return not any(s.opened or s.ran for s in stages)


def test_schema_mismatch_names_both_stages_ports_and_types():
    p = Pipeline("typed")
    a = p.add(Recorder("rollout", outputs={"rows": packed_schema(16)}))
    b = p.add(Recorder("update", inputs={"batch": packed_schema(32)}))
    with pytest.raises(BuildError) as info:
        p.connect("rollout.rows", "update.batch", capacity=2)
    msg = str(info.value)
    assert "\n" not in msg
    for part in ("'rollout'", "'rows'", "'update'", "'batch'", "fixed_size_list<item: int32>[16]"):
        assert part in msg
    assert "field 'input_ids' is fixed_size_list<item: int32>[16], expected" in msg
    assert "[32]" in msg
    assert _nothing_ran(a, b) and not p.edges


def test_missing_field_and_kind_mismatches():
    p = Pipeline("typed")
    p.add(Recorder("tasks", outputs={"out": TASKS_SCHEMA}))
    p.add(Recorder("pack", inputs={"in": packed_schema(8)}))
    p.add(Recorder("control", inputs={"in": int}))
    p.add(Recorder("objects", outputs={"out": str}))
    with pytest.raises(BuildError, match="field 'input_ids' is missing"):
        p.connect("tasks", "pack", capacity=1)
    with pytest.raises(BuildError, match="a schema is not a Python type"):
        p.connect("tasks", "control", capacity=1)
    with pytest.raises(BuildError, match="a Python type is not an Arrow schema"):
        p.connect("objects", "pack", capacity=1)
    with pytest.raises(BuildError, match="str is not a subclass of int"):
        p.connect("objects", "control", capacity=1)


def test_compatible_wiring_is_accepted():
    p = Pipeline("ok")
    wide = packed_schema(8, ppo=True)
    p.add(Recorder("a", outputs={"out": wide, "n": bool}))
    p.add(Recorder("b", inputs={"in": packed_schema(8), "n": int}))  # subset; bool <: int
    p.add(Recorder("c", inputs={"any": object}))
    p.add(Recorder("d", inputs={"rb": pa.RecordBatch}))
    p.connect("a.out", "b.in", capacity=1)
    p.connect("a.n", "b.n", capacity=1)
    p.connect("a.out", "c", capacity=1)
    p.connect("a.out", "d", capacity=1)
    assert len(p.edges) == 4


def test_duplicate_stage_names_are_refused():
    p = Pipeline("dup")
    p.add(Recorder("pack", outputs={"out": int}))
    with pytest.raises(BuildError, match="stage 'pack' already exists .*two stages with the same"):
        p.add(Recorder("pack", inputs={"in": int}))
    # connecting a new stage object under a taken name is refused the same way
    with pytest.raises(BuildError, match="stage 'pack' already exists"):
        p.connect(
            Recorder("pack", outputs={"out": int}), Recorder("x", inputs={"in": int}), capacity=1
        )


def test_dangling_required_ports_are_refused_before_any_thread_starts():
    p = Pipeline("dangling")
    src = p.add(Recorder("src", outputs={"out": int}))
    mid = p.add(
        Recorder(
            "mid", inputs={"in": int}, outputs={"out": int, "extra": Port(int, required=False)}
        )
    )
    p.connect("src", "mid", capacity=1)
    before = set(threading.enumerate())
    with pytest.raises(BuildError) as info:
        p.run(timeout=5)
    assert str(info.value) == (
        "stage 'mid' output port 'out' (int) is not connected; connect it or declare it "
        "Port(..., required=False)"
    )
    with pytest.raises(BuildError, match="stage 'sink' input port 'in' \\(int\\) is not connected"):
        q = Pipeline("dangling-in")
        q.add(Recorder("sink", inputs={"in": int}))
        q.start()
    assert set(threading.enumerate()) == before
    assert _nothing_ran(src, mid)


def test_unknown_stage_or_port_and_ambiguous_port():
    p = Pipeline("names")
    p.add(Recorder("a", outputs={"x": int, "y": int}))
    p.add(Recorder("b", inputs={"in": int}))
    with pytest.raises(BuildError, match="has no stage 'c'; it has \\['a', 'b'\\]"):
        p.connect("c", "b", capacity=1)
    with pytest.raises(BuildError, match="stage 'a' has 2 output ports \\['x', 'y'\\]; name one"):
        p.connect("a", "b", capacity=1)
    with pytest.raises(BuildError, match="stage 'a' has no output port 'z'; its outputs are"):
        p.connect("a.z", "b", capacity=1)
    with pytest.raises(BuildError, match="stage 'b' has no input port 'q'"):
        p.connect("a.x", "b.q", capacity=1)


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, None])
def test_capacity_must_be_a_positive_int(capacity):
    p = Pipeline("cap")
    p.add(Recorder("a", outputs={"out": int}))
    p.add(Recorder("b", inputs={"in": int}))
    with pytest.raises(
        BuildError, match=f"edge a.out->b.in: capacity={capacity!r}, expected an int >= 1"
    ):
        p.connect("a", "b", capacity=capacity)


def test_duplicate_edge_is_refused():
    p = Pipeline("twice")
    p.add(Recorder("a", outputs={"out": int}))
    p.add(Recorder("b", inputs={"in": int}))
    p.connect("a", "b", capacity=1)
    with pytest.raises(BuildError, match="edge a.out->b.in is connected twice"):
        p.connect("a", "b", capacity=3)


def test_cycle_without_feedback_edge_is_refused():
    p = Pipeline("loop")
    p.add(Recorder("a", inputs={"in": int, "back": int}, outputs={"out": int}))
    p.add(Recorder("b", inputs={"in": int}, outputs={"out": int}))
    p.add(Recorder("src", outputs={"out": int}))
    p.connect("src", "a.in", capacity=1)
    p.connect("a", "b", capacity=1)
    p.connect("b", "a.back", capacity=1)
    with pytest.raises(
        BuildError, match="cycle a -> b -> a with no feedback edge; .*feedback=True"
    ):
        p.check()


def test_feedback_edge_must_close_a_cycle():
    p = Pipeline("fb")
    p.add(Recorder("a", outputs={"out": int}))
    p.add(Recorder("b", inputs={"in": int}))
    p.connect("a", "b", capacity=1, feedback=True)
    with pytest.raises(
        BuildError, match="feedback edge a.out->b.in closes no cycle: 'b' does not lead back to 'a'"
    ):
        p.check()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Recorder("a.b"), "stage name 'a.b'"),
        (lambda: Recorder(""), "stage name ''"),
        (lambda: Recorder("a", inputs={"x.y": int}), "port name 'x.y'"),
        (lambda: Recorder("a", inputs={"x": 3}), "port type 3"),
        (lambda: Map("m", lambda x: x, input_type=int, workers=0), "workers=0"),
        (lambda: Map("m", input_type=int), "pass a callable or override apply"),
        (lambda: Sink("s", input_type=int), "pass a callable or override consume"),
        (lambda: Source("s", output_type=int), "pass a callable or override items"),
        (lambda: Recorder("a").__class__.__base__("x"), "abstract"),
        (lambda: Pipeline("a:b"), "pipeline name 'a:b'"),
    ],
)
def test_bad_declarations(make, match):
    with pytest.raises((BuildError, TypeError), match=match):
        make()


def test_empty_pipeline_and_bad_run_options():
    with pytest.raises(BuildError, match="has no stages"):
        Pipeline("empty").run()
    p = Pipeline("opts")
    p.chain(Source("s", lambda: [], output_type=int), Sink("k", print, input_type=int), capacity=1)
    for kwargs, match in (
        ({"timeout": 0}, "timeout=0"),
        ({"metrics_every": -1}, "metrics_every=-1"),
    ):
        with pytest.raises(BuildError, match=match):
            p.run(**kwargs)
    p.run(timeout=5)  # the refused options left nothing claimed


def test_describe_lists_stages_and_edges():
    p = Pipeline("d")
    p.chain(Source("s", lambda: [], output_type=int), Sink("k", print, input_type=int), capacity=3)
    text = p.describe()
    assert "pipeline 'd': 2 stages, 1 edges" in text and "s.out->k.in (capacity 3)" in text
