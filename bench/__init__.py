"""Benchmarks of the learner and the operator: `make bench` (= `python -m bench`) rewrites BENCHMARKS.md.

Each section is a module with `NAME`, `TITLE` and `run(context) -> markdown`; `python -m bench NAME...` runs only
those sections and replaces only their part of BENCHMARKS.md. Figures are medians with min-max over repetitions,
and every comparison is a ratio of runs made in the same process (pipeline) or the same bench run (trainer runs).
"""
