"""GPU tests run only where a CUDA or ROCm GPU and the native extension are present;
elsewhere (the CPU CI) the tests under tests/gpu are deselected, and one line at the end
of the run says how many and why (hundreds of "skipped" lines read as failures).

One exception, for checking a GPU test's harness (inputs, layouts, reference
values) on a machine without a GPU: with FUSEDATTN_GPU_TESTS_ON_CPU=1, tests
marked `harness_on_cpu` are not skipped here. Such a test must run with a
backend that needs no native extension (e.g. test_cudnn.py with
FUSEDATTN_TEST_BACKEND=xla) and skip itself otherwise."""
from __future__ import annotations

import functools
import os
from typing import Optional

import pytest

HARNESS_ON_CPU = os.environ.get("FUSEDATTN_GPU_TESTS_ON_CPU") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "harness_on_cpu: GPU test that can also run with a non-native backend "
                   "(FUSEDATTN_GPU_TESTS_ON_CPU=1 runs it without a GPU)")


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> Optional[str]:
    """None when tests can use the GPU, else why they cannot."""
    try:
        from fusedattn.backends import extension as native
        platform = native.gpu_platform()
    except Exception as e:  # jax missing or broken: say so rather than erroring
        return f"cannot query the platform: {type(e).__name__}: {e}"
    if platform is None:
        return "needs a CUDA or ROCm GPU"
    return native.reason(platform)


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    gpu_items = [item for item in items if str(item.fspath).startswith(here)]
    if HARNESS_ON_CPU:
        gpu_items = [item for item in gpu_items if item.get_closest_marker("harness_on_cpu") is None]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    chosen = set(map(id, gpu_items))
    items[:] = [item for item in items if id(item) not in chosen]
    config.hook.pytest_deselected(items=gpu_items)
    config._fusedattn_gpu_deselected = (len(gpu_items), reason)
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: tell the controller
        config.workeroutput["fusedattn_gpu_deselected"] = (len(gpu_items), reason)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller collects nothing itself: each worker deselected the same
    GPU tests, and says so here."""
    found = getattr(node, "workeroutput", {}).get("fusedattn_gpu_deselected")
    if found:
        node.config._fusedattn_gpu_deselected = tuple(found)


def pytest_terminal_summary(terminalreporter, config):
    count, reason = getattr(config, "_fusedattn_gpu_deselected", (0, ""))
    if count:
        terminalreporter.write_line(f"{count} GPU tests not collected: {reason} "
                                    f"(tests/gpu; ci/cuda.sh runs them on a GPU)")
