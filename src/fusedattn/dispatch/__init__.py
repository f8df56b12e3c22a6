"""Dispatch: platform + AttnConfig -> the `Plan` that runs the call (`plan`), the
backends by name (`registry`), and the measurement that picks between rival backends
(`measure`)."""
from ..vendor import ENV_PLATFORM, current_platform
from .plan import ENV_BACKEND, PREFERENCE, MeasuredRivals, Plan, UnsupportedError, clear_cache, plan
from .registry import ALL_BACKENDS, load_backend

__all__ = ["ALL_BACKENDS", "ENV_BACKEND", "ENV_PLATFORM", "PREFERENCE", "MeasuredRivals", "Plan",
           "UnsupportedError", "clear_cache", "current_platform", "load_backend", "plan"]
