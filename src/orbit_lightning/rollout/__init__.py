"""The native rollout engine: continuous batching over a paged KV cache on the trainer's own model and kernels,
with per-token log-probs, seeded sampling, versioned double-buffered adapter slots and CUDA-graph decode."""

from .adapter_slots import AdapterSlotBusy
from .async_engine import AsyncRolloutEngine
from .engine import RolloutEngine
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams

__all__ = ["AdapterSlotBusy", "AsyncRolloutEngine", "CompletionOutput", "RequestOutput", "RolloutEngine",
           "SamplingParams"]
