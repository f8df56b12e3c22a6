"""Which of its inputs a mask_mod's result depends on, read from its jaxpr.

A mask_mod whose result depends on the positions alone is the same for every
batch row and head and reads no array (passed or closed over), so its block map
is static (computed on the host at trace time). One that depends on the batch or
the head index gets a map with that axis; one that depends on an array needs the
device.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp


class Reads(NamedTuple):
    batch: bool
    head: bool
    args: bool

    @property
    def positions_only(self) -> bool:
        return not (self.batch or self.head or self.args)


def index_specs(batch: int, heads: int, s_q: int, s_kv: int):
    """Abstract (batch, head, q_idx, kv_idx) shaped as the map builders call them."""
    i32 = jnp.int32
    return [jax.ShapeDtypeStruct(s, i32) for s in
            ((batch, 1, 1, 1), (1, heads, 1, 1), (1, 1, s_q, 1), (1, 1, 1, s_kv))]


def specs_of(arrays) -> tuple:
    """The ShapeDtypeStructs of `arrays` (what hoisting and tracing are keyed on)."""
    return tuple(jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in arrays)


def mask_mod_reads(mask_mod, args: Sequence, batch: int, heads: int, s_q: int,
                   s_kv: int) -> Reads:
    """Whether `mask_mod`'s output depends on batch, head or any of `args`.

    Taint flows forward through every equation (an equation with a tainted input
    taints all its outputs, sub-jaxprs included as black boxes), so the answer
    is conservative: it may say "depends" for a value that cancels out, never
    the reverse.
    """
    specs = index_specs(batch, heads, s_q, s_kv)
    closed = jax.make_jaxpr(mask_mod)(*specs, *specs_of(args))
    jaxpr = closed.jaxpr
    # Arrays the function closes over count as arguments: a kernel cannot capture them,
    # so they are read (hoisted) like score_mod_args or the map needs the device.
    captured = [v for v, c in zip(jaxpr.constvars, closed.consts) if jnp.ndim(c) > 0]
    return Reads(*(_depends(jaxpr, group) for group in (
        [jaxpr.invars[0]], [jaxpr.invars[1]], jaxpr.invars[4:] + captured)))


def depends(fn, specs: Sequence, argnums: Sequence[int]) -> Tuple[bool, ...]:
    """Per argument in `argnums`, whether `fn`'s result depends on it (`specs`: a
    pytree of ShapeDtypeStructs per argument, None for an argument that is None;
    conservative, as `mask_mod_reads`)."""
    closed = jax.make_jaxpr(fn)(*specs)
    jaxpr = closed.jaxpr
    leaves = [len(jax.tree_util.tree_leaves(s)) for s in specs]
    starts = [sum(leaves[:i]) for i in range(len(specs))]
    return tuple(_depends(jaxpr, jaxpr.invars[starts[i]:starts[i] + leaves[i]])
                 for i in argnums)


def _depends(jaxpr, sources) -> bool:
    tainted = {id(v) for v in sources}
    for eqn in jaxpr.eqns:
        # (literals are fresh objects, never tainted)
        if any(id(v) in tainted for v in eqn.invars):
            tainted.update(id(v) for v in eqn.outvars)
    return any(id(v) in tainted for v in jaxpr.outvars)
