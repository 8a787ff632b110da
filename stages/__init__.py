"""The concrete stages of asynchronous RL, imported as ``dew_pipe.stages``.

============  ====================================================================
stage         does
============  ====================================================================
``Rollout``   submits tasks to a SessionSource, stamps and relabels what comes back
``Reward``    scores sessions a source left unscored, on worker threads
``Pack``      admits sessions into groups and batches, packs fixed ``[N, W]`` rows
``Rescore``   replaces ``old_log_probs`` with the trainer's current likelihoods
``Update``    publishes weight versions, hands batches over, or trains on them
============  ====================================================================

``wire`` connects them (with the feedback edges that carry resubmissions, handovers and
weights); ``RolloutScheduler`` runs that graph as the Trainer's rollout, and
``pipelines/grpo_async.py`` runs it as a pipeline file. Names resolve lazily.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "Rollout": "dew_pipe.stages.rollout",
    "Reward": "dew_pipe.stages.reward",
    "Pack": "dew_pipe.stages.pack",
    "Rescore": "dew_pipe.stages.rescore",
    "Update": "dew_pipe.stages.update",
    "publish": "dew_pipe.stages.update",
    "Admission": "dew_pipe.stages.admission",
    "wire": "dew_pipe.stages.graph",
    "TaskBatches": "dew_pipe.stages.graph",
    "task_batch": "dew_pipe.stages.graph",
    "grpo_pipeline": "dew_pipe.stages.graph",
    "RolloutScheduler": "dew_pipe.stages.scheduler",
    "SchedulerRecord": "dew_pipe.stages.messages",
    "SESSION_ROWS": "dew_pipe.stages.messages",
    "Handover": "dew_pipe.stages.messages",
    "Orders": "dew_pipe.stages.messages",
    "Plan": "dew_pipe.stages.messages",
    "Proximal": "dew_pipe.stages.messages",
    "Step": "dew_pipe.stages.messages",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
