"""What flows to and from inference: samples, generate state and hooks, data source, engines."""

from rollout.types import (
    AdapterRef,
    GenerateRequest,
    GenerateResult,
    RewardSpec,
    Sample,
    SampleStatus,
    SamplingParams,
)

__all__ = [
    "AdapterRef",
    "GenerateRequest",
    "GenerateResult",
    "RewardSpec",
    "Sample",
    "SampleStatus",
    "SamplingParams",
]
