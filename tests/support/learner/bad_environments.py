"""User environment factories that break at the worker child's start, as `module:function` factories for the learner's
tests: TRL's rollout loop constructs one environment of each factory in its spawned child before it is ready."""

from __future__ import annotations


def raises_at_construction() -> object:
    """A factory whose environment cannot be made: the same code raises the same way on every retry."""
    raise RuntimeError("no sandbox image 'guess-game:missing' on this node")
