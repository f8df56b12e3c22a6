"""The in-kernel form of a mask_mod or score_mod that reads arrays: its reads hoisted out.

A kernel cannot gather, but a mask_mod such as ``doc[b, q] == doc[b, kv]`` reads
each array per row (b, q_idx) or per column (b, kv_idx), and a score_mod such as
``s * scale[doc[b, q]] + slope[h] * (kv - q)`` per row, per column or per (b, h).
`hoist` follows each value's dependence on the score, b, h, q, kv and the arrays
through the jaxpr (traced with `dependence.index_specs`' shapes) and splits it
there: the values at the split are computed on the device (`Hoisted.values`) and
the rest, elementwise, runs on tiles (`Hoisted.__call__`, each equation by
`tile_ops`). No hoisted value varies along both q and kv (those of q - kv are taken
once per run of diagonals), so no ``s_q x s_kv`` array forms.

* A mask_mod's values (`MASK`) are integers per (b, row) or (b, column), read by the
  kernels like segment ids: int32 ``[B|1, s]``.
* A score_mod's values (`SCORE`) may also depend on the head and be floats: 32-bit
  words ``[B|1, H|1, s]`` as float32, integers bit-cast (so ids stay exact), and the
  float ones differentiable (the kernels return their gradients, `Hoisted.floats`).
* A score_mod may also read by a function of ``q_idx - kv_idx`` (a T5 bucket table):
  those values are taken once per run of diagonals sharing an index (`diagonal`),
  found from a second trace at ``s_q + s_kv - 1`` rows and one column, where each
  row is one diagonal.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from .dependence import index_specs
from .diagonal import MAX_RUNS, Runs
from .mosaic_ops import kernel_runs
from .tile_ops import flat_values, from_tile, is_float, on_tiles, stack_words, widened, word
from ..jaxprs import SHAPE_ONLY, Eqn, bind, flatten, name_of as _name, value_of


class Unsupported(ValueError):
    """The mask has a term no kernel evaluates (the message says which and why)."""


# What a value depends on, as bits. _DEVICE: it comes from an operation no kernel
# runs (a gather, a reduction, ...), so it must be computed before the kernel. _D: on
# q_idx and kv_idx only through q_idx - kv_idx (tracked for score_mods).
_B, _H, _Q, _KV, _ARG, _DEVICE, _S, _D = 1, 2, 4, 8, 16, 32, 64, 128


class Kind(NamedTuple):
    """What is hoisted: the function's name in messages, its leading (non-array)
    inputs' dependence bits, and what its hoisted values may be."""
    name: str
    index_bits: tuple
    heads: bool   # values may depend on the head index
    floats: bool  # values may be floating point (else integers and bools)


MASK = Kind("mask_mod", (_B, _H, _Q, _KV), heads=False, floats=False)
SCORE = Kind("score_mod", (_S, _B, _H, _Q, _KV), heads=True, floats=True)

# Elementwise operations: in the kernels where Mosaic GPU compiles them (`mosaic_ops`),
# else hoisted where their operands allow (per row, per column, per run of diagonals:
# a bucket's log1p of q_idx - kv_idx, say) and computed by XLA.
_ELEMENTWISE = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "add", "sub", "mul", "div",
    "rem", "neg", "abs", "sign", "max", "min", "select_n", "clamp", "convert_element_type",
    "integer_pow", "square", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "floor", "ceil", "round", "exp", "exp2", "log", "sqrt", "rsqrt", "pow",
    "is_finite", "tanh", "logistic", "log1p", "expm1", "sin", "cos", "tan", "asin", "acos",
    "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv",
    "cbrt", "lgamma", "digamma", "nextafter"})
_READS = frozenset({"gather", "dynamic_slice"})  # what jnp indexing becomes

_REASONS = {
    "head": "it reads an array at an index that depends on the head index h (hoisted "
            "values are per row (b, q_idx) or per column (b, kv_idx))",
    "dtype": "an array read gives {dtype} values (only {allowed} values up to 32 bits "
             "are hoisted)",
    "shape": "an array read gives a value of shape {shape}, not one per row [B|1, {h}, s_q, 1] "
             "or per column [B|1, {h}, 1, s_kv]",
    "runs": "its {values} value(s) read by q_idx - kv_idx change index at {runs} runs of "
            f"diagonals (at most {MAX_RUNS} values x runs are hoisted)",
}
# Index conversions that keep a position exact (up to 2^24 for float32).
_EXACT = frozenset(np.dtype(t) for t in ("int32", "int64", "uint32", "uint64", "float32",
                                         "float64"))


