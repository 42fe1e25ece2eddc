"""Real outside servers the tests start: vLLM, the vLLM-shaped completions server, MLflow, S3, Prometheus."""
