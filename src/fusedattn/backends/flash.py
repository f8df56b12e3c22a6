"""The flash backend: FlashAttention-3's Hopper kernels (the `flash-attn3-jax`
package, ``pip install fusedattn[flash]``) for the configs they compute exactly as
fusedattn's contract says.

Why it exists: on H100 with a causal mask at head dim 128, FA3 is 11-18% faster
than the plans cuDNN's heuristics pick, forward and backward, while cuDNN leads at
head dim 64 and FA3 stops at 128 (benchmarks/results/SUMMARY.md). With
``backend="auto"`` dispatch runs it only where cudnn runs the same config too and
a measurement on this GPU says it is faster (`fusedattn.backend_choice`);
``backend="flash"`` forces it.

It exposes the per-device `forward` / `backward` that `native_call` wraps, so it
partitions over batch and heads by fusedattn's one rule, not by the package's own
(which wants q, k and v sharded alike). We bind the package's un-partitioned
primitives (`flash_attn3_jax.flash_hlo`), the ones its own partitioning wraps;
the pinned version range in pyproject keeps that internal name honest.

What it runs: bf16 / fp16, bshd, separate q, k, v, dense sequences, d_qk == d_v
<= 128 (the package's kernels stop there), GQA, no bias / dropout / score_mod /
sinks / FP8, not deterministic (FA3's backward accumulates dq with atomics). Its
causal mask and windows are aligned to the bottom-right corner, so a top-left
mask or window runs only when s_q == s_kv, and never with s_q > s_kv (rows
without keys). The LSE it saves is fp32 natural-log ``[b, h_q, s_q]``, the
contract's.

Gradients only with the causal mask: flash-attn3-jax 0.2.3's backward returns NaN
or wrong gradients on every other config we measured (its own `flash_mha` as much
as our binding; H100, against the float64 oracle). `training_reason` says so,
auto dispatch never trains with it there, and a forced backward raises.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from ..config import AttnConfig
from . import native_call
from .base import AttnInputs

DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 128
INSTALL = "pip install 'fusedattn[flash]' (flash-attn3-jax, Hopper only)"


@functools.lru_cache(maxsize=None)
def _kernels():
    """The package's un-partitioned primitives (ImportError when it is absent)."""
    from flash_attn3_jax import flash_hlo  # noqa: PLC0415 - optional dependency
    return flash_hlo._flash_mha_fwd_hlo, flash_hlo._flash_mha_bwd_hlo


def availability_reason() -> Optional[str]:
    """Why the kernels cannot run in this process (None if they can)."""
    try:
        _kernels()
    except Exception as e:  # absent, or built against another CUDA / jaxlib
        return f"flash-attn3-jax not importable ({type(e).__name__}: {e}); {INSTALL}"
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None or not str(capability).startswith("9."):
        return (f"FlashAttention-3 runs on Hopper (sm90) only; the device is "
                f"{getattr(device, 'device_kind', device.platform)} (compute capability "
                f"{capability})")
    return None


def config_reason(config: AttnConfig) -> Optional[str]:
    """What FA3 cannot do exactly as the contract says, from the config alone."""
    aligned = config.s_q == config.s_kv or config.bottom_right
    rules = (
        (config.dtype in DTYPES, f"dtype {config.dtype}: FA3 is {'/'.join(DTYPES)} only"),
        (not config.is_fp8, "FP8 runs on cudnn"),
        (config.layout == "bshd", f"layout {config.layout}: FA3 takes bshd"),
        (config.qkv_packing == "separate", "packed qkv / kv: FA3 takes separate q, k, v"),
        (config.sequence == "dense",
         f"{config.sequence} sequences: this FA3 binding takes dense batches only"),
        (config.d_qk == config.d_v, f"d_qk {config.d_qk} != d_v {config.d_v}"),
        (config.d_qk <= MAX_HEAD_DIM,
         f"head dim {config.d_qk}: flash-attn3-jax's kernels stop at {MAX_HEAD_DIM}"),
        (not config.has_bias, "bias: FA3 has none"),
        (not config.has_dropout, "dropout: FA3 has none"),
        (config.score_mod is None, "score_mod: FA3 has none (cudnn lowers score_mods)"),
        (config.softmax == "vanilla", f"softmax {config.softmax!r}: FA3 has no sink"),
        (not config.deterministic,
         "deterministic: FA3's backward accumulates dq with atomics"),
        (not (config.causal or config.window is not None) or aligned,
         "a top-left causal mask or window with s_q != s_kv: FA3 aligns them bottom-right"),
        (not (config.causal or config.window is not None) or config.s_q <= config.s_kv,
         "a mask or window with s_q > s_kv leaves rows without keys, which FA3 does not "
         "zero as the contract says"),
    )
    return next((why for ok, why in rules if not ok), None)


def training_reason(config: AttnConfig) -> Optional[str]:
    """Why flash must not run this config's backward (None: it may)."""
    if _mask_args(config)["is_causal"]:
        return None
    return (f"flash-attn3-jax {package_version() or '(not installed)'}'s backward returns "
            f"NaN / wrong gradients without its causal mask (measured against the float64 "
            f"oracle on H100), so flash runs only the forward of this config")


def package_version() -> Optional[str]:
    """The installed flash-attn3-jax version, None when it is absent."""
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("flash-attn3-jax")
    except Exception:  # not installed
        return None


def _mask_args(config: AttnConfig):
    left, right = config.window_bounds() if (config.causal or config.window is not None) \
        else (-1, -1)
    is_causal = (left, right) == (-1, 0)  # FA3's dedicated causal path
    return dict(softmax_scale=float(config.scale), is_causal=is_causal,
                window_size=(-1, -1) if is_causal else (left, right))


class _FlashBackend(native_call.NativeBackend):
    name = "flash"
    platforms = ("cuda",)

    def supports(self, config: AttnConfig) -> Optional[str]:
        return config_reason(config) or availability_reason()


BACKEND = _FlashBackend()


# ---- the per-device kernels (native_call partitions and differentiates them) ------------
def forward(config: AttnConfig, inputs: AttnInputs, training: bool):
    """(out, fp32 lse [b, h_q, s_q] when training)."""
    fwd, _ = _kernels()
    out, lse = fwd(inputs.q, inputs.k, inputs.v, **_mask_args(config))
    return out, (lse if training else None)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v."""
    why = training_reason(config)
    if why is not None:
        raise ValueError(f"flash backend cannot differentiate {config.short()}: {why}; "
                         f"use backend='cudnn' or 'auto'")
    _, bwd = _kernels()
    d_q, d_k, d_v = bwd(d_out.astype(out.dtype), inputs.q, inputs.k, inputs.v, out, lse,
                        **_mask_args(config))
    return AttnInputs(q=d_q, k=d_k, v=d_v)
