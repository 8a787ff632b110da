"""Inlet and Outlet: a thread outside a running pipeline feeding it and reading from it."""

import threading
import time

import pytest

from dew_pipe.flow import (
    Cancelled,
    EndOfStream,
    FlowError,
    Inlet,
    Map,
    Outlet,
    Pipeline,
    StageFailed,
)


def _chain(fn=lambda x: 2 * x, capacity=1):
    inlet = Inlet("feed", output_type=int, capacity=capacity)
    outlet = Outlet("results", input_type=int, capacity=capacity)
    p = Pipeline("outside")
    p.chain(inlet, Map("work", fn, input_type=int), outlet, capacity=1)
    return p, inlet, outlet


def test_items_round_trip_in_order_and_the_stream_ends_on_close():
    p, inlet, outlet = _chain()
    run = p.start()
    got = []
    for x in range(5):
        inlet.put(x)
        got.append(outlet.get(timeout=10))
    inlet.end()
    with pytest.raises(EndOfStream):
        outlet.get(timeout=10)
    run.wait(timeout=10)
    assert got == [0, 2, 4, 6, 8]
    with pytest.raises(FlowError, match="its run has ended"):
        inlet.put(1)
    ended = Inlet("idle", output_type=int)
    ended.end()
    with pytest.raises(FlowError, match="the stream was ended"):
        ended.put(1)


def test_put_checks_the_port_type_and_blocks_at_capacity():
    p, inlet, outlet = _chain(capacity=1)
    with pytest.raises(TypeError, match="inlet 'feed': got a str, expected int"):
        inlet.put("3")
    inlet.put(1)  # before the run starts: held
    with pytest.raises(TimeoutError, match="no room within 0.05 s"):
        inlet.put(2, timeout=0.05)
    run = p.start()
    assert outlet.get(timeout=10) == 2
    inlet.end()
    run.wait(timeout=10)


def test_a_failed_run_releases_both_sides_and_names_the_stage():
    def boom(x):
        raise ValueError("bad item")

    p, inlet, outlet = _chain(fn=boom)
    run = p.start()
    inlet.put(1)
    with pytest.raises(EndOfStream):
        outlet.get(timeout=10)
    with pytest.raises(StageFailed, match="stage 'work' failed"):
        run.wait(timeout=10)
    deadline = time.monotonic() + 10
    with pytest.raises(FlowError, match="run has ended"):
        while time.monotonic() < deadline:  # the inlet's thread has finished by now
            inlet.put(2, timeout=1)
    assert not [t for t in threading.enumerate() if t.name.startswith("flow:outside:")]


def test_cancellation_wakes_a_waiting_inlet_and_outlet():
    p, inlet, outlet = _chain()
    run = p.start()
    time.sleep(0.05)
    run.cancel("stop")
    with pytest.raises(Cancelled, match="stop"):
        run.wait(timeout=10)
    with pytest.raises(EndOfStream):
        outlet.get(timeout=10)
    with pytest.raises(FlowError):
        inlet.put(1, timeout=1)
