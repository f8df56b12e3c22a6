"""The one differentiable, partitionable call around every native backend.

A native backend (cudnn, small_seq, ck, flash: FFI calls; block_sparse: Pallas Mosaic
GPU kernels) provides two per-device functions:

* ``forward(config, inputs, training) -> (out, lse | None)``, ``lse`` fp32
  ``[b, h_q, s_q]`` when training;
* ``backward(config, inputs, out, lse, d_out) -> AttnInputs`` of gradients
  (q, k, v, bias, softmax_offset; with ``Kernels.arg_grads`` also the floating
  score_mod_args; None elsewhere),

where ``config`` describes the arrays that device holds and ``inputs.rng``
is raw uint32 bits (`rng_bits`). This module wraps them once:

* a custom_vjp (inference forward when no gradient is taken, training
  forward + backward otherwise);
* `jax.experimental.custom_partitioning` with the rule of
  `fusedattn.partitioning`, as a Shardy `sharding_rule` and as GSPMD
  callbacks, so batch and head splits need no collective and each device runs
  the backend on its own shard (a config of the local shapes, whose score_mod
  sees the call's batch and head numbers: `_on_shard`);
* sequential `vmap` (one call per mapped element), as the FFI calls had.

Each backend registers its kernels by name (`register`): an object with ``forward``
and ``backward``, and for FP8 one with ``fp8_forward`` / ``fp8_backward`` (see
`fusedattn.fp8`). FP8 kernels go through the same rule as steps of
their own (`fp8_forward`, `fp8_backward` below): scales are replicated scalars,
and each amax a kernel returns is the max over the devices' shards (one scalar
all-reduce), so it equals the unsplit call's.

Under `shard_map` (every mesh axis manual) custom_partitioning inlines the
call: it runs per device as written. Under a `shard_map` that leaves some mesh
axes to the partitioner (``axis_names=`` a subset), custom_partitioning gets no
mesh to name a split by (and GSPMD aborts the process on its sharding), so the
call skips it: it runs per manual shard, and the partitioner gathers its operands
over the axes left automatic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from .. import partitioning as P
from .. import score_mods
from ..config import AttnConfig
from ..inputs import AttnInputs

RNG_WORDS = 4  # uint32 words of dropout randomness handed to the kernels
# FP8 scalars: scales in (replicated), amaxes out (the max over shards, see _partition).
SCALAR_DIMS = P.Dims(())


def rng_bits(config: AttnConfig, rng) -> Optional[jax.Array]:
    """The dropout key as raw uint32 bits (None without dropout)."""
    if not config.has_dropout:
        return None
    return jax.random.bits(rng, (RNG_WORDS,), jnp.uint32)


class Kernels(NamedTuple):
    """A backend's per-device kernels: ``forward(config, inputs, training)`` and
    ``backward(config, inputs, out, lse, d_out)``; for FP8 ``fp8_forward`` /
    ``fp8_backward`` of `fusedattn.fp8`'s contract. ``per_entry(config)`` True: the
    kernels run one batch entry at a time (`_run_per_entry`). ``arg_grads`` True: the
    backward also returns the floating score_mod_args' gradients (None for the
    others); under a split each device's is a partial sum, summed over the split axes
    like a broadcast bias's (block_sparse: its kernels' value gradients)."""
    forward: Callable
    backward: Callable
    per_entry: Callable[[AttnConfig], bool] = lambda config: False
    arg_grads: bool = False


# Per-device kernels by backend name, filled by each backend module as it loads.
_KERNELS: Dict[str, Any] = {}
_FP8_KERNELS: Dict[str, Any] = {}


def register(name: str, kernels: Kernels, fp8_kernels: Optional[Kernels] = None) -> None:
    """Make `name`'s per-device kernels (and FP8 kernels, if any) callable here."""
    _KERNELS[name] = kernels
    if fp8_kernels is not None:
        _FP8_KERNELS[name] = fp8_kernels


@dataclasses.dataclass(frozen=True)
class _Op:
    """One native step (static: custom_partitioning's and custom_vjp's hashable argument)."""
    backend: str               # a name given to `register`
    step: str                  # "inference", "training" or "backward"; "fp8_" + one of them
    config: AttnConfig         # the global (unsplit) config
    in_tree: Any               # treedef of the operands
    in_dims: Tuple[P.Dims, ...]
    out_tree: Any
    out_dims: Tuple[P.Dims, ...]

    @property
    def fp8(self) -> bool:
        return self.step.startswith("fp8_")

    @property
    def kernels(self):
        return (_FP8_KERNELS if self.fp8 else _KERNELS)[self.backend]