class Hoisted:
    """A function split at its per-row / per-column (and per-run-of-diagonals) values
    (see the module doc)."""

    def __init__(self, kind, inputs, consts, device, kernel, sides, out, s_q, s_kv,
                 diagonal=None):
        rows, cols, diags = sides
        self.kind = kind
        self._inputs, self._consts = inputs, consts
        self._device, self._kernel = device, kernel
        self._rows, self._cols, self._diags, self._out = rows, cols, diags, out
        self._diagonal = diagonal   # (the second trace's evaluation, runs) or None
        self.s_q, self.s_kv = s_q, s_kv
        self.n_rows, self.n_cols = len(rows), len(cols)  # how many values of each side
        # which values are floating point (a score_mod's differentiable ones), per side
        self.floats = (tuple(is_float(v.aval.dtype) for v in rows),
                       tuple(is_float(v.aval.dtype) for v in cols))
        self.d_floats = tuple(is_float(v.aval.dtype) for v in diags)
        # whether a value varies along the rows or columns (not only with b and h)
        self.by_position = bool(diags) or \
            any(v.aval.shape[2:3] not in ((), (1,)) for v in rows) or \
            any(v.aval.shape[3:4] not in ((), (1,)) for v in cols)

    @property
    def in_kernel(self):
        """(the equations run on tiles, in order; the row values and the column values
        they read; the result): the function as the kernels evaluate it."""
        return self._kernel, self._rows, self._cols, self._out

    @property
    def runs(self) -> Optional[Runs]:
        """The runs of diagonals of the values read by ``q_idx - kv_idx`` (None: none)."""
        return None if self._diagonal is None else self._diagonal[1]

    def values(self, args: Sequence):
        """(per-row list, per-column list) of the values from the function's actual
        arguments: int32 ``[B|1, s]`` for a mask_mod, float32 words ``[B|1, H|1, s]``
        for a score_mod (differentiable in the float args)."""
        env = _evaluate(self.kind, self._inputs, self._consts, self._device, args)
        flat = word if self.kind.floats else lambda x: x[:, 0].astype(jnp.int32)
        return ([flat(flat_values(env[v], self.s_q, 2)) for v in self._rows],
                [flat(flat_values(env[v], self.s_kv, 3)) for v in self._cols])

    def diagonal(self, args: Sequence):
        """The values read by ``q_idx - kv_idx``, one per run (`runs`): float32 words
        ``[B|1, H|1, n, K]`` (differentiable in the float args), or None."""
        if self._diagonal is None:
            return None
        (inputs, consts, device, diags, positions), runs = self._diagonal
        env = _evaluate(self.kind, inputs, consts, device, args, positions)
        diagonals = runs.run_of.shape[0]
        return stack_words([word(flat_values(env[v], diagonals, 2))[..., runs.starts]
                            for v in diags])

    def __call__(self, *index_rows_cols, diags=()):
        """``split(*index, rows, cols, diags=...)``: the function on tiles. `index` its
        leading inputs (b, h scalars, q / kv position tiles; a score_mod's score first),
        `rows` / `cols` the values' tiles as `values` gives them (broadcastable to q /
        kv's shape), `diags` those of `diagonal` at each pair's run. A mask_mod's result
        is a boolean tile; a score_mod's is in its own dtype."""
        *index, rows, cols = index_rows_cols
        env = self._scalars()
        env.update(zip(self._inputs[:len(index)], index))
        for v, x in zip(self._rows + self._cols + self._diags,
                        list(rows) + list(cols) + list(diags)):
            env[v] = from_tile(x, v.aval.dtype, self.kind.floats)
        out = _on_tiles_all(self._kernel, env, self._out)
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in index[-2:]))
        if self.kind.floats:
            return jnp.broadcast_to(out, jnp.broadcast_shapes(shape, jnp.shape(index[0])))
        out = out if jnp.result_type(out) == np.bool_ else out != 0
        return jnp.broadcast_to(out, shape)

    def reads_positions_only(self, v) -> bool:
        """Whether the in-kernel value `v` is computed from q_idx and kv_idx alone (and
        scalar constants): no hoisted value, no b or h."""
        kept, needed = _slice(self._kernel, [v])
        allowed = {o for e in kept for o in e.outs} | set(self._positions) | \
            set(self._scalars())
        return needed <= allowed

    def positions_fn(self, values):
        """``fn(b, h, q_idx, kv_idx)``: the AND of the in-kernel booleans `values`, each
        of positions alone (`reads_positions_only`), on index arrays of any shapes that
        broadcast (a static mask_mod's)."""
        kept, _ = _slice(self._kernel, values)

        def fn(b, h, q, kv):
            env = self._scalars()
            env.update(zip(self._positions, (q, kv)))
            out = True
            for v in values:
                out = out & (_on_tiles_all(kept, env, v) != 0)
            return jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(q), jnp.shape(kv)))
        return fn

    @property
    def _positions(self):
        """The function's q_idx and kv_idx inputs."""
        n = len(self.kind.index_bits)
        return self._inputs[n - 2:n]

    def _scalars(self):
        return {v: widened(c.reshape(())) for v, c in self._consts.items() if np.size(c) == 1}


