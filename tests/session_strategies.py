"""Hypothesis strategies and helpers for session tests (imported by test files)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from dew_pipe.objectives.rl.sessions import Call, Session, Status


def call(prompt, sampled, version=0, raw=None, **kw):
    """A call with distinct, recognizable behavior log-probs."""
    behavior = [-0.5 - 0.01 * k for k in range(len(sampled))]
    return Call(prompt, sampled, behavior, "stop", version, log_probs=raw, **kw)


def trains(s, truncation):
    """Whether pack trains this session, from the spec's rules."""
    if s.status in (Status.COMPLETED, Status.AGENT_ERROR):
        return True
    return s.status is Status.TRUNCATED and truncation != "mask"


@st.composite
def sessions_strategy(draw, max_sessions=7, with_extras=False, min_sampled=0):
    """Sessions whose intended chain structure is known: returns (sessions, chains)."""
    ids = st.integers(0, 40)
    out, structure = [], []
    for index in range(draw(st.integers(0, max_sessions))):
        calls, chains = [], []
        for k in range(draw(st.integers(0, 4))):
            sampled = draw(st.lists(ids, min_size=min_sampled, max_size=5))
            previous = calls[-1] if calls else None
            mode = draw(st.sampled_from(["extend", "new", "prompt_prefix"])) if calls else "new"
            if mode == "extend":
                between = draw(st.lists(ids, max_size=3))
                prompt = [*previous.prompt_ids, *previous.sampled_ids, *between]
            elif mode == "prompt_prefix" and previous.sampled_ids.size:
                # starts with the previous prompt but not with its draw: must not merge
                wrong = [(int(previous.sampled_ids[0]) + 1) % 41]
                prompt = [*previous.prompt_ids, *wrong, *draw(st.lists(ids, max_size=2))]
            else:
                first = 41 + len(chains)  # a first id no earlier chain has: cannot extend
                prompt = [first, *draw(st.lists(ids, max_size=4))]
                mode = "new"
            if mode == "extend":
                chains[-1].append(k)
            else:
                chains.append([k])
            extras = {}
            if with_extras and draw(st.booleans()):
                n = len(prompt) + len(sampled) - draw(st.integers(0, 1))
                if n >= 1:
                    extras["routed_experts"] = np.full((n, 2, 2), 10 * index + k, np.int16)
            if with_extras and draw(st.booleans()):
                extras["support"] = [[s, 41 + s] for s in sampled]
            raw = draw(st.one_of(st.none(), st.just([-0.25 * (m + 1) for m in sampled])))
            version = draw(st.integers(0, 3))
            calls.append(call(prompt, sampled, version, raw, **extras))
        status = draw(st.sampled_from(list(Status)))
        reward = draw(st.one_of(st.floats(-2, 2, allow_nan=False), st.sampled_from([0.0, 1.0])))
        out.append(
            Session(
                draw(st.integers(0, 2)), draw(st.integers(0, 1)), index, 0, calls, status, reward
            )
        )
        structure.append(chains)
    return out, structure
