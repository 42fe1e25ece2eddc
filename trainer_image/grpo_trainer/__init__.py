"""What runs in the GRPORun pods: the learner (TRL's AsyncGRPOTrainer plus progress-and-stop), the rollout server
launcher, and the torch-free contract the operator shares (`grpo_trainer.contract`)."""
