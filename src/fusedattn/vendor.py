"""Which vendor's GPU JAX runs on (`current_platform`), and device facts from the
vendors' Python packages, for `python -m fusedattn info`.

cupy (``fusedattn[cuda]``) reads an NVIDIA GPU's compute capability, SM count, memory
and driver version; hip-python (``fusedattn[rocm]``) an AMD GPU's gfx architecture,
CU count, memory and HIP runtime version. Both are optional: without them (or
without a GPU) each says so in one line, never with an ImportError.
"""
from __future__ import annotations

import os
from typing import List, Optional

import jax

ENV_PLATFORM = "FUSEDATTN_PLATFORM"  # for tests: pretend to be cpu / cuda / rocm


def current_platform() -> str:
    """'cpu', 'cuda' or 'rocm', from JAX's default backend (overridable for tests)."""
    forced = os.environ.get(ENV_PLATFORM)
    if forced:
        return forced
    platform = jax.default_backend()
    if platform == "gpu":  # older jaxlib spells both vendors "gpu"
        version = jax.devices()[0].client.platform_version.lower()
        platform = "rocm" if "rocm" in version or "hip" in version else "cuda"
    return platform


def cuda_lines() -> List[str]:
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return ["cupy           not installed (pip install 'fusedattn[cuda]' for device facts)"]
    try:
        rt = cupy.cuda.runtime
        lines = [f"cupy           {cupy.__version__}, driver {_cuda_version(rt.driverGetVersion())}, "
                 f"runtime {_cuda_version(rt.runtimeGetVersion())}"]
        for i in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            lines.append(f"cuda device    {i}: {name}, compute capability {p['major']}.{p['minor']}, "
                         f"{p['multiProcessorCount']} SMs, {p['totalGlobalMem'] / 2**30:.0f} GiB")
        return lines
    except Exception as e:  # no driver / no device: a line, not a crash
        return [f"cupy           {cupy.__version__}, no CUDA device: {type(e).__name__}: {e}"]


def rocm_lines() -> List[str]:
    try:
        from hip import hip  # noqa: PLC0415
    except ImportError:
        return ["hip-python     not installed (pip install 'fusedattn[rocm]' for device facts)"]
    try:
        err, count = hip.hipGetDeviceCount()
        _check(err)
        err, version = hip.hipRuntimeGetVersion()
        _check(err)
        lines = [f"hip-python     HIP runtime {version}"]
        for i in range(count):
            props = hip.hipDeviceProp_t()
            _check(hip.hipGetDeviceProperties(props, i)[0])
            arch = props.gcnArchName.decode() if isinstance(props.gcnArchName, bytes) \
                else props.gcnArchName
            lines.append(f"rocm device    {i}: {arch}, {props.multiProcessorCount} CUs, "
                         f"{props.totalGlobalMem / 2**30:.0f} GiB")
        return lines
    except Exception as e:  # no driver / no device: a line, not a crash
        return [f"hip-python     no ROCm device: {type(e).__name__}: {e}"]


def rocm_archs() -> Optional[List[str]]:
    """gfx architecture of every ROCm device (e.g. "gfx942:sramecc+:xnack-"), or None
    when hip-python is not installed or cannot query a device."""
    try:
        from hip import hip  # noqa: PLC0415
        err, count = hip.hipGetDeviceCount()
        _check(err)
        archs = []
        for i in range(count):
            props = hip.hipDeviceProp_t()
            _check(hip.hipGetDeviceProperties(props, i)[0])
            name = props.gcnArchName
            archs.append(name.decode() if isinstance(name, bytes) else str(name))
        return archs
    except Exception:  # hip-python missing, or no driver / device
        return None


def _check(err) -> None:
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"HIP error {err}")


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"
