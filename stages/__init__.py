"""The concrete stages of asynchronous RL, imported as ``dew_pipe.stages``.

=============  ==================================================================================
stage          does
=============  ==================================================================================
``Rollout``    submits tasks to a SessionSource, stamps and relabels what comes back
``Reward``     scores sessions a source left unscored, on worker threads
``Pack``       admits sessions into groups and batches, packs fixed ``[N, W]`` rows
``Rescore``    replaces ``old_log_probs`` with the trainer's current likelihoods
``Values``     PPO's stage in rescore's place: critic values, rescoring, GAE targets
               (``values.py``, with ``PolicyWeights``, the publisher of the policy subtree)
``Handoff``    the library view's update stage: publishes weight versions, announces each
               handover, hands each batch back to the Trainer (``handoff.py``)
``Train``      the pipeline view's update stage: the same, then trains on each batch itself
               (``train.py``)
``Journal``    not a stage: the sessions pack kept and the update has not consumed, on disk,
               which rollout replays after a resume (``journal.py``)
=============  ==================================================================================

Both update stages sit at the graph's node named "update". :class:`GraphSettings` holds the
graph's settings and checks them once; :func:`build_graph` makes the stages from them and
:func:`wire` connects them (with the feedback edges that carry resubmissions, handovers and
weights). ``RolloutScheduler`` runs that graph as the Trainer's rollout;
:func:`grpo_pipeline` builds it as a pipeline (``pipelines/grpo_async.py``,
``pipelines/arithmetic.py``). What the stages need of their collaborators (sources,
publishers, scorers, trainers) is written as small protocols in ``protocols.py``; the
records they pass each other are in ``messages.py``. Names resolve lazily.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "Rollout": "dew_pipe.stages.rollout",
    "Reward": "dew_pipe.stages.reward",
    "Pack": "dew_pipe.stages.pack",
    "Rescore": "dew_pipe.stages.rescore",
    "Values": "dew_pipe.stages.values",
    "PolicyWeights": "dew_pipe.stages.values",
    "Handoff": "dew_pipe.stages.handoff",
    "publish": "dew_pipe.stages.handoff",
    "Train": "dew_pipe.stages.train",
    "Journal": "dew_pipe.stages.journal",
    "WeightsPublisher": "dew_pipe.stages.protocols",
    "LikelihoodScorer": "dew_pipe.stages.protocols",
    "TrainingStep": "dew_pipe.stages.protocols",
    "TrainingState": "dew_pipe.stages.protocols",
    "Admission": "dew_pipe.stages.admission",
    "wire": "dew_pipe.stages.graph",
    "TaskBatches": "dew_pipe.stages.graph",
    "task_batch": "dew_pipe.stages.graph",
    "grpo_pipeline": "dew_pipe.stages.graph",
    "GraphSettings": "dew_pipe.stages.graph",
    "build_graph": "dew_pipe.stages.graph",
    "rescorer": "dew_pipe.stages.graph",
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
