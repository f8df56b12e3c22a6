"""A traced boolean mask as a mask_mod over the arrays it reads per row or per column.

Flax's padding mask (``make_attention_mask(tokens > 0, tokens > 0)``) and document
mask (``make_attention_mask(seg, seg, jnp.equal)``), ANDed with ``make_causal_mask``,
reach the drop-ins as one ``[B, 1, T, S]`` boolean tracer. Its value depends on data,
so it is not known at trace time (`folding`), but it is an elementwise function of
arrays read per query row or per key column and of positions. `as_mask_mod` walks the
equations that made it back to those arrays (`walk`) and writes the mask as
``mask_mod(b, h, i, j, *arrays)``: each array read at the index that the shape
operations on the way (broadcasts, reshapes, transposes, slices) map ``(b, h, i, j)``
to, each ``iota`` the position along its axis. The block-sparse backend then builds the
map from those arrays (counting ids per block for documents) and the kernels evaluate
the element mask from them: no ``T x S`` array is formed or read.

Only primitives exact on every backend are rewritten (`folding.exact`: comparisons,
boolean logic, selects, integer arithmetic), so the mask_mod computes the mask's very
bits. Anything else (a float sum, a reduction, a gather) is a leaf: its result is read
like an input. A mask that would read one array by both positions (the mask itself
passed in, a constant ``T x S`` table) gives None, and the drop-in keeps the mask.

The program built again with kv_idx read as q_idx, and folded, says whether the mask
holds on the diagonal whatever the arrays hold (``ids[q] == ids[kv]``): then every row
sees its own key, and the drop-in skips jax.nn's rule for rows that see none.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from ..jaxprs import flatten
from .folding import CALLS, call_body, exact
from .walk import MOVES, NotWalkable, Walk

MAX_EQUATIONS = 256       # equations walked at most
MAX_INSTRUCTIONS = 1024   # instructions of the mask_mod at most
# Operations that move elements (the mask's element at an index is the operand's at
# another), each with its rule in `_Builder`; and exact ones that are not elementwise.
_MOVES = MOVES | {"iota"}
_NOT_ELEMENTWISE = frozenset({"concatenate", "dynamic_slice", "pad", "reduce_and",
                              "reduce_or", "reduce_max", "reduce_min"})
_INFIX = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "&",
          "or": "|", "xor": "^", "add": "+", "sub": "-", "mul": "*", "rem": "%"}
_POSITION_BITS = (1, 2, 4, 8)   # dependence of a value on b, h, q_idx, kv_idx
_BOTH = _POSITION_BITS[2] | _POSITION_BITS[3]


class _Refused(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class MaskProgram:
    """``mask_mod(b, h, i, j, *args)``: a traced mask's element at ``(b, h, i, j)``.

    `code` is a straight-line program, each instruction reading earlier ones by number:
    ``("pos", axis)``, ``("lit", dtype, bytes)``, ``("read", arg, (index, ...))``,
    ``("convert", dtype, x)`` and ``("op", primitive, params, (x, ...))``, the last
    instruction the mask. Two traces of one mask give equal programs, so plans and
    maps cached by config are found again."""
    code: Tuple[tuple, ...]

    @property
    def __name__(self) -> str:
        return "traced_mask"

    def expression(self, limit: int = 240) -> str:
        """The program as one expression over ``b, h, i, j`` and its arrays ``a0, a1,
        ...`` (what explain() prints), cut at `limit` characters."""
        text: List[str] = []
        for ins in self.code:
            kind = ins[0]
            if kind == "pos":
                t = "bhij"[ins[1]]
            elif kind == "lit":
                t = repr(np.frombuffer(ins[2], jnp.dtype(ins[1])).item())
            elif kind == "read":
                t = f"a{ins[1]}" + (f"[{', '.join(text[x] for x in ins[2])}]" if ins[2] else "")
            elif kind == "convert":
                t = f"{ins[1]}({text[ins[2]]})"
            else:
                name, xs = ins[1].name, [text[x] for x in ins[3]]
                t = (f"({f' {_INFIX[name]} '.join(xs)})" if name in _INFIX and len(xs) == 2
                     else f"~{xs[0]}" if name == "not" else f"{name}({', '.join(xs)})")
            text.append(t)
        out = text[-1]
        return out if len(out) <= limit else out[:limit - 3] + "..."

    def __call__(self, b, h, i, j, *args):
        positions = (b, h, i, j)
        values: List = []
        for ins in self.code:
            kind = ins[0]
            if kind == "pos":
                v = positions[ins[1]]
            elif kind == "lit":
                v = np.frombuffer(ins[2], jnp.dtype(ins[1])).reshape(())
            elif kind == "read":
                v = jnp.asarray(args[ins[1]])   # (a NumPy array cannot take traced indices)
                if ins[2]:
                    v = v[tuple(values[x] for x in ins[2])]
            elif kind == "convert":
                v = lax.convert_element_type(values[ins[2]], jnp.dtype(ins[1]))
            else:
                _, prim, params, xs = ins
                v = prim.bind(*jnp.broadcast_arrays(*(values[x] for x in xs)), **dict(params))
            values.append(v)
        return jnp.asarray(values[-1])


class Rewritten(NamedTuple):
    program: MaskProgram
    args: tuple            # the arrays it reads, the mask_mod's score_mod_args
    # Whether the mask holds at every (i, i) whatever the arrays hold (``ids[q] ==
    # ids[kv]``, causal): then a row that has key i sees a key.
    diagonal: bool


def as_mask_mod(mask) -> Optional[Rewritten]:
    """The `MaskProgram` equal to the boolean jit tracer `mask` ``[B|1, N|1, T, S]`` on
    every element, with the arrays it reads; None when the mask is not such a function
    of arrays read per row or per column and of positions."""
    if not isinstance(mask, jax.core.Tracer) or mask.dtype != np.bool_ or mask.ndim != 4:
        return None
    try:
        walk = Walk(mask, _expand, MAX_EQUATIONS)
        leaves = list(walk.leaves)

        def rebuild(*values):
            return walk.rebuild(dict(zip(leaves, values)))
        closed = jax.make_jaxpr(rebuild)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                           for v in leaves))
        eqns, consts, env = flatten(closed)
        inputs = {env[v]: walk.leaves[leaf] for v, leaf in zip(closed.jaxpr.invars, leaves)}
        out = env[closed.jaxpr.outvars[0]]
        builder = _Builder(eqns, consts, inputs)
        code, args = builder.live(builder.value(out, builder.positions(mask.shape)))
        # (the same program with kv_idx read as q_idx, folded: the mask on the diagonal)
        on_diagonal = _Builder(eqns, consts, inputs, diagonal=True)
        diagonal = on_diagonal.is_true(on_diagonal.value(out, on_diagonal.positions(mask.shape)))
    except (NotWalkable, _Refused):
        return None
    except Exception:  # noqa: BLE001 - internals of another JAX version: keep the mask
        return None
    return Rewritten(MaskProgram(code), args, diagonal)


def _expand(eqn) -> bool:
    """Walk through `eqn` (else its outputs are leaves, read as arrays): a move, an
    exact elementwise primitive, or a call whose body is all of those."""
    name = eqn.primitive.name
    if eqn.effects:
        return False
    if name in CALLS:
        body = call_body(eqn.params)
        return body is not None and all(_expand(e) for e in body.eqns)
    return name in _MOVES or (name not in _NOT_ELEMENTWISE and
                              exact(name, [v.aval for v in eqn.outvars]))


def _keeps_bools(dtype) -> bool:
    """Whether False and True made `dtype` are 0 and 1 (not so in a type without 0)."""
    try:
        ones = np.array([False, True]).astype(dtype)
        return ones.astype(np.float64).tolist() == [0.0, 1.0]
    except (TypeError, ValueError):
        return False


def _squeezed(array, shape):
    """A leaf as the mask_mod reads it: without its axes of size 1, and no gradient."""
    kept = tuple(n for n in shape if n != 1)
    if jnp.issubdtype(array.dtype, jnp.inexact):
        array = lax.stop_gradient(array)
    return array.reshape(kept) if kept != tuple(shape) else array


class _Builder:
    """Writes the program of one value at an index, equation by equation backwards."""

    def __init__(self, eqns, consts, inputs: Dict, diagonal: bool = False):
        self.diagonal = diagonal
        self.producer = {o: e for e in eqns for o in e.outs}
        self.consts, self.inputs = consts, inputs
        self.code: List[tuple] = []
        self.deps: List[int] = []     # per instruction: which positions it depends on
        self.dtypes: List[np.dtype] = []
        self.number: Dict[tuple, int] = {}
        self.args: List = []
        self.arg_of: Dict[object, int] = {}   # the leaf's variable -> arg number
        self.memo: Dict[tuple, int] = {}   # (variable, index) -> instruction

    def live(self, result: int):
        """(the instructions `result` needs, renumbered, it last; the arrays they read)."""
        needed, todo = set(), [result]
        while todo:
            x = todo.pop()
            if x not in needed:
                needed.add(x)
                todo += self._inputs(self.code[x])
        number, code, arg_number = {}, [], {}
        for x in sorted(needed):
            ins = self.code[x]
            if ins[0] == "read":
                arg = arg_number.setdefault(ins[1], len(arg_number))
                ins = ("read", arg, tuple(number[y] for y in ins[2]))
            elif ins[0] == "convert":
                ins = ins[:2] + (number[ins[2]],)
            elif ins[0] == "op":
                ins = ins[:3] + (tuple(number[y] for y in ins[3]),)
            number[x] = len(code)
            code.append(ins)
        return tuple(code), tuple(self.args[k] for k in arg_number)

    @staticmethod
    def _inputs(ins) -> List[int]:
        return list(ins[2]) if ins[0] == "read" else [ins[2]] if ins[0] == "convert" else \
            list(ins[3]) if ins[0] == "op" else []

    def emit(self, ins: tuple, deps: int, dtype) -> int:
        if ins not in self.number:
            if len(self.code) >= MAX_INSTRUCTIONS:
                raise _Refused
            self.number[ins] = len(self.code)
            self.code.append(ins)
            self.deps.append(deps)
            self.dtypes.append(np.dtype(dtype))
        return self.number[ins]

    def literal(self, value, dtype=np.int32) -> int:
        value = np.asarray(value, dtype)
        return self.emit(("lit", value.dtype.name, value.tobytes()), 0, value.dtype)

    def positions(self, shape) -> Tuple[int, ...]:
        """The instructions of (b, h, q_idx, kv_idx) (kv_idx as q_idx on the diagonal),
        0 along axes of size 1."""
        axes = (0, 1, 2, 2 if self.diagonal else 3)
        return tuple(self.literal(0) if n == 1 else
                     self.emit(("pos", a), _POSITION_BITS[a], np.int32)
                     for a, n in zip(axes, shape))

    def is_true(self, x: int) -> bool:
        value = self._literal_value(x)
        return value is not None and value.dtype == np.bool_ and bool(value)

    def _literal_value(self, x: int):
        ins = self.code[x]
        return np.frombuffer(ins[2], self.dtypes[x]).reshape(()) if ins[0] == "lit" else None

    def op(self, prim, xs, params=(), dtype=np.int32) -> int:
        folded = self._fold(prim, tuple(xs), params)
        if folded is not None:
            return folded
        deps = 0
        for x in xs:
            deps |= self.deps[x]
        return self.emit(("op", prim, params, tuple(xs)), deps, dtype)

    def _fold(self, prim, xs, params) -> Optional[int]:
        """The instruction `prim` of `xs` is known to equal, or None: literals evaluated
        (by XLA, as the device would), ``x == x`` of integers, and the identities of
        boolean logic and selection."""
        values = [self._literal_value(x) for x in xs]
        if all(v is not None for v in values):
            with jax.ensure_compile_time_eval():
                value = np.asarray(prim.bind(*values, **dict(params)))
            return self.literal(value, value.dtype)
        name = prim.name
        if len(xs) == 2 and xs[0] == xs[1] and not np.issubdtype(self.dtypes[xs[0]],
                                                                  np.inexact):
            same = {"eq": True, "le": True, "ge": True, "ne": False, "lt": False, "gt": False}
            if name in same:
                return self.literal(same[name], np.bool_)
            if name in ("and", "or", "max", "min"):
                return xs[0]
        if name in ("and", "or") and self.dtypes[xs[0]] == np.bool_:
            for known, other in ((values[0], xs[1]), (values[1], xs[0])):
                if known is not None:   # (True & x is x, False | x is x, else the literal)
                    return other if bool(known) == (name == "and") else self.literal(
                        bool(known), np.bool_)
        if name == "select_n" and values[0] is not None:
            return xs[1 + int(values[0])]
        return None

    def convert(self, x: int, dtype) -> int:
        """`x` as `dtype`; a boolean made a number and back (Flax's float masks) is itself."""
        dtype = np.dtype(dtype)
        if self.dtypes[x] == dtype:
            return x
        if dtype == np.bool_ and self._bool_as_number(x) is not None:
            return self._bool_as_number(x)
        return self.emit(("convert", dtype.name, x), self.deps[x], dtype)

    def _bool_as_number(self, x: int) -> Optional[int]:
        """The boolean instruction that `x` converts to a number (one with an exact 0 and
        1), or None."""
        ins = self.code[x]
        return ins[2] if ins[0] == "convert" and self.dtypes[ins[2]] == np.bool_ and \
            _keeps_bools(self.dtypes[x]) else None

    def _is_zero(self, x: int) -> bool:
        ins = self.code[x]
        return ins[0] == "lit" and not np.frombuffer(ins[2], self.dtypes[x]).any()

    def value(self, var, idx: Tuple[int, ...]) -> int:
        """The instruction computing `var` at index `idx` (instructions, one per axis)."""
        if isinstance(var, Literal):   # (unhashable; alive in the equations it is read by)
            return self._constant(("literal", id(var)), np.asarray(var.val, var.aval.dtype), idx)
        if (var, idx) not in self.memo:
            self.memo[var, idx] = self._value(var, idx)
        return self.memo[var, idx]

    def _value(self, var, idx):
        if var in self.inputs:
            return self._read(var, self.inputs[var], var.aval.shape, idx)
        if var in self.consts:
            return self._constant(var, self.consts[var], idx)
        eqn = self.producer[var]
        name = eqn.prim.name
        rule = getattr(self, "_" + name, None) if name in _MOVES else None
        if rule is not None:
            return rule(eqn, idx)
        if any(len(x.aval.shape) not in (0, len(idx)) for x in eqn.ins):
            raise _Refused
        ins = [self.value(x, idx if len(x.aval.shape) else ()) for x in eqn.ins]
        if name == "ne" and self._is_zero(ins[1]) and self._bool_as_number(ins[0]) is not None:
            return self._bool_as_number(ins[0])   # (a number made of a boolean, != 0)
        try:
            params = tuple(sorted(eqn.params.items()))
            hash(params)
        except TypeError:
            raise _Refused from None
        return self.op(eqn.prim, ins, params, eqn.outs[0].aval.dtype)

    def _constant(self, key, value, idx) -> int:
        if isinstance(value, jax.core.Tracer):
            raise _Refused
        value = np.asarray(value)
        if value.size == 1:
            return self.literal(value.reshape(()), value.dtype)
        return self._read(key, value, value.shape, idx)

    def _read(self, key, array, shape, idx) -> int:
        """`array` (the leaf `key` names: its variable) at `idx`, read through its axes
        longer than 1. Arrays are numbered by their variable, never by the array
        object: a constant's array may be a new object at each read."""
        if key not in self.arg_of:
            self.arg_of[key] = len(self.args)
            # (the diagonal's look at the program runs nothing: it reads no array)
            self.args.append(array if self.diagonal else _squeezed(array, shape))
        at = tuple(x for x, n in zip(idx, shape) if n != 1)
        deps = 0
        for x in at:
            deps |= self.deps[x]
        if deps & _BOTH == _BOTH:
            raise _Refused   # (one array read by both positions: a T x S array)
        return self.emit(("read", self.arg_of[key], at), deps, array.dtype)

    # -- the moves: each maps the output index to the operand's ------------------------

    def _zero_or(self, size: int, x: int) -> int:
        return self.literal(0) if size == 1 else x

    def _broadcast_in_dim(self, eqn, idx):
        (x, *dynamic), dims = eqn.ins, eqn.params["broadcast_dimensions"]
        if dynamic:
            raise _Refused
        return self.value(x, tuple(self._zero_or(n, idx[d]) for n, d in zip(x.aval.shape, dims)))

    def _squeeze(self, eqn, idx):
        x, rest = eqn.ins[0], iter(idx)
        dims = {d % len(x.aval.shape) for d in eqn.params["dimensions"]}
        return self.value(x, tuple(self.literal(0) if d in dims else next(rest)
                                   for d in range(len(x.aval.shape))))

    def _transpose(self, eqn, idx):
        x, perm = eqn.ins[0], eqn.params["permutation"]
        at = [None] * len(perm)
        for k, d in enumerate(perm):
            at[d] = idx[k]
        return self.value(x, tuple(at))

    def _slice(self, eqn, idx):
        x = eqn.ins[0]
        strides = eqn.params.get("strides") or (1,) * len(idx)
        at = []
        for n, start, stride, y in zip(x.aval.shape, eqn.params["start_indices"], strides, idx):
            if stride != 1:
                y = self.op(lax.mul_p, (y, self.literal(stride)))
            at.append(self._zero_or(n, self.op(lax.add_p, (y, self.literal(start)))
                                    if start else y))
        return self.value(x, tuple(at))

    def _rev(self, eqn, idx):
        x, dims = eqn.ins[0], set(eqn.params["dimensions"])
        return self.value(x, tuple(
            self.op(lax.sub_p, (self.literal(n - 1), y)) if d in dims and n > 1 else y
            for d, (n, y) in enumerate(zip(x.aval.shape, idx))))

    def _iota(self, eqn, idx):
        dtype, axis = np.dtype(eqn.params["dtype"]), eqn.params["dimension"]
        at = idx[axis] if eqn.params["shape"][axis] != 1 else self.literal(0)
        return self.convert(at, dtype)

    def _convert_element_type(self, eqn, idx):
        return self.convert(self.value(eqn.ins[0], idx), eqn.params["new_dtype"])

    def _copy(self, eqn, idx):
        return self.value(eqn.ins[0], idx)

    _copy_p = _copy

    def _reshape(self, eqn, idx):
        """Axes of equal runs map one to one; a run of axes merged or split goes through
        its linear index (int32: a run past 2^31 elements is refused)."""
        x = eqn.ins[0]
        if len(eqn.ins) > 1 or eqn.params.get("dimensions") is not None:
            raise _Refused
        src, dst = x.aval.shape, eqn.outs[0].aval.shape
        at = [self.literal(0)] * len(src)
        src_axes = [d for d, n in enumerate(src) if n != 1]
        dst_axes = [d for d, n in enumerate(dst) if n != 1]
        a = b = 0
        while a < len(dst_axes):
            outs, ins = [dst_axes[a]], [src_axes[b]]
            a, b = a + 1, b + 1
            n_out, n_in = dst[outs[0]], src[ins[0]]
            while n_out != n_in:
                if n_out < n_in:
                    outs.append(dst_axes[a])
                    n_out, a = n_out * dst[dst_axes[a]], a + 1
                else:
                    ins.append(src_axes[b])
                    n_in, b = n_in * src[src_axes[b]], b + 1
            if len(outs) == len(ins) == 1:
                at[ins[0]] = idx[outs[0]]
                continue
            if n_out >= 1 << 31:
                raise _Refused
            linear = None
            for d in outs:   # (row-major: the last axis fastest)
                linear = idx[d] if linear is None else self.op(
                    lax.add_p, (self.op(lax.mul_p, (linear, self.literal(dst[d]))), idx[d]))
            stride = n_in
            for d in ins:
                stride //= src[d]
                y = self.op(lax.div_p, (linear, self.literal(stride))) if stride > 1 else linear
                at[d] = self.op(lax.rem_p, (y, self.literal(src[d]))) if d != ins[0] else y
        return self.value(x, tuple(at))
