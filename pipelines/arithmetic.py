"""The embedded default job: SFT, then asynchronous GRPO, on generated multi-digit addition.

    dew-pipe run pipelines/arithmetic.py [--set seed=1 --set grpo_steps=200 ...]

Nothing is downloaded: the problems ("37+485=", answered with reversed digits "225"), the
character tokenizer and the decoder are made from the seed. SFT trains the decoder on
answers; GRPO then samples ``groups`` completions per problem from a continuous-batching
rollout server, scores each with exact match and trains on the group-relative advantages,
through the asynchronous stages of ``dew_pipe.stages`` (rollout, reward, pack, rescore,
update). The job prints held-out exact match before and after GRPO, and writes
``metrics.jsonl``, ``progress.png`` (reward and accuracy over time), ``summary.json`` and
the tokenizer into the run directory. See ``dew_pipe/tasks/job.py`` for the phases and
``benchmarks/RESULTS.md`` for what the default reaches and how long it takes.
"""

from __future__ import annotations

from dew_pipe.tasks.job import ArithmeticJob, JobSettings

D = JobSettings()  # the defaults live with the job, documented there


def pipeline(
    seed: int = D.seed,
    digits: int = D.digits,
    operations: str = D.operations,
    sft_steps: int = D.sft_steps,
    sft_learning_rate: float = D.sft_learning_rate,
    eval_every: int = D.eval_every,
    grpo_steps: int = D.grpo_steps,
    prompts: int = D.prompts,
    groups: int = D.groups,
    learning_rate: float = D.learning_rate,
    warmup: int = D.warmup,
    temperature: float = D.temperature,
    beta: float = D.beta,
    epsilon: float = D.epsilon,
    aggregation: str = D.aggregation,
    max_lag: int = D.max_lag,
    ahead: int = D.ahead,
    slots: int = D.slots,
    grpo_eval_every: int = D.grpo_eval_every,
    test_size: int = D.test_size,
    sample_probe: int = D.sample_probe,
) -> ArithmeticJob:
    """The arithmetic job with these settings (each is a field of ``JobSettings``)."""
    return ArithmeticJob(JobSettings(**locals()))
