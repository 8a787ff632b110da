"""One process of the two-process RolloutScheduler check (tests/test_rollout_pool.py).

    python tests/rollout_pool_worker.py pair PROCESS_ID PORT OUT.npz
    python tests/rollout_pool_worker.py reference PAIR0.npz PAIR1.npz OUT.npz

``pair``: one of two ``jax.distributed`` CPU processes (one device each). Each process runs
its own NativeRolloutServer and PromptSource and its own RolloutScheduler over the prompt
rows its data stream reads; a Trainer fits three GRPO updates through it (one batch ahead,
max_lag 1). It saves, per step, the rows its scheduler returned and the parameters it was
handed, the weight pushes it made and the tasks it submitted. Then it runs two fits that
fail on process 1 only, a push that raises and a source that raises, and saves each
process's error.

``reference``: one process with two CPU devices (the pair's global mesh, in one process)
trains from the same initial state on the pair's batches put together (process 0's rows,
then process 1's, as the Trainer places them), scoring each under its own weights, and
saves the differences from what the pair did.
"""

from __future__ import annotations

import os
import sys

mode = sys.argv[1]
if mode == "reference":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

if mode == "pair":
    process_id, port = int(sys.argv[2]), sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import concurrent.futures as cf  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402
from grpo_helpers import WIDTH, tiny_decoder  # noqa: E402

from dew_pipe import Dataset, Trainer  # noqa: E402
from dew_pipe.inference import NativeRolloutServer, PromptSource, Server, ServeTask  # noqa: E402
from dew_pipe.objectives.rl import GRPOObjective, RolloutScheduler, prompt_tasks  # noqa: E402
from dew_pipe.sampling import Sampling  # noqa: E402

PROMPT, NEW, EOS = 5, 8, 2
TASKS, BATCH, GROUPS, ROWS, STEPS = 8, 4, 4, 8, 3  # BATCH tasks a step over both processes
COLUMNS = ("input_ids", "text_segment_ids", "text_positions", "response_mask",
           "old_log_probs", "behavior_log_probs", "advantages", "versions", "session_weights")  # fmt: skip

model = tiny_decoder()
variables = jax.jit(model.init)(jax.random.key(1), np.zeros((1, 4), np.int32))
objective = GRPOObjective(model, seq_len=WIDTH - 1, pretrained=variables, behavior_importance=2.0)
optimizer = optax.adam(3e-2)


def prompts(task: int) -> np.ndarray:
    return (np.arange(PROMPT) * 3 + task * 5) % 10 + 3  # ids 3..12: never EOS


def data() -> Dataset:
    """BATCH prompt rows a step; process p of n reads its own slice of each."""

    def train(partition):
        share = BATCH // partition.count
        for start in range(0, TASKS, BATCH):
            tasks = np.arange(start, start + BATCH)[partition.index * share :][:share]
            yield {
                "prompt": np.stack([prompts(int(t)) for t in tasks]).astype(np.int32),
                "prompt_length": np.full(share, PROMPT, np.int32),
                "task_id": tasks.astype(np.int32),
            }

    return Dataset(train=train, val=None, records=TASKS, batch=BATCH)


def reward(data_source, completion, ground_truth, extra_info) -> float:
    return float(sum(int(t) for t in completion.split()) % 7) / 6.0


def host(tree):
    return jax.tree.map(lambda leaf: np.asarray(leaf.addressable_data(0)), tree)