# ---- the per-device body ------------------------------------------------------------
def _run(op: _Op, config: AttnConfig, flat, shard_starts=None):
    if not op.fp8 and config.batch > 1 and op.kernels.per_entry(config):
        return _run_per_entry(op, config, flat, shard_starts)
    operands = jax.tree_util.tree_unflatten(op.in_tree, flat)
    if shard_starts is not None:  # the score_mod's two more arguments (see _on_shard)
        inputs = operands[0] if op.step == "backward" else operands
        inputs = inputs._replace(score_mod_args=tuple(inputs.score_mod_args) + shard_starts)
        operands = (inputs,) + tuple(operands[1:]) if op.step == "backward" else inputs
    if op.step == "fp8_backward":
        result = op.kernels.backward(config, *operands)
    elif op.fp8:
        training = op.step == "fp8_training"
        o8, lse, amax_s, amax_o = op.kernels.forward(config, *operands, training)
        result = (o8, lse, amax_s, amax_o) if training else (o8, amax_s, amax_o)
    elif op.step == "backward":
        inputs, out, lse, d_out = operands
        result = op.kernels.backward(config, inputs, out, lse, d_out)
        if shard_starts is not None and op.kernels.arg_grads:  # (the starts have none)
            n = len(result.score_mod_args) - len(shard_starts)
            result = result._replace(score_mod_args=tuple(result.score_mod_args)[:n])
    else:
        out, lse = op.kernels.forward(config, operands, op.step == "training")
        result = (out, lse) if op.step == "training" else (out,)
    leaves = jax.tree_util.tree_leaves(result)
    assert len(leaves) == len(op.out_dims), (op.step, len(leaves), len(op.out_dims))
    return tuple(leaves)


def entry_config(config: AttnConfig) -> AttnConfig:
    """The config one batch entry of `config` runs as (`_run_per_entry`): batch 1, its
    score_mod reading the call's batch number."""
    return _on_shard(dataclasses.replace(config, batch=1))


def _run_per_entry(op: _Op, config: AttnConfig, flat, shard_starts):
    """`_run` one batch entry at a time (a loop on the device, not an unrolled one):
    what a backend asks for when its kernels cannot read values that vary over the
    batch. Each entry is a shard of one batch row (`_on_shard`); outputs with a batch
    dimension are put back together, the others (gradients of replicated values, a
    learnable sink) summed. Dropout streams get the entry's number mixed in, as
    shards' do."""
    if shard_starts is None:
        entry, (b0, h0) = entry_config(config), (jnp.int32(0), jnp.int32(0))
    else:  # already a shard's config: its score_mod reads the shard's starts
        entry, (b0, h0) = dataclasses.replace(config, batch=1), shard_starts
    in_axes = [_batch_axis(d) for d in op.in_dims]
    out_axes = [_batch_axis(d) for d in op.out_dims]

    def one(i):
        part = [x if a is None else jax.lax.dynamic_slice_in_dim(x, i, 1, a)
                for x, a in zip(flat, in_axes)]
        if op.config.has_dropout:  # (a word of its own: shards mix into word 0)
            part = _mix_into_rng(op, part, b0 + i, word=1)
        outs = _run(op, entry, part, (b0 + i, h0))
        return tuple(o if a is None else jnp.squeeze(o, a) for o, a in zip(outs, out_axes))
    stacked = jax.lax.map(one, jnp.arange(config.batch, dtype=jnp.int32))
    return tuple(jnp.sum(s, 0) if a is None else jnp.moveaxis(s, 0, a)
                 for s, a in zip(stacked, out_axes))


def _batch_axis(dims: P.Dims) -> Optional[int]:
    return dims.roles.index(P.BATCH) if P.BATCH in dims.roles else None