def _on_tiles_all(eqns, env, out):
    """`out` after running `eqns` on tiles over `env` (which it extends)."""
    for e in eqns:
        if e.outs[0] not in env:
            env[e.outs[0]] = on_tiles(e, [_read(env, v, tile=True) for v in e.ins])
    return _read(env, out, tile=True)


def hoist(fn, arg_specs: Sequence, batch: int, heads: int, s_q: int, s_kv: int,
          kind: Kind = MASK) -> Hoisted:
    """Split ``fn(b, h, q_idx, kv_idx, *args)`` (a `SCORE` kind: ``fn(score, b, h,
    q_idx, kv_idx, *args)``) at its array reads (`arg_specs`: the args'
    ShapeDtypeStructs); raises `Unsupported` naming the rule it breaks."""
    dims = (batch, heads, s_q, s_kv)
    eqns, inputs, consts, out, dep = _program(fn, kind, arg_specs, *dims)
    kernel, frontier = _frontier(kind, eqns, inputs, consts, out, dep, dims)
    side = {v: _side(kind, v, dep[v], *dims) for v in frontier}
    rows, cols, diags = ([v for v in frontier if side[v] == k] for k in (2, 3, 4))
    diagonal = _diagonal(fn, kind, arg_specs, dims, [v.aval.dtype for v in diags]) \
        if diags else None
    return Hoisted(kind, inputs, consts, _slice(eqns, rows + cols)[0], kernel,
                   (rows, cols, diags), out, s_q, s_kv, diagonal)


def _frontier(kind, eqns, inputs, consts, out, dep, dims):
    """(the equations the kernel evaluates, the hoisted values they read), or
    `Unsupported`."""
    producer = {o: e for e in eqns for o in e.outs}
    everything = list(inputs) + list(consts) + [o for e in eqns for o in e.outs]
    # What reads an array or needs the device, on one side; of q_idx - kv_idx only a read
    # itself (what follows it runs on the tiles, the values taken once per run).
    hoisted = {v for v in everything
               if dep[v] & (_ARG | _DEVICE) and not dep[v] & _S and not _both_positions(dep[v])
               and not (dep[v] & _D and _in_kernel(producer[v]))}
    kernel, frontier = _split(eqns, out, hoisted, everything)
    for e in reversed(kernel):  # (moving values into the kernel below adds none of these)
        if not _in_kernel(e):
            d = dep[e.outs[0]]
            raise Unsupported(_refusal(kind, (
                f"it reads an array at an index that depends on {_both(d)} (only per-row, "
                "per-column, per-(batch, head) or, in a score_mod, q_idx - kv_idx reads are "
                "hoisted)")
                if e.prim.name in _READS and d & _ARG else (
                f"its {e.prim.name} of values of {_both(d)} is no elementwise operation "
                "the kernels evaluate" + (" (Mosaic GPU cannot compile it)"
                                          if e.prim.name in _ELEMENTWISE else ""))))
    while True:
        bad = [(v, why) for v in frontier if (why := _problem(kind, v, dep[v], *dims)) is not None]
        if not bad:
            break
        for v, why in bad:
            e = producer.get(v)
            if e is None or not _in_kernel(e):  # it cannot move into the kernel: refuse
                allowed = "integer, bool and float" if kind.floats else "integer and bool"
                raise Unsupported(_refusal(kind, _REASONS[why].format(
                    dtype=v.aval.dtype, shape=v.aval.shape, allowed=allowed,
                    h="H|1" if kind.heads else "1")))
            hoisted.discard(v)  # computed in the kernel from what it reads instead
        kernel, frontier = _split(eqns, out, hoisted, everything)
    for e in kernel:
        if not _keeps_layout(e, dims):
            raise Unsupported(_refusal(kind,
                f"its {e.prim.name} gives shape {e.outs[0].aval.shape}: kernel-side values must "
                "keep the index layout [B|1, H|1, s_q|1, s_kv|1]"))
    return kernel, frontier


