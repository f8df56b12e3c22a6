"""GPU tests run only where a CUDA or ROCm GPU and the native extension are present;
elsewhere (the CPU CI) the tests under tests/gpu are deselected, and one line at the end
of the run says how many and why (hundreds of "skipped" lines read as failures).

One exception, for checking a GPU test's harness (inputs, layouts, reference
values) on a machine without a GPU: with FUSEDATTN_GPU_TESTS_ON_CPU=1, tests
marked `harness_on_cpu` are not skipped here. Such a test must run with a
backend that needs no native extension (e.g. test_cudnn.py with
FUSEDATTN_TEST_BACKEND=xla) and skip itself otherwise.

FUSEDATTN_GPU_SHARD=i/n keeps every n-th GPU test from the i-th (`_shard`)."""
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
    in_here = lambda item: str(item.fspath).startswith(here)  # noqa: E731
    gpu_items = [item for item in items if in_here(item)]
    if HARNESS_ON_CPU:
        gpu_items = [item for item in gpu_items if item.get_closest_marker("harness_on_cpu") is None]
    reason = gpu_skip_reason() if gpu_items else None
    if reason is not None:
        _deselect(config, items, gpu_items)
        config._fusedattn_gpu_deselected = (len(gpu_items), reason)
        if hasattr(config, "workeroutput"):  # a pytest-xdist worker: tell the controller
            config.workeroutput["fusedattn_gpu_deselected"] = (len(gpu_items), reason)
    shard = _shard(os.environ.get("FUSEDATTN_GPU_SHARD"))
    if shard:
        i, n = shard
        _deselect(config, items, [item for k, item in enumerate(
            item for item in items if in_here(item)) if k % n != i])


def _deselect(config, items, chosen):
    ids = set(map(id, chosen))
    items[:] = [item for item in items if id(item) not in ids]
    config.hook.pytest_deselected(items=chosen)


def _shard(spec: Optional[str]):
    """FUSEDATTN_GPU_SHARD="i/n": run every n-th GPU test from the i-th (0 <= i < n), so
    the whole GPU suite fits a few calls of a machine that limits each command's time."""
    if not spec:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise pytest.UsageError(f"FUSEDATTN_GPU_SHARD={spec!r}: expected i/n with 0 <= i < n")
    return i, n


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
