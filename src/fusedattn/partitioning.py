"""The one partitioning rule of every native attention call.

XLA sees an FFI call (or a Mosaic GPU kernel's custom call) as opaque: without a
rule it gathers the operands onto every device. This module says, from the
`AttnConfig` alone, what each dimension of each operand and result *is* (its
role), and from the shardings the partitioner proposes, which mesh axes split
the call:

* ``b``: batch (for small-seq, the tokens) and ``h``/``k``: query / kv heads
  split with no collective; every operand carrying them follows (kv heads
  under GQA, bias, a dense boolean mask, softmax offsets, sequence descriptor
  arrays, the LSE).
* ``s``/``t`` (query / key tokens) and head dims stay whole: splitting the
  sequence is context parallelism (`fusedattn.context_parallel`), a different
  algorithm, not a partitioning of one call.

A sharding the rule cannot honour without moving data gets the cheapest
correct plan (the partitioner gathers only what the rule must have whole),
and `Split.notes` says what moved and why; `explain()` prints it. The rule
knows nothing about any backend: `backends/native_op.py` applies it to the
cudnn, small_seq, ck and block_sparse calls alike, and `block_sparse/sharded.py` to
the steps of a direct `block_sparse_attention` call.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import NamedSharding, PartitionSpec

from .config import AttnConfig
from .inputs import AttnInputs

# Roles a dimension can have. None: nothing to split (kept whole).
BATCH, Q_HEADS, KV_HEADS, Q_TOKENS, KV_TOKENS = "b", "h", "k", "s", "t"
# Small-seq packed kv offsets [n + 1]: kept whole; each device reads its slice.
OFFSETS = "o"
SPLIT_ROLES = (BATCH, Q_HEADS, KV_HEADS)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The roles of one array's dimensions (a pytree leaf, unlike a plain tuple)."""
    roles: Tuple[Optional[str], ...]

    def __len__(self) -> int:
        return len(self.roles)

    def covers(self, role: str) -> bool:
        """Does the array carry `role` (kv heads carry the query heads' split)?"""
        return role in self.roles or (role == Q_HEADS and KV_HEADS in self.roles)


def token_dims(seq_first: bool, heads: str, tokens: str, packed: bool = False) -> Dims:
    """[b, s, (n,) h, d] (sequence-first: [s, b, ..]; n: the packing dimension)."""
    lead = (tokens, BATCH) if seq_first else (BATCH, tokens)
    return Dims(lead + ((None,) if packed else ()) + (heads, None))


def _tensor(config: AttnConfig, heads: str, tokens: str, packed: bool = False) -> Dims:
    """A token array in the config's layout."""
    return token_dims(config.layout == "sbhd", heads, tokens, packed)


def input_dims(config: AttnConfig, inputs):
    """An `AttnInputs` of `Dims` for the arrays `inputs` holds (None where it has none).

    ``inputs.rng`` is expected as raw bits (a uint32 vector), as native calls take it.
    """
    ragged = config.sequence == "ragged"
    # Packed qkv (h_q == h_kv) is named by its query heads, as the output is.
    q = _tensor(config, Q_HEADS, Q_TOKENS, packed=config.qkv_packing == "qkv")
    kv = _tensor(config, KV_HEADS, KV_TOKENS, packed=config.qkv_packing == "kv")
    if ragged:  # packed keys [total, h, d]: not split by token shards
        kv = Dims((KV_TOKENS, KV_HEADS, None))
    seq = inputs.sequence
    if seq is not None:
        def field(name, x):
            if x is None:
                return None
            if ragged and name == "kv_offsets":
                return Dims((OFFSETS,))
            return Dims((BATCH,) + (None,) * (x.ndim - 1))
        seq = type(seq)(seq.kind, seq.max_segments, seq.shared_segments,
                        **{n: field(n, getattr(seq, n)) for n in type(seq)._FIELDS})
    return AttnInputs(
        q=q, k=None if inputs.k is None else kv, v=None if inputs.v is None else kv,
        bias=broadcast_dims(config.bias_shape),
        softmax_offset=None if inputs.softmax_offset is None else Dims((Q_HEADS,)),
        sequence=seq, rng=None if inputs.rng is None else Dims((None,)),
        score_mod_args=tuple(Dims((None,) * len(s)) for s, _ in config.score_mod_arg_specs),
        dense_mask=broadcast_dims(config.dense_mask_shape))


