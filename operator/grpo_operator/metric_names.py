"""The operator's Prometheus metric names: the one place they are spelled.

Every per-run series carries the labels `namespace` and `run`. The chart's alerts and dashboard are tested against
these constants and against `grpo_trainer.contract.metrics.LEARNER_METRIC_NAMES`.
"""

RUN_LABELS = ("namespace", "run")

RUN_INFO = "grpo_operator_run_info"  # labels + model; value 1
RUN_PHASE = "grpo_operator_run_phase"  # labels + phase; 1 for the current phase, 0 for the others
RUN_PROGRESS_RATIO = "grpo_operator_run_progress_ratio"  # groups consumed / groups total, 0..1
RUN_GROUPS_TRAINED = "grpo_operator_run_groups_trained"
RUN_GROUPS_CONSUMED = "grpo_operator_run_groups_consumed"
RUN_GROUPS_DROPPED = "grpo_operator_run_groups_dropped"  # labels + reason
RUN_EPOCH = "grpo_operator_run_epoch"
RUN_STALL_STREAK = "grpo_operator_run_stall_streak_groups"
RUN_STALL_LIMIT = "grpo_operator_run_stall_limit_groups"
RUN_STALLED = "grpo_operator_run_stalled"  # 1 while the Stalled condition is True
RUN_RESTARTS = "grpo_operator_run_learner_restarts"
RUN_LAST_PROGRESS = "grpo_operator_run_last_progress_timestamp_seconds"
RUN_ESTIMATED_REMAINING = "grpo_operator_run_estimated_remaining_seconds"  # absent while the status has no estimate
RUN_PROGRESS_DEADLINE = "grpo_operator_run_progress_deadline_seconds"
RUN_ROLLOUT_REPLICAS = "grpo_operator_run_rollout_replicas"
RUN_ROLLOUT_READY = "grpo_operator_run_rollout_ready_replicas"
RUN_ROLLOUT_RESTARTS = "grpo_operator_run_rollout_restarts"  # rollout servers replaced, all servers together
RECONCILE_ERRORS = "grpo_operator_reconcile_errors_total"  # label: handler
RECONCILE_SECONDS = "grpo_operator_reconcile_seconds"  # histogram, label: handler

OPERATOR_METRIC_NAMES = (
    RUN_INFO,
    RUN_PHASE,
    RUN_PROGRESS_RATIO,
    RUN_GROUPS_TRAINED,
    RUN_GROUPS_CONSUMED,
    RUN_GROUPS_DROPPED,
    RUN_EPOCH,
    RUN_STALL_STREAK,
    RUN_STALL_LIMIT,
    RUN_STALLED,
    RUN_RESTARTS,
    RUN_LAST_PROGRESS,
    RUN_ESTIMATED_REMAINING,
    RUN_PROGRESS_DEADLINE,
    RUN_ROLLOUT_REPLICAS,
    RUN_ROLLOUT_READY,
    RUN_ROLLOUT_RESTARTS,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
)

OPERATOR_METRICS_PORT = 8080
OPERATOR_LIVENESS_PORT = 8081
