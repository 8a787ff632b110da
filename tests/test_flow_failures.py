"""Failure paths: a stage that raises, hangs, is cancelled, deadlocks; every thread joined."""

import os
import signal
import threading
import time

import pytest

from dew_pipe.flow import (
    Cancelled,
    Deadlock,
    Map,
    Pipeline,
    Port,
    RunTimeout,
    Sink,
    Source,
    Stage,
    StageFailed,
    StageTimeout,
)

BOUND_S = 3.0  # every failure must surface well within this


def _threads(name):
    return [t for t in threading.enumerate() if t.name.startswith(f"flow:{name}:")]


class Lifecycle(Stage):
    """Passes items on; records open/close so tests can check close runs on every path."""

    def __init__(self, name, log, *, fail_open=False, fail_close=False):
        super().__init__(name, inputs={"in": int}, outputs={"out": int})
        self.log, self.fail_open, self.fail_close = log, fail_open, fail_close

    def open(self):
        self.log.append(f"open {self.name}")
        if self.fail_open:
            raise OSError("no device")

    def run(self, ctx):
        for x in ctx.read("in"):
            ctx.put("out", x)

    def close(self):
        self.log.append(f"close {self.name}")
        if self.fail_close:
            raise OSError("close failed")


def _endless():
    i = 0
    while True:
        yield i
        i += 1


@pytest.mark.parametrize("workers", [1, 3])
def test_raising_stage_fails_the_run_naming_stage_and_item(workers):
    log = []

    def boom(x):
        if x == 7:
            raise ValueError("bad reward for 7")
        return x

    p = Pipeline(f"raise{workers}")
    p.chain(
        Source("src", _endless, output_type=int),
        Lifecycle("pass", log),
        Map("reward", boom, input_type=int, workers=workers),
        Sink("sink", lambda x: None, input_type=int),
        capacity=2,
    )
    start = time.monotonic()
    with pytest.raises(StageFailed) as info:
        p.run(timeout=30)
    assert time.monotonic() - start < BOUND_S
    err = info.value
    assert err.stage == "reward" and err.item == 7
    assert str(err) == "stage 'reward' failed on item 7: ValueError: bad reward for 7"
    assert isinstance(err.__cause__, ValueError) and err.__cause__.args == ("bad reward for 7",)
    assert log == ["open pass", "close pass"]
    assert not _threads(p.name)


def test_failure_in_open_and_close_are_named():
    log = []
    p = Pipeline("open-fails")
    p.chain(Source("src", _endless, output_type=int), Lifecycle("dev", log, fail_open=True),
            Sink("sink", lambda x: None, input_type=int), capacity=1)  # fmt: skip
    with pytest.raises(StageFailed, match="stage 'dev' failed: OSError: no device") as info:
        p.run(timeout=10)
    assert info.value.item is None and log == ["open dev"]  # close only after a good open
    q = Pipeline("close-fails")
    q.chain(Source("src", lambda: range(3), output_type=int), Lifecycle("dev", log, fail_close=True),
            Sink("sink", lambda x: None, input_type=int), capacity=1)  # fmt: skip
    with pytest.raises(
        StageFailed, match="stage 'dev' failed in close\\(\\): OSError: close failed"
    ):
        q.run(timeout=10)
    assert not _threads("open-fails") and not _threads("close-fails")


def test_wrong_item_type_is_refused_at_put_naming_stage_and_port():
    p = Pipeline("types")
    p.chain(
        Source("src", lambda: [1, 2, "three"], output_type=int),
        Sink("sink", lambda x: None, input_type=int),
        capacity=1,
    )
    with pytest.raises(
        StageFailed,
        match="stage 'src' failed on item 2: TypeError: stage 'src' port 'out': got a str, expected int",
    ):
        p.run(timeout=10)


class Hang(Stage):
    """Takes one item, then loops cooperatively forever (checks ctx.cancelled)."""

    def __init__(self, timeout=None):
        super().__init__("hang", inputs={"in": int}, timeout=timeout)
        self.stopped = threading.Event()

    def run(self, ctx):
        ctx.item = 0
        ctx.get("in")
        while not ctx.cancelled:
            ctx.wait(0.05)
        self.stopped.set()