def _mix_into_rng(op: _Op, flat, index, word: int = 0):
    """The operands with `index` mixed into a word of the dropout bits (a stream per
    shard or per entry: documented, masks under a split differ from the unsplit call's)."""
    inputs = jax.tree_util.tree_unflatten(op.in_tree, flat)
    root = inputs[0] if op.step == "backward" else inputs
    bits = root.rng.at[word].add(jnp.asarray(index).astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
    root = root._replace(rng=bits)
    inputs = (root,) + tuple(inputs[1:]) if op.step == "backward" else root
    return jax.tree_util.tree_leaves(inputs)


def _body(op: _Op, *flat):
    # Under jit, so that arrays the body creates are constants of an inner call:
    # custom_partitioning takes a body without constants of its own. Its results' types
    # are the call's (traced here, at the global shapes): the rule's split, not the
    # kernels' (an FFI call's carry none). Under Explicit axes the body runs with them
    # Auto: at the global shapes a kernel's wrapper may slice a split dimension (the
    # FP8 backward's groups of batch rows), which sharding in types refuses.
    run = jax.jit(functools.partial(_run, op, op.config))
    return tuple(P.in_auto_axes(
        lambda *x: run(x), flat[0],
        lambda: P.rule_specs(op.config, op.in_dims[0], flat[0], op.out_dims), *flat))


def _split(op: _Op, mesh, arg_shapes) -> P.Split:
    arrays = [(f"operand {i}", dims, s.sharding.spec if isinstance(s.sharding, NamedSharding)
               else None) for i, (dims, s) in enumerate(zip(op.in_dims, arg_shapes))]
    arrays[0] = ("q",) + arrays[0][1:]
    return P.decide(op.config, dict(mesh.shape), arrays)


def _infer(op, mesh, arg_shapes, result_shape):
    return P.shardings(mesh, _split(op, mesh, arg_shapes), op.out_dims)


def _partition(op, mesh, arg_shapes, result_shape):
    split = _split(op, mesh, arg_shapes)
    shape = dict(mesh.shape)
    local = P.local_config(op.config, split, shape)
    on_shard = not op.fp8 and _reads_shard_numbers(op.config.score_mod, split)
    if on_shard:
        local = _on_shard(local)

    def per_device(*flat):
        flat = list(flat)
        for i, dims in enumerate(op.in_dims):
            if dims.roles == (P.OFFSETS,) and split.batch:  # small-seq packed kv offsets
                n = local.batch
                start = P.shard_index(split.batch, shape) * n
                flat[i] = jax.lax.dynamic_slice_in_dim(flat[i], start, n + 1)
        if op.config.has_dropout and not split.trivial:
            flat = _fold_shard_into_rng(op, flat, split, shape)
        starts = None
        if on_shard:  # this shard's first batch row and query head
            starts = tuple(jnp.asarray(P.shard_index(axes, shape) * n, jnp.int32) for axes, n in
                           ((split.batch, local.batch), (split.heads, local.h_q)))
        outs = list(_run(op, local, flat, starts))
        if op.fp8 and not split.trivial:  # amaxes: the max over every device's shard
            for i, dims in enumerate(op.out_dims):
                if dims == SCALAR_DIMS:
                    outs[i] = jax.lax.pmax(outs[i], split.batch + split.heads)
        if op.step == "backward":
            outs = P.sum_partials(outs, op.out_dims, split)
        return tuple(outs)

    return (mesh, per_device, P.shardings(mesh, split, op.out_dims),
            P.shardings(mesh, split, op.in_dims))


def _reads_shard_numbers(mod, split: P.Split) -> bool:
    """Whether a score_mod may read batch / head numbers that this split makes differ
    between a shard and the call (soft-capping reads none, ALiBi only heads)."""
    if mod is None or split.trivial or isinstance(mod, score_mods.SoftCap):
        return False
    return bool(split.heads) if isinstance(mod, score_mods.Alibi) else True


def _on_shard(local: AttnConfig) -> AttnConfig:
    """The shard's config with its score_mod seeing the call's batch and head numbers:
    a shard computes rows b0.. and heads h0.. of the call, and a per-head slope or a
    per-batch argument must be read by those numbers, not by the shard's own 0..;
    b0 and h0 go in as two more (traced) score_mod_args."""
    return score_mods.reindexed_config(local, score_mods.Starts())


def _fold_shard_into_rng(op: _Op, flat, split: P.Split, shape):
    """Each shard's dropout stream: the bits mixed with the shard's index."""
    return _mix_into_rng(op, flat, P.shard_index(split.batch + split.heads, shape))


def _rule(op, mesh, value_types, result_types):
    return P.sdy_rule(op.in_dims, op.out_dims)


_partitioned = custom_partitioning(_body, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)


def _call(backend: str, step: str, config: AttnConfig, operands, dims):
    flat, in_tree = jax.tree_util.tree_flatten(operands)
    in_dims = tuple(jax.tree_util.tree_leaves(dims))
    assert len(in_dims) == len(flat), (len(in_dims), len(flat))
    out_dims, out_tree = _out_dims(backend, step, config, operands, dims)
    op = _Op(backend, step, config, in_tree, in_dims, out_tree, out_dims)
    call = _body if P.partially_manual() else _partitioned
    outs = jax.custom_batching.sequential_vmap(functools.partial(call, op))(*flat)
    return jax.tree_util.tree_unflatten(out_tree, list(outs))


def _out_dims(backend: str, step: str, config: AttnConfig, operands, dims):
    if step == "fp8_backward":
        return ((dims[0], dims[1], dims[2]) + (SCALAR_DIMS,) * 4,
                jax.tree_util.tree_structure((0, 0, 0, (0, 0, 0, 0))))
    if step == "fp8_training":
        return ((P.output_dims(config), P.LSE_DIMS, SCALAR_DIMS, SCALAR_DIMS),
                jax.tree_util.tree_structure((0,) * 4))
    if step == "fp8_inference":
        return (P.output_dims(config), SCALAR_DIMS, SCALAR_DIMS), jax.tree_util.tree_structure((0,) * 3)
    if step == "backward":
        inputs, input_dims = operands[0], dims[0]
        grads = _grad_slots(config, inputs, _KERNELS[backend].arg_grads)
        slots = AttnInputs(**{f: (0 if getattr(grads, f) is True else None)
                              for f in grads._fields if f != "score_mod_args"},
                           score_mod_args=tuple(0 if g else None for g in grads.score_mod_args))
        out_dims = []  # (in the leaves' order: AttnInputs' fields)
        for f in grads._fields:
            if f == "score_mod_args":
                out_dims += [d for d, g in zip(input_dims.score_mod_args, grads.score_mod_args)
                             if g]
            elif getattr(grads, f) is True:
                out_dims.append(getattr(input_dims, f))
        return tuple(out_dims), jax.tree_util.tree_structure(slots)
    if step == "training":
        return (P.output_dims(config), P.LSE_DIMS), jax.tree_util.tree_structure((0, 0))
    return (P.output_dims(config),), jax.tree_util.tree_structure((0,))


def _grad_slots(config: AttnConfig, inputs: AttnInputs, arg_grads: bool) -> AttnInputs:
    """Which fields of `inputs` a backward returns gradients for (True/False; for
    score_mod_args one per arg: the floating ones when the kernels give them)."""
    return AttnInputs(q=True, k=inputs.k is not None, v=inputs.v is not None,
                      bias=inputs.bias is not None,
                      softmax_offset=inputs.softmax_offset is not None
                      and config.softmax == "learnable",
                      sequence=None, rng=None,
                      score_mod_args=tuple(arg_grads and jnp.issubdtype(jnp.result_type(a),
                                                                       jnp.floating)
                                           for a in inputs.score_mod_args))


# ---- the differentiable call ----------------------------------------------------------
def attention(backend, config: AttnConfig, inputs: AttnInputs, *, need_lse: bool = False):
    """(out, lse) from native `backend`; lse (fp32 ``[b, h_q, s_q]``, no gradient) only
    when `need_lse`. Differentiable in q, k, v, bias and softmax_offset.

    `backend` is a backend name, or dispatch's `MeasuredRivals`, whose
    ``for_step(step)`` names the backend of each step: "inference" runs a call nobody
    differentiates, "training" the forward and backward of one that is. It is asked
    while tracing, so only the steps a program contains are measured
    (`fusedattn.backend_choice`)."""
    # score_mod_args reach the kernels as they are; their cotangents come from the
    # backward step where the kernels give them (block_sparse: `Kernels.arg_grads`),
    # else they are None here (cudnn_flex supplies floating ones from the XLA backend).
    inputs = inputs._replace(rng=rng_bits(config, inputs.rng))
    if need_lse:
        out, lse = _attend_with_lse(_for_step(backend, "training"), config, inputs)
        return out, jax.lax.stop_gradient(lse)
    return _attend(backend, config, inputs), None


def _for_step(backend, step: str) -> str:
    """The backend name that runs `step` ("inference" or "training")."""
    return backend if isinstance(backend, str) else backend.for_step(step)


def forward(backend: str, config: AttnConfig, inputs: AttnInputs, training: bool):
    """The partitioned forward alone (inputs.rng already bits)."""
    dims = P.input_dims(config, inputs)
    if training:
        return _call(backend, "training", config, inputs, dims)
    return _call(backend, "inference", config, inputs, dims)[0], None


def backward(backend: str, config: AttnConfig, inputs: AttnInputs, out, lse, d_out):
    """The partitioned backward alone: gradients as an AttnInputs (None where none)."""
    dims = (P.input_dims(config, inputs), P.output_dims(config), P.LSE_DIMS,
            P.output_dims(config))
    grads = _call(backend, "backward", config, (inputs, out, lse, d_out.astype(out.dtype)), dims)
    return _cotangents(inputs, grads)


def _cotangents(inputs: AttnInputs, grads: AttnInputs) -> AttnInputs:
    """Gradients for every leaf of `inputs`: integer data (descriptor, rng bits) gets
    none, score_mod_args theirs where the kernels give them (`Kernels.arg_grads`).
    Each is typed as its primal (custom_vjp's rule): where the partitioning rule gathers
    an axis the primal splits, the call's results are typed unsplit."""
    like = P.typed_like
    args = tuple(grads.score_mod_args) or tuple(None for _ in inputs.score_mod_args)
    return AttnInputs(q=like(grads.q, inputs.q), k=like(grads.k, inputs.k),
                      v=like(grads.v, inputs.v),
                      bias=None if inputs.bias is None else like(grads.bias, inputs.bias),
                      softmax_offset=None if inputs.softmax_offset is None else like(
                          grads.softmax_offset, inputs.softmax_offset),
                      sequence=jax.tree_util.tree_map(lambda _: None, inputs.sequence),
                      rng=None, score_mod_args=tuple(
                          g if g is None or x is None else like(g, x)
                          for g, x in zip(args, inputs.score_mod_args)))


# The primal asks for the inference step's backend, the fwd rule for the training
# step's. Under jit(grad(f)) JAX traces only the fwd rule; where the call is staged
# before it is differentiated (grad(jit(f)), grad of a jax.checkpoint) it traces both,
# and both steps are measured.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(backend, config, inputs):
    return forward(_for_step(backend, "inference"), config, inputs, training=False)[0]


def _attend_fwd(backend, config, inputs):
    out, lse = forward(_for_step(backend, "training"), config, inputs, training=True)
    return out, (inputs, out, lse)


def _attend_bwd(backend, config, residuals, d_out):
    inputs, out, lse = residuals
    return (backward(_for_step(backend, "training"), config, inputs, out, lse, d_out),)


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend_with_lse(backend, config, inputs):
    return forward(backend, config, inputs, training=True)


def _attend_with_lse_fwd(backend, config, inputs):
    out, lse = forward(backend, config, inputs, training=True)
    return (out, lse), (inputs, out, lse)


def _attend_with_lse_bwd(backend, config, residuals, cotangents):
    # The caller stops the LSE's gradient: only the output's cotangent is non-zero.
    inputs, out, lse = residuals
    return (backward(backend, config, inputs, out, lse, cotangents[0]),)


_attend_with_lse.defvjp(_attend_with_lse_fwd, _attend_with_lse_bwd)


class NativeBackend:
    """The `attention` of a backend whose per-device kernels this module wraps: the
    backend's own `supports` first (its reason in the error), then the partitioned,
    differentiable call. Subclasses set `name` and define `supports`."""
    name: str

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        self.require(config)
        return attention(self.name, config, inputs)[0]

    def require(self, config: AttnConfig, context: str = "") -> None:
        """ValueError with the backend's reason (and `context`) when it cannot run `config`."""
        why = self.supports(config)
        if why is not None:
            raise ValueError(f"{self.name} backend cannot run {config.short()}: {why}{context}")


# ---- FP8 kernels (fusedattn.fp8 differentiates them) ------------------------------------
def _fp8_dims(config: AttnConfig, q8, k8, v8, sequence, scales):
    qkv = P.input_dims(config, AttnInputs(q8, k8, v8, sequence=sequence))
    return qkv, jax.tree_util.tree_map(lambda _: SCALAR_DIMS, scales)


def fp8_forward(backend: str, config: AttnConfig, q8, k8, v8, sequence, scales, training: bool):
    """`backend`'s FP8 forward, partitioned: (o8, lse or None, amax of S, amax of o)."""
    qkv, scale_dims = _fp8_dims(config, q8, k8, v8, sequence, scales)
    step = "fp8_training" if training else "fp8_inference"
    outs = _call(backend, step, config, (q8, k8, v8, sequence, scales),
                 (qkv.q, qkv.k, qkv.v, qkv.sequence, scale_dims))
    return (outs[0], outs[1] if training else None) + tuple(outs[-2:])


def fp8_backward(backend: str, config: AttnConfig, q8, k8, v8, o8, do8, lse, sequence, scales):
    """`backend`'s FP8 backward, partitioned: (dq8, dk8, dv8, (amax dq, dk, dv, dP))."""
    qkv, scale_dims = _fp8_dims(config, q8, k8, v8, sequence, scales)
    out = P.output_dims(config)
    dq8, dk8, dv8, amaxes = _call(
        backend, "fp8_backward", config, (q8, k8, v8, o8, do8, lse, sequence, scales),
        (qkv.q, qkv.k, qkv.v, out, out, P.LSE_DIMS, qkv.sequence, scale_dims))
    return dq8, dk8, dv8, amaxes
