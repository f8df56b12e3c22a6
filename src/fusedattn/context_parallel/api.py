"""Context parallelism: q, k, v split along the sequence over one mesh axis.

``fused_attn(q, k, v, ..., context_parallel=ContextParallel(axis="cp"))`` with
q, k, v sharded along their sequence dimension over mesh axis ``cp`` (n
devices). Each device keeps its query tokens; two strategies bring it the keys:

* ``"ring"``: kv blocks travel around the ring with `ppermute`, the next
  block's transfer issued before this block's kernel so XLA overlaps them.
  The backward sends kv around again, with the kv gradients travelling along
  and arriving home after the last step.
* ``"allgather"``: kv is all-gathered once (one collective, n times the kv
  memory); the backward reduce-scatters the kv gradients. Cheapest for short
  rings and small kv (GQA).

Every step runs the chosen backend's own kernels (`backends/native_op.py`
for the native ones) and returns the log-sum-exp; partial outputs merge
exactly through it, and the backward reuses the merged (out, lse), so each
step's kernel computes its exact share of the gradient.

Causal masks are load-balanced with a zig-zag order: the sequence is cut into
2n halves and device r computes halves r and 2n-1-r, so every device does the
same work at every step. fusedattn moves the halves itself (one `ppermute`
each way); the caller's tokens stay in natural order.

Batch and head splits over other mesh axes combine with it: the shard_map is
manual over the sequence axis and over the axes that split batch and heads,
read from q's sharding type (Explicit mesh axes) or given as
``ContextParallel(batch_axes=..., head_axes=...)``, so each device runs its
kernels on its own batch / head / sequence shard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..config import AttnConfig
from .allgather import gather_blocks
from .attend import attend
from .blocks import Block, Static, block_call, ring_cases
from ..partitioning import shard_index

STRATEGIES = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Split the sequence over mesh axis `axis`.

    Args:
      axis: the mesh axis q, k and v are sharded over along their sequence dimension.
      strategy: ``"ring"`` (kv blocks passed around, overlapped with compute) or
        ``"allgather"`` (kv gathered once).
      mesh: the mesh; None takes the one set with `jax.set_mesh`.
      load_balance: zig-zag the tokens for causal masks (no effect without one).
      reorder: with load balancing, move the halves into zig-zag order and back
        (2 ppermutes per tensor). False: the caller's tokens are already in zig-zag
        order along the axis (`zigzag_order`), which saves those moves and their
        copies; outputs and gradients then stay in that order.
      batch_axes, head_axes: mesh axes that also split q's batch / heads (k, v
        follow). None: read from q's sharding type where the mesh axes are Explicit,
        else no split (those dimensions are then gathered over the other axes).
    """
    axis: str
    strategy: str = "ring"
    mesh: Optional[jax.sharding.Mesh] = None
    load_balance: bool = True
    batch_axes: Optional[Tuple[str, ...]] = None
    head_axes: Optional[Tuple[str, ...]] = None
    reorder: bool = True

    def __post_init__(self):
        if not isinstance(self.axis, str):
            raise TypeError(f"ContextParallel axis must be a mesh axis name (str), got {self.axis!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"ContextParallel strategy must be one of {STRATEGIES}, got "
                             f"{self.strategy!r}")


