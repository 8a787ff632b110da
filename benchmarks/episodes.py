"""Multi-turn episodes/s: EnvironmentSource on the native server against EpisodeRollout.

Both collectors run the same episodes: the same decoder and weights, the same tasks, the
same environment and so the same turn counts, the same sampling and budgets.

- ``cohort``: ``EpisodeRollout(TextGeneration(model, variables), ...).collect``: the B * G
  episodes of a collection sample in lock-step rounds, every round one compiled
  ``generate`` call over all slots (finished episodes hold inert rows), so a round lasts
  as long as its longest response and the collection as long as its longest episode.
- ``source``: ``EnvironmentSource`` on a ``NativeRolloutServer`` with as many slots as the
  cohort has rows: every episode runs on its own thread and submits each turn when its
  previous one is answered, so turns of different episodes share the continuous batch and
  a finished response frees its row at once.

The environment (in-process, no tool cost) shows ``[task, sample]`` and appends three ids
after each turn; episode ``(task, sample)`` ends after ``1 + (3 * task + sample) % T``
turns, so turn counts spread from 1 to T within every group. Sampling is temperature 1
with ``--eos`` of the 128 ids as EOS ids (32: responses of about 4 ids; 8: about 16); a
budget hit truncates the episode in both collectors alike.

Each round times one collection of each (the order alternating), after ``--warmup``
untimed collections of each that compile every shape. The report gives episodes/s, model
calls/s and sampled ids/s per collector (medians over rounds), the source-over-cohort
ratio, the server's batch occupancy (busy rows per decode step over its slots) and the
cohort's (running episodes per round over its rows).

    .venv/bin/python benchmarks/episodes.py [--rounds 5] [--tasks 8 --groups 8 --turns 4]
    .venv/bin/python benchmarks/episodes.py --eos 32 --budget 24 --context 96   # short turns
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

from machine import print_machine

VOCAB = 128


class Turns:
    """The benchmark's environment: ``1 + (3 * task + sample) % turns`` turns, each answered
    by the turn's ids and three more."""

    def __init__(self, task: int, sample: int, turns: int) -> None:
        self.left = 1 + (3 * task + sample) % turns
        self.first = [4 + task % 100, 4 + sample % 100]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def reset(self):
        from dew_pipe.objectives.rl import Observation

        return Observation(self.first)

    def step(self, action):
        from dew_pipe.objectives.rl import Observation

        self.left -= 1
        if self.left == 0:
            return Observation(status="completed", detail=str(action.tokens.size))
        return Observation([*action.context.tolist(), *action.tokens.tolist(), 1, 2, 3])


