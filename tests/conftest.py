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
# compiled programs little (they are small and many), so XLA is asked not to spend
# long on them; the HLO passes and the programs' semantics are unchanged:
# - JAX's own switch for that (LLVM at -O0, its expensive passes off);
# - XLA's CPU emitters for fusions of before its MLIR ones
#   (--xla_cpu_use_fusion_emitters=false), used where this jaxlib knows the flag (an
#   unknown one aborts the process, so a child process asks first, once per session).
# Together they take each compilation to about a quarter, the suite to about half.
# Only in this process: the tests that start a fresh Python (README, examples, the long
# sequence) run with the defaults a user has; and not where a GPU may run the tests.
# JAX_DISABLE_MOST_OPTIMIZATIONS (0 or 1) and FUSEDATTN_TEST_XLA_CPU_FLAGS (the XLA
# flags, empty for none) in the environment decide instead.
import jax  # noqa: E402  (after XLA_FLAGS: the backends read them when first used)

CPU_FLAGS_ENV = "FUSEDATTN_TEST_XLA_CPU_FLAGS"
FAST_CPU_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def _fast_cpu_flags() -> str:
    """The XLA flags of FAST_CPU_FLAGS this jaxlib knows (asked once: the answer is kept
    in the environment, where pytest-xdist's workers find it)."""
    if CPU_FLAGS_ENV not in os.environ:
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_FLAGS}")
        try:
            ok = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                                capture_output=True, timeout=300).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        os.environ[CPU_FLAGS_ENV] = FAST_CPU_FLAGS if ok else ""
    return os.environ[CPU_FLAGS_ENV]


COMPILATION = []  # what of the above this process does (the report header says)
if _no_gpu_plugin():
    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
        jax.config.update("jax_disable_most_optimizations", True)
    if os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "1").lower() in ("1", "true"):
        COMPILATION.append("jax_disable_most_optimizations")
    if _fast_cpu_flags():
        # XLA reads XLA_FLAGS once, when the backend starts: start it with the flags,
        # then give child processes the environment as it was.
        flags = os.environ["XLA_FLAGS"]
        os.environ["XLA_FLAGS"] = f"{flags} {_fast_cpu_flags()}"
        try:
            jax.devices()
        finally:
            os.environ["XLA_FLAGS"] = flags
        COMPILATION.append(_fast_cpu_flags())


def pytest_report_header(config):
    return f"CPU compilation for speed: {', '.join(COMPILATION) or 'no (the defaults)'}"


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
