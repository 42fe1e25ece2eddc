"""The learner's pod: its entrypoint (`main`), `GRPOLearner` (TRL's AsyncGRPOTrainer with progress and a run
that always ends), rewards and reward models, the training step's scoring, checkpoints, attention kernels, CPU
support, the gang supervisor and preemption, the /progress exporter and experiment tracking."""