def broadcast_dims(shape, heads: bool = True) -> Optional[Dims]:
    """An array [1|b, 1|h_q, ...] (a bias, a dense mask, a block map's arrays; without
    `heads` [1|b, ...]): batch and query heads where it is not broadcast over them."""
    if shape is None:
        return None
    lead = (BATCH if shape[0] > 1 else None,) + ((Q_HEADS if shape[1] > 1 else None,)
                                                 if heads else ())
    return Dims(lead + (None,) * (len(shape) - len(lead)))


def output_dims(config: AttnConfig) -> Dims:
    """The attention output [b, s_q, h_q, d_v] (sbhd: [s_q, b, ..])."""
    return _tensor(config, Q_HEADS, Q_TOKENS)


LSE_DIMS = Dims((BATCH, Q_HEADS, Q_TOKENS))  # fp32 [b, h_q, s_q], the contract's shape


def summed_roles(dims: Dims) -> Tuple[str, ...]:
    """Split roles a gradient does not carry: each device holds a partial sum over them
    (a bias broadcast over the batch, the per-head sink over the batch, packed keys
    over token shards)."""
    return tuple(r for r in (BATCH, Q_HEADS) if not dims.covers(r))


# ---- deciding the split -------------------------------------------------------------
class CallShape(NamedTuple):
    """What `decide` reads of a call: an `AttnConfig` has these fields, and a call made
    without one (a direct `block_sparse_attention`) gives them so."""
    batch: int
    h_q: int
    h_kv: int


@dataclasses.dataclass(frozen=True)
class Split:
    """Which mesh axes split the call, and what the plan had to gather and why."""
    batch: Tuple[str, ...] = ()
    heads: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = ()

    def axes(self, role: Optional[str]) -> Tuple[str, ...]:
        if role == BATCH:
            return self.batch
        if role in (Q_HEADS, KV_HEADS):
            return self.heads
        return ()

    def spec(self, dims: Dims) -> PartitionSpec:
        return PartitionSpec(*(_entry(self.axes(r)) for r in dims.roles))

    @property
    def trivial(self) -> bool:
        return not self.batch and not self.heads


def _entry(axes: Tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _axes(entry) -> Tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_axes(spec: Optional[PartitionSpec], ndim: int) -> Tuple[Tuple[str, ...], ...]:
    """Per dimension, the mesh axes a PartitionSpec splits it over."""
    entries = tuple(spec) if spec is not None else ()
    entries = entries + (None,) * (ndim - len(entries))
    return tuple(_axes(e) for e in entries)


def decide(config: AttnConfig | CallShape, mesh_shape: Mapping[str, int],
           arrays: Sequence[Tuple[str, Dims, Optional[PartitionSpec]]]) -> Split:
    """The split for operands named and shaped as `arrays` ((name, dims, spec) each) of
    a call of `config`'s batch and heads.

    The batch and head splits are read off the first operand (q); an axis that
    does not divide its dimension, or a split of a dimension the call needs
    whole, is dropped and named in the notes (the partitioner then gathers it).
    """
    notes = []
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)  # noqa: E731
    q_name, q_dims, q_spec = arrays[0]
    q_axes = dict(zip(q_dims.roles, spec_axes(q_spec, len(q_dims))))
    batch = q_axes.get(BATCH, ())
    if batch and config.batch % size(batch):
        notes.append(f"batch {config.batch} does not divide over {batch} ({size(batch)} devices): "
                     f"gathered")
        batch = ()
    heads = q_axes.get(Q_HEADS, ())
    if heads:
        n = size(heads)
        if config.h_q % n or config.h_kv % n:
            notes.append(f"heads split {n} ways over {heads}, but h_q={config.h_q}, "
                         f"h_kv={config.h_kv}: each device needs whole kv heads, so heads are "
                         f"gathered (split heads by a divisor of h_kv)")
            heads = ()
    split = Split(batch, heads)
    for name, dims, spec in arrays:
        for role, axes in zip(dims.roles, spec_axes(spec, len(dims))):
            kept = split.axes(role) if role in SPLIT_ROLES else ()
            moved = tuple(a for a in axes if a not in kept)
            if moved:
                notes.append(f"{name}: {_role_name(role)} split over {moved} is gathered"
                             + _why(role, moved))
    return Split(batch, heads, tuple(dict.fromkeys(notes)))


def _role_name(role: Optional[str]) -> str:
    return {BATCH: "batch", Q_HEADS: "query heads", KV_HEADS: "kv heads",
            Q_TOKENS: "query sequence", KV_TOKENS: "key sequence",
            OFFSETS: "kv offsets"}.get(role, "head dim / other")


def _why(role: Optional[str], axes) -> str:
    if role in (Q_TOKENS, KV_TOKENS):
        axis = axes[0] if len(axes) == 1 else axes
        return (f" (one attention call needs whole sequences; to split them use "
                f"context_parallel=ContextParallel(axis={axis!r}))")
    if role == OFFSETS or role is None:
        return " (the call reads it whole)"
    return " (it must follow q's split)"