def _diagonal(fn, kind, arg_specs, dims, dtypes):
    """The reads by ``q_idx - kv_idx`` (of `dtypes`, in order) from a second trace with
    one row per diagonal and one column: row i, column ``s_kv - 1`` is diagonal
    ``i - (s_kv - 1)``. Returns ((inputs, consts, device equations, its diagonal values,
    the positions to evaluate them at), Runs)."""
    batch, heads, s_q, s_kv = dims
    n = s_q + s_kv - 1
    small = (batch, heads, n, 1)
    eqns, inputs, consts, out, dep = _program(fn, kind, arg_specs, *small)
    _, frontier = _frontier(kind, eqns, inputs, consts, out, dep, small)
    diags = [v for v in frontier if _side(kind, v, dep[v], *small) == 4]
    if [v.aval.dtype for v in diags] != dtypes:
        raise Unsupported(_refusal(kind, "its reads by q_idx - kv_idx take another form when "
                                         "traced along the diagonals"))
    device, needed = _slice(eqns, diags)
    # The index: values of the diagonal alone that meet the args, b or h (or are
    # read as they are). Positions alone, so known now; the values read are constant
    # where none of them changes.
    fixed = lambda v: dep.get(v, 0) & _D and not dep[v] & ~(_D | _DEVICE)  # noqa: E731
    static = [v for v in needed if fixed(v) and (v in diags or any(
        v in e.ins and not fixed(e.outs[0]) for e in device))]
    q_idx = np.arange(n, dtype=np.int32).reshape(1, 1, n, 1)
    kv_idx = np.full((1, 1, 1, 1), s_kv - 1, np.int32)
    with jax.ensure_compile_time_eval():   # (no arg: the index reads none)
        env = _evaluate(kind, inputs, consts, _slice(eqns, static)[0], (), (q_idx, kv_idx))
        index = [np.asarray(env[v]) for v in static]
    if any(x.ndim < 3 or x.shape[2] != n for x in index):
        raise Unsupported(_refusal(kind, "its index by q_idx - kv_idx leaves the layout "
                                         "[B|1, H|1, s_q, s_kv]"))
    index = [np.moveaxis(x, 2, 0) for x in index]
    runs = Runs.of(index, s_q, s_kv)
    if runs.count * len(diags) > MAX_RUNS:
        raise Unsupported(_refusal(kind, _REASONS["runs"].format(runs=runs.count,
                                                                 values=len(diags))))
    return (inputs, consts, device, diags, (q_idx, kv_idx)), runs


def reason(fn, arg_specs: Sequence, batch: int, heads: int, s_q: int, s_kv: int,
           kind: Kind = MASK) -> Optional[str]:
    """Why `fn` (see `hoist`) has no in-kernel form, from shapes alone; None when it has
    one (a function that reads no array is called as it is)."""
    *_, out, dep = _program(fn, kind, arg_specs, batch, heads, s_q, s_kv)
    if isinstance(out, Literal) or not dep[out] & _ARG:
        return None
    try:
        hoist(fn, arg_specs, batch, heads, s_q, s_kv, kind)
    except Unsupported as e:
        return str(e)
    return None


def by_difference(fn, arg_specs: Sequence, batch: int, heads: int, s_q: int,
                  s_kv: int) -> bool:
    """Whether the score_mod `fn` (``fn(score, b, h, q_idx, kv_idx, *args)``) reads the
    positions only through ``q_idx - kv_idx``: every other use of them (a row read, a
    comparison with a constant, a product) makes it False."""
    dims = (batch, heads, s_q, s_kv)
    eqns, inputs, _, out, dep = _program(fn, SCORE, arg_specs, *dims)
    n = len(SCORE.index_bits)
    # The positions through exact casts and shape changes that keep each index on its
    # axis (one that moves a position to another axis is a use of its own).
    copies = set(inputs[n - 2:n])
    for e in eqns:
        first = e.ins[0] if e.ins else None
        if not isinstance(first, Literal) and first in copies and _pointwise(e, dep, dims) and (
                e.prim.name in SHAPE_ONLY or e.prim.name == "convert_element_type"
                and e.outs[0].aval.dtype in _EXACT):
            copies.update(e.outs)
        elif any(dep[o] & (_Q | _KV) for o in e.outs):
            return False   # (their difference carries _D alone)
    return isinstance(out, Literal) or out not in copies


