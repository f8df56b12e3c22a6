"""The in-kernel form of a mask_mod that reads arrays: its reads hoisted out.

A kernel cannot gather, but a mask_mod such as ``doc[b, q] == doc[b, kv]`` reads
each array per row (b, q_idx) or per column (b, kv_idx). `hoist` follows each
value's dependence on b, h, q, kv and the arrays through the jaxpr (traced with
`dependence.index_specs`' shapes) and splits it there: the values at the split
are computed on the device as int32 ``[B|1, s_q]`` / ``[B|1, s_kv]`` arrays, which
the kernels read like segment ids (`Hoisted.values`), and the rest, elementwise,
runs on tiles (`Hoisted.__call__`). No hoisted value depends on both q and kv, so
no ``s_q x s_kv`` array forms.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from .dependence import index_specs


class Unsupported(ValueError):
    """The mask has a term no kernel evaluates (the message says which and why)."""


# What a value depends on, as bits. _DEVICE: it comes from an operation no kernel
# runs (a gather, a reduction, ...), so it must be computed before the kernel.
_B, _H, _Q, _KV, _ARG, _DEVICE = 1, 2, 4, 8, 16, 32

_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                     "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"})
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
                         "copy_p"})
_ELEMENTWISE = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "add", "sub", "mul", "div",
    "rem", "neg", "abs", "sign", "max", "min", "select_n", "clamp", "convert_element_type",
    "integer_pow", "square", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "floor", "ceil", "round", "exp", "exp2", "log", "sqrt", "rsqrt", "pow",
    "is_finite", "tanh", "logistic"})
_SAME_SHAPES = frozenset({"select_n", "clamp"})  # (lax broadcasts only scalars here)

_REASONS = {
    "head": "it reads an array at an index that depends on the head index h (hoisted "
            "values are per row (b, q_idx) or per column (b, kv_idx))",
    "dtype": "an array read gives {dtype} values (only integer and bool values up to 32 "
             "bits are hoisted, as int32)",
    "shape": "an array read gives a value of shape {shape}, not one per row [B|1, 1, s_q, 1] "
             "or per column [B|1, 1, 1, s_kv]",
}


class _Eqn(NamedTuple):
    prim: object
    params: dict
    ins: tuple
    outs: tuple


class _Var:
    """A fresh variable: an inlined call's values get one per call site."""
    def __init__(self, aval):
        self.aval = aval


class Hoisted:
    """A mask_mod split at its per-row / per-column values (see the module doc)."""

    def __init__(self, inputs, consts, device, kernel, rows, cols, out, s_q, s_kv):
        self._inputs, self._consts = inputs, consts
        self._device, self._kernel = device, kernel
        self._rows, self._cols, self._out = rows, cols, out
        self.s_q, self.s_kv = s_q, s_kv
        self.n_rows, self.n_cols = len(rows), len(cols)  # how many values of each side

    def values(self, args: Sequence):
        """(per-row int32 ``[B|1, s_q]`` list, per-column int32 ``[B|1, s_kv]`` list) from
        the mask_mod's actual arguments."""
        env = dict(self._consts)
        env.update((v, jax.lax.broadcasted_iota(v.aval.dtype, v.aval.shape, axis))
                   for axis, v in enumerate(self._inputs[:4]))
        env.update(zip(self._inputs[4:], (jnp.asarray(a, v.aval.dtype)
                                          for a, v in zip(args, self._inputs[4:]))))
        for e in self._device:
            params = e.prim.get_bind_params(e.params)
            sub, params = params if isinstance(params, tuple) else ((), params)  # older JAX
            outs = e.prim.bind(*sub, *[_read(env, v) for v in e.ins], **params)
            env.update(zip(e.outs, outs if e.prim.multiple_results else [outs]))
        return ([_flat(env[v], self.s_q, 2) for v in self._rows],
                [_flat(env[v], self.s_kv, 3) for v in self._cols])

    def __call__(self, b, h, q, kv, rows: Sequence, cols: Sequence):
        """The mask on tiles: b, h scalars, q / kv position tiles, `rows` / `cols` the
        values' int32 tiles (broadcastable to q / kv's shape)."""
        env = {v: _wide(c.reshape(())) for v, c in self._consts.items() if np.size(c) == 1}
        env.update(zip(self._inputs[:4], (b, h, q, kv)))
        for v, x in zip(self._rows + self._cols, list(rows) + list(cols)):
            env[v] = x != 0 if v.aval.dtype == np.bool_ else \
                x if v.aval.dtype == np.int32 or _narrow(v.aval.dtype) else x.astype(v.aval.dtype)
        for e in self._kernel:
            env[e.outs[0]] = _on_tiles(e, [_read(env, v, wide=True) for v in e.ins])
        out = _read(env, self._out, wide=True)
        out = out if jnp.result_type(out) == np.bool_ else out != 0
        return jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(q), jnp.shape(kv)))