def local_config(config: AttnConfig, split: Split, mesh_shape: Mapping[str, int]) -> AttnConfig:
    """The config one device runs: batch and heads divided by their splits."""
    nb = math.prod(mesh_shape[a] for a in split.batch)
    nh = math.prod(mesh_shape[a] for a in split.heads)
    if nb == nh == 1:
        return config

    def local(shape):  # a broadcast [1|b, 1|h_q, ..] shape: its split dimensions divided
        if shape is None:
            return None
        return (shape[0] // nb if shape[0] > 1 else 1, shape[1] // nh if shape[1] > 1 else 1) \
            + shape[2:]
    return dataclasses.replace(config, batch=config.batch // nb, h_q=config.h_q // nh,
                               h_kv=config.h_kv // nh, bias_shape=local(config.bias_shape),
                               dense_mask_shape=local(config.dense_mask_shape))


def shard_index(axes: Tuple[str, ...], mesh_shape: Mapping[str, int]) -> jax.Array:
    """This device's index along the product of `axes` (major to minor), inside a
    partitioned function."""
    index = 0
    for a in axes:
        index = index * mesh_shape[a] + jax.lax.axis_index(a)
    return index


# ---- custom_partitioning's parts -------------------------------------------------------
def shardings(mesh, split: Split, dims: Sequence[Dims]):
    """The NamedShardings the split gives arrays of roles `dims`."""
    return tuple(NamedSharding(mesh, split.spec(d)) for d in dims)


def sum_partials(outs, dims: Sequence[Dims], split: Split) -> list:
    """Inside a partitioned function: each result lacking a split role (the gradient of
    an operand broadcast over that axis) is this device's partial sum, summed over the
    axes of that role."""
    outs = list(outs)
    for i, d in enumerate(dims):
        axes = sum((split.axes(r) for r in summed_roles(d)), ())
        if axes:
            outs[i] = jax.lax.psum(outs[i], axes)
    return outs


def sdy_rule(in_dims: Sequence[Dims], out_dims: Sequence[Dims]) -> SdyShardingRule:
    """The Shardy rule: batch, query-head and kv-head factors shared by every array that
    has them; tokens and head dims need replication. Query and kv heads are separate
    factors: a compound (kv heads x group) would let Shardy split kv heads into
    sub-axes when heads are split finer than h_kv, which no NamedSharding expresses;
    the partition callback makes k and v follow q instead."""
    counter = iter(range(10 ** 6))
    own = []
    factor = {BATCH: "b", Q_HEADS: "h", KV_HEADS: "k", Q_TOKENS: "s", KV_TOKENS: "t"}

    def mapping(dims: Dims):
        names = []
        for role in dims.roles:
            if role in factor:
                names.append(factor[role])
            else:  # a dimension of its own, kept whole
                names.append(f"x{next(counter)}")
                own.append(names[-1])
        return ArrayMapping(*names)

    ins = tuple(mapping(d) for d in in_dims)
    outs = tuple(mapping(d) for d in out_dims)
    # Shardy wants special factors in the order the factors first appear.
    order = list(dict.fromkeys(n for m in ins + outs for n in m))
    replicate = tuple(n for n in order if n in ("s", "t", *own))
    return SdyShardingRule(ins, outs, need_replication_factors=replicate)


def partially_manual() -> bool:
    """Inside a shard_map that leaves some of the mesh's axes automatic? There
    custom_partitioning gets no mesh to name a split by (and GSPMD aborts the process
    on its sharding), so a call runs per manual shard without it."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and 0 < len(mesh.manual_axes) < len(mesh.axis_names)


# ---- explain(): the distributed plan --------------------------------------------------
def describe(config: AttnConfig, mesh_shape: Mapping[str, int], split: Split,
             backend: str, arg_grads: bool = False) -> str:
    """Lines for `explain()`: the split, per-device shapes and the collectives
    (`arg_grads`: the backend's backward gives the float score_mod_args' gradients)."""
    local = local_config(config, split, mesh_shape)
    lines = [f"sharding over mesh {dict(mesh_shape)}:"]
    if split.trivial:
        lines.append("  no batch or head split: every device runs the whole call")
    else:
        lines.append(f"  batch split over {split.batch or '-'}, heads over {split.heads or '-'}; "
                     f"each device runs b{local.batch} h{local.h_q}/{local.h_kv} "
                     f"(sq{local.s_q} skv{local.s_kv})")
    if backend == "xla":
        lines.append("  collectives: XLA partitions the pure-JAX backend itself")
    else:
        summed = [r for r in (BATCH, Q_HEADS) if split.axes(r)]
        grads = []
        if config.has_bias and summed:
            bb, hb = config.bias_shape[:2]
            if (bb == 1 and split.batch) or (hb == 1 and split.heads):
                grads.append("bias gradient (bias broadcast over a split axis)")
        if config.softmax == "learnable" and split.batch:
            grads.append("softmax_offset gradient (summed over batch shards)")
        if arg_grads and summed and any(
                jax.numpy.issubdtype(dtype, jax.numpy.floating)
                for _, dtype in config.score_mod_arg_specs):
            grads.append("float score_mod_args' gradients (each shard's partial sum)")
        if config.sequence == "ragged" and split.batch:
            grads.append("packed k/v gradients (every token shard writes its rows)")
        lines.append("  collectives: none in the forward; "
                     + ("all-reduce of the " + ", ".join(grads) + " in the backward"
                        if grads else "none in the backward"))
    if config.has_dropout and not split.trivial and backend != "xla":
        lines.append("  dropout: each shard draws its mask from the key folded with its shard "
                     "index, so masks differ from the unsharded call's (same rate, "
                     "independent per shard)")
    lines += [f"  gathered: {n}" for n in split.notes]
    return "\n".join(lines)


def named_specs(arrays) -> Optional[Tuple[Dict[str, int], list]]:
    """(mesh shape, specs) of arrays that carry NamedShardings (concrete arrays or
    ShapeDtypeStructs with sharding=), else None."""
    mesh, specs = None, []
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            mesh = mesh or dict(sharding.mesh.shape)
            specs.append(sharding.spec)
        else:
            specs.append(None)
    return (mesh, specs) if mesh else None


# ---- sharding in types (Explicit mesh axes) ---------------------------------------------
def explicit_mesh(x):
    """The abstract mesh of x's sharding type where some of its axes are Explicit (JAX's
    sharding in types), else None (Auto axes, or inside a shard_map's manual axes)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return None
    return mesh if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types) else None


