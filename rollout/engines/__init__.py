"""Rollout engines: one `RolloutEngine` interface, several back ends."""

from rollout.engines.base import RolloutEngine

__all__ = ["RolloutEngine"]
