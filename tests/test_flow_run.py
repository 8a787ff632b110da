"""Running pipelines: order, fan-out/fan-in, worker pools, cycles, counters and backpressure."""

import gc
import threading
import time

import numpy as np
import pytest

from dew_pipe.batches import packed_from_arrow, packed_schema, packed_to_arrow
from dew_pipe.flow import (
    EndOfStream,
    Map,
    Pipeline,
    Port,
    Sink,
    Source,
    Stage,
)


def test_docstring_examples_run():
    import doctest
    import importlib

    names = [
        "config",
        "display",
        "forms",
        "job",
        "metrics",
        "pipeline",
        "ports",
        "runtime",
        "stage",
    ]
    attempted = 0
    for name in names:
        module = importlib.import_module(f"dew_pipe.flow.{name}")
        failed, tried = doctest.testmod(module)
        assert failed == 0, name
        attempted += tried
    assert attempted >= 20


def _threads(name):
    return [t for t in threading.enumerate() if t.name.startswith(f"flow:{name}:")]


def _packed(rows, width, value):
    schema = packed_schema(width)
    arrays = {
        f.name: np.full((rows, width), value, np.float32 if f.type.value_type.bit_width == 32
                        and str(f.type.value_type) == "float" else np.int32)
        for f in schema
    }  # fmt: skip
    return packed_to_arrow(arrays)


def test_linear_chain_keeps_order_and_counts():
    out = []
    p = Pipeline("linear")
    p.chain(
        Source("src", lambda: range(50), output_type=int),
        Map("sq", lambda x: x * x, input_type=int),
        Sink("keep", out.append, input_type=int),
        capacity=3,
    )
    snap = p.run(timeout=10)
    assert out == [x * x for x in range(50)]
    assert snap.stages["src"].items_out == 50 and snap.stages["sq"].items_in == 50
    assert snap.stages["keep"].items_in == 50 and snap.stages["keep"].state == "done"
    edge = snap.edges["src.out->sq.in"]
    assert edge.items == 50 and edge.depth == 0 and edge.closed and 1 <= edge.max_depth <= 3
    assert snap.dropped == 0 and not _threads("linear")
    p.run(timeout=10)  # a pipeline can run again (fresh queues; the source is a callable)
    assert len(out) == 100


def test_arrow_batches_pass_through_without_copies():
    rb = _packed(4, 16, 3)
    seen = []
    p = Pipeline("arrow")
    schema = packed_schema(16)
    p.chain(
        Source("src", lambda: [rb, rb], output_type=schema),
        Map("id", lambda b: b, input_type=schema),
        Sink("keep", seen.append, input_type=schema),
        capacity=1,
    )
    p.run(timeout=10)
    src = packed_from_arrow(rb)
    for got in seen:
        for name, arr in packed_from_arrow(got).items():
            assert arr.ctypes.data == src[name].ctypes.data


def test_fan_out_broadcasts_and_fan_in_merges():
    class Join(Stage):
        def __init__(self):
            super().__init__("join", inputs={"a": int, "b": int}, outputs={"out": tuple})

        def run(self, ctx):
            while True:
                got = ctx.get_any()
                if got is not None:
                    ctx.put("out", got)

    got = []
    p = Pipeline("diamond")
    p.add(Source("src", lambda: range(20), output_type=int))
    p.add(Map("neg", lambda x: -x, input_type=int))
    p.add(Map("big", lambda x: x + 1000, input_type=int))
    p.add(Join())
    p.add(Sink("keep", got.append, input_type=tuple))
    p.connect("src", "neg", capacity=2)
    p.connect("src", "big", capacity=2)
    p.connect("neg", "join.a", capacity=2)
    p.connect("big", "join.b", capacity=2)
    p.connect("join", "keep", capacity=2)
    snap = p.run(timeout=10)
    assert sorted(v for port, v in got if port == "a") == sorted(-x for x in range(20))
    assert sorted(v for port, v in got if port == "b") == [x + 1000 for x in range(20)]
    assert snap.stages["src"].items_out == 20  # one put reaches both edges
    assert snap.edges["src.out->neg.in"].items == snap.edges["src.out->big.in"].items == 20


def test_several_edges_into_one_port_interleave_and_end_together():
    got = []
    p = Pipeline("merge")
    p.add(Source("a", lambda: range(0, 10), output_type=int))
    p.add(Source("b", lambda: range(100, 130), output_type=int))
    p.add(Sink("keep", got.append, input_type=int))
    p.connect("a", "keep", capacity=1)
    p.connect("b", "keep", capacity=1)
    p.run(timeout=10)
    assert sorted(got) == [*range(10), *range(100, 130)]
    first_b = next(i for i, v in enumerate(got) if v >= 100)
    assert first_b < 10  # turns are taken: b is not starved until a is done