def flat(tree, prefix):
    return {
        prefix + jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


class Publisher:
    """The process's server as the weights publisher, recording each push it makes;
    ``fail_at`` makes the push of that version raise (on this process only)."""

    def __init__(self, server, fail_at=None):
        self.server, self.fail_at, self.pushes = server, fail_at, []

    @property
    def version(self):
        return self.server.version

    def load(self, params, version):
        self.pushes.append(version)
        if version == self.fail_at:
            raise RuntimeError(f"engine refused version {version}")
        self.server.load(host(params), version)  # this process's copy of the replicated tree


class Source:
    """The PromptSource, recording the tasks submitted; ``fail_task`` makes that task's
    sessions raise instead of returning a status (a broken source)."""

    def __init__(self, inner, fail_task=None):
        self.inner, self.fail_task, self.tasks = inner, fail_task, set()

    def submit(self, task, **identity):
        self.tasks.add(task.id)
        if task.id == self.fail_task:
            future = cf.Future()
            future.set_exception(RuntimeError(f"sandbox lost for task {task.id}"))
            return future
        return self.inner.submit(task, **identity)

    def cancel(self, future):
        self.inner.cancel(future)

    def close(self):
        pass


class Recorder:
    """The Trainer's rollout: the scheduler, recording what it hands back and the weights."""

    def __init__(self, scheduler):
        self.scheduler, self.read_ahead, self.seen = scheduler, scheduler.read_ahead, []

    def __call__(self, state, batch, key):
        out = self.scheduler(state, batch, key)
        self.seen.append((host(state.params), out))
        return out

    def metrics(self):
        return self.scheduler.metrics()


def fit(trainer, publisher, source, steps):
    records = []
    scheduler = RolloutScheduler(
        objective, source, publisher, width=WIDTH, rows=ROWS, groups=GROUPS,
        tasks=prompt_tasks, max_lag=1, ahead=1, log=records.append,
    )  # fmt: skip
    trainer.rollout = recorder = Recorder(scheduler)
    try:
        state = trainer.fit(scheduler.tasks(data()), steps=steps, log_every=steps)
    finally:
        scheduler.close()
    return state, recorder, records


def pair() -> None:
    out = sys.argv[4]
    assert jax.process_count() == 2 and jax.device_count() == 2
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, Sampling(eos_id=EOS, temperature=1.0)),
            slots=8,
            capacity=PROMPT + NEW,
            buckets=(PROMPT,),
        )
    )
    prompt_source = PromptSource(server, reward, max_new_tokens=NEW, seed=process_id)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), progress=False)
    saved = {}
    try:
        publisher, source = Publisher(server), Source(prompt_source)
        state, recorder, records = fit(trainer, publisher, source, STEPS)
        for step, (params, rows) in enumerate(recorder.seen):
            saved.update(flat(params, f"params/{step}/"))
            saved.update({f"rows/{step}/{name}": rows[name] for name in COLUMNS})
        saved.update(flat(host(state.params), f"params/{STEPS}/"))
        saved["pushes"] = np.array(publisher.pushes)
        saved["tasks"] = np.array(sorted(source.tasks))
        saved["lags"] = np.array([r.lag for r in records])
        saved["updates"] = np.array(int(state.updates))
        # A push that fails on process 1 only, then a source that breaks on process 1 only.
        second = process_id == 1  # the failures happen on process 1 alone
        broken = {
            "push": (Publisher(server, fail_at=2 if second else None), Source(prompt_source)),
            "source": (Publisher(server), Source(prompt_source, fail_task=6 if second else None)),
        }
        for name, (publisher, source) in broken.items():
            server.load(variables, 0)  # the next fit starts from the initial weights again
            try:
                fit(trainer, publisher, source, STEPS)
                saved[f"error/{name}"] = np.array("no error")
            except Exception as error:  # noqa: BLE001 - the message is what the test checks
                saved[f"error/{name}"] = np.array(f"{type(error).__name__}: {error}")
    finally:
        prompt_source.close()
        server.close()
    np.savez(out, **saved)


def reference() -> None:
    first, second = (dict(np.load(path)) for path in sys.argv[2:4])
    out = sys.argv[4]
    assert jax.process_count() == 1 and jax.device_count() == 2
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), progress=False)
    state = trainer.initial_state()
    score = jax.jit(objective.packed_log_probs)
    saved = {}
    for step in range(STEPS):
        batch = {
            name: np.concatenate([first[f"rows/{step}/{name}"], second[f"rows/{step}/{name}"]])
            for name in COLUMNS
        }
        ours = flat(host(state.params), "")
        saved[f"params_error/{step}"] = max(
            float(np.max(np.abs(ours[k] - first[f"params/{step}/{k}"]))) for k in ours
        )
        mask = batch["response_mask"] == 1
        scored = np.asarray(score(state.params, batch))
        saved[f"rescore_error/{step}"] = float(
            np.max(np.abs(scored[mask] - batch["old_log_probs"][mask]))
        )
        saved[f"behavior_gap/{step}"] = float(
            np.max(np.abs(batch["old_log_probs"][mask] - batch["behavior_log_probs"][mask]))
        )
        state, _ = trainer.train_step(state, batch)
    ours = flat(host(state.params), "")
    initial = flat(host(trainer.initial_state().params), "")
    saved["params_error/final"] = max(
        float(np.max(np.abs(ours[k] - first[f"params/{STEPS}/{k}"]))) for k in ours
    )
    saved["pair_agrees"] = max(
        float(np.max(np.abs(first[f"params/{STEPS}/{k}"] - second[f"params/{STEPS}/{k}"])))
        for k in ours
    )
    saved["moved"] = max(float(np.max(np.abs(ours[k] - initial[k]))) for k in ours)
    np.savez(out, **saved)


if __name__ == "__main__":
    pair() if mode == "pair" else reference()
