import os
import pytest

# Tests run on the CPU unless a GPU test asks otherwise; keep XLA single-threaded
# enough to be predictable on the 2-core CI machine.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Eight host devices, so that sharded calls (tests/test_sharding.py,
# tests/test_context_parallel.py) compile and run for real on the CPU; unsharded
# work still runs on the first device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


def _no_gpu_plugin() -> bool:
    """True where JAX can only run on the CPU (no CUDA / ROCm plugin is installed, or
    JAX_PLATFORMS=cpu); asked without starting a backend."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    from importlib import metadata  # noqa: PLC0415
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    return not any(n.startswith(("jax-cuda", "jax-rocm")) for n in names)


# On the CPU, compiling is about two thirds of the suite's time and running the
# compiled programs little (they are small), so XLA is asked not to spend long
# optimizing them: JAX's own switch for that (LLVM at -O0, its expensive passes off,
# about half of each compilation); the HLO passes and the programs' semantics are
# unchanged. Only this process: the tests that start a fresh Python (README, examples,
# the long sequence) run with the defaults a user has; and not where a GPU may run the
# tests. JAX_DISABLE_MOST_OPTIMIZATIONS in the environment (0 or 1) decides instead.
import jax  # noqa: E402  (after XLA_FLAGS: the backends read them when first used)

if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ and _no_gpu_plugin():
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture
def hopper_reference(monkeypatch):
    """A CUDA platform with a Hopper GPU, the block-sparse kernels run as the reference
    list walks: dispatch and the drop-ins take the block_sparse route on the CPU."""
    from fusedattn import dispatch
    from fusedattn.backends import block_sparse as backend
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setattr(backend, "on_hopper", lambda: True)
    monkeypatch.setattr(backend, "IMPLEMENTATION", "reference")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()