def test_stage_past_its_timeout_fails_the_run():
    hang = Hang(timeout=0.3)
    p = Pipeline("hang")
    p.chain(Source("src", _endless, output_type=int), hang, capacity=2)
    start = time.monotonic()
    with pytest.raises(StageFailed) as info:
        p.run(timeout=30)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < BOUND_S
    assert info.value.stage == "hang" and info.value.item == 0
    assert isinstance(info.value.__cause__, StageTimeout)
    assert "no progress for 0.3" in str(info.value) and "timeout=0.3 s" in str(info.value)
    assert hang.stopped.is_set() and not _threads("hang")


def test_time_blocked_on_queues_does_not_count_toward_the_timeout():
    # the consumer waits ~0.5 s for input in total, longer than its 0.2 s timeout
    p = Pipeline("patient")
    p.chain(
        Source("slow-src", lambda: (time.sleep(0.1) or i for i in range(5)), output_type=int),
        Sink("sink", lambda x: None, input_type=int, timeout=0.2),
        capacity=1,
    )
    assert p.run(timeout=10).stages["sink"].items_in == 5


def test_heartbeat_keeps_a_long_stage_alive():
    class Long(Stage):
        def __init__(self):
            super().__init__("long", outputs={"out": int}, timeout=0.15)

        def run(self, ctx):
            for _ in range(6):
                ctx.wait(0.05)
                ctx.heartbeat()
            ctx.put("out", 1)

    got = []
    p = Pipeline("beat")
    p.chain(Long(), Sink("sink", got.append, input_type=int), capacity=1)
    p.run(timeout=10)
    assert got == [1]


@pytest.mark.parametrize("how", ["event", "method"])
def test_cancellation_from_outside(how):
    hang = Hang()
    event = threading.Event()
    p = Pipeline(f"cancel-{how}")
    p.chain(Source("src", _endless, output_type=int), hang, capacity=2)
    run = p.start(cancel=event)
    time.sleep(0.1)
    start = time.monotonic()
    if how == "event":
        event.set()
    else:
        run.cancel("stop now")
    with pytest.raises(Cancelled) as info:
        run.wait(timeout=BOUND_S)
    assert time.monotonic() - start < 1.0
    assert str(info.value) == ("cancelled from outside" if how == "event" else "stop now")
    assert not isinstance(info.value, RunTimeout)
    assert hang.stopped.is_set() and not _threads(p.name)


def test_run_timeout_cancels_with_run_timeout():
    p = Pipeline("overall")
    p.chain(Source("src", _endless, output_type=int), Hang(), capacity=2)
    start = time.monotonic()
    with pytest.raises(RunTimeout, match="pipeline 'overall' did not finish within 0.3 s"):
        p.run(timeout=0.3)
    assert time.monotonic() - start < BOUND_S and not _threads("overall")


def test_run_timeout_fires_on_time_however_long_the_supervisor_may_sleep(monkeypatch):
    from dew_pipe.flow import runtime

    monkeypatch.setattr(runtime, "_SLOW_TICK_S", 60.0)  # no stage has a timeout here
    p = Pipeline("overall-slow-tick")
    p.chain(Source("src", _endless, output_type=int), Hang(), capacity=2)
    start = time.monotonic()
    with pytest.raises(RunTimeout, match="did not finish within 0.3 s"):
        p.run(timeout=0.3)
    assert time.monotonic() - start < BOUND_S


def test_keyboard_interrupt_while_waiting_cancels_and_reraises():
    hang = Hang()
    p = Pipeline("ctrl-c")
    p.chain(Source("src", _endless, output_type=int), hang, capacity=2)
    # Python's own handler, whatever this process inherited: a shell starts background jobs
    # with SIGINT ignored, and the signal would then never arrive.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = p.start()
        timer = threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run.wait(timeout=30)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.done and hang.stopped.is_set() and not _threads("ctrl-c")


