"""The learner <-> operator contract: what both sides of the wire agree on, and the only part of grpo_trainer the
operator imports (tests/test_boundary.py holds it to that, with an explicit list of the few operator modules that run
trainer code on purpose).

A leaf: its modules import pydantic, the standard library and each other, nothing else of grpo_trainer, and never
torch, transformers, trl or vllm (the operator image has none of them). Import from the module that owns a name:

- `wire`: the base model of everything on the wire (camelCase), the counts and names a report may carry, one
  validation error as one line naming the field;
- `codes`: exit codes, the termination message, ports and paths, file names, and the enums a report names;
- `config`: the resolved run config (`run.json`);
- `report`: the progress report (`GET /progress`, the termination message);
- `metrics`: the learner's Prometheus metric names;
- `launch`: a learner pod's command line (one process, or accelerate's launcher under the gang supervisor);
- `rollout_pod`: a rollout pod's probe timings, its exit line and the engine's error line in its log, and the
  weight-version header a generation request carries and the server's refusal;
- `store_uri`: object store locations (`s3://bucket/prefix`) and the variables that say where and as whom;
- `pod_env`: the other variables the operator renders onto the pods (credentials, environment URLs).
"""
