"""One jaxpr's lowering into a program of cuDNN pointwise instructions (`Program`):
which equations are dynamic (instructions) and which static (XLA evaluates them),
the forms cuDNN's engines take (int32 index arithmetic, masks as selects), and the
jaxpr plumbing it needs (which calls stay whole when `fusedattn.jaxprs.flatten`
inlines the others, live equations). `lowering.lower` puts a call's two programs
together; csrc/cuda/flex.h has the grammar."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ....jaxprs import SHAPE_ONLY, Eqn
from .derivative import FUSED_BWD

_UNARY = {"neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh",
          "logistic": "sigmoid", "erf": "erf", "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin",
          "cos": "cos", "tan": "tan", "floor": "floor", "ceil": "ceil"}
_BINARY = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "max": "max", "min": "min", "pow": "pow",
           "rem": "mod", "eq": "eq", "ne": "ne", "gt": "gt", "ge": "ge", "lt": "lt", "le": "le"}
_LOGICAL = {"and": "and", "or": "or", "not": "not"}
_COMPARE = ("eq", "ne", "gt", "ge", "lt", "le")
_NEGATED = {"eq": "ne", "ne": "eq", "gt": "le", "ge": "lt", "lt": "ge", "le": "gt"}
_ELEMENTWISE = set(_UNARY) | set(_BINARY) | set(_LOGICAL) | {
    "div", "select_n", "convert_element_type", "integer_pow", "square", "exp2", "log1p",
    "expm1", "clamp", "sign", "one_minus_square"}
# What cuDNN computes in int32 here (its division and remainder keep fp32: their
# rounding is what the lowering spells out).
_INT_OPS = ("add", "sub", "mul", "max", "min", "neg", "abs")


class Unsupported(ValueError):
    """The score_mod uses something cuDNN cannot express; the message names it."""


def fmt(value: float) -> str:
    return "c" + repr(float(value))


def parse_lines(lines: List[str]) -> List[Tuple[str, List[str]]]:
    """(op, operands) of each instruction of a program's text."""
    return [(line.split(":")[0], line.split(":")[1].split(",")) for line in lines]


def kept_whole(call) -> bool:
    """A call `flatten` leaves whole, for `Program._dynamic` to lower as one cuDNN op:
    a derivative cuDNN fuses, an integer floor division. A jax.checkpoint (remat2) stays
    whole too, and is refused by name: its derivatives come out as plain arithmetic
    (tanh's as 1 - y^2, not the fused form), untested on cuDNN."""
    if call.primitive.name == "remat2":
        return True
    name = call.params.get("name")
    return name in FUSED_BWD or name == "floor_divide" and all(
        jnp.issubdtype(v.aval.dtype, jnp.integer) for v in call.invars)


def live(eqns: List[Eqn], outs) -> List[Eqn]:
    """The equations the outputs need, in order (a derivative's jaxpr also holds the
    forward's now unused reduction, and inlined calls their unused outputs)."""
    needed = {v for v in outs if not isinstance(v, Literal)}
    kept = []
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outs):
            kept.append(eqn)
            needed.update(v for v in eqn.ins if not isinstance(v, Literal))
    return kept[::-1]


