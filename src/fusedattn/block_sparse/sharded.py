"""The block-sparse steps of a direct call, split over batch and heads.

XLA sees the Mosaic GPU kernels as opaque custom calls: under a jit whose inputs are
sharded it would gather q, k, v and the map onto every device and run the whole call
on each. `run` makes a step (the forward, or the backward) one custom_partitioning op
under the package's partitioning rule (`fusedattn.partitioning`): q's batch and head
splits are kept, every operand carrying those axes follows (k and v by their kv
heads; a map's lists, mask arrays and score values by their leading ``[B|1, H|1]``
axes), and each device runs the step on its shard with no collective. An output that
lacks a split axis (the gradient of score values broadcast over it) is each device's
partial sum, summed over that axis (one all-reduce of its size).

The kernels give a mask or score function the shard's own batch and head numbers.
Arrays indexed by them are the shard's rows, so that is right; a function that reads
the numbers as values (`reads_numbers`) would compute with the wrong ones, so that
axis is gathered instead.

The fusedattn backend builds its map per device inside `backends/native_op`, which
applies the same rule to the whole call, and runs the steps there unsplit.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from .. import partitioning as P
from .dependence import depends
from .kernel_parts import BLOCK


def reads_numbers(mask_fn, score, n_q: int, n_kv: int, dense: bool,
                  n_values: Sequence[int]) -> Tuple[bool, bool]:
    """(batch, head): whether the kernels' mask function or score function computes
    with the batch / head number itself, rather than only reading arrays the step
    already sliced by it (`kernel_mask`'s and `kernel_score`'s tile forms)."""
    try:
        return _reads_numbers(mask_fn, score, n_q, n_kv, dense, n_values)
    except Exception:  # (not traceable apart from the kernels: split neither axis)
        return True, True


def _reads_numbers(mask_fn, score, n_q, n_kv, dense, n_values):
    i32, f32 = jnp.int32, jnp.float32
    num = jax.ShapeDtypeStruct((), i32)
    row, col = jax.ShapeDtypeStruct((BLOCK, 1), i32), jax.ShapeDtypeStruct((1, BLOCK), i32)
    tile = jax.ShapeDtypeStruct((BLOCK, BLOCK), f32)
    rows, cols = [row] * n_q, [col] * n_kv
    bits = jax.ShapeDtypeStruct((BLOCK, BLOCK), bool) if dense else None
    batch, head = depends(mask_fn, (num, num, row, col, rows, cols, bits), (0, 1))
    if score is not None:
        tiles = [[tile] * n for n in n_values]
        sb, sh = depends(lambda b, h, q, kv, x, t: score.call(x, b, h, q, kv, t[0], t[1],
                                                              diags=t[2]),
                         (num, num, row, col, tile, tiles), (0, 1))
        batch, head = batch or sb, head or sh
    return batch, head


# ---- the partitioned op ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Step:
    body: Callable            # per device: body(*operands) -> results
    shape: P.CallShape        # the call's batch and heads
    reads: Callable[[], Tuple[bool, bool]]  # `reads_numbers`, asked where a split is decided
    in_tree: Any
    in_dims: Tuple[P.Dims, ...]
    out_tree: Any
    out_dims: Tuple[P.Dims, ...]


def run(body: Callable, operands: Sequence, dims: Sequence, out_dims, shape: P.CallShape,
        reads: Callable[[], Tuple[bool, bool]]):
    """``body(*operands)`` split over q's (the first operand's) batch and heads.
    `dims` is a pytree of `Dims` matching `operands` (None where an operand is None);
    `out_dims` the results' (a pytree of `Dims` as the results are of arrays)."""
    flat, in_tree = jax.tree_util.tree_flatten(tuple(operands))
    in_dims = tuple(jax.tree_util.tree_leaves(tuple(dims)))
    assert len(in_dims) == len(flat), (len(in_dims), len(flat))
    outs, out_tree = jax.tree_util.tree_flatten(out_dims)
    step = _Step(body, shape, reads, in_tree, in_dims, out_tree, tuple(outs))
    call = _body if P.partially_manual() else _partitioned
    results = jax.custom_batching.sequential_vmap(functools.partial(call, step))(*flat)
    return jax.tree_util.tree_unflatten(out_tree, list(results))


def _run(step: _Step, flat):
    results = step.body(*jax.tree_util.tree_unflatten(step.in_tree, list(flat)))
    leaves = jax.tree_util.tree_leaves(results)
    assert len(leaves) == len(step.out_dims), (len(leaves), len(step.out_dims))
    return tuple(leaves)


def _body(step: _Step, *flat):
    # (as native_op's body: under jit, so arrays it creates are an inner call's
    # constants; under Explicit axes, run with them Auto and typed by the split)
    inner = jax.jit(functools.partial(_run, step))

    def typed():
        q = flat[0]
        mesh = P.explicit_mesh(q)
        split = _decide(step, dict(mesh.shape),
                        [("q", step.in_dims[0], jax.typeof(q).sharding.spec)])
        return tuple(split.spec(d) for d in step.out_dims)
    return tuple(P.in_auto_axes(lambda *x: inner(x), flat[0], typed, *flat))


def _split(step: _Step, mesh, arg_shapes) -> P.Split:
    arrays = [("q" if i == 0 else f"operand {i}", dims,
               s.sharding.spec if isinstance(s.sharding, NamedSharding) else None)
              for i, (dims, s) in enumerate(zip(step.in_dims, arg_shapes))]
    return _decide(step, dict(mesh.shape), arrays)


def _decide(step: _Step, mesh_shape, arrays) -> P.Split:
    """The rule's split, less an axis whose number the kernels' functions read."""
    split = P.decide(step.shape, mesh_shape, arrays)
    reads = step.reads() if not split.trivial else (False, False)
    batch, heads = ((() if read else axes) for read, axes in
                    zip(reads, (split.batch, split.heads)))
    notes = tuple(f"the mask or score function reads the {what} number (or could not be "
                  f"traced apart from the kernels): {what} gathered"
                  for what, read, axes in (("batch", reads[0], split.batch),
                                           ("head", reads[1], split.heads))
                  if read and axes)
    return P.Split(batch, heads, split.notes + notes)


def _infer(step, mesh, arg_shapes, result_shape):
    return P.shardings(mesh, _split(step, mesh, arg_shapes), step.out_dims)


def _partition(step, mesh, arg_shapes, result_shape):
    split = _split(step, mesh, arg_shapes)

    def per_device(*flat):   # (results lacking a split axis: partial sums over it)
        return tuple(P.sum_partials(_run(step, flat), step.out_dims, split))
    return (mesh, per_device, P.shardings(mesh, split, step.out_dims),
            P.shardings(mesh, split, step.in_dims))


def _rule(step, mesh, value_types, result_types):
    return P.sdy_rule(step.in_dims, step.out_dims)


_partitioned = custom_partitioning(_body, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)