def test_worker_pool_overlaps_work_and_keeps_order():
    def slow(x):
        time.sleep(0.05 if x % 3 == 0 else 0.01)
        return x

    out = []
    p = Pipeline("pool")
    p.chain(
        Source("src", lambda: range(24), output_type=int),
        Map("slow", slow, input_type=int, workers=4),
        Sink("keep", out.append, input_type=int),
        capacity=4,
    )
    start = time.monotonic()
    p.run(timeout=10)
    elapsed = time.monotonic() - start
    serial = 8 * 0.05 + 16 * 0.01
    assert out == list(range(24))
    assert elapsed < serial * 0.75, (elapsed, serial)
    assert not _threads("pool")


def test_unordered_pool_emits_in_completion_order():
    out = []
    p = Pipeline("unordered")
    p.chain(
        Source("src", lambda: [0.2, 0.01, 0.01, 0.01], output_type=float),
        Map("wait", lambda s: time.sleep(s) or s, input_type=float, workers=4, ordered=False),
        Sink("keep", out.append, input_type=float),
        capacity=4,
    )
    p.run(timeout=10)
    assert sorted(out) == sorted([0.2, 0.01, 0.01, 0.01]) and out[-1] == 0.2


def test_backpressure_bounds_items_in_flight():
    capacity = 3
    p = Pipeline("backpressure")
    produced, samples, holder = [], [], {}
    started = threading.Event()

    def slow_consume(x):
        # from the counters: what the producer has put, minus what this sink has finished
        started.wait()
        time.sleep(0.01)  # by now the producer has refilled the edge
        snap = holder["run"].snapshot()
        put = snap.stages["fast"].items_out
        finished = snap.stages["slow"].items_in - 1  # this item is not finished yet
        samples.append((put - finished, snap.edges["fast.out->slow.in"].depth))

    p.chain(
        Source("fast", lambda: (produced.append(i) or i for i in range(40)), output_type=int),
        Sink("slow", slow_consume, input_type=int),
        capacity=capacity,
    )
    holder["run"] = p.start(timeout=20)
    started.set()
    snap = holder["run"].wait()
    in_flight = max(s[0] for s in samples)
    assert in_flight <= capacity + 1 and in_flight == capacity + 1  # full, never more
    assert max(s[1] for s in samples) <= capacity
    edge = snap.edges["fast.out->slow.in"]
    assert edge.max_depth == capacity and edge.items == 40
    assert edge.put_wait_s > 0.2  # the fast producer spent most of the run blocked
    assert snap.stages["fast"].put_wait_s == pytest.approx(edge.put_wait_s)
    assert snap.stages["slow"].busy_s >= 0.35


def test_early_finishing_consumer_releases_producer_and_counts_drops():
    class TakeTwo(Stage):
        def __init__(self):
            super().__init__("take", inputs={"in": int})

        def run(self, ctx):
            ctx.get("in")
            ctx.get("in")

    pulled = []
    p = Pipeline("early")
    p.chain(
        Source("endless", lambda: (pulled.append(i) or i for i in range(10**9)), output_type=int),
        Map("id", lambda x: x, input_type=int),
        TakeTwo(),
        capacity=2,
    )
    snap = p.run(timeout=10)
    assert len(pulled) < 20  # the source stopped soon after nobody read on
    assert snap.dropped == sum(e.dropped for e in snap.edges.values()) > 0
    assert (
        snap.stages["endless"].items_out
        == snap.stages["id"].items_in + snap.edges["endless.out->id.in"].dropped
    )


def test_optional_ports_may_stay_unconnected():
    class Two(Stage):
        def __init__(self):
            super().__init__(
                "two",
                inputs={"in": int, "extra": Port(int, required=False)},
                outputs={"out": int, "log": Port(str, required=False)},
            )

        def run(self, ctx):
            assert not ctx.connected("extra") and ctx.ended("extra")
            for x in ctx.read("in"):
                ctx.put("log", f"saw {x}")
                ctx.put("out", x)

    out = []
    p = Pipeline("optional")
    p.chain(
        Source("s", lambda: range(5), output_type=int),
        Two(),
        Sink("k", out.append, input_type=int),
        capacity=1,
    )
    snap = p.run(timeout=10)
    assert out == list(range(5)) and snap.stages["two"].discarded == 5


class Router(Stage):
    """Reads new numbers and numbers sent back; passes both on."""

    def __init__(self):
        super().__init__(
            "route", inputs={"in": int, "back": Port(int, required=False)}, outputs={"out": int}
        )

    def run(self, ctx):
        while True:
            got = ctx.get_any()
            if got is not None:
                ctx.put("out", got[1])


