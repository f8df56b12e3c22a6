"""Context parallelism: q, k, v split along the sequence over one mesh axis.

`api` holds the public `ContextParallel` and the call; `ring` and `allgather` the two
strategies; `blocks` what they share (one kernel call per block, the exact LSE merge,
the zig-zag token order); `attend` the differentiable per-device function.
"""
from .api import ContextParallel, attention, axis_size, describe, plan_reason
from .blocks import zigzag_order

__all__ = ["ContextParallel", "attention", "axis_size", "describe", "plan_reason", "zigzag_order"]