# ---- what context parallelism supports ------------------------------------------------
def config_reason(config: AttnConfig, cp: ContextParallel, n: int) -> Optional[str]:
    """Why this call cannot be split along the sequence (None: it can)."""
    zigzag = config.causal and cp.load_balance
    parts = 2 * n if zigzag else n
    rules = (
        (config.is_fp8, "context parallelism runs BF16/FP16 blocks; precision='fp8' is not "
                        "split along the sequence"),
        (config.layout != "bshd" or config.qkv_packing != "separate",
         "context parallelism takes separate q, k, v in the bshd layout"),
        (config.s_q != config.s_kv, f"context parallelism needs s_q == s_kv (got {config.s_q}, "
                                    f"{config.s_kv})"),
        (config.s_q % parts, f"sequence {config.s_q} does not split into {parts} equal parts "
                             f"({'2 x ' if zigzag else ''}{n} devices on axis {cp.axis!r})"),
        (config.is_packed, "packed (THD) sequences are not split by context parallelism "
                           "(segments would cross devices); use padding or no split"),
        (config.window is not None, "sliding windows are not supported with context parallelism"),
        (config.has_bias, "bias is not supported with context parallelism"),
        (config.has_dropout, "dropout is not supported with context parallelism"),
        (config.softmax != "vanilla", "softmax sinks are not supported with context "
                                      "parallelism (the sink must enter the merge once)"),
        (any(jnp.issubdtype(jnp.dtype(d), jnp.floating) for _, d in config.score_mod_arg_specs),
         "floating score_mod_args under context parallelism (their gradients would need "
         "the whole score matrix): close over constants in the function, or use "
         "fusedattn.score_mods.alibi"),
        (config.bottom_right and config.is_padded,
         "mask='causal_bottom_right' with padding under context parallelism (use 'causal')"),
        (cp.strategy == "allgather" and zigzag and config.is_padded,
         "the allgather strategy with a causal mask and padding (use strategy='ring')"),
    )
    return next((why for broken, why in rules if broken), None)


def axis_size(cp: ContextParallel) -> int:
    return _mesh(cp).shape[cp.axis]


def _mesh(cp: ContextParallel):
    mesh = cp.mesh if cp.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or cp.axis not in mesh.axis_names:
        raise ValueError(f"context_parallel axis {cp.axis!r} is not an axis of the mesh "
                         f"({None if mesh is None or mesh.empty else mesh.axis_names}): pass "
                         f"ContextParallel(axis, mesh=mesh) or call under jax.set_mesh(mesh)")
    return mesh


def describe(config: AttnConfig, cp: ContextParallel) -> str:
    """Lines for `explain()`: per-device shapes and the collectives of the plan."""
    n = axis_size(cp)
    c = config.s_q // n
    zigzag = config.causal and cp.load_balance
    kv_bytes = 2 * config.batch * c * config.h_kv * config.d_qk * 2
    lines = [f"context parallel over {cp.axis!r} ({n} devices), strategy {cp.strategy}: each "
             f"device holds sq{c} skv{c} of every sequence"]
    if zigzag:
        lines.append(f"  causal load balance: zig-zag halves (r, {2 * n - 1}-r) of {c // 2} tokens; "
                     f"1 ppermute of q, k, v in and of out back (and of the gradients)")
    if cp.strategy == "ring":
        lines.append(f"  forward: {n} steps, {n - 1} ppermutes of k, v (~{kv_bytes / 2**20:.1f} MiB "
                     f"each) overlapped with the kernels; backward: {n} ppermutes of k, v, dk, dv")
    else:
        lines.append(f"  forward: 1 all-gather of k, v ({n} x ~{kv_bytes / 2**20:.1f} MiB); "
                     f"backward: 1 reduce-scatter of dk, dv")
    return "\n".join(lines)