def test_uncooperative_thread_is_reported_after_join_timeout():
    release = threading.Event()

    class Stuck(Stage):
        def __init__(self):
            super().__init__("stuck", inputs={"in": int})

        def run(self, ctx):
            ctx.get("in")
            release.wait()  # ignores cancellation, like a blocking C call

    p = Pipeline("stuck")
    p.chain(Source("src", _endless, output_type=int), Stuck(), capacity=1)
    run = p.start(join_timeout=0.2)
    time.sleep(0.05)
    run.cancel()
    try:
        start = time.monotonic()
        with pytest.raises(Cancelled) as info:
            run.wait(timeout=BOUND_S)
        assert time.monotonic() - start < 1.0
        assert info.value.stuck == ("flow:stuck:stuck",)
        assert str(info.value) == (
            "cancelled from outside; 1 thread(s) did not stop within 0.2 s of cancellation "
            "and were left running: flow:stuck:stuck"
        )
        with pytest.raises(Exception, match="stage 'stuck' is already running"):
            p.start()  # still claimed by the thread that did not stop
    finally:
        release.set()
    for thread in _threads("stuck"):
        thread.join(2)
    assert not _threads("stuck")
    release.clear()
    run = p.start(join_timeout=0.2)  # released once its thread ended
    run.cancel()
    release.set()
    with pytest.raises(Cancelled):
        run.wait(BOUND_S)


def test_stage_in_a_running_pipeline_cannot_run_twice():
    hang = Hang()
    p = Pipeline("claim")
    p.chain(Source("src", _endless, output_type=int), hang, capacity=1)
    run = p.start()
    try:
        with pytest.raises(Exception, match="stage 'src' is already running"):
            p.start()
    finally:
        run.cancel()
        with pytest.raises(Cancelled):
            run.wait(BOUND_S)
    assert not _threads("claim")


def test_cycle_deadlock_is_detected_and_named():
    class Amplify(Stage):
        def __init__(self):
            super().__init__(
                "amp", inputs={"in": int, "back": Port(int, required=False)}, outputs={"out": int}
            )

        def run(self, ctx):
            while True:
                got = ctx.get_any()
                if got is not None:
                    for _ in range(3):
                        ctx.put("out", got[1])

    p = Pipeline("deadlock")
    p.add(Source("src", lambda: range(10), output_type=int))
    p.add(Amplify())
    p.add(Map("echo", lambda x: x, input_type=int))
    p.connect("src", "amp.in", capacity=1)
    p.connect("amp", "echo", capacity=1)
    p.connect("echo", "amp.back", capacity=1, feedback=True)
    start = time.monotonic()
    with pytest.raises(Deadlock) as info:
        p.run(timeout=30)
    assert time.monotonic() - start < BOUND_S
    msg = str(info.value)
    assert "pipeline 'deadlock' deadlocked in a cycle" in msg
    assert "'echo' waits for room on echo.out->amp.back (1/1)" in msg
    assert "'amp' waits for room on amp.out->echo.in (1/1)" in msg
    assert isinstance(info.value, StageFailed) and not _threads("deadlock")


def test_failing_metrics_callback_fails_the_run():
    def broken(snapshot):
        raise OSError("disk full")

    p = Pipeline("bad-metrics")
    p.chain(
        Source("src", _endless, output_type=int),
        Sink("sink", lambda x: None, input_type=int),
        capacity=1,
    )
    with pytest.raises(StageFailed, match="stage 'on_metrics' failed: OSError: disk full"):
        p.run(timeout=10, on_metrics=broken, metrics_every=0.05)
    assert not _threads("bad-metrics")


def test_first_failure_wins_later_ones_are_secondary():
    second_has_item = threading.Event()

    class Fails(Stage):
        def __init__(self, name, delay):
            super().__init__(name, inputs={"in": int})
            self.delay = delay

        def run(self, ctx):
            ctx.get("in")
            if self.name == "second":
                second_has_item.set()
            else:
                second_has_item.wait(5)
            time.sleep(self.delay)  # second raises well after first cancelled the run
            raise RuntimeError(f"{self.name} broke")

    p = Pipeline("two-fail")
    p.add(Source("src", _endless, output_type=int))
    p.add(Fails("first", 0.0))
    p.add(Fails("second", 0.2))
    p.connect("src", "first", capacity=1)
    p.connect("src", "second", capacity=1)
    run = p.start()
    with pytest.raises(StageFailed, match="stage 'first' failed: RuntimeError: first broke"):
        run.wait(BOUND_S)
    assert [(name, str(e)) for name, e in run.secondary] == [("second", "second broke")]
