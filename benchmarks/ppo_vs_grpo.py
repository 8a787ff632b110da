"""PPO with a critic against GRPO on the calculator tool task, on the same budget.

Both start from one SFT warm-up (``tests/tool_rl.py``: 2-digit products, the tool
in-process, the model answering at once under greedy decoding) and train the same number of
updates on the same cohorts (the same problems in the same order, ``groups`` episodes each,
the same Adam learning rate). Held-out success (one greedy episode per test problem) is
probed every ``--every`` updates; the table prints both curves and the PPO/GRPO ratio of
held-out success at each probe, then the wall seconds of the first ``--every`` updates
(compiles included) and the seconds per update after them, with their ratio, measured in
the same run (probes excluded).

Usage::

    .venv/bin/python benchmarks/ppo_vs_grpo.py                 # the table in RESULTS.md
    .venv/bin/python benchmarks/ppo_vs_grpo.py --updates 20 --every 5 --seeds 0,1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from machine import print_machine
from tool_rl import Setting, sft, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()
    print_machine()
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        setting = Setting(
            sft_steps=args.sft_steps, updates=args.updates, prompts=args.prompts,
            groups=args.groups, learning_rate=args.learning_rate, every=args.every,
            test_size=args.test_size, seed=seed,
        )  # fmt: skip
        start = time.monotonic()
        task, model, params = sft(setting)
        sft_s = time.monotonic() - start
        runs = {name: train(name, setting, task, model, params) for name in ("ppo", "grpo")}
        results.append({"seed": seed, "sft_s": round(sft_s, 1), **runs})
        print(
            f"seed {seed}: {setting.prompts} problems x {setting.groups} episodes per update, "
            f"Adam {setting.learning_rate}, {setting.test_size} held-out problems; "
            f"SFT ({setting.sft_steps} steps) {sft_s:.0f} s"
        )
        print(f"  {'updates':>7}  {'PPO':>6}  {'GRPO':>6}  {'PPO/GRPO':>8}")
        for (done, ppo), (_, grpo) in zip(runs["ppo"]["curve"], runs["grpo"]["curve"], strict=True):
            ratio = f"{ppo / grpo:8.2f}" if grpo else f"{'-':>8}"
            print(f"  {done:7d}  {ppo:6.1%}  {grpo:6.1%}  {ratio}")
        first = {k: runs[k]["seconds"][0] for k in runs}
        later = {k: sum(runs[k]["seconds"][1:]) / (setting.updates - setting.every) for k in runs}
        print(
            f"  first {setting.every} updates (compiles included): PPO {first['ppo']:.0f} s, "
            f"GRPO {first['grpo']:.0f} s; then s per update: PPO {later['ppo']:.2f}, GRPO "
            f"{later['grpo']:.2f} (PPO/GRPO {later['ppo'] / later['grpo']:.2f}: PPO adds "
            "the critic's forward pass in the rollout and its forward and backward in the update)"
        )
    if args.json:
        print(json.dumps({"setting": dataclasses.asdict(setting), "results": results}))


if __name__ == "__main__":
    main()
