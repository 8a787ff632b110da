"""Dataset, Partition, check_batch and the Loading read-ahead helpers."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dew_pipe import Dataset as TopDataset
from dew_pipe import Loading as TopLoading
from dew_pipe.data import Dataset, Loading, Partition, Prefetch
from dew_pipe.data.dataset import check_batch


def test_top_level_and_package_exports_are_the_same_objects():
    assert TopDataset is Dataset
    assert TopLoading is Loading


def test_dataset_as_the_spec_writes_it():
    batch = {"text": np.tile(np.arange(5, dtype=np.int32), (8, 1))}
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=8, batch=8)
    assert next(data.open_train(Partition(0, 1))) is batch
    assert (data.records, data.batch, data.val) == (8, 8, None)
    seen = []
    data = Dataset(
        train=lambda partition: (seen.append(partition), itertools.repeat(batch))[1],
        val=None,
        records=8,
        batch=8,
    )
    iterator = data.open_train(Partition(0, 1))
    assert next(iterator) is batch
    assert seen == [(0, 1)]
    index, count = seen[0]
    assert (index, count) == (0, 1)


def test_dataset_open_train_accepts_iterables_and_rejects_others():
    batches = [{"x": np.zeros((2, 1))}, {"x": np.ones((2, 1))}]
    data = Dataset(train=lambda partition: batches, batch=2)
    assert [b["x"][0, 0] for b in data.open_train(Partition(0, 1))] == [0.0, 1.0]
    bad = Dataset(train=lambda partition: 3, batch=2)
    with pytest.raises(TypeError, match="Dataset.train returned int"):
        bad.open_train(Partition(0, 1))


def test_dataset_val():
    batch = {"x": np.zeros((2, 1))}
    data = Dataset(train=lambda p: iter(()), val=lambda p: [batch, batch], batch=2)
    assert len(list(data.open_val(Partition(0, 1)))) == 2
    with pytest.raises(ValueError, match="Dataset.val is None"):
        Dataset(train=lambda p: iter(()), batch=2).open_val(Partition(0, 1))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"train": 3, "batch": 8}, TypeError, "Dataset.train=3 is not callable"),
        ({"train": iter, "val": 5, "batch": 8}, TypeError, "Dataset.val=5 is not callable"),
        ({"train": iter}, ValueError, "Dataset.batch is missing"),
        ({"train": iter, "batch": 0}, ValueError, r"Dataset.batch is 0; expected an int >= 1"),
        ({"train": iter, "batch": True}, TypeError, "Dataset.batch is True; expected an int"),
        ({"train": iter, "batch": 2.0}, TypeError, "Dataset.batch is 2.0; expected an int"),
        ({"train": iter, "batch": 8, "records": -1}, ValueError, "Dataset.records is -1"),
    ],
)
def test_dataset_rejects_bad_fields(kwargs, error, message):
    with pytest.raises(error, match=message):
        Dataset(**kwargs)


def test_partition():
    assert Partition(1, 4) == (1, 4)
    assert Partition(1, 4).local_batch(8) == 2
    assert [Partition(1, 3).owns(i) for i in range(6)] == [False, True, False, False, True, False]
    with pytest.raises(ValueError, match=r"batch=6 does not divide among 4 processes"):
        Partition(0, 4).local_batch(6)
    with pytest.raises(ValueError, match=r"Partition.index=2; expected an int below count=2"):
        Partition(2, 2)
    with pytest.raises(ValueError, match=r"Partition.count is 0"):
        Partition(0, 0)


def test_check_batch():
    out = check_batch({"a": [[1, 2]], "b": np.zeros((1, 3), np.int8)}, rows=1)
    assert out["a"].shape == (1, 2) and out["b"].dtype == np.int8
    with pytest.raises(TypeError, match="batch is a list; expected a mapping"):
        check_batch([1, 2])
    with pytest.raises(ValueError, match="has no fields"):
        check_batch({})
    with pytest.raises(TypeError, match=r"field 'a' has dtype <U1"):
        check_batch({"a": np.array(["x"])})
    with pytest.raises(ValueError, match=r"field 'a' is a scalar"):
        check_batch({"a": np.float32(1.0)})
    with pytest.raises(ValueError, match=r"field 'b' has 3 rows but 'a' has 2"):
        check_batch({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))})
    with pytest.raises(ValueError, match=r"training batch 4 has 2 rows \(field 'a'\); expected 8"):
        check_batch({"a": np.zeros((2, 1))}, rows=8, where="training batch 4")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"workers": -1}, ValueError, r"Loading.workers is -1; expected an int >= 0"),
        ({"threads": 0}, ValueError, r"Loading.threads is 0; expected an int >= 1"),
        ({"read_buffer": -2}, ValueError, r"Loading.read_buffer is -2; expected an int >= 0"),
        ({"threads": True}, TypeError, "Loading.threads is True; expected an int"),
        ({"workers": "2"}, TypeError, "Loading.workers is '2'; expected an int"),
    ],
)
def test_loading_rejects_bad_fields(kwargs, error, message):
    with pytest.raises(error, match=message):
        Loading(**kwargs)


def _slow_square(x: int) -> int:
    time.sleep(0.001 * ((x * 7) % 5))  # finish out of order
    return x * x


@pytest.mark.parametrize(
    "loading",
    [
        Loading(workers=0, threads=1, read_buffer=0),
        Loading(workers=0, threads=1, read_buffer=2),
        Loading(workers=0, threads=4, read_buffer=1),
    ],
    ids=["sync", "prefetch-thread", "thread-pool"],
)
def test_loading_map_keeps_order(loading):
    with loading.map(_slow_square, range(40)) as results:
        assert list(results) == [x * x for x in range(40)]


def test_loading_map_in_worker_processes():
    # abs is picklable by reference, so spawned workers need not import this test module.
    with Loading(workers=2, threads=1, read_buffer=2).map(abs, range(-10, 10)) as results:
        assert list(results) == [abs(x) for x in range(-10, 10)]


def test_loading_prefetch_passes_items_through():
    with Loading(read_buffer=3).prefetch(iter("abc")) as items:
        assert list(items) == ["a", "b", "c"]


def test_prefetch_reads_a_bounded_distance_ahead():
    pulled = []

    def source():
        for i in itertools.count():
            pulled.append(i)
            yield i

    with Prefetch(source(), buffer=2) as items:
        assert next(items) == 0
        time.sleep(0.3)  # let the producer run as far as the queue allows
        # one consumed, two queued, one held by the producer while it waits to put
        assert len(pulled) <= 1 + 2 + 1
        assert next(items) == 1


def test_prefetch_reraises_the_source_error_after_the_good_items():
    def source():
        yield 1
        yield 2
        raise KeyError("broken row 3")

    items = Prefetch(source(), buffer=1)
    assert next(items) == 1
    assert next(items) == 2
    with pytest.raises(KeyError, match="broken row 3"):
        next(items)
    with pytest.raises(StopIteration):
        next(items)


@pytest.mark.parametrize("loading", [Loading(threads=3), Loading(threads=1, read_buffer=2)])
def test_loading_map_reraises_the_function_error(loading):
    def fn(x):
        if x == 5:
            raise ValueError(f"cannot decode record {x}")
        return x

    with loading.map(fn, range(10)) as results:
        assert [next(results) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError, match="cannot decode record 5"):
            next(results)


def test_prefetch_close_stops_the_thread_and_closes_the_source():
    closed = threading.Event()

    def source():
        try:
            yield from itertools.count()
        finally:
            closed.set()

    items = Prefetch(source(), buffer=2)
    assert next(items) == 0
    items.close()
    assert closed.wait(5.0)
    assert not items._thread.is_alive()
    with pytest.raises(StopIteration):
        next(items)


def test_importing_the_package_and_datasets_does_not_import_jax():
    code = (
        "import sys, dew_pipe; from dew_pipe import Dataset, Loading; "
        "assert 'jax' not in sys.modules, 'jax imported'; "
        "assert dew_pipe.Dataset is Dataset and 'Trainer' in dir(dew_pipe)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        import dew_pipe

        dew_pipe.Nope  # noqa: B018
