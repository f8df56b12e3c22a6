"""GPU tests run only where a CUDA or ROCm GPU and the native extension are present;
elsewhere (the CPU CI) every test under tests/gpu is skipped with the reason."""
from __future__ import annotations

import functools
from typing import Optional

import pytest


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> Optional[str]:
    """None when tests can use the GPU, else why they cannot."""
    try:
        from fusedattn.backends import native
        platform = native.gpu_platform()
    except Exception as e:  # jax missing or broken: say so rather than erroring
        return f"cannot query the platform: {type(e).__name__}: {e}"
    if platform is None:
        return "needs a CUDA or ROCm GPU"
    return native.reason(platform)


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    gpu_items = [item for item in items if str(item.fspath).startswith(here)]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=f"GPU tests skipped: {reason}")
    for item in gpu_items:
        item.add_marker(marker)
