"""The learner's Prometheus metric names (Prometheus conventions: counters end in _total, base units, no run label:
the scrape config adds the pod's labels). The chart's dashboard and alerts are tested against these constants."""

from __future__ import annotations

METRIC_GROUPS_TOTAL = "grpo_learner_groups"  # gauge: groups the run must consume (prompts x epochs)
# Gauges, not counters: these figures go down inside a process (a stop returns a discarded window's groups; a
# dropped group can train after all), and Prometheus reads a counter that decreases as a reset.
METRIC_GROUPS_CONSUMED = "grpo_learner_groups_consumed"
METRIC_GROUPS_TRAINED = "grpo_learner_groups_trained"
METRIC_GROUPS_DROPPED = "grpo_learner_groups_dropped"  # label: reason
# Counters: they count in this process, from 0 (a resumed learner too), and never decrease, unlike trained (a stop's
# discarded window returns its groups). Trained grows by collated - returned, so a trained rate is
# rate(collated) - rate(returned). Totals since the run began (trained, consumed, regenerated) are gauges.
METRIC_GROUPS_COLLATED = "grpo_learner_groups_collated_total"
METRIC_GROUPS_RETURNED = "grpo_learner_groups_returned_total"
METRIC_GROUPS_REGENERATED = "grpo_learner_groups_regenerated"  # gauge: groups another group replaced
# Gauge: of those, the groups an environment's failure left untrained (the rest were stale).
METRIC_GROUPS_REGENERATED_ENVIRONMENT = "grpo_learner_groups_regenerated_environment"
METRIC_EPOCHS_DONE = "grpo_learner_epochs_done"
METRIC_EPOCHS = "grpo_learner_epochs"
METRIC_STALL_STREAK = "grpo_learner_stall_streak_groups"
METRIC_STALL_LIMIT = "grpo_learner_stall_limit_groups"
METRIC_GLOBAL_STEP = "grpo_learner_global_step"
METRIC_LAST_TRAINED = "grpo_learner_last_trained_timestamp_seconds"
METRIC_STALLED = "grpo_learner_stalled"
METRIC_REWARD_MEAN = "grpo_learner_reward_mean"
METRIC_WEIGHT_SYNCS = "grpo_learner_weight_syncs_total"
# The training step's scoring: samples it scored, and those it took out of the loss (label: reason, MASK_REASONS).
METRIC_SAMPLES_SCORED = "grpo_learner_step_samples_scored_total"
METRIC_SAMPLES_MASKED = "grpo_learner_step_samples_masked_total"
# Episodes (tools and environments, grpo_trainer.agentic.episodes): counted as they reach the learner, from 0 per
# process.
METRIC_EPISODES = "grpo_learner_episodes_total"
METRIC_EPISODE_TURNS = "grpo_learner_episode_turns_total"  # model turns, summed over episodes
METRIC_EPISODES_FORKED = "grpo_learner_episodes_forked_total"  # episodes that became more than one training row
METRIC_TOOL_CALLS = "grpo_learner_tool_calls_total"
METRIC_TOOL_FAILURES = "grpo_learner_tool_failures_total"  # TRL's: a tool that raised or a name no tool has
METRIC_ENVIRONMENT_FAILURES = "grpo_learner_environment_failures_total"  # label: environment; episodes unscorable
# With weight_syncs_total, the count and sum of a summary: rate(seconds) / rate(syncs) is the mean sync time.
METRIC_WEIGHT_SYNC_SECONDS = "grpo_learner_weight_sync_seconds_total"
METRIC_WEIGHT_SYNC_LAST_SECONDS = "grpo_learner_weight_sync_last_duration_seconds"
# Gauge: how long the sync now running has run (0 between syncs); alert on it before the deadline ends the learner.
METRIC_WEIGHT_SYNC_RUNNING_SECONDS = "grpo_learner_weight_sync_running_seconds"
METRIC_WEIGHT_SYNC_DEADLINE = "grpo_learner_weight_sync_deadline_seconds"
METRIC_WEIGHT_VERSION = "grpo_learner_weight_version"  # gauge: N of the vN the learner last pushed
# Info-style gauge, value 1, label `kernel` (an AttentionKernel value): the kernel answering the tree attention.
METRIC_ATTENTION_KERNEL = "grpo_learner_attention_kernel_info"
# The autoscaling signal (docs/rollout.md): rate() of the wait counter is the share of time the learner waited for a
# sample; a counter, not a ratio over a window the learner would have to choose.
METRIC_ROLLOUT_WAIT_SECONDS = "grpo_learner_rollout_wait_seconds_total"
METRIC_ROLLOUT_QUEUE_SAMPLES = "grpo_learner_rollout_queue_samples"  # gauge: scored samples waiting for the learner
# Per rollout server, label `replica` (its index in rollout.urls).
METRIC_REPLICA_READY = "grpo_learner_rollout_replica_ready"  # gauge: 1 when requests are routed to it
METRIC_REPLICA_WEIGHT_VERSION = "grpo_learner_rollout_replica_weight_version"  # gauge: N of the vN it serves
METRIC_REPLICA_SAMPLES = "grpo_learner_rollout_replica_samples_total"  # completions it produced
METRIC_REPLICA_FAILURES = "grpo_learner_rollout_replica_failures_total"  # requests that failed on it
METRIC_REPLICA_VERSION_LAG = "grpo_learner_rollout_replica_weight_version_lag"  # gauge: versions it is behind
# TRL's per-step training curves, as last logged (gauges; a step that logged a non-finite value leaves the series as
# it was). TRL logs every `logging_steps` (the operator sets 1): `loss`, `entropy`... are that window's means.
METRIC_STEP_LOSS = "grpo_learner_step_loss"
METRIC_STEP_GRAD_NORM = "grpo_learner_step_grad_norm"
METRIC_STEP_LEARNING_RATE = "grpo_learner_step_learning_rate"
METRIC_STEP_ENTROPY = "grpo_learner_step_entropy"  # mean token entropy of the policy (nats)
METRIC_STEP_KL = "grpo_learner_step_kl"  # mean approximate KL of the policy from the sampling policy
METRIC_STEP_CLIP_RATIO = "grpo_learner_step_clip_ratio"  # label bound: low, high, region (share of tokens clipped)
METRIC_STEP_COMPLETION_TOKENS_MEAN = "grpo_learner_step_completion_length_mean_tokens"
METRIC_STEP_COMPLETION_TOKENS_MAX = "grpo_learner_step_completion_length_max_tokens"
METRIC_STEP_STALENESS_MEAN = "grpo_learner_step_staleness_mean_versions"  # weight versions a sample is behind
METRIC_STEP_STALENESS_MAX = "grpo_learner_step_staleness_max_versions"
#: TRL's log key -> (metric name, labels): which of TRL's logged numbers /metrics exports, and as what.
TRL_LOG_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "loss": (METRIC_STEP_LOSS, {}),
    "grad_norm": (METRIC_STEP_GRAD_NORM, {}),
    "learning_rate": (METRIC_STEP_LEARNING_RATE, {}),
    "entropy": (METRIC_STEP_ENTROPY, {}),
    "kl": (METRIC_STEP_KL, {}),
    "clip_ratio/low_mean": (METRIC_STEP_CLIP_RATIO, {"bound": "low"}),
    "clip_ratio/high_mean": (METRIC_STEP_CLIP_RATIO, {"bound": "high"}),
    "clip_ratio/region_mean": (METRIC_STEP_CLIP_RATIO, {"bound": "region"}),
    "completions/mean_length": (METRIC_STEP_COMPLETION_TOKENS_MEAN, {}),
    "completions/max_length": (METRIC_STEP_COMPLETION_TOKENS_MAX, {}),
    "sample/staleness_mean": (METRIC_STEP_STALENESS_MEAN, {}),
    "sample/staleness_max": (METRIC_STEP_STALENESS_MAX, {}),
}
STEP_METRIC_NAMES: tuple[str, ...] = tuple(dict.fromkeys(name for name, _ in TRL_LOG_METRICS.values()))
#: Exported only by a learner whose run has tools or an environment (ProgressReport.episodes).
EPISODE_METRIC_NAMES: tuple[str, ...] = (
    METRIC_EPISODES, METRIC_EPISODE_TURNS, METRIC_EPISODES_FORKED, METRIC_TOOL_CALLS, METRIC_TOOL_FAILURES,
    METRIC_ENVIRONMENT_FAILURES,
)
LEARNER_METRIC_NAMES: tuple[str, ...] = (
    METRIC_GROUPS_TOTAL,
    METRIC_GROUPS_CONSUMED,
    METRIC_GROUPS_TRAINED,
    METRIC_GROUPS_DROPPED,
    METRIC_GROUPS_COLLATED,
    METRIC_GROUPS_RETURNED,
    METRIC_GROUPS_REGENERATED,
    METRIC_GROUPS_REGENERATED_ENVIRONMENT,
    METRIC_EPOCHS_DONE,
    METRIC_EPOCHS,
    METRIC_STALL_STREAK,
    METRIC_STALL_LIMIT,
    METRIC_GLOBAL_STEP,
    METRIC_LAST_TRAINED,
    METRIC_STALLED,
    METRIC_REWARD_MEAN,
    METRIC_WEIGHT_SYNCS,
    METRIC_SAMPLES_SCORED,
    METRIC_SAMPLES_MASKED,
    METRIC_WEIGHT_SYNC_SECONDS,
    METRIC_WEIGHT_SYNC_LAST_SECONDS,
    METRIC_WEIGHT_SYNC_RUNNING_SECONDS,
    METRIC_WEIGHT_SYNC_DEADLINE,
    METRIC_WEIGHT_VERSION,
    METRIC_ATTENTION_KERNEL,
    METRIC_ROLLOUT_WAIT_SECONDS,
    METRIC_ROLLOUT_QUEUE_SAMPLES,
    METRIC_REPLICA_READY,
    METRIC_REPLICA_WEIGHT_VERSION,
    METRIC_REPLICA_SAMPLES,
    METRIC_REPLICA_FAILURES,
    METRIC_REPLICA_VERSION_LAG,
    *STEP_METRIC_NAMES,
    *EPISODE_METRIC_NAMES,
)