class Split(Stage):
    """Sends a number back (+1) until its last digit reaches 3."""

    def __init__(self, workers_delay=0.0):
        super().__init__("split", inputs={"in": int}, outputs={"done": int, "again": int})
        self.delay = workers_delay

    def run(self, ctx):
        for x in ctx.read("in"):
            time.sleep(self.delay)
            ctx.put("again" if x % 10 < 3 else "done", x + 1 if x % 10 < 3 else x)


def _cycle(name, items, delay=0.0, capacity=2, feedback_capacity=8):
    out = []
    p = Pipeline(name)
    p.add(Source("src", lambda: items, output_type=int))
    p.add(Router())
    p.add(Split(delay))
    p.add(Sink("sink", out.append, input_type=int))
    p.connect("src", "route.in", capacity=capacity)
    p.connect("route", "split", capacity=capacity)
    p.connect("split.done", "sink", capacity=capacity)
    p.connect("split.again", "route.back", capacity=feedback_capacity, feedback=True)
    return p, out


@pytest.mark.parametrize("delay", [0.0, 0.002])
def test_feedback_cycle_ends_once_drained(delay):
    items = list(range(0, 60, 10))
    p, out = _cycle("cycle", items, delay)
    snap = p.run(timeout=10)
    assert sorted(out) == [x + 3 for x in items]
    fb = snap.edges["split.again->route.back"]
    assert fb.feedback and fb.closed and fb.items == 3 * len(items) and fb.dropped == 0
    assert snap.stages["route"].items_in == 4 * len(items)
    assert not _threads("cycle")


def test_a_drained_cycle_ends_on_the_idle_nudge_not_a_tick(monkeypatch):
    # With the supervisor's ticks out of reach (the run's 10 s deadline is its only
    # timed wake-up), the cycle can only end because its last stage to go idle saw every
    # other one idle and woke the supervisor.
    from dew_pipe.flow import runtime

    monkeypatch.setattr(runtime, "_SLOW_TICK_S", 60.0)
    items = list(range(0, 60, 10))
    p, out = _cycle("cycle-nudge", items, delay=0.002)
    start = time.monotonic()
    snap = p.run(timeout=10)
    assert time.monotonic() - start < 5.0
    assert sorted(out) == [x + 3 for x in items] and snap.edges["split.again->route.back"].closed


def _ticks(monkeypatch):
    """Every sleep the supervisor chose, recorded while the real rule picks it."""
    from dew_pipe.flow import runtime

    seen = []
    real = runtime.Run._tick

    def tick(self, *args):
        seen.append(real(self, *args))
        return seen[-1]

    monkeypatch.setattr(runtime.Run, "_tick", tick)
    return runtime, seen


def test_supervisor_ticks_slowly_unless_a_stage_has_a_timeout(monkeypatch):
    runtime, seen = _ticks(monkeypatch)
    slow = lambda x: time.sleep(0.05) or x  # noqa: E731
    p = Pipeline("calm")
    p.chain(Source("s", lambda: range(6), output_type=int), Map("m", slow, input_type=int),
            Sink("k", lambda x: None, input_type=int), capacity=2)  # fmt: skip
    p.run(timeout=30)
    assert seen and all(t == runtime._SLOW_TICK_S for t in seen)
    assert runtime._SLOW_TICK_S > runtime._TICK_S

    seen.clear()
    p = Pipeline("watched")
    p.chain(Source("s", lambda: range(6), output_type=int),
            Map("m", slow, input_type=int, timeout=5.0),
            Sink("k", lambda x: None, input_type=int), capacity=2)  # fmt: skip
    p.run(timeout=30)
    assert seen and all(t == runtime._TICK_S for t in seen)


def test_supervisor_wakes_for_the_run_deadline_and_metrics(monkeypatch):
    runtime, seen = _ticks(monkeypatch)
    monkeypatch.setattr(runtime, "_SLOW_TICK_S", 60.0)
    slow = lambda x: time.sleep(0.05) or x  # noqa: E731
    reports = []
    p = Pipeline("deadline")
    p.chain(Source("s", lambda: range(4), output_type=int), Map("m", slow, input_type=int),
            Sink("k", lambda x: None, input_type=int), capacity=2)  # fmt: skip
    p.run(timeout=30, on_metrics=reports.append, metrics_every=0.05)
    assert seen and max(seen) <= 0.05 and len(reports) >= 2


def test_cycle_with_pool_and_tracked_futures_does_not_end_early():
    # a map with workers inside the cycle has work outstanding while it waits for input;
    # the cycle must not be declared drained under it
    out = []
    p = Pipeline("cycle-pool")
    p.add(Source("src", lambda: [0, 10, 20, 30], output_type=int))
    p.add(Router())
    p.add(Map("work", lambda x: time.sleep(0.03) or x, input_type=int, workers=3))
    p.add(Split())
    p.add(Sink("sink", out.append, input_type=int))
    p.connect("src", "route.in", capacity=1)
    p.connect("route", "work", capacity=1)
    p.connect("work", "split", capacity=1)
    p.connect("split.done", "sink", capacity=1)
    p.connect("split.again", "route.back", capacity=16, feedback=True)
    p.run(timeout=10)
    assert sorted(out) == [3, 13, 23, 33]


