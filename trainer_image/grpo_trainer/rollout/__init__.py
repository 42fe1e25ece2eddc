"""The learner's side of generation: its rollout servers (joining, serving, draining: `server_set`, following the
run config: `run_config_watch`), their supervision (`supervisor`), the routing of each generation request in TRL's
worker child (`router`, fed through `route_board`), the filesystem weight sync and its deadline, TRL's rollout worker
supervised, and the time the learner waits for samples. `pool` wires them for rank 0."""