def typed_like(x, ref):
    """x carrying ref's sharding type (x and ref of one rank, e.g. d_out and q). A
    custom_vjp's gradient must have its primal's type, and a cotangent made from an
    unsharded constant, or a native call fed one, may not; where both are typed the
    same (or nothing is Explicit) x is returned."""
    mesh = None if x is None or x.ndim != ref.ndim else explicit_mesh(ref)
    if mesh is None:
        return x
    want = jax.typeof(ref).sharding.spec
    if jax.typeof(x).sharding.spec == want:
        return x
    with jax.sharding.use_abstract_mesh(mesh):  # a PartitionSpec needs its mesh in context
        return jax.sharding.reshard(x, want)


def rule_specs(config: AttnConfig, q_dims: Dims, q, dims: Sequence[Dims]):
    """The specs the rule's split gives results of roles `dims` of a native call on `q`,
    whose mesh has Explicit axes. An FFI call's results carry no sharding type; an op
    that meets them (a dequantize) would type its own result unsharded, and the
    partitioner gather the call's results to match."""
    mesh = explicit_mesh(q)
    split = decide(config, dict(mesh.shape), [("q", q_dims, jax.typeof(q).sharding.spec)])
    return tuple(split.spec(d) for d in dims)


def in_auto_axes(fn, ref, out_specs, *args):
    """fn(*args) with the Explicit axes of ref's mesh made Auto inside, results typed by
    `out_specs()` (asked only then). XLA-level attention reshapes heads and scatters
    into per-head arrays, which sharding in types refuses when heads are split; as
    Auto axes the partitioner places those ops instead."""
    mesh = explicit_mesh(ref)
    if mesh is None:
        return fn(*args)
    # (only the Explicit axes: inside a shard_map some may be Manual, which stay so)
    explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                     if kind == jax.sharding.AxisType.Explicit)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_specs())(*args)


def typed_specs(config: AttnConfig, q, dims: Sequence[Dims]) -> Tuple[PartitionSpec, ...]:
    """Specs for results with roles `dims`, following q's sharding type role by role."""
    spec = spec_axes(jax.typeof(q).sharding.spec, q.ndim)
    q_roles = _tensor(config, Q_HEADS, Q_TOKENS, packed=config.qkv_packing == "qkv").roles
    by_role = {role: axes for role, axes in zip(q_roles, spec) if role is not None}
    return tuple(PartitionSpec(*(_entry(by_role.get(r, ())) if r else None for r in d.roles))
                 for d in dims)
