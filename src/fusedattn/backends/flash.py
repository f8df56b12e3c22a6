"""The flash backend: FlashAttention-3's Hopper kernels (the `flash-attn3-jax`
package, ``pip install fusedattn[flash]``) for the configs they compute exactly as
fusedattn's contract says.

Why it exists: at head dim 128 FA3 can be faster than the plans cuDNN's heuristics
pick, at other shapes cuDNN leads, and FA3 stops at head dim 128
(benchmarks/results/SUMMARY.md). With ``backend="auto"`` dispatch runs it only where
cudnn runs the same config too and a measurement on this GPU says it is faster
(`fusedattn.dispatch.measure`);
``backend="flash"`` forces it.

It exposes the per-device `forward` / `backward` that `native_op` wraps, so it
partitions over batch and heads by fusedattn's one rule, not by the package's own
(which wants q, k and v sharded alike). We bind the package's un-partitioned
forward primitive (`flash_attn3_jax.flash_hlo`), the one its own partitioning
wraps, and its registered backward FFI target "flash_mha_bwd"; the pinned version
range in pyproject keeps those internal names honest.

What it runs: bf16 / fp16, bshd, separate q, k, v, dense or packed (THD) sequences
(`flash_varlen`: each segment one of FA3's variable-length sequences), d_qk == d_v
<= 128 (the package's kernels stop there), GQA, no bias / dropout / score_mod /
sinks / FP8, not deterministic (FA3's backward accumulates dq with atomics). Its
causal mask and windows are aligned to the bottom-right corner, so a top-left
mask or window runs only when s_q == s_kv (packed: when the kv segments are the
query segments), and never with s_q > s_kv (rows without keys). The LSE it saves is
fp32 natural-log ``[b, h_q, s_q]``, the contract's.

The backward is our own call of the package's registered FFI target
(`_backward_call`), not its `_flash_mha_bwd_hlo`: that one sizes FA3's two fp32
scratch rows per (batch, head) for a 128-row tile, while the head-dim-128 kernel
without a causal mask or window runs 80-row tiles, so the kernel wrote past them
and the package's non-causal d128 gradients came back NaN or wrong.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..config import AttnConfig
from . import flash_varlen, native_op
from ..inputs import AttnInputs

DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 128
INSTALL = "pip install 'fusedattn[flash]' (flash-attn3-jax, Hopper only)"


@functools.lru_cache(maxsize=None)
def _forward_kernel():
    """The package's un-partitioned forward primitive (ImportError when it is absent);
    importing it registers the package's FFI targets."""
    from flash_attn3_jax import flash_hlo  # noqa: PLC0415 - optional dependency
    return flash_hlo._flash_mha_fwd_hlo


# Row heights of the tiles FA3's Hopper backward runs (mha_bwd_impl's kBlockM: 80 at
# head dim 128 without a causal mask or window, 64 / 96 / 128 elsewhere). Its scratch
# rows per (batch, head) are s_q rounded up to the tile's height.
_BWD_TILE_ROWS = (64, 80, 96, 128)


def _scratch_rows(s_q: int, sequences: int = 0) -> int:
    """Scratch rows enough for every tile height: s_q rounded up, and for varlen calls
    total tokens plus a tile per sequence, rounded up (FA3's own sizes)."""
    return max(-(-(s_q + sequences * m) // m) * m for m in _BWD_TILE_ROWS)


def _backward_call(config: AttnConfig, d_out, q, k, v, out, lse):
    """FA3's backward through the package's FFI target "flash_mha_bwd", with the
    softmax_d / base-2 LSE scratch sized for the kernel's tiles."""
    _forward_kernel()  # registers the target
    b, s_q, h_q, _ = q.shape
    rows = jax.ShapeDtypeStruct((b, h_q, _scratch_rows(s_q)), jnp.float32)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)] + [rows, rows]
    none = jnp.zeros((0,), jnp.int32)  # cu_seqlens / seqused: absent (dense batches)
    mask = _mask_args(config)
    d_q, d_k, d_v, _, _ = jax.ffi.ffi_call("flash_mha_bwd", results)(
        d_out, q, k, v, out, lse, none, none, none, none,
        max_seqlen_q_val=s_q, max_seqlen_q_has_value=True,
        max_seqlen_k_val=k.shape[1], max_seqlen_k_has_value=True,
        softmax_scale_val=mask["softmax_scale"], softmax_scale_has_value=True,
        is_causal=mask["is_causal"], window_size_left=mask["window_size"][0],
        window_size_right=mask["window_size"][1], softcap=0.0, deterministic=False,
        sm_margin=0)
    return d_q, d_k, d_v