def test_get_returns_none_when_a_tracked_future_finishes():
    import concurrent.futures as cf

    events = []

    class Poller(Stage):
        def __init__(self):
            super().__init__("poll", inputs={"in": int})

        def run(self, ctx):
            with cf.ThreadPoolExecutor(1) as pool:
                future = ctx.track(pool.submit(time.sleep, 0.05))
                events.append(ctx.get("in"))  # nothing arrives: the future wakes us
                assert future.done()
                events.append(ctx.get("in", timeout=0.02))  # plain timeout
            try:
                ctx.get("in")
            except EndOfStream:
                events.append("end")

    class Quiet(Stage):
        def __init__(self):
            super().__init__("quiet", outputs={"out": int})

        def run(self, ctx):
            ctx.wait(0.2)

    p = Pipeline("track")
    p.add(Quiet())
    p.add(Poller())
    p.connect("quiet", "poll", capacity=1)
    p.run(timeout=10)
    assert events == [None, None, "end"]


def test_metrics_callback_is_called_periodically_and_at_the_end():
    snaps = []
    p = Pipeline("metrics")
    p.chain(
        Source("src", lambda: range(10), output_type=int),
        Sink("slow", lambda x: time.sleep(0.02), input_type=int),
        capacity=1,
    )
    final = p.run(timeout=10, on_metrics=snaps.append, metrics_every=0.05)
    assert len(snaps) >= 3
    assert snaps[-1].stages["slow"].items_in == 10 == final.stages["slow"].items_in
    counts = [s.stages["slow"].items_in for s in snaps]
    assert counts == sorted(counts) and counts[0] < 10
    as_dict = final.to_dict()
    assert as_dict["edges"]["src.out->slow.in"]["items"] == 10


def test_background_run_reports_progress():
    p = Pipeline("background")
    p.chain(
        Source("src", lambda: range(20), output_type=int),
        Sink("slow", lambda x: time.sleep(0.01), input_type=int),
        capacity=1,
    )
    run = p.start()
    with pytest.raises(TimeoutError, match="still running"):
        run.wait(timeout=0.01)
    assert not run.done and run.snapshot().stages["slow"].state in ("running", "opening")
    final = run.wait(timeout=10)
    assert run.done and final.stages["slow"].items_in == 20


def _gated(name: str, gate: threading.Event, seen: list) -> Pipeline:
    """A pipeline whose sink records the collector's settings, then waits for ``gate``."""

    def keep(_: int) -> None:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        assert gate.wait(10)

    p = Pipeline(name)
    p.chain(
        Source("src", lambda: range(1), output_type=int),
        Sink("keep", keep, input_type=int),
        capacity=1,
    )
    return p


def test_runs_tune_the_collector_and_the_last_one_restores_it():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert frozen == 0
    gc.set_threshold(700, 10, 500)  # a user's setting above one of ours stays
    try:
        first_gate, second_gate, seen = threading.Event(), threading.Event(), []
        first = _gated("gc-first", first_gate, seen).start()
        second = _gated("gc-second", second_gate, seen).start()
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s[0] for s in seen] == [(20_000, 20, 500)] * 2
        assert all(count > frozen for _, count in seen)  # what was alive left the scans
        first_gate.set()
        first.wait(timeout=10)
        assert gc.get_threshold() == (20_000, 20, 500)  # the second run still runs
        second_gate.set()
        second.wait(timeout=10)
        assert gc.get_threshold() == (700, 10, 500)
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)
        first_gate.set()
        second_gate.set()


def test_a_freeze_of_the_process_own_is_kept():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        fresh = [[i] for i in range(5000)]  # tracked, alive, not frozen: a second freeze
        #   would add them all. Frozen objects that die leave the count, so it may only fall.
        gate, seen = threading.Event(), []
        gate.set()
        _gated("gc-frozen", gate, seen).run(timeout=10)
        assert seen[0][0][0] >= 20_000  # tuned
        assert count - 1000 < seen[0][1] <= count  # not frozen again (nor unfrozen: 0)
        assert count - 1000 < gc.get_freeze_count() <= count  # nor unfrozen after
        assert len(fresh) == 5000
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_left_alone():
    gc.disable()
    try:
        seen = []
        gate = threading.Event()
        gate.set()
        _gated("gc-off", gate, seen).run(timeout=10)
        assert seen[0][1] == 0 and not gc.isenabled()
    finally:
        gc.enable()
