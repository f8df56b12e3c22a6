"""The primitives the block-sparse kernels can evaluate on tiles: those Pallas's Mosaic
GPU lowering has a rule for in the installed JAX (read from its registry, a JAX
internal; where that cannot be read, `LACKED` lists what it was seen to lack).

A mask_mod or score_mod that needs another primitive inside a kernel would fail when
the kernel compiles (``jnp.power`` did). Dispatch refuses it instead, naming the
primitive (`missing`), and `hoisting` computes such an operation outside the kernel
where its operands allow (a function of ``q_idx - kv_idx``, or of one side)."""
from __future__ import annotations

import functools
from typing import FrozenSet, List, Optional

import jax
import jax.numpy as jnp

from ..jaxprs import flatten

# Elementwise primitives the Mosaic GPU lowering had no rule for (JAX 0.10-0.11).
LACKED = frozenset({
    "ceil", "floor", "is_finite", "population_count", "pow", "sqrt", "acos", "acosh", "asin",
    "asinh", "atan", "atanh", "cbrt", "cosh", "digamma", "erf_inv", "erfc", "expm1",
    "lgamma", "log1p", "nextafter", "sinh", "tan"})
# Bound as another primitive inside a kernel (`jaxprs.plain`: add_any as add).
_REBOUND = frozenset({"add_any"})
# Elementwise primitives whose derivative in a float operand needs others.
_DERIVATIVE_NEEDS = {"rem": ("floor",), "pow": ("pow", "log")}


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
    runs = (lambda n: n not in LACKED) if names is None else \
        (lambda n: n in names or n in _REBOUND)
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