def reward(episode) -> float:
    return float(len(episode.actions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="B, tasks per collection")
    parser.add_argument("--groups", type=int, default=8, help="G, episodes per task")
    parser.add_argument("--turns", type=int, default=4, help="T, the most turns per episode")
    parser.add_argument("--budget", type=int, default=48, help="R, ids per turn at most")
    parser.add_argument("--context", type=int, default=160, help="P, the longest context")
    parser.add_argument(
        "--eos",
        type=int,
        default=8,
        help="ids of the 128 that end a turn (8: turns of about 16 ids; 32: about 4)",
    )
    parser.add_argument(
        "--steps-per-call", type=int, default=8, help="the server's decode steps per compiled call"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print_machine()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew_pipe import models
    from dew_pipe.inference import (
        EnvironmentSource,
        NativeRolloutServer,
        Server,
        ServeTask,
        TextGeneration,
    )
    from dew_pipe.objectives.rl import EpisodeRollout, Task
    from dew_pipe.sampling import Sampling

    B, G, T, R, P = args.tasks, args.groups, args.turns, args.budget, args.context
    model = models.build(
        "causal_transformer", vocab_size=VOCAB, emb_features=128, num_layers=2, num_heads=4,
        mlp_features=256, max_seq_len=P + R,
    )  # fmt: skip
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    sampling = Sampling(eos_id=tuple(range(VOCAB - args.eos, VOCAB)), temperature=1.0)
    slots = B * G
    state = types.SimpleNamespace(step=0, updates=0, params=variables)
    rollout = EpisodeRollout(
        TextGeneration(model, variables), lambda i: Turns(i.task, i.sample, T),
        reward, max_prompt_tokens=P, max_new_tokens=R, max_turns=T, groups=G, sampling=sampling,
    )  # fmt: skip
    server = NativeRolloutServer(
        Server.from_task(
            ServeTask(model, variables, sampling), slots=slots, capacity=P + R - 1,
            steps_per_call=args.steps_per_call,
            buckets=(P,),  # one prefill width (contexts never pass P): fewer shapes to warm
        )
    )  # fmt: skip
    source = EnvironmentSource(
        server, lambda task, identity: Turns(task.id, identity.sample, T),
        lambda task, episode: reward(episode), max_prompt_tokens=P, max_new_tokens=R,
        max_turns=T, workers=slots,
    )  # fmt: skip
    tasks = np.arange(B)

    def cohort(round_: int) -> dict:
        start = time.perf_counter()
        episodes = rollout.collect(state, {"task_id": tasks}, jax.random.key(round_))
        seconds = time.perf_counter() - start
        turns = [len(e.actions) for e in episodes]
        rows = 1 << (slots - 1).bit_length()  # TextGeneration pads rows to a power of two
        running = sum(turns)  # one running row per episode per round it samples in
        return {
            "seconds": seconds, "episodes": len(episodes), "calls": sum(turns),
            "ids": sum(a.tokens.size for e in episodes for a in e.actions),
            "occupancy": running / (rows * max(turns)), "turns": sorted(turns),
        }  # fmt: skip

    def environment_source(round_: int) -> dict:
        before = server.counters()
        start = time.perf_counter()
        futures = [
            source.submit(Task(int(t)), group=int(t), sample=g, attempt=round_)
            for t in tasks
            for g in range(G)
        ]
        sessions = [f.result() for f in futures]
        seconds = time.perf_counter() - start
        after = server.counters()
        steps = after.steps - before.steps
        busy = sum(k * (v - before.rows_per_step.get(k, 0)) for k, v in after.rows_per_step.items())
        return {
            "seconds": seconds, "episodes": len(sessions),
            "calls": sum(len(s.calls) for s in sessions),
            "ids": sum(c.sampled_ids.size for s in sessions for c in s.calls),
            "occupancy": busy / (steps * slots), "turns": sorted(len(s.calls) for s in sessions),
            "steps": steps, "decode_calls": after.calls - before.calls,
            "prefills": after.prefills - before.prefills,
            "statuses": sorted({s.status.value for s in sessions}),
        }  # fmt: skip

    runs = {"cohort": cohort, "source": environment_source}
    for k in (1 << i for i in range(slots.bit_length())):  # every prefill of k joining rows
        for f in [server.submit([5] * P, 1, seed=j) for j in range(k)]:
            f.result()
    for i in range(args.warmup):
        for run in runs.values():
            run(1000 + i)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            results[name].append(runs[name](r))
    source.close()
    server.close()

    def median(name: str, key: str) -> float:
        return statistics.median(x[key] / x["seconds"] if key else x["seconds"]
                                 for x in results[name])  # fmt: skip

    print(f"{B} tasks x {G} episodes, at most {T} turns of {R} ids, contexts up to {P} ids; "
          f"{args.rounds} rounds after {args.warmup} warm-up collections each")  # fmt: skip
    for name in runs:
        last = results[name][-1]
        occupancy = statistics.median(x["occupancy"] for x in results[name])
        print(
            f"{name:>7}: {median(name, 'episodes'):7.1f} episodes/s, {median(name, 'calls'):7.1f}"
            f" calls/s, {median(name, 'ids'):8.0f} ids/s ({median(name, '') * 1000:.0f} ms per "
            f"collection); occupancy {occupancy:.0%}; turns per episode "
            f"{np.bincount(last['turns'], minlength=T + 1)[1:].tolist()}"
        )
    ratios = [
        (s["episodes"] / s["seconds"]) / (c["episodes"] / c["seconds"])
        for s, c in zip(results["source"], results["cohort"], strict=True)
    ]
    print(f"source / cohort episodes/s: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    last = results["source"][-1]
    print(f"server, last round: {last['steps']} decode steps in {last['decode_calls']} calls, "
          f"{last['prefills']} prefills for {last['calls']} turns; statuses "
          f"{last['statuses']}")  # fmt: skip


if __name__ == "__main__":
    main()
