"""Public entry points: `fused_attn` and `explain`."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

import jax

from . import dispatch, partitioning
from .context_parallel import ContextParallel, axis_size
from .sequence import SequenceDescriptor
from .validation import build_call


def fused_attn(q: jax.Array, k: Optional[jax.Array], v: Optional[jax.Array], *,
               bias: Optional[jax.Array] = None,
               sequence: Optional[SequenceDescriptor] = None,
               mask: str = "none",
               window: Optional[Tuple[int, int]] = None,
               scale: Optional[float] = None,
               softmax: str = "vanilla",
               softmax_offset: Optional[jax.Array] = None,
               dropout: float = 0.0,
               rng: Optional[jax.Array] = None,
               score_mod: Optional[Callable] = None,
               score_mod_args: Sequence[jax.Array] = (),
               mask_mod: Optional[Callable] = None,
               deterministic: bool = False,
               layout: str = "bshd",
               precision: Optional[str] = None,
               context_parallel: Optional[ContextParallel] = None,
               backend: str = "auto") -> jax.Array:
    """Scaled dot-product attention on the best backend for this platform and config.

    Args:
      q, k, v: ``[b, s, h, d]`` (``layout="bshd"``) or ``[s, b, h, d]`` (``"sbhd"``).
        With ``layout="bs3hd"``/``"sb3hd"`` q is packed ``[.., 3, h, d]`` and k, v are
        None; with ``"bshd_bs2hd"``/``"sbhd_sb2hd"`` k is packed ``[.., 2, h, d]`` and
        v is None. ``h_q % h_kv == 0`` (GQA / MQA); ``d_v`` may differ from ``d_qk``.
      bias: additive, after scaling, broadcast from ``[1|b, 1|h_q, s_q, s_kv]``;
        differentiable.
      sequence: a `SequenceDescriptor` for padding or packing (THD); None = all
        tokens valid.
      mask: ``"none"``, ``"causal"`` (top-left) or ``"causal_bottom_right"``.
      window: ``(left, right)`` sliding window around the (aligned) diagonal;
        -1 = unbounded. Causal masks need ``right`` 0.
      scale: logit scale, default ``1/sqrt(d_qk)``.
      softmax: ``"vanilla"``, ``"off_by_one"`` (a zero sink logit) or
        ``"learnable"`` (per-head sink logits ``softmax_offset [h_q]``, differentiable).
      dropout, rng: dropout rate on the probabilities and its PRNG key.
      score_mod, score_mod_args: ``f(score, batch, head, q_idx, kv_idx, *args)``
        applied to the scaled (and biased) logits. On cuDNN any such JAX function is
        lowered to the graph's pointwise operations (`lowering.lower`;
        ``explain`` says why when it cannot be). Under packing q_idx and kv_idx are
        positions inside the segments. Every backend may also evaluate it at masked
        pairs (its value dropped, its gradient times zero), so keep it and its
        derivative finite for any positions in the rows: a non-finite one there
        gives NaN gradients. (Under packing with one set of segments, a function of
        q_idx - kv_idx alone sees, at pairs across segments, their distance in the
        packed row.)
      mask_mod: ``f(batch, head, q_idx, kv_idx, *score_mod_args) -> bool``: pairs it
        rejects are masked (on top of ``mask``, ``window`` and the sequence).
      deterministic: ask for a bitwise-reproducible backward pass.
      precision: None, or ``"fp8"``: q, k, v (bf16 / fp16) are quantized to FP8 E4M3
        with per-tensor current scaling inside the jit, the FP8 kernels run, and the
        output and gradients come back in q's dtype (see `fusedattn.fp8`; tensors
        already in FP8 with scales of their own go to `fusedattn.fp8.attention`).
      context_parallel: a `ContextParallel` when q, k, v are sharded along their
        sequence over a mesh axis (ring or all-gather of kv; see
        `fusedattn.context_parallel`). Batch and head splits need nothing: every
        backend partitions over them by itself.
      backend: ``"auto"`` or a backend name (``FUSEDATTN_BACKEND`` overrides auto).

    Returns:
      ``[b, s_q, h_q, d_v]`` (``[s_q, b, h_q, d_v]`` for sbhd layouts) in q's dtype.
    """
    config, inputs = build_call(
        q, k, v, bias=bias, sequence=sequence, mask=mask, window=window, scale=scale,
        softmax=softmax, softmax_offset=softmax_offset, dropout=dropout, rng=rng,
        score_mod=score_mod, score_mod_args=score_mod_args, mask_mod=mask_mod,
        deterministic=deterministic, layout=layout, precision=precision)
    cp = _check_context_parallel(context_parallel)
    return dispatch.plan(config, backend, context_parallel=cp).run(inputs)


def _check_context_parallel(cp) -> Optional[ContextParallel]:
    if cp is None:
        return None
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"context_parallel must be a fusedattn.ContextParallel or None, got "
                        f"{type(cp).__name__}")
    axis_size(cp)  # raises ValueError naming the axis when the mesh lacks it
    return cp


def explain(q, k, v, *, backend: str = "auto", context_parallel=None, **options) -> dispatch.Plan:
    """The plan `fused_attn(q, k, v, **options)` would follow, without running it.

    Arrays may be `jax.ShapeDtypeStruct`s. The plan names the chosen backend and,
    for every other backend, why it was not chosen; ``print(plan)`` shows a table.
    Arrays that carry a `NamedSharding` (device arrays, or ShapeDtypeStructs made
    with ``sharding=``) add the distributed plan: the batch / head split, the
    per-device shapes, the collectives and which array must be gathered and why.
    """
    config, inputs = build_call(q, k, v, **options)
    cp = _check_context_parallel(context_parallel)
    plan = dispatch.plan(config, backend, context_parallel=cp)
    if cp is not None:
        return plan
    if plan.groups:   # a call per run of rows: each splits as its own plan says
        parts = [(q_rows, kv_rows, _distributed(sub, inputs)) for q_rows, kv_rows, sub
                 in plan.groups]
        text = "\n".join(f"{plan.group_label(q_rows, kv_rows)}: {d}"
                         for q_rows, kv_rows, d in parts if d)
        return dataclasses.replace(plan, distributed=text) if text else plan
    text = _distributed(plan, inputs)
    return dataclasses.replace(plan, distributed=text) if text else plan


def _distributed(plan: dispatch.Plan, inputs) -> str:
    """The batch / head split of `plan`'s call over the inputs' shardings ("" when the
    arrays carry none, or no backend runs the call). The split reads each array's
    dims by role, so the full arrays describe a call on a run of their rows too."""
    if plan.chosen is None:
        return ""
    config = dispatch.config_for(plan.config, plan.chosen)  # (a dense mask as it is taken)
    names, dims, arrays = zip(*_held(partitioning.input_dims(config, inputs._replace(rng=None)),
                                     inputs))
    found = partitioning.named_specs(arrays)
    if found is None:
        return ""
    mesh_shape, specs = found
    split = partitioning.decide(config, mesh_shape, list(zip(names, dims, specs)))
    return partitioning.describe(config, mesh_shape, split, plan.chosen,
                                 arg_grads=dispatch.runs_block_maps(plan.chosen))


def _held(dims, inputs):
    """(name, dims, array) of each array of the call the rule names, q first (the
    sequence descriptor aside): a split the call must gather is named in the plan."""
    for name in ("q", "k", "v", "bias", "softmax_offset", "dense_mask"):
        d, x = getattr(dims, name), getattr(inputs, name)
        if d is not None and x is not None:
            yield name, d, x
    for i, (d, x) in enumerate(zip(dims.score_mod_args, inputs.score_mod_args)):
        yield f"score_mod_args[{i}]", d, x
