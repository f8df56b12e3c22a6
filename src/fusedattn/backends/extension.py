"""The native extensions (`fusedattn._cuda`, `fusedattn._rocm`): loading, FFI
registration, versions and status, for every backend that uses them.

An extension is loaded lazily, only on a GPU platform and only after JAX's GPU
backend is initialised: jaxlib then has its cuDNN (or ROCm libraries) loaded,
and the extension, whose RPATH points at the same wheel, binds to that very
library instead of loading a second copy. Each capsule in the extension's
``ffi_targets`` dict is registered with `jax.ffi.register_ffi_target` for the
platform once.
"""
from __future__ import annotations

import importlib
import threading
from typing import Dict, Iterable, Optional, Tuple

import jax

from .. import vendor

MODULES = {"cuda": "fusedattn._cuda", "rocm": "fusedattn._rocm"}
FFI_PLATFORMS = {"cuda": "CUDA", "rocm": "ROCM"}

_lock = threading.RLock()
_modules: Dict[str, object] = {}
_failures: Dict[str, str] = {}
_registered: Dict[str, set] = {}


def gpu_platform() -> Optional[str]:
    """'cuda' or 'rocm' when JAX runs on such a GPU, else None (no GPU init forced on CPU)."""
    platform = vendor.current_platform()
    return platform if platform in MODULES else None


def load(platform: Optional[str] = None):
    """The extension module for `platform` (default: the current one), or None.

    The reason it is missing is kept for `status()` / `reason()`.
    """
    platform = platform or gpu_platform()
    if platform is None:
        return None
    with _lock:
        if platform in _modules:
            return _modules[platform]
        if platform in _failures:
            return None
        try:
            jax.devices()  # initialise the GPU backend first: its libraries load before ours
            module = importlib.import_module(MODULES[platform])
        except Exception as e:  # a missing build or a library mismatch is a reason, not a crash
            _failures[platform] = f"{MODULES[platform]} not available: {type(e).__name__}: {e}"
            return None
        why = architecture_reason(module) if platform == "rocm" else None
        if why is not None:
            _failures[platform] = why
            return None
        _modules[platform] = module
        return module


def architecture_reason(module) -> Optional[str]:
    """Why the ROCm extension's kernels cannot run on this machine's GPUs (None: they
    can, or hip-python is absent and the architectures cannot be read)."""
    built = [a for a in str(getattr(module, "hip_architectures", "")).split(";") if a]
    archs = vendor.rocm_archs() if built else None
    for arch in archs or ():
        if arch.split(":")[0] not in built:
            return (f"{MODULES['rocm']} was built for {';'.join(built)}, not this GPU's {arch} "
                    f"(rebuild with CMAKE_HIP_ARCHITECTURES={arch.split(':')[0]})")
    return None


def reason(platform: Optional[str] = None) -> Optional[str]:
    """None when the extension for the (current) platform is loaded, else why not."""
    platform = platform or gpu_platform()
    if platform is None:
        return f"no CUDA or ROCm GPU (JAX platform: {jax.default_backend()})"
    if load(platform) is None:
        return _failures.get(platform, f"{MODULES[platform]} not loaded")
    return None


def ensure_targets(names: Iterable[str], platform: Optional[str] = None) -> Optional[str]:
    """Register the named FFI targets (once); None on success, else the reason."""
    platform = platform or gpu_platform()
    why = reason(platform)
    if why is not None:
        return why
    module = _modules[platform]
    targets = getattr(module, "ffi_targets", {})
    names = tuple(names)
    missing = [n for n in names if n not in targets]
    if missing:
        return f"{MODULES[platform]} was built without {', '.join(missing)}"
    with _lock:
        done = _registered.setdefault(platform, set())
        for name in names:
            if name not in done:
                jax.ffi.register_ffi_target(name, targets[name], platform=FFI_PLATFORMS[platform])
                done.add(name)
    return None


def module(platform: Optional[str] = None):
    """The loaded extension (raises RuntimeError with the reason when there is none)."""
    why = reason(platform)
    if why is not None:
        raise RuntimeError(why)
    return _modules[platform or gpu_platform()]


def versions() -> Dict[str, object]:
    """cuDNN runtime / compiled, cudnn-frontend, CUDA and extension build facts."""
    platform = gpu_platform()
    mod = load(platform) if platform else None
    out: Dict[str, object] = {"native": status()}
    if mod is None:
        return out
    out["native_path"] = getattr(mod, "__file__", "?")
    if hasattr(mod, "cudnn_versions"):
        v = dict(mod.cudnn_versions())
        out.update({
            "cudnn": _dotted(v["cudnn_runtime"]),
            "cudnn_compiled": _dotted(v["cudnn_compiled"]),
            "cudnn_frontend": _dotted(v["cudnn_frontend"]),
            "cuda_compiled": _dotted(v["cudart_compiled"], cuda=True),
            "cudnn_library": v["cudnn_library"],
        })
    return out


def handler_counts(platform: Optional[str] = None) -> Dict[str, Tuple[int, int]]:
    """FFI target -> (calls, calls made while XLA captured the stream into a graph).

    A handler XLA records into a command buffer is called once, under capture,
    and then replayed without being called; one run outside a graph counts as a
    call that was not captured. Raises RuntimeError without the extension."""
    return {name: (int(c), int(k)) for name, (c, k) in module(platform).handler_counts().items()}


def cudnn_version() -> Optional[int]:
    """The runtime cuDNN version as an integer (e.g. 91901), or None without the extension."""
    mod = load("cuda") if gpu_platform() == "cuda" else None
    if mod is None or not hasattr(mod, "cudnn_versions"):
        return None
    return int(mod.cudnn_versions()["cudnn_runtime"])


def status() -> str:
    """'loaded <module> (<path>)' or the reason the extension is not there."""
    platform = gpu_platform()
    why = reason(platform)
    if why is not None:
        return why
    mod = _modules[platform]
    return f"loaded {MODULES[platform]} ({getattr(mod, '__file__', '?')})"


def _dotted(version: int, cuda: bool = False) -> str:
    """91901 -> '9.19.1' (cuDNN / frontend style); 13000 -> '13.0' (CUDA style)."""
    if cuda:
        return f"{version // 1000}.{version % 1000 // 10}"
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
