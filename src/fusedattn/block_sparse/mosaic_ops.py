"""The primitives the block-sparse kernels can evaluate on tiles: those Pallas's Mosaic
GPU lowering has a rule for in the installed JAX (read from its registry, a JAX
internal; where that cannot be read, `LACKED` lists what it was seen to lack).

A mask_mod or score_mod that needs another primitive inside a kernel would fail when
the kernel compiles (``jnp.power`` did). Dispatch refuses it instead, naming the
primitive (`missing`), and `hoisting` computes such an operation outside the kernel
where its operands allow (a function of ``q_idx - kv_idx``, or of one side).

Some primitives that do lower fail in some forms under the kernels' warpgroup
semantics (a boolean ``not``, a select of a scalar and a tile, ``x ** 0``), and a few
that do not lower have exact forms in ones that do (``floor`` from ``round``).
`evaluate` runs a function inside a kernel with those rewritten (`FORMS`), and
`kernel_runs` counts them as evaluable."""
from __future__ import annotations

import functools
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ..jaxprs import flatten, plain

# Elementwise primitives the Mosaic GPU lowering had no rule for (JAX 0.10-0.11).
LACKED = frozenset({
    "ceil", "floor", "is_finite", "population_count", "pow", "sqrt", "acos", "acosh", "asin",
    "asinh", "atan", "atanh", "cbrt", "cosh", "digamma", "erf_inv", "erfc", "expm1",
    "lgamma", "log1p", "nextafter", "sinh", "tan"})
# Registered, but their MLIR operations have no layout-inference rule under the
# warpgroup semantics the kernels compile with (math.erf, math.atan2), so they fail.
NO_LAYOUT = frozenset({"erf", "atan2"})
# Control flow: `evaluate` rewrites nothing inside its bodies, so a form they need would
# fail to compile there; a mask_mod or score_mod with them runs elsewhere.
BRANCHING = frozenset({"cond", "while", "scan"})
# Elementwise primitives whose derivative in a float operand needs others.
_DERIVATIVE_NEEDS = {"rem": ("floor",), "pow": ("pow", "log"), "sin": ("cos",),
                     "cos": ("sin",)}


class Form(NamedTuple):
    """A primitive's kernel form: ``rewrite(ins, params)`` gives its outputs in other
    primitives, or None to bind it as it is (a case its own rule takes); `needs` lists
    every primitive it may bind, itself included where it may decline."""
    rewrite: Callable
    needs: Tuple[str, ...] = ()


def _fill(x, value):
    return lax.full_like(x, value, shape=jnp.shape(x))


def _not(ins, params):
    # a boolean not lowers through an int32 -> bool cast, whose 2-bit registers the
    # lowering rejects; an integer not stays bitwise
    (x,) = ins
    return lax.eq(x, _fill(x, False)) if x.dtype == jnp.bool_ else None


def _to_bool(ins, params):
    # the same cast; XLA's conversion to bool is x != 0 (NaN: True)
    (x,) = ins
    if params["new_dtype"] != jnp.bool_ or x.dtype == jnp.bool_:
        return None
    return lax.ne(x, _fill(x, 0))


def _bool_op(op):
    # max / min of booleans: the lowering has no boolean rule for them
    def rewrite(ins, params):
        return op(*ins) if ins[0].dtype == jnp.bool_ else None
    return rewrite


def _select_n(ins, params):
    # the lowering takes two cases, a boolean predicate and no implicit broadcast
    which, *cases = ins
    shape = max((jnp.shape(x) for x in ins), key=len)
    if len(cases) == 2 and which.dtype == jnp.bool_ and \
            all(jnp.shape(x) == shape for x in ins):
        return None
    which, *cases = (x if jnp.shape(x) == shape else
                     lax.broadcast_in_dim(x, shape, ()) for x in ins)
    if which.dtype == jnp.bool_:
        return lax.select_n(which, *cases)

    def pick(lo, hi):   # cases[lo:hi], by halves
        if hi - lo == 1:
            return cases[lo]
        mid = (lo + hi) // 2
        return lax.select_n(lax.lt(which, _fill(which, mid)), pick(mid, hi), pick(lo, mid))
    return pick(0, len(cases))


def _integer_pow(ins, params):
    (x,), y = ins, params["y"]   # the lowering takes y > 1 and y == -1 only
    if y == 0:
        return _fill(x, 1)
    if y == 1:
        return x
    if y < 0:    # (floats only: lax refuses a negative power of an integer)
        return lax.div(_fill(x, 1), x if y == -1 else lax.integer_pow(x, -y))
    return None


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Unary float operations whose 16-bit forms the lowering lacks under approximate math;
# XLA computes them in float32 too and rounds the result.
_WIDENED = {"exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "sin": lax.sin, "cos": lax.cos,
            "tanh": lax.tanh, "logistic": lax.logistic, "sqrt": lax.sqrt, "rsqrt": lax.rsqrt}


