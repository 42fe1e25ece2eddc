"""Test and demo support that ships with the trainer: the offline tiny model and a rollout worker without vLLM."""