def availability_reason() -> Optional[str]:
    """Why the kernels cannot run in this process (None if they can)."""
    try:
        _forward_kernel()
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
    aligned = (config.shared_segments if config.is_packed else config.s_q == config.s_kv) \
        or config.bottom_right
    rules = (
        (config.dtype in DTYPES, f"dtype {config.dtype}: FA3 is {'/'.join(DTYPES)} only"),
        (not config.is_fp8, "FP8 runs on cudnn"),
        (config.layout == "bshd", f"layout {config.layout}: FA3 takes bshd"),
        (config.qkv_packing == "separate", "packed qkv / kv: FA3 takes separate q, k, v"),
        (config.sequence in ("dense", "packed"),
         f"{config.sequence} sequences: FA3 runs dense batches and packed segments"),
        (config.d_qk == config.d_v, f"d_qk {config.d_qk} != d_v {config.d_v}"),
        (config.d_qk % 8 == 0, f"head dim {config.d_qk}: FA3's kernels take multiples of 8"),
        (config.d_qk <= MAX_HEAD_DIM,
         f"head dim {config.d_qk}: flash-attn3-jax's kernels stop at {MAX_HEAD_DIM}"),
        (not config.has_bias, "bias: FA3 has none"),
        (not config.has_dropout, "dropout: FA3 has none"),
        (config.score_mod is None, "score_mod: FA3 has none (cudnn lowers score_mods)"),
        (config.softmax == "vanilla", f"softmax {config.softmax!r}: FA3 has no sink"),
        (not config.deterministic,
         "deterministic: FA3's backward accumulates dq with atomics"),
        (not (config.causal or config.window is not None) or aligned,
         "a top-left causal mask or window with s_q != s_kv (packed: kv segments of their "
         "own): FA3 aligns them bottom-right"),
        (not (config.causal or config.window is not None) or config.s_q <= config.s_kv,
         "a mask or window with s_q > s_kv leaves rows without keys, which FA3 does not "
         "zero as the contract says"),
    )
    return next((why for ok, why in rules if not ok), None)


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


class _FlashBackend(native_op.NativeBackend):
    name = "flash"
    platforms = ("cuda",)

    def supports(self, config: AttnConfig) -> Optional[str]:
        return config_reason(config) or availability_reason()


BACKEND = _FlashBackend()


# ---- the per-device kernels (native_op partitions and differentiates them) ------------
def forward(config: AttnConfig, inputs: AttnInputs, training: bool):
    """(out, fp32 lse [b, h_q, s_q] when training)."""
    if config.is_packed:
        _forward_kernel()  # registers the targets
        out, lse = flash_varlen.forward(config, inputs, _mask_args(config))
        return out, (lse if training else None)
    out, lse = _forward_kernel()(inputs.q, inputs.k, inputs.v, **_mask_args(config))
    return out, (lse if training else None)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v."""
    if config.is_packed:
        d_q, d_k, d_v = flash_varlen.backward(config, inputs, out, lse, d_out.astype(out.dtype),
                                              _mask_args(config), _scratch_rows)
        return AttnInputs(q=d_q, k=d_k, v=d_v)
    d_q, d_k, d_v = _backward_call(config, d_out.astype(out.dtype), inputs.q, inputs.k,
                                   inputs.v, out, lse)
    return AttnInputs(q=d_q, k=d_k, v=d_v)


native_op.register("flash", native_op.Kernels(forward, backward))