def _refusal(kind: Kind, why: str) -> str:
    return f"a {kind.name} that reads arrays has no in-kernel form here: {why}"


def _both(d: int) -> str:
    return "the score" if d & _S else "both q_idx and kv_idx"


def _both_positions(d: int) -> bool:
    """Whether a value depends on q_idx and kv_idx otherwise than by their difference."""
    return (d & (_Q | _KV)) == _Q | _KV or bool(d & _D and d & (_Q | _KV))


def _program(fn, kind, arg_specs, batch, heads, s_q, s_kv):
    """(flat equations, inputs, consts, output, dependence bits per variable)."""
    specs = index_specs(batch, heads, s_q, s_kv)
    if kind.floats:  # the score, as the kernels give it
        specs = [jax.ShapeDtypeStruct((batch, heads, s_q, s_kv), jnp.float32)] + specs
    closed = jax.make_jaxpr(fn)(*specs, *arg_specs)
    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1:
        raise Unsupported(_refusal(kind, f"it returns {len(jaxpr.outvars)} values, not one"))
    inputs = list(jaxpr.invars)
    eqns, consts, env = flatten(closed)
    out = _name(env, jaxpr.outvars[0])
    # an array closed over is read like an argument; a scalar one is a constant
    dep = {v: (_ARG if np.size(c) > 1 else 0) for v, c in consts.items()}
    n_index = len(kind.index_bits)
    dep.update(zip(inputs, list(kind.index_bits) + [_ARG] * (len(inputs) - n_index)))
    # the positions themselves (through reshapes and exact casts): their difference is _D
    same = {inputs[n_index - 2]: _Q, inputs[n_index - 1]: _KV} if kind.floats else {}
    # Values that may vary along q or kv with no position bit (iotas, arrays shaped
    # like the index layout): met by one of q_idx - kv_idx they make one of both.
    loose = {v for v in list(consts) + list(inputs[n_index:])
             if len(v.aval.shape) >= 4 and v.aval.shape[2:4] != (1, 1)}
    dims = (batch, heads, s_q, s_kv)
    for e in eqns:
        d = 0 if _in_kernel(e) else _DEVICE
        for v in e.ins:
            d |= 0 if isinstance(v, Literal) else dep[v]
        ins = [None if isinstance(v, Literal) else same.get(v) for v in e.ins]
        if ins[:1] != [None] and (e.prim.name in SHAPE_ONLY or e.prim.name ==
                                  "convert_element_type" and e.outs[0].aval.dtype in _EXACT):
            same[e.outs[0]] = ins[0]
        elif e.prim.name == "sub" and sorted(x or 0 for x in ins) == [_Q, _KV]:
            d = _D
        ins_loose = any(not isinstance(v, Literal) and v in loose for v in e.ins)
        if d & _D and (ins_loose or not _pointwise(e, dep, dims)):
            d |= _Q | _KV   # (no longer a function of the difference alone)
        if not d & (_D | _Q | _KV) and (e.prim.name == "iota" or ins_loose):
            loose.update(e.outs)
        dep.update((o, d) for o in e.outs)
    return eqns, inputs, consts, out, dep


def _pointwise(e: Eqn, dep, dims) -> bool:
    """Whether each output element at index position (b, h, q, kv) comes from the
    inputs' elements at that position alone (what keeps a value of q_idx - kv_idx one)."""
    name = e.prim.name
    if name in SHAPE_ONLY:   # (jnp indexing adds a trailing axis to its index arrays)
        src, dst = e.ins[0].aval.shape, e.outs[0].aval.shape
        if name == "broadcast_in_dim":
            return len(src) == 0 or len(src) >= 4 and \
                tuple(e.params["broadcast_dimensions"][:4]) == (0, 1, 2, 3)
        return (len(src) >= 4 and src[:4] == dst[:4]) or _keeps_layout(e, dims)
    if name == "concatenate":   # jnp indexing stacks index arrays along a new last axis
        return e.params["dimension"] >= 4
    if name == "gather":        # a read at each position's own index, of a table
        return (e.outs[0].aval.shape[:4] == e.ins[1].aval.shape[:4]
                and not dep.get(e.ins[0], 0) & (_D | _Q | _KV))
    return name in _ELEMENTWISE