class Program:
    """Lowers one flattened jaxpr: dynamic equations to instructions, the static values
    they read to inputs (evaluated by XLA), scalar constants folded into the text."""

    def __init__(self, first_input: int, consts: Dict[object, np.ndarray],
                 forward: Optional[Dict[str, str]] = None, masks: frozenset = frozenset(),
                 forward_lines: Tuple[str, ...] = ()):
        self.lines: List[str] = []
        # bprop only: forward instruction text -> "wN" of the values on the forward's
        # score chain, read rather than recomputed (what depends on positions alone is
        # recomputed from the bprop's own indices, as the frontend's bprop sample does)
        self.forward = forward or {}
        # bprop only: the forward's predicates that select -inf, as `expand` writes them
        self.masks = masks
        self.forward_lines = list(forward_lines)
        self.dropped_mask = False  # a select on one of them was left out
        self.bool_expr: Dict[object, Tuple[str, tuple]] = {}  # and / or / not / compare
        self.inputs: List[object] = []  # vars XLA evaluates and the graph takes
        self.first_input = first_input
        self.value: Dict[object, str] = {}     # dynamic var -> operand
        self.ints = {"q", "k"}                  # operands that are int32 in the graph
        self.nonneg = {"q", "k"}                # operands known to be >= 0
        self.is_bool: Dict[object, bool] = {}
        self.const: Dict[object, float] = {v: float(c.reshape(()))
                                           for v, c in consts.items() if c.size == 1}
        self.arrays = {v: c for v, c in consts.items() if c.size != 1}
        self.static_eqns: List[Eqn] = []       # what XLA evaluates, in order
        self.origin: Dict[object, Tuple[object, Tuple[int, ...]]] = {}  # static broadcasts

    def emit(self, op: str, *args: str) -> str:
        # x + 0, x - 0, x * 1: no instruction.
        base = op.split(".")[0]
        if base in ("add", "sub") and args[1] == "c0.0" or base == "mul" and args[1] == "c1.0":
            return args[0]
        if base in ("add", "mul") and args[0] == ("c0.0" if base == "add" else "c1.0"):
            return args[1]
        text = f"{op}:{','.join(args)}"
        if text in self.forward:
            return self.forward[text]
        if text in self.lines:  # computed already (a chunk's offset query index, twice)
            return f"v{self.lines.index(text)}"
        self.lines.append(text)
        name = f"v{len(self.lines) - 1}"
        if op.endswith(".i"):
            self.ints.add(name)
        known = [a in self.nonneg or a[0] == "c" and float(a[1:]) >= 0 for a in args]
        if base == "abs" or base in ("add", "mul", "div", "min") and all(known) \
                or base == "max" and any(known):
            self.nonneg.add(name)
        return name

    def times_gradient(self, result: str) -> str:
        """The operand of ``g * result``, with g multiplied in where cuDNN takes it: a
        derivative op's dy (``tanh_bwd:g*c,x``, the frontend's soft-capping form) reached
        through sums and products; a plain ``mul:g,result`` for anything else. cuDNN's
        engines refuse a derivative op on a constant dy (flex_ops.py, ``-const``)."""
        parsed = parse_lines(self.lines)  # (what `scaled` emits is appended after these)

        def fused(t: str) -> bool:
            if not t.startswith("v"):
                return False
            op, args = parsed[int(t[1:])]
            return op in FUSED_BWD.values() or any(fused(a) for a in args)

        def scaled(t: str) -> str:
            if not fused(t):
                return self.emit("mul", "g", t)
            op, args = parsed[int(t[1:])]
            if op in FUSED_BWD.values():
                return self.emit(op, scaled(args[0]), args[1])
            if op in ("add", "sub"):
                return self.emit(op, scaled(args[0]), scaled(args[1]))
            if op == "mul":
                first = fused(args[0])
                return self.emit("mul", scaled(args[0]) if first else args[0],
                                 args[1] if first else scaled(args[1]))
            if op == "div" and fused(args[0]) and not fused(args[1]):
                return self.emit("div", scaled(args[0]), args[1])
            return self.emit("mul", "g", t)
        return scaled(result)

    def emit_arith(self, op: str, integer: bool, *args: str) -> str:
        """`op` in int32 (``op.i``) where the jaxpr computes it on integers and every
        operand is int32 in the graph (indices, integer inputs, constants)."""
        if integer and op in _INT_OPS and all(a in self.ints or a[0] == "c" for a in args):
            op += ".i"
        return self.emit(op, *args)

    def operand(self, atom) -> str:
        """The program operand of an atom (dynamic value, constant or static input)."""
        if isinstance(atom, Literal):
            return fmt(atom.val)
        if atom in self.value:
            return self.value[atom]
        if atom in self.const:
            return fmt(self.const[atom])
        if atom not in self.inputs:
            self.inputs.append(atom)
        name = f"a{self.first_input + self.inputs.index(atom)}"
        if atom.aval.dtype == jnp.bool_:  # static inputs travel as float 0 / 1
            return self.emit("ne", name, "c0.0")
        if is_int(atom):
            self.ints.add(name)
        return name

    def lower(self, eqns: List[Eqn], out, names: Dict[object, str]) -> str:
        for var, name in names.items():
            self.value[var] = name
            self.is_bool[var] = False
        for eqn in eqns:
            if any(not isinstance(v, Literal) and v in self.value for v in eqn.ins) \
                    or self._broadcasts(eqn):
                var = eqn.outs[0]
                self.is_bool[var] = var.aval.dtype == jnp.bool_
                self.value[var] = self._dynamic(eqn, eqn.prim.name)
                if eqn.prim.name in _LOGICAL or eqn.prim.name in _COMPARE:
                    self.bool_expr[var] = (eqn.prim.name, tuple(eqn.ins))
                elif eqn.prim.name in SHAPE_ONLY and eqn.ins[0] in self.bool_expr:
                    self.bool_expr[var] = self.bool_expr[eqn.ins[0]]  # a broadcast of it
            else:
                self._static(eqn)
        return self.operand(out)

    def _broadcasts(self, eqn: Eqn) -> bool:
        """An elementwise op of static values whose result is larger than its operands
        (a per-head value times a full-size constant): an instruction, so the graph
        takes the small operand, not an s_q x s_kv tensor."""
        if eqn.prim.name not in _ELEMENTWISE or self._fold(eqn) is not None:
            return False
        sizes = [math.prod(v.aval.shape) for v in eqn.ins
                 if not isinstance(v, Literal) and v not in self.const]
        return bool(sizes) and math.prod(eqn.outs[0].aval.shape) > max(sizes)

    def _static(self, eqn: Eqn):
        """XLA evaluates it, except what folds to a scalar constant; a broadcast of a
        static value keeps its small source (no s_q x s_kv input)."""
        folded = self._fold(eqn)
        if folded is not None:
            self.const[eqn.outs[0]] = folded
            return
        if eqn.prim.name == "broadcast_in_dim":
            self.origin[eqn.outs[0]] = (eqn.ins[0], tuple(eqn.params["broadcast_dimensions"]))
        self.static_eqns.append(eqn)

    def _fold(self, eqn: Eqn) -> Optional[float]:
        """The scalar value of an elementwise equation of constants (None: not one)."""
        if len(eqn.outs) != 1 or not eqn.ins or eqn.prim.multiple_results:
            return None
        values = []
        for v in eqn.ins:
            if isinstance(v, Literal):
                values.append(v.val)
            elif v in self.const:
                values.append(self.const[v])
            else:
                return None
        if eqn.prim.name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
            return float(np.asarray(values[0]).reshape(()))
        try:
            dtypes = [v.aval.dtype for v in eqn.ins]
            # Eagerly, also while a caller's jit traces: else the value is a tracer, and
            # the constant becomes a static input (another program text, another graph).
            with jax.ensure_compile_time_eval():
                out = eqn.prim.bind(*[jnp.asarray(x, d) for x, d in zip(values, dtypes)],
                                    **eqn.params)
            return float(np.asarray(out).reshape(()))
        except Exception:  # not elementwise on scalars: XLA evaluates it
            return None

    def _dynamic(self, eqn, name: str) -> str:
        ins = eqn.ins
        out = eqn.outs[0]
        a = lambda i: self.operand(ins[i])  # noqa: E731
        integer = jnp.issubdtype(out.aval.dtype, jnp.integer)
        if name in SHAPE_ONLY:
            return a(0)
        if name in _UNARY:
            return self.emit_arith(_UNARY[name], integer, a(0))
        if name in _BINARY:
            return self.emit_arith(_BINARY[name], integer, a(0), a(1))
        if name in _LOGICAL:
            if not all(self._is_bool(v) for v in ins):
                raise Unsupported(f"score_mod applies bitwise {name!r} to integers; cuDNN's "
                                  f"logical operations take predicates only")
            return self.emit(_LOGICAL[name], *(a(i) for i in range(len(ins))))
        if name in ("pjit", "jit"):  # what `flatten` keeps whole: one cuDNN op each
            call = eqn.params["name"]
            if call in FUSED_BWD:
                return self.emit(FUSED_BWD[call], a(0), a(1))
            return self._floor_divide(a(0), a(1))
        if name == "div":
            q = self.emit("div", a(0), a(1))
            return self._trunc(q) if integer else q
        if name == "select_n" and len(ins) == 3 and self._is_neg_inf(ins[1]):
            return self._masked(ins[0], a(2))  # where(keep, x, -inf): a mask
        if name == "select_n":
            if len(ins) != 3 or not self._is_bool(ins[0]):
                raise Unsupported("score_mod selects among more than two cases (select_n with "
                                  "an integer index); cuDNN selects with a predicate")
            cond, if_false, if_true = a(0), a(1), a(2)
            if self.masks and if_false == "c0.0" and _finite_constant(if_true) \
                    and expand(self.lines, cond, self.forward_lines) in self.masks:
                # The derivative of a mask written into the score_mod: where the forward
                # selected -inf, cuDNN's dS is 0 already, so the constant alone is exact
                # (cuDNN's engines refuse a select between constants).
                self.dropped_mask = True
                return if_true
            return self.emit("sel", cond, if_true, if_false)
        if name == "convert_element_type":
            return self._convert(ins[0], eqn.params["new_dtype"])
        if name == "integer_pow":
            y = eqn.params["y"]
            x = a(0)
            return self.emit_arith("mul", integer, x, x) if y == 2 else self.emit("pow", x, fmt(y))
        if name == "square":
            x = a(0)
            return self.emit_arith("mul", integer, x, x)
        if name == "one_minus_square":  # tanh's derivative in recent JAX
            x = a(0)
            return self.emit("sub", "c1.0", self.emit("mul", x, x))
        if name == "exp2":
            return self.emit("exp", self.emit("mul", a(0), fmt(math.log(2.0))))
        if name == "log1p":
            return self.emit("log", self.emit("add", a(0), "c1.0"))
        if name == "expm1":
            return self.emit("sub", self.emit("exp", a(0)), "c1.0")
        if name == "clamp":
            return self.emit("min", self.emit("max", a(1), a(0)), a(2))
        if name == "sign":
            x = a(0)
            neg = self.emit("sel", self.emit("lt", x, "c0.0"), "c-1.0", "c0.0")
            return self.emit("sel", self.emit("gt", x, "c0.0"), "c1.0", neg)
        if name in ("gather", "dynamic_slice", "concatenate", "scatter", "dynamic_update_slice"):
            raise Unsupported(f"score_mod indexes an array with q_idx / kv_idx or the score "
                              f"({name!r} in its jaxpr): cuDNN's graph has no gather; only "
                              f"indexing by batch / head is evaluated (by XLA)")
        raise Unsupported(f"score_mod uses {name!r} on a value that depends on the score or on "
                          f"q_idx / kv_idx; cuDNN's graph has no such pointwise operation")

    def _is_neg_inf(self, atom) -> bool:
        value = atom.val if isinstance(atom, Literal) else self.const.get(atom)
        return value is not None and np.ndim(value) == 0 and float(value) == -math.inf

    def _masked(self, keep, x: str) -> str:
        """x where `keep`, -inf elsewhere, as selects on x: a conjunction nests them, a
        disjunction takes their max. cuDNN's engines take nested
        selects on comparisons of index tensors, and refuse logical operations on
        predicates and comparisons with constants (benchmarks/tune/flex_ops.py)."""
        op, args = self.bool_expr.get(keep, (None, ()))
        if op == "and":
            return self._masked(args[1], self._masked(args[0], x))
        if op == "or":
            return self.emit("max", self._masked(args[0], x), self._masked(args[1], x))
        if op == "not" and self.bool_expr.get(args[0], ("",))[0] in _NEGATED:
            inner, (a, b) = self.bool_expr[args[0]]
            return self.emit("sel", self.emit(_NEGATED[inner], self.operand(a),
                                              self.operand(b)), x, "c-inf")
        return self.emit("sel", self.operand(keep), x, "c-inf")

    def _is_bool(self, atom) -> bool:
        if isinstance(atom, Literal):
            return np.asarray(atom.val).dtype == np.bool_
        return self.is_bool.get(atom, atom.aval.dtype == jnp.bool_)

    def _floor_divide(self, x: str, y: str) -> str:
        """Integer x // y: cuDNN's int32 division where it equals the floor (x >= 0,
        y a positive constant: a document id from a position), else the fp32 quotient's
        floor (exact while |x|, |y| < 2**24: the quotient cannot round across an
        integer); not JAX's sign corrections, a dozen instructions per division."""
        if x in self.nonneg and y[0] == "c" and float(y[1:]) > 0 and float(y[1:]).is_integer():
            return self.emit("div.i", x, f"c{int(float(y[1:]))}")
        return self.emit("floor", self.emit("div", x, y))

    def _trunc(self, x: str) -> str:
        """Round toward zero (integer division and float -> int casts)."""
        return self.emit("sel", self.emit("lt", x, "c0.0"), self.emit("ceil", x),
                         self.emit("floor", x))

    def _convert(self, atom, new_dtype) -> str:
        x = self.operand(atom)
        src_bool = self._is_bool(atom)
        if jnp.dtype(new_dtype) == jnp.bool_:
            return x if src_bool else self.emit("ne", x, "c0.0")
        if src_bool:
            return self.emit("sel", x, "c1.0", "c0.0")
        src_float = jnp.issubdtype(atom.aval.dtype, jnp.floating)
        if src_float and jnp.issubdtype(new_dtype, jnp.integer):
            return self._trunc(x)
        return x  # numeric -> float (cuDNN computes in fp32), int -> int


def expand(lines: List[str], token: str, forward: List[str] = ()) -> str:
    """The expression `token` computes with every instruction inlined (wN from the
    `forward` lines): equal for equal values however a program numbers them."""
    parsed, outer = parse_lines(lines), parse_lines(list(forward))

    def go(t: str) -> str:
        if t[0] in "vw" and t[1:].isdigit():
            op, args = (parsed if t[0] == "v" else outer)[int(t[1:])]
            return f"{op}({','.join(go(a.replace('v', 'w') if t[0] == 'w' else a) for a in args)})"
        return t
    return go(token)


def reads_score(lines: List[str]) -> List[bool]:
    """Which instructions of a program depend on the score."""
    reads: List[bool] = []
    for _, args in parse_lines(lines):
        reads.append(any(a == "s" or (a[0] == "v" and a[1:].isdigit() and reads[int(a[1:])])
                         for a in args))
    return reads


def _finite_constant(operand: str) -> bool:
    return operand.startswith("c") and math.isfinite(float(operand[1:]))


def is_int(var) -> bool:
    return jnp.issubdtype(var.aval.dtype, jnp.integer)
