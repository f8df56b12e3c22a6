"""Any JAX score_mod / mask_mod on cuDNN: the cudnn backend's side of
`lowering.lower`.

The config's masks (causal, window, padding lengths) and its score_mod (a mask_mod
arrives composed into it, `score_mods.Masked`) are lowered together into the graph's
score_mod and score_mod_bprop programs; the graph key then says "no mask, dense"
to cuDNN, whose own masks a score_mod switches off. Padded query rows are zeroed
here after the call, as the contract says.

Gradients of floating-point score_mod_args (a learnable per-head scale): cuDNN's
bprop gives the gradient of the scores only, so they are computed by the XLA
backend's backward on the same inputs (correct, and as slow as that backend; the
plan says so). Integer arguments get none.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Optional

import jax
import jax.numpy as jnp

from .lowering import lower as flex_lowering
from .lowering import ranges as flex_ranges
from ... import partitioning
from .. import xla
from ...config import AttnConfig
from ...score_mods import Alibi
from ...inputs import AttnInputs


def is_flex(config: AttnConfig) -> bool:
    """A config whose score_mod / mask_mod runs as lowered programs (the built-ins too;
    ALiBi in cuDNN's own form only where no program can run: `uses_cudnn_alibi`)."""
    return config.score_mod is not None and not uses_cudnn_alibi(config)


def uses_cudnn_alibi(config: AttnConfig) -> bool:
    """ALiBi through cuDNN's ALiBi mask: where a lowered program cannot run (packed
    sequences, bias) or would run per batch entry (padding lengths), and cuDNN's form can."""
    return (isinstance(config.score_mod, Alibi)
            and (reason(config) is not None or _reads_per_batch(config))
            and alibi_reason(config) is None)


def alibi_reason(config: AttnConfig) -> Optional[str]:
    """Why cuDNN's own ALiBi form cannot run this config (None: it can); the rules of
    cudnn-frontend's checks (sdpa_support_surface.h, frontend 1.32)."""
    mod = config.score_mod
    if mod.num_heads != config.h_q:
        return (f"alibi(num_heads={mod.num_heads}) with h_q={config.h_q}: cuDNN computes the "
                f"ALiBi slopes for the query heads, so num_heads must equal h_q")
    if config.mask == "causal_bottom_right":
        return ("mask='causal_bottom_right': cuDNN supports ALiBi only with top-left causal "
                "masking (mask='causal')")
    if config.window_bounds()[1] != 0:
        return ("no causal mask: cuDNN supports ALiBi only with the diagonal band's right "
                "bound 0 (mask='causal', or window=(left, 0))")
    return None


def float_args(config: AttnConfig) -> bool:
    return any(jnp.issubdtype(jnp.dtype(d), jnp.floating) for _, d in config.score_mod_arg_specs)


@functools.lru_cache(maxsize=256)
def lowered(config: AttnConfig) -> flex_lowering.Lowered:
    """The programs of this config (raises flex_lowering.Unsupported)."""
    return flex_lowering.lower(config, config.score_mod)


# cuDNN 9.19 misreads score_mod tensors that vary over the batch; a GPU test flips this
# to check that it still does (tests/gpu/test_flex_gpu.py).
PER_BATCH_INPUTS_OK = False


def reason(config: AttnConfig) -> Optional[str]:
    """Why this score_mod cannot run on cuDNN (None: it is lowered)."""
    if config.has_bias:
        return ("score_mod with bias: cuDNN applies a score_mod before the bias, fusedattn's "
                "contract after it (to scale * q.k + bias)")
    if config.is_packed:
        return ("score_mod with packed (THD) sequences: positions inside segments are not "
                "composed into the lowered graph")
    if config.has_dropout and float_args(config):
        return ("score_mod_args gradients come from the XLA backend, whose dropout masks "
                "differ from cuDNN's: not with dropout")
    try:
        low = lowered(config)
    except flex_lowering.Unsupported as e:
        return f"score_mod cannot be lowered to cuDNN: {e}"
    small = flex_lowering.unbroadcast(low.bprop.split("|") if low.bprop else [])
    if small:
        return (f"score_mod's bprop computes {small[0]!r} from static values alone (a value "
                f"of a static input's shape, not the scores'): cuDNN 9.19's backward fails on "
                f"it with a misaligned address")
    if math.isfinite(low.magnitude) and low.magnitude > flex_ranges.LIMIT:
        return (f"score_mod values reach {low.magnitude:.3g} (bounded over the call's positions "
                f"and constants, the score as [-1, 1]): cuDNN's backward recomputes the "
                f"probabilities from float32 scores with an error that grows with their "
                f"magnitude (dV far off beyond {flex_ranges.LIMIT:.3g})")
    return None


def per_entry(config: AttnConfig) -> bool:
    """Whether the programs read values that vary over the batch (the batch index,
    per-batch score_mod_args, padding lengths composed into the graph): cuDNN computes
    wrong scores from a per-batch score_mod tensor (tests/gpu/test_flex_gpu.py
    per_batch_scale), so such a call runs one batch entry at a time, each entry's
    graph reading a tensor of its own (`native_op` loops)."""
    return not PER_BATCH_INPUTS_OK and is_flex(config) and _reads_per_batch(config)


def _reads_per_batch(config: AttnConfig) -> bool:
    return (config.batch > 1 and reason(config) is None
            and any(shape[0] > 1 for shape in lowered(config).input_shapes))


def describe(config: AttnConfig) -> str:
    """The lowered programs, for explain()."""
    low = lowered(config)
    text = f"score_mod lowered to cuDNN: forward {low.forward!r}, bprop {low.bprop!r}"
    if low.row_terms:
        text += (f"; query-only terms left out of the forward program (softmax is "
                 f"shift-invariant along a row; the LSE adds them back): {low.row_terms}")
    if per_entry(config):
        text += ("; its inputs vary over the batch, which cuDNN misreads: one graph of batch "
                 "1 runs each batch entry in turn")
    return text


def key_fields(config: AttnConfig) -> Dict[str, object]:
    """The graph-key fields a lowered score_mod sets: its programs and inputs, and no
    cuDNN masks (the programs hold them)."""
    low = lowered(config)
    return {"mask": 0, "wl": -1, "wr": -1, "seq": 0, "segs": 1, "flex": low.forward,
            "flexb": low.bprop,
            "flexin": ",".join(".".join(map(str, shape)) + ("i" if is_int else "")
                               for shape, is_int in zip(low.input_shapes, low.input_ints))}


def _lengths(config: AttnConfig, inputs: AttnInputs):
    if not config.is_padded:
        return ()
    return (jnp.clip(inputs.sequence.q_lengths, 0, config.s_q).astype(jnp.int32),
            jnp.clip(inputs.sequence.kv_lengths, 0, config.s_kv).astype(jnp.int32))


def static_inputs(config: AttnConfig, inputs: AttnInputs):
    """The programs' static inputs, evaluated by XLA from the arguments and lengths."""
    return tuple(lowered(config).evaluate(inputs.score_mod_args, _lengths(config, inputs)))


def row_shift(config: AttnConfig, inputs: AttnInputs, shape):
    """The query-only terms the forward program leaves out (`flex_hoist`), as an fp32
    array of the LSE's `shape` [b, h_q, s_q] (None: none left out): the score_mod's
    LSE is cuDNN's plus this. No gradient (nor has any LSE fusedattn returns)."""
    shift = lowered(config).row_shift(inputs.score_mod_args, _lengths(config, inputs))
    if shift is None:
        return None
    return jax.lax.stop_gradient(jnp.broadcast_to(shift[..., 0], shape))


def zero_padded_rows(config: AttnConfig, inputs: AttnInputs, out, lse):
    """Padded query rows: 0 in the output and -inf in the LSE (the graph computed them
    with every key masked)."""
    if not config.is_padded:
        return out, lse
    q_len = inputs.sequence.q_lengths.astype(jnp.int32)
    valid = jnp.arange(config.s_q)[None, :] < q_len[:, None]  # [b, s_q]
    token = valid.T[:, :, None, None] if config.layout == "sbhd" else valid[:, :, None, None]
    out = jnp.where(token, out, jnp.zeros((), out.dtype))
    if lse is not None:
        lse = jnp.where(valid[:, None, :], lse, -jnp.inf)
    return out, lse


def with_arg_gradients(native, config: AttnConfig, inputs: AttnInputs):
    """`native(inputs) -> (out, lse)` with gradients for floating score_mod_args from the
    XLA backend (cuDNN gives only the scores' gradient)."""

    @jax.custom_vjp
    def run(inputs):
        return native(inputs)

    def fwd(inputs):
        (out, lse), vjp = jax.vjp(native, inputs)
        return (out, lse), (inputs, vjp)

    def bwd(residuals, cotangents):
        inputs, vjp = residuals
        grads = vjp(cotangents)[0]
        _, arg_vjp = jax.vjp(lambda a: xla.attention(config, inputs._replace(score_mod_args=a)),
                             inputs.score_mod_args)
        # A cotangent made from an unsharded constant is typed unsharded (Explicit axes).
        d_out = partitioning.typed_like(cotangents[0].astype(inputs.q.dtype), inputs.q)
        d_args = arg_vjp(d_out)[0]
        return (grads._replace(score_mod_args=tuple(
            g if jnp.issubdtype(a.dtype, jnp.floating) else None
            for g, a in zip(d_args, inputs.score_mod_args))),)
    run.defvjp(fwd, bwd)
    return run(inputs)
