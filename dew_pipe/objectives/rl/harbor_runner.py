"""Runs one Harbor trial and prints its outcome as one JSON line (run by Harbor's interpreter).

`HarborSource` starts this file as ``<harbor python> -P harbor_runner.py CONFIG.json`` (``-P``:
this folder stays off sys.path, where ``harbor.py`` would shadow Harbor); dew_pipe
itself never imports it, since Harbor (0.25.0: Python >= 3.12) lives in its own
environment. The config is a Harbor ``TrialConfig`` as JSON. The last line on stdout is

    {"reward": float | null, "rewards": {...} | null, "cause": str | null,
     "exception": str | null, "message": str | null, "trial_dir": str}

where ``cause`` is Harbor's own classification of the failure (``FailureCause``:
``agent_exhausted_budget``, ``sandbox_failed``, ``model_provider_failed``...), ``reward`` the
verifier's ``reward`` entry (or its only entry), and ``reward_valid`` whether Harbor counts
the reward as a measurement of the agent. SIGTERM cancels the trial so that Harbor stops
its environment before the process exits.
"""

import asyncio
import json
import signal
import sys


def _reward(rewards):
    if not rewards:
        return None
    if "reward" in rewards:
        return float(rewards["reward"])
    if len(rewards) == 1:
        return float(next(iter(rewards.values())))
    return None


async def _run(path):
    from harbor.models.trial.config import TrialConfig
    from harbor.trial.trial import Trial

    with open(path) as file:
        config = TrialConfig.model_validate_json(file.read())
    trial = await Trial.create(config)
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await trial.run()


def main(argv):
    if len(argv) != 2:
        sys.exit(f"usage: {argv[0]} TRIAL_CONFIG.json")
    try:
        result = asyncio.run(_run(argv[1]))
    except asyncio.CancelledError:
        print(json.dumps({"cancelled": True}), flush=True)
        sys.exit(3)
    verifier = result.verifier_result
    rewards = dict(verifier.rewards) if verifier is not None and verifier.rewards else None
    info = result.exception_info
    cause = result.failure_cause
    record = {
        "reward": _reward(rewards),
        "rewards": rewards,
        "reward_valid": result.reward_valid,
        "cause": None if cause is None else str(cause.value),
        "exception": None if info is None else info.exception_type,
        "message": None if info is None else info.exception_message[:2000],
        "trial_dir": str(result.trial_uri),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv)