def _in_float32(fn, decline=True):
    """`fn` on a 16-bit float argument computed in float32, its result rounded back; on
    another dtype `fn` itself, or None to bind the primitive (`decline`)."""
    def rewrite(ins, params):
        (x,) = ins
        if x.dtype not in _HALF:
            return None if decline else fn(x)
        return lax.convert_element_type(fn(lax.convert_element_type(x, jnp.float32)), x.dtype)
    return rewrite


def _floor(x):
    # round to nearest, then one down where that went up: exact (|x - r| <= 1/2;
    # integers, infinities, NaN and -0 pass through)
    r = lax.round(x)
    return lax.select(lax.gt(r, x), lax.sub(r, _fill(r, 1)), r)


_FLOOR = ("round", "gt", "sub", "select_n", "convert_element_type")
FORMS: Dict[str, Form] = {
    "add_any": Form(lambda ins, params: lax.add(*ins), ("add",)),  # JAX's cotangent sums
    "not": Form(_not, ("not", "eq")),
    "convert_element_type": Form(_to_bool, ("convert_element_type", "ne")),
    "max": Form(_bool_op(lax.bitwise_or), ("max", "or")),
    "min": Form(_bool_op(lax.bitwise_and), ("min", "and")),
    "select_n": Form(_select_n, ("select_n", "broadcast_in_dim", "lt")),
    "integer_pow": Form(_integer_pow, ("integer_pow", "div", "broadcast_in_dim")),
    # (a 16-bit floor computed in float32 is exact: the result fits the narrower type)
    "floor": Form(_in_float32(_floor, decline=False), _FLOOR),
    "ceil": Form(_in_float32(lambda x: lax.neg(_floor(lax.neg(x))), decline=False),
                 _FLOOR + ("neg",)),
    "is_finite": Form(lambda ins, params: lax.lt(lax.abs(ins[0]), _fill(ins[0], jnp.inf)),
                      ("abs", "lt")),
    **{name: Form(_in_float32(fn), (name, "convert_element_type"))
       for name, fn in _WIDENED.items()},
}


def evaluate(fn, *args):
    """``fn(*args)`` inside a kernel: its primitives bound one by one (calls inlined),
    those with a kernel form (`FORMS`) rewritten."""
    def rewrite(prim, ins, params):
        form = FORMS.get(prim.name)
        return None if form is None else form.rewrite(ins, params)
    return plain(fn, *args, rewrite=rewrite)


@functools.lru_cache(maxsize=None)
def lowered() -> Optional[FrozenSet[str]]:
    """Names of the primitives with a Mosaic GPU lowering rule under both the lane and
    the warpgroup semantics (which one a kernel compiles under is Pallas's choice);
    None where this JAX's registry cannot be read."""
    try:
        from jax._src.pallas.mosaic_gpu import core, lowering
        rules = lowering.mosaic_lowering_rules
        return frozenset(p.name for p in rules[core.WGxWG_SEMANTICS]) & \
            frozenset(p.name for p in rules[core.LANExWG_SEMANTICS])
    except Exception:  # noqa: BLE001 (an internal that moved: `LACKED` decides)
        return None


def kernel_runs(name: str, with_derivative: bool = False) -> bool:
    """Whether a kernel can evaluate primitive `name` on its tiles (and, with
    `with_derivative`, its derivative in a float operand)."""
    names = lowered()
    native = (lambda n: n not in LACKED) if names is None else (lambda n: n in names)

    def runs(n):
        form = FORMS.get(n)
        if form is not None:
            return all(map(native, form.needs))
        return native(n) and n not in NO_LAYOUT and n not in BRANCHING
    return runs(name) and (not with_derivative
                           or all(map(runs, _DERIVATIVE_NEEDS.get(name, ()))))


def missing(fn, *specs, derivative_of: Optional[int] = None) -> List[str]:
    """The primitives a kernel would need to evaluate ``fn(*specs)`` (and, with
    `derivative_of`, its forward-mode derivative in that argument, as the backward
    kernels evaluate a score_mod's) that it cannot, sorted; calls are inlined."""
    def traced(*args):
        if derivative_of is None:
            return fn(*args)
        x = args[derivative_of]

        def of_x(x_):
            return fn(*args[:derivative_of], x_, *args[derivative_of + 1:])
        return jax.jvp(of_x, (x,), (jnp.ones_like(x),))
    eqns, _, _ = flatten(jax.make_jaxpr(traced)(*specs))
    return sorted({e.prim.name for e in eqns if not kernel_runs(e.prim.name)})