def hoist(fn, arg_specs: Sequence, batch: int, heads: int, s_q: int, s_kv: int) -> Hoisted:
    """Split ``fn(b, h, q_idx, kv_idx, *args)`` at its array reads (`arg_specs`: the
    args' ShapeDtypeStructs); raises `Unsupported` naming the rule it breaks."""
    eqns, inputs, consts, out, dep = _program(fn, arg_specs, batch, heads, s_q, s_kv)
    producer = {o: e for e in eqns for o in e.outs}
    everything = list(inputs) + list(consts) + [o for e in eqns for o in e.outs]
    hoisted = {v for v in everything  # what reads an array or needs the device, on one side
               if dep[v] & (_ARG | _DEVICE) and (dep[v] & (_Q | _KV)) != _Q | _KV}
    kernel, frontier = _split(eqns, out, hoisted, everything)
    for e in reversed(kernel):  # (moving values into the kernel below adds none of these)
        if not _in_kernel(e):
            raise Unsupported(_refusal(
                "it reads an array at an index that depends on both q_idx and kv_idx (only "
                "per-row or per-column reads are hoisted)" if dep[e.outs[0]] & _ARG else
                f"its {e.prim.name} of values of both q_idx and kv_idx is no elementwise "
                "operation"))
    while True:
        bad = [(v, why) for v in frontier
               if (why := _problem(v, dep[v], batch, s_q, s_kv)) is not None]
        if not bad:
            break
        for v, why in bad:
            e = producer.get(v)
            if e is None or not _in_kernel(e):  # it cannot move into the kernel: refuse
                raise Unsupported(_refusal(_REASONS[why].format(dtype=v.aval.dtype,
                                                                shape=v.aval.shape)))
            hoisted.discard(v)  # computed in the kernel from what it reads instead
        kernel, frontier = _split(eqns, out, hoisted, everything)
    for e in kernel:
        if not _keeps_layout(e, (batch, heads, s_q, s_kv)):
            raise Unsupported(_refusal(
                f"its {e.prim.name} gives shape {e.outs[0].aval.shape}: kernel-side values must "
                "keep the index layout [B|1, H|1, s_q|1, s_kv|1]"))
    rows = [v for v in frontier if _side(v, dep[v], batch, s_q, s_kv) == 2]
    cols = [v for v in frontier if _side(v, dep[v], batch, s_q, s_kv) == 3]
    return Hoisted(inputs, consts, _slice(eqns, frontier)[0], kernel, rows, cols, out, s_q, s_kv)


def mask_mod_reason(fn, arg_specs: Sequence, batch: int, heads: int, s_q: int,
                    s_kv: int) -> Optional[str]:
    """Why ``fn(b, h, q_idx, kv_idx, *args)`` has no in-kernel form, from shapes alone;
    None when it has one (a mask_mod that reads no array is called as it is)."""
    *_, out, dep = _program(fn, arg_specs, batch, heads, s_q, s_kv)
    if isinstance(out, Literal) or not dep[out] & _ARG:
        return None
    try:
        hoist(fn, arg_specs, batch, heads, s_q, s_kv)
    except Unsupported as e:
        return str(e)
    return None


def _refusal(why: str) -> str:
    return f"a mask_mod that reads arrays has no in-kernel form here: {why}"


def _program(fn, arg_specs, batch, heads, s_q, s_kv):
    """(flat equations, inputs, consts, output, dependence bits per variable)."""
    closed = jax.make_jaxpr(fn)(*index_specs(batch, heads, s_q, s_kv), *arg_specs)
    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1:
        raise Unsupported(_refusal(f"it returns {len(jaxpr.outvars)} values, not one mask"))
    inputs, consts, eqns = list(jaxpr.invars), {}, []
    env = {v: v for v in inputs}
    _constants(jaxpr, closed.consts, env, consts)
    _flatten(jaxpr, env, consts, eqns)
    out = _name(env, jaxpr.outvars[0])
    # an array closed over is read like an argument; a scalar one is a constant
    dep = {v: (_ARG if np.size(c) > 1 else 0) for v, c in consts.items()}
    dep.update(zip(inputs, [_B, _H, _Q, _KV] + [_ARG] * (len(inputs) - 4)))
    for e in eqns:
        d = 0 if _in_kernel(e) else _DEVICE
        for v in e.ins:
            d |= 0 if isinstance(v, Literal) else dep[v]
        dep.update((o, d) for o in e.outs)
    return eqns, inputs, consts, out, dep


def _flatten(jaxpr, env, consts, eqns):
    """`jaxpr`'s equations with calls (pjit, custom_jvp, ...) inlined, every output renamed."""
    for eqn in jaxpr.eqns:
        ins = tuple(_name(env, v) for v in eqn.invars)
        sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in eqn.params), None)
        if eqn.primitive.name in _INLINE and sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            inner_env = dict(zip(inner.invars, ins))
            _constants(inner, getattr(sub, "consts", ()), inner_env, consts)
            _flatten(inner, inner_env, consts, eqns)
            env.update((o, _name(inner_env, i)) for o, i in zip(eqn.outvars, inner.outvars))
        else:
            outs = tuple(_Var(v.aval) for v in eqn.outvars)
            env.update(zip(eqn.outvars, outs))
            eqns.append(_Eqn(eqn.primitive, eqn.params, ins, outs))


