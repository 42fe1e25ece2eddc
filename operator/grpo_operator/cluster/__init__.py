"""The cluster adapter: one pass of a GRPORun against the Kubernetes API (reconcile.py, the engine's port there), the
API client (kube.py) and Kueue's Workload (kueue.py). The kopf wiring that calls it is handlers.py."""
