"""The real learner run as a script (one process, or several under accelerate or torchrun), and bad user rewards."""
