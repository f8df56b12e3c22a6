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

# Elementwise primitives the Mosaic GPU lowering had no warpgroup rule for.
LACKED = frozenset({"ceil", "floor", "is_finite", "population_count", "pow", "sqrt"})
# Bound as another primitive inside a kernel (`jaxprs.plain`: add_any as add).
_REBOUND = frozenset({"add_any"})


@functools.lru_cache(maxsize=None)
def lowered() -> Optional[FrozenSet[str]]:
    """Names of the primitives with a Mosaic GPU lowering rule under the warpgroup
    semantics the kernels use; None where this JAX's registry cannot be read."""
    try:
        from jax._src.pallas.mosaic_gpu import core, lowering
        return frozenset(p.name for p in lowering.mosaic_lowering_rules[core.WGxWG_SEMANTICS])
    except Exception:  # noqa: BLE001 (an internal that moved: `LACKED` decides)
        return None


def kernel_runs(name: str) -> bool:
    """Whether a kernel can evaluate primitive `name` on its tiles."""
    names = lowered()
    if names is None:
        return name not in LACKED
    return name in names or name in _REBOUND


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