def _constants(jaxpr, values, env, consts):
    for v, c in zip(jaxpr.constvars, values):
        env[v] = _Var(v.aval)
        consts[env[v]] = np.asarray(c) if isinstance(c, (np.ndarray, np.generic)) else c


def _name(env, v):
    return v if isinstance(v, Literal) else env[v]


def _read(env, v, wide=False):
    if not isinstance(v, Literal):
        return env[v]
    x = np.asarray(v.val, v.aval.dtype)
    return _wide(x) if wide else x


def _on_tiles(e: _Eqn, ins):
    """One equation on tiles (8-bit integers held as int32: see `_narrow`)."""
    name, dt, params = e.prim.name, e.outs[0].aval.dtype, e.params
    if name in _SHAPE_ONLY:
        return ins[0]
    if name == "convert_element_type" and _narrow(dt):
        params = dict(params, new_dtype=np.dtype(np.int32))
    if name in ("shift_right_logical", "population_count"):  # of the 8-bit pattern
        ins = [x & 255 if _narrow(v.aval.dtype) else x for x, v in zip(ins, e.ins)]
    x = e.prim.bind(*_aligned(name, ins), **params)
    return _wrap(x, dt) if _narrow(dt) else x


def _narrow(dtype) -> bool:
    """8-bit integers: the kernels do no arithmetic on them, so tiles hold them as int32
    (sign- or zero-extended) and each result is wrapped back into range."""
    return np.dtype(dtype).itemsize == 1 and np.issubdtype(dtype, np.integer)


def _wide(x):
    return x.astype(np.int32) if _narrow(x.dtype) else x


def _wrap(x, dtype):
    """An int32 result of 8-bit arithmetic, reduced to the 8-bit value (extended again)."""
    if np.issubdtype(dtype, np.signedinteger):
        return jax.lax.shift_right_arithmetic(jax.lax.shift_left(x, np.int32(24)), np.int32(24))
    return x & np.int32(255)


def _in_kernel(e: _Eqn) -> bool:
    return e.prim.name in _ELEMENTWISE or e.prim.name in _SHAPE_ONLY


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


def _side(v, d, batch, s_q, s_kv) -> Optional[int]:
    """2: a per-row value (also one of neither q nor kv), 3: per-column, None: neither shape."""
    shape = v.aval.shape
    if len(shape) == 0:
        return 2
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != 1:
        return None
    if d & _KV:
        return 3 if shape[2] == 1 and shape[3] in (1, s_kv) else None
    if d & _Q:
        return 2 if shape[3] == 1 and shape[2] in (1, s_q) else None
    return 2 if shape[2] == shape[3] == 1 else None


def _problem(v, d, batch, s_q, s_kv) -> Optional[str]:
    if d & _H:
        return "head"
    dt = np.dtype(v.aval.dtype)
    if not (dt == np.bool_ or (np.issubdtype(dt, np.integer) and dt.itemsize <= 4)):
        return "dtype"
    return "shape" if _side(v, d, batch, s_q, s_kv) is None else None


def _keeps_layout(e: _Eqn, dims) -> bool:
    """Values of an equation on tiles are scalars or [B|1, H|1, s_q|1, s_kv|1]; a shape-only
    one is the identity there when each axis keeps its meaning."""
    if not all(len(s) == 0 or (len(s) == 4 and all(n in (1, m) for n, m in zip(s, dims)))
               for s in (v.aval.shape for v in e.outs + e.ins)):
        return False
    src, dst = e.ins[0].aval.shape, e.outs[0].aval.shape
    return (e.prim.name not in _SHAPE_ONLY or len(src) == 0 or src == dst
            or int(np.prod(src)) == 1 or e.prim.name == "broadcast_in_dim"
            and tuple(e.params["broadcast_dimensions"]) == (0, 1, 2, 3))


def _aligned(name, xs):
    """Operands broadcast where the primitive needs it (lax takes scalars mixed in)."""
    shapes = [jnp.shape(x) for x in xs]
    if len(set(shapes)) <= 1:
        return xs
    target = jnp.broadcast_shapes(*shapes)
    return [x if jnp.shape(x) == target or (not jnp.shape(x) and name not in _SAME_SHAPES)
            else jnp.broadcast_to(x, target) for x in xs]


def _flat(x, n, axis):
    """A frontier value ``[B|1, 1, n|1, 1]`` (axis 2) or ``[B|1, 1, 1, n|1]`` as int32 [B|1, n]."""
    x = jnp.reshape(x, (1, 1, 1, 1)) if jnp.ndim(x) == 0 else x
    shape = (x.shape[0], 1, n, 1) if axis == 2 else (x.shape[0], 1, 1, n)
    return jnp.broadcast_to(x, shape).reshape(x.shape[0], n).astype(jnp.int32)
