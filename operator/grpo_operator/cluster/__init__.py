"""The cluster adapter: everything only the operator in a cluster runs. The kopf wiring (handlers.py) feeds one task
per run (run_loops.py) that runs the engine's pass through the cluster's port (reconcile.py: observe, write, act;
children.py creates the run's objects), over the Kubernetes API client (kube.py), the pod index's reading of a Pod
(pods.py), the learner's /progress (progress_poller.py), the run's Events (events.py), Kueue's Workload (kueue.py),
the per-run metrics (operator_metrics.py), leader election (leader.py); and `grporun export --cluster`'s export pod
(export_runner.py). The pure core (status/, builders, the engine) imports nothing from here."""
