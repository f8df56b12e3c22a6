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
