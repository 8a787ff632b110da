"""The learning check: PPO with a critic learns when to call the calculator.

On the project's multi-turn tool task (:class:`~dew_pipe.tasks.tool_calc.ToolCalcTask`, 2-digit
products, the tool in-process), a 400-step SFT warm-up leaves a model that answers at once
under greedy decoding and gets hardly any held-out problem right. Ten PPO updates
(8 problems x 4 episodes each, critic and policy from one Adam) must raise held-out success
(64 problems the RL phase never sees, one greedy episode each) by at least 0.4; on the
machine the figures in ``benchmarks/RESULTS.md`` come from it went from 0.016 to 0.906.
``benchmarks/ppo_vs_grpo.py`` runs the longer curve against GRPO on the same budget.
"""

from __future__ import annotations

import pytest
from tool_rl import Setting, sft, train

SETTING = Setting(sft_steps=400, learning_rate=1e-3, updates=10, every=10, test_size=64)
MARGIN = 0.4


@pytest.mark.slow
def test_ppo_raises_held_out_success_on_the_tool_task():
    task, model, params = sft(SETTING)
    result = train("ppo", SETTING, task, model, params)
    (start, before), (updates, after) = result["curve"]
    print(f"held-out success {before:.3f} -> {after:.3f} in {updates} PPO updates")
    assert (start, updates) == (0, SETTING.updates)
    assert before < 0.2, "the warm-up alone should rarely answer right (it answers at once)"
    assert after - before >= MARGIN, result["curve"]
    turns = [r["episode/turns"] for r in result["rollout"]]
    assert turns[-1] > turns[0]  # it learned to call the tool: more turns per episode
