"""The learner's side of generation: its rollout servers (joining, serving, draining: `server_set`, following the
run config: `run_config_watch`), the balancer in front of them, the filesystem weight sync and its deadline, TRL's
rollout worker supervised, and the time the learner waits for samples. `pool` wires them for rank 0."""