# ---- the public entry (called by fused_attn) ---------------------------------------------
def block_configs(config: AttnConfig, cp: ContextParallel, n: int) -> Tuple[AttnConfig, ...]:
    """Every config a device's kernels run under this split (at the global batch/heads)."""
    local = dataclasses.replace(config, s_q=config.s_q // n, s_kv=config.s_kv // n)
    st = Static(local, cp.axis, n, cp.strategy, config.causal and cp.load_balance, "xla")
    if cp.strategy == "ring":
        blocks = [b for case in ring_cases(st) for b in case if b.mask != "skip"]
    else:
        blocks = [Block(rows, (0, config.s_kv), "none" if prefix is None else "causal_bottom_right")
                  for rows, prefix in gather_blocks(st, 0)]
    return tuple(dict.fromkeys(block_call(st, b, None, None)[0] for b in blocks))


def plan_reason(config: AttnConfig, cp: ContextParallel, backend) -> Optional[str]:
    """Why `backend` cannot run this split (None: it can)."""
    n = axis_size(cp)
    why = config_reason(config, cp, n)
    if why is not None:
        return why
    for cfg in block_configs(config, cp, n):
        why = backend.supports(cfg)
        if why is not None:
            return f"a block ({cfg.short()}): {why}"
    return None


def attention(config: AttnConfig, inputs, cp: ContextParallel, backend: str) -> jax.Array:
    """fused_attn with the sequence split over `cp.axis`, on `backend`'s kernels."""
    mesh = _mesh(cp)
    n = mesh.shape[cp.axis]
    why = config_reason(config, cp, n)
    if why is not None:
        raise ValueError(f"context_parallel: {why}")
    b = config.batch
    seq = inputs.sequence
    q_len = seq.q_lengths if config.is_padded else jnp.full((b,), config.s_q, jnp.int32)
    kv_len = seq.kv_lengths if config.is_padded else jnp.full((b,), config.s_kv, jnp.int32)
    zigzag = config.causal and cp.load_balance
    batch, heads = _other_axes(config, inputs.q, cp, mesh)
    move = zigzag and cp.reorder
    entry = lambda axes: None if not axes else axes  # noqa: E731
    spec = PartitionSpec(entry(batch), cp.axis, entry(heads))
    lengths = PartitionSpec()  # tiny: every device slices its batch rows

    def per_device(q, k, v, q_len, kv_len, args):
        local = dataclasses.replace(config, batch=q.shape[0], h_q=q.shape[2], h_kv=k.shape[2],
                                    s_q=q.shape[1], s_kv=k.shape[1])
        shape = dict(mesh.shape)
        batch_start = shard_index(batch, shape) * local.batch if batch else 0
        if batch:
            q_len, kv_len = (jax.lax.dynamic_slice_in_dim(x, batch_start, local.batch)
                             for x in (q_len, kv_len))
        # A score_mod sees the call's batch, head and position numbers (score_mods.Starts).
        head_start = shard_index(heads, shape) * local.h_q if heads else 0
        extra = () if config.score_mod is None else (args, batch_start, head_start)
        st = Static(local, cp.axis, n, cp.strategy, zigzag, backend, move)
        return attend(st, q, k, v, q_len.astype(jnp.int32), kv_len.astype(jnp.int32), extra)

    args = tuple(inputs.score_mod_args)
    fn = jax.shard_map(per_device, mesh=mesh,
                       in_specs=(spec, spec, spec, lengths, lengths,
                                 tuple(PartitionSpec() for _ in args)),
                       out_specs=spec, axis_names=frozenset((cp.axis,) + batch + heads),
                       check_vma=False)
    return fn(inputs.q, inputs.k, inputs.v, q_len, kv_len, args)


def _other_axes(config: AttnConfig, q, cp: ContextParallel, mesh):
    """(batch axes, head axes) the shard_map splits besides the sequence axis."""
    batch, heads = cp.batch_axes, cp.head_axes
    if batch is None or heads is None:
        spec = tuple(getattr(getattr(jax.typeof(q), "sharding", None), "spec", None) or ())
        spec = spec + (None,) * (4 - len(spec))
        as_tuple = lambda e: () if e is None else tuple(e) if isinstance(e, tuple) else (e,)  # noqa: E731
        batch = as_tuple(spec[0]) if batch is None else batch
        heads = as_tuple(spec[2]) if heads is None else heads
    batch, heads = tuple(batch), tuple(heads)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    if config.batch % size(batch):
        raise ValueError(f"context_parallel: batch {config.batch} does not split over {batch}")
    if config.h_kv % size(heads):
        raise ValueError(f"context_parallel: heads split over {heads} ({size(heads)} ways) must "
                         f"divide h_kv={config.h_kv}")
    return batch, heads