def _evaluate(kind, inputs, consts, device, args, positions=None):
    """The environment after `device`'s equations, the index inputs as iotas (or
    `positions`: the q_idx and kv_idx values) and the args given."""
    n_index = len(kind.index_bits)
    env = dict(consts)
    for axis, v in enumerate(inputs[n_index - 4:n_index]):
        env[v] = jax.lax.broadcasted_iota(v.aval.dtype, v.aval.shape, axis)
    if positions is not None:
        env.update(zip(inputs[n_index - 2:n_index], positions))
    env.update(zip(inputs[n_index:], (jnp.asarray(a, v.aval.dtype)
                                      for a, v in zip(args, inputs[n_index:]))))
    for e in device:
        env.update(zip(e.outs, bind(e.prim, e.params, [_read(env, v) for v in e.ins])))
    return env


def _read(env, v, tile=False):
    x = value_of(env, v)
    return widened(x) if tile and isinstance(v, Literal) else x


def _in_kernel(e: Eqn) -> bool:
    # (an elementwise operation Mosaic GPU cannot compile, or whose derivative in a float
    # it cannot, is hoisted where its operands allow)
    name = e.prim.name
    return (name in _ELEMENTWISE and kernel_runs(name, is_float(e.outs[0].aval.dtype))) \
        or name in SHAPE_ONLY


def _slice(eqns, targets, stop=frozenset()):
    """(the equations `targets` need, in order, short of the `stop` values; what they read)."""
    needed = {v for v in targets if not isinstance(v, Literal)}
    kept = []
    for e in reversed(eqns):
        if any(o in needed and o not in stop for o in e.outs):
            kept.append(e)
            needed.update(v for v in e.ins if not isinstance(v, Literal))
    return kept[::-1], needed


def _split(eqns, out, hoisted, everything):
    """(the equations the kernel evaluates, in order; the hoisted values they read)."""
    kernel, needed = _slice(eqns, [out], hoisted)
    return kernel, [v for v in everything if v in needed and v in hoisted]


def _side(kind, v, d, batch, heads, s_q, s_kv) -> Optional[int]:
    """2: a per-row value (also one of neither q nor kv), 3: per-column, 4: one of
    q_idx - kv_idx, None: neither shape."""
    shape = v.aval.shape
    if len(shape) == 0:
        return 2
    if len(shape) != 4 or shape[0] not in (1, batch) or \
            shape[1] not in ((1, heads) if kind.heads else (1,)):
        return None
    if d & _D:
        return 4 if shape[2] in (1, s_q) and shape[3] in (1, s_kv) else None
    if d & _KV:
        return 3 if shape[2] == 1 and shape[3] in (1, s_kv) else None
    if d & _Q:
        return 2 if shape[3] == 1 and shape[2] in (1, s_q) else None
    return 2 if shape[2] == shape[3] == 1 else None


def _problem(kind, v, d, batch, heads, s_q, s_kv) -> Optional[str]:
    if d & _H and not kind.heads:
        return "head"
    dt = np.dtype(v.aval.dtype)
    if not (dt == np.bool_ or (np.issubdtype(dt, np.integer) and dt.itemsize <= 4)
            or (kind.floats and is_float(dt) and dt.itemsize <= 4)):
        return "dtype"
    return "shape" if _side(kind, v, d, batch, heads, s_q, s_kv) is None else None


def _keeps_layout(e: Eqn, dims) -> bool:
    """Values of an equation on tiles are scalars or [B|1, H|1, s_q|1, s_kv|1]; a shape-only
    one is the identity there when each axis keeps its meaning."""
    if not all(len(s) == 0 or (len(s) == 4 and all(n in (1, m) for n, m in zip(s, dims)))
               for s in (v.aval.shape for v in e.outs + e.ins)):
        return False
    src, dst = e.ins[0].aval.shape, e.outs[0].aval.shape
    return (e.prim.name not in SHAPE_ONLY or len(src) == 0 or src == dst
            or int(np.prod(src)) == 1 or e.prim.name == "broadcast_in_dim"
            and tuple(e.params["broadcast_dimensions"]) == (0, 1, 2, 3))
