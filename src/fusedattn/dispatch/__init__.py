"""Dispatch: platform + AttnConfig -> the `Plan` that runs the call (`plan`), the
backends by name (`registry`), and the measurement that picks between rival backends
(`measure`)."""
from ..vendor import ENV_PLATFORM, current_platform
from .plan import (ENV_BACKEND, PREFERENCE, MeasuredRivals, Plan, UnsupportedError, clear_cache,
                   config_for, inputs_for, plan, runs_block_maps, takes_dense_mask)
from .registry import ALL_BACKENDS, load_backend

__all__ = ["ALL_BACKENDS", "ENV_BACKEND", "ENV_PLATFORM", "PREFERENCE", "MeasuredRivals", "Plan",
           "UnsupportedError", "clear_cache", "config_for", "current_platform", "inputs_for",
           "load_backend", "plan", "runs_block_maps", "takes_dense_mask"]
