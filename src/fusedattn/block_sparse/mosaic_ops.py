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
# Elementwise primitives whose derivative in a float operand needs others.
_DERIVATIVE_NEEDS = {"rem": ("floor",), "pow": ("pow", "log"), "sin": ("cos",),
                     "cos": ("sin",), "logistic": ("exp",)}


class Form(NamedTuple):
    """A primitive's kernel form: ``rewrite(ins, params)`` gives its outputs from
    primitives in `needs` (None where the primitive is bound as it is)."""
    rewrite: Callable
    needs: Tuple[str, ...] = ()


def _not(ins, params):
    (x,) = ins   # a boolean not lowers through an int8 cast the lowering cannot size
    return lax.eq(x, False) if x.dtype == jnp.bool_ else None


def _select_n(ins, params):
    # the warpgroup lowering takes no implicit broadcast of a scalar predicate or case
    shape = max((jnp.shape(x) for x in ins), key=len)
    if all(jnp.shape(x) == shape for x in ins):
        return None
    return lax.select_n(*(jnp.broadcast_to(x, shape) for x in ins))


def _integer_pow(ins, params):
    (x,), y = ins, params["y"]   # the lowering takes y > 1 and y == -1 only
    if y == 0:
        return jnp.ones_like(x)
    if y == 1:
        return x
    if y < 0:
        return 1 / (x if y == -1 else lax.integer_pow(x, -y))
    return None


def _floor(ins, params):
    # round to nearest, then one down where that went up: exact (|x - r| <= 1/2;
    # integers, infinities, NaN and -0 pass through)
    (x,) = ins
    r = lax.round(x)
    return jnp.where(r > x, r - 1, r)


FORMS: Dict[str, Form] = {
    "add_any": Form(lambda ins, params: lax.add(*ins), ("add",)),  # JAX's cotangent sums
    "not": Form(_not),
    "select_n": Form(_select_n),
    "integer_pow": Form(_integer_pow, ("div",)),
    "floor": Form(_floor, ("round", "gt", "sub", "select_n")),
    "ceil": Form(lambda ins, params: -_floor([-ins[0]], params),
                 ("round", "gt", "sub", "select_n", "neg")),
    "is_finite": Form(lambda ins, params: lax.abs(ins[0]) < jnp.inf, ("abs", "lt")),
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
        if form is not None and all(map(native, form.needs)):
            return True   # (bound as it is where its rewrite declines: lowered there)
        return native(n) and n not in NO_LAYOUT
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
