"""Reinforcement-learning objectives, rollouts and the session records they train on.

Objectives: ``dpo`` (:class:`DPOObjective`), ``grpo`` (:class:`GRPOObjective` on packed
rows) built from ``policy`` (the policy options and their composition into one loss) and
``losses`` (the pure token-level pieces); ``grpo_batches`` checks what GRPO reads.

Sessions, from records to rows: ``session_records`` defines the records a rollout engine
reports (``Call``, ``Session``, ``Status``, ``Task``, ``SessionSource``), which the spec's
module ``sessions`` serves together with the functions over them; ``advantages`` scores a
group, ``packing`` (:func:`pack`) lays sessions into fixed ``[rows, width]`` rows,
``session_stats`` measures a batch, ``session_arrow`` is the one mapping between records and
Arrow rows (the schemas are in :mod:`dew_pipe.rollout_batches`), and ``task_rows`` turns a
training batch into tasks.

Tool episodes: ``episodes`` defines the Environment protocol and the records of one
multi-turn episode (``EpisodeId``, ``Observation`` and ``EpisodeStatus``, ``Action``,
``Transition``, ``Episode``, ``EpisodeFailure``, ``EpisodeCancelled``); ``episode_sessions``
projects episodes onto sessions (``session_of``, ``pack_episodes``); ``episode_rollout``
holds ``EpisodeRollout``, the trainer's rollout hook that collects and packs them (it calls
the policy it is given, so it needs nothing from :mod:`dew_pipe.inference`), with its slots
and rules in ``episode_collection``; ``episode_journal`` holds ``EpisodeJournal`` (SQLite
crash recovery of collections) and ``subprocess_environment`` ``SubprocessEnvironment``
(episodes served by a worker process over JSON lines, through the sandbox launcher).

PPO with a critic: ``critic`` holds ``ValueHead`` and the clipped value loss, ``gae`` the
advantage estimation over whole episodes in packed rows, ``ppo`` ``PPOObjective`` (GRPO's
policy loss plus the value loss on one variables tree) and ``ppo_rollout`` ``PPORollout``
(an ``EpisodeRollout`` plus critic values and GAE targets).

Harbor trials as sessions: ``gateway`` holds ``Gateway``, the client of rllm-model-gateway
(stamps, readiness, a session's traces read back as calls) and ``harbor`` ``HarborSource``
(each sample one Harbor trial whose harness reaches the model through the gateway; its
``harbor_runner`` runs under Harbor's own interpreter and is never imported).

Flow-GRPO: ``flow_grpo`` holds ``FlowGRPOObjective`` (the clipped per-coordinate ratio loss
over a rectified-flow model's stochastic transitions, built on
:class:`dew_pipe.objectives.diffusion.DiffusionObjective`) and names ``transition_kl`` (defined
with the process in :mod:`dew_pipe.diffusion`).

Some names live on higher floors and are only named here, so the spec's import paths work:
``SampledRollout``, ``PromptSource``, ``EnvironmentSource``, ``FlowRollout`` and
``sample_trajectory`` with its ``FlowTrajectory`` (they sample, so they live in
:mod:`dew_pipe.inference`) and ``RolloutScheduler`` (composed of stages, in
:mod:`dew_pipe.stages`).

Names resolve lazily (module ``__getattr__``) so importing the package costs nothing until a
name is used. To export a new name, add it to ``_LAZY`` with the module that defines it.
"""

from __future__ import annotations

from dew_pipe._lazy import lazy_exports

_LAZY: dict[str, str] = {
    # preference optimization
    "DPOObjective": "dew_pipe.objectives.rl.dpo",
    # sessions and packing
    "Call": "dew_pipe.objectives.rl.sessions",
    "Session": "dew_pipe.objectives.rl.sessions",
    "SessionSource": "dew_pipe.objectives.rl.sessions",
    "Status": "dew_pipe.objectives.rl.sessions",
    "Task": "dew_pipe.objectives.rl.sessions",
    "pack": "dew_pipe.objectives.rl.packing",
    "chain_lengths": "dew_pipe.objectives.rl.packing",
    "rows_needed": "dew_pipe.objectives.rl.packing",
    "session_metrics": "dew_pipe.objectives.rl.session_stats",
    "compute_advantages": "dew_pipe.objectives.rl.advantages",
    # single-turn sessions drawn from a RolloutServer (lives above, in dew_pipe.inference)
    "PromptSource": "dew_pipe.inference.prompt_source",
    # Harbor trials through the recording gateway
    "Gateway": "dew_pipe.objectives.rl.gateway",
    "GatewayError": "dew_pipe.objectives.rl.gateway",
    "HarborSource": "dew_pipe.objectives.rl.harbor",
    # multi-turn tool episodes drawn from a RolloutServer (lives above, in dew_pipe.inference)
    "EnvironmentSource": "dew_pipe.inference.environment_source",
    # GRPO objective and its policy loss
    "GRPOObjective": "dew_pipe.objectives.rl.grpo",
    "PolicyOptions": "dew_pipe.objectives.rl.policy",
    "policy_loss": "dew_pipe.objectives.rl.policy",
    # the trainer's GRPO rollout hook; it samples, so it lives above, in dew_pipe.inference
    "SampledRollout": "dew_pipe.inference.sampled_rollout",
    # task readers and the asynchronous scheduler (which lives above, in dew_pipe.stages:
    # it is composed of stages, so it is only imported when asked for)
    "task_ids": "dew_pipe.objectives.rl.task_rows",
    "prompt_tasks": "dew_pipe.objectives.rl.task_rows",
    "RolloutScheduler": "dew_pipe.stages.scheduler",
    # Flow-GRPO on a rectified-flow model; its rollout and sampler sample, so they live in
    # dew_pipe.inference
    "FlowGRPOObjective": "dew_pipe.objectives.rl.flow_grpo",
    "transition_kl": "dew_pipe.objectives.rl.flow_grpo",
    "FlowRollout": "dew_pipe.inference.flow_rollout",
    "FlowTrajectory": "dew_pipe.inference.flow_sampling",
    "sample_trajectory": "dew_pipe.inference.flow_sampling",
    "SchedulerRecord": "dew_pipe.stages.messages",
    # tool episodes: the Environment protocol and its records, projection, the rollout hook
    "Action": "dew_pipe.objectives.rl.episodes",
    "Environment": "dew_pipe.objectives.rl.episodes",
    "Episode": "dew_pipe.objectives.rl.episodes",
    "EpisodeCancelled": "dew_pipe.objectives.rl.episodes",
    "EpisodeFailure": "dew_pipe.objectives.rl.episodes",
    "EpisodeId": "dew_pipe.objectives.rl.episodes",
    "EpisodeStatus": "dew_pipe.objectives.rl.episodes",
    "Observation": "dew_pipe.objectives.rl.episodes",
    "Transition": "dew_pipe.objectives.rl.episodes",
    "session_of": "dew_pipe.objectives.rl.episode_sessions",
    "pack_episodes": "dew_pipe.objectives.rl.episode_sessions",
    "EpisodeRollout": "dew_pipe.objectives.rl.episode_rollout",
    # crash recovery of episodes, and the worker-process environment
    "EpisodeJournal": "dew_pipe.objectives.rl.episode_journal",
    "SubprocessEnvironment": "dew_pipe.objectives.rl.subprocess_environment",
    # PPO with a critic: the value head, the objective, the rollout that adds GAE targets
    "ValueHead": "dew_pipe.objectives.rl.critic",
    "PPOObjective": "dew_pipe.objectives.rl.ppo",
    "PPORollout": "dew_pipe.objectives.rl.ppo_rollout",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
