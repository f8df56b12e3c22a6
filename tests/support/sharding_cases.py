"""Sharded calls against unsharded ones: the helpers the CPU tests (8 host devices,
the partitioning rule exercised with the XLA kernels behind native_call) and the
GPU tests (cudnn / small_seq on 2 GPUs) share.

A call under test is ``f(q, k, v, *extra) -> out``; `run` jits a loss
``sum(out * d_out)``, its value and the gradients of q, k, v (and float extras),
once on one device and once with the inputs placed by the given shardings, and
returns both plus the collectives XLA compiled into the sharded step.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .attn_cases import rel_error

@pytest.fixture(params=[True, False], ids=["shardy", "gspmd"])
def partitioner(request):
    """Each test under Shardy and under GSPMD (a fixture: import it into the test module)."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param)
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", previous)


COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def collectives(hlo_text: str) -> Dict[str, int]:
    """How many of each collective the compiled HLO holds (async pairs counted once; a
    tuple's shape may hold "=", as in ``/*index=5*/``)."""
    return {c: len(re.findall(rf"^\s*(?:ROOT )?\S+ = .*? {c}(?:-start)?\(", hlo_text, re.M))
            for c in COLLECTIVES}


def all_reduce_shapes(hlo_text: str):
    """The result shapes of the all-reduces (tuple shapes as written)."""
    return re.findall(r"= (\S+(?: \S+)*?) all-reduce(?:-start)?\(", hlo_text)


def _step(f: Callable, d_out, n_diff: int):
    def loss(*args):
        out = f(*args)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_diff)), has_aux=True))


def _f64(tree):
    return jax.tree_util.tree_map(
        lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64), tree)


def run_single(f: Callable, args: Sequence, d_out, n_diff: int = 3):
    """The unsharded step's ``((loss, out), grads)`` on one device, as NumPy float64:
    what `run` compares the sharded step with (for a caller that compares several splits
    of one call with it, computed once)."""
    return _f64(_step(f, d_out, n_diff)(*args))


def run(f: Callable, args: Sequence, shardings: Sequence, d_out, n_diff: int = 3,
        reference: Optional[Callable] = None, single=None):
    """(unsharded results, sharded results, collectives of the sharded step, its HLO);
    results are ``((loss, out), grads)`` as NumPy float64 leaves. The unsharded run
    is of `reference` (default `f`) on one device; `single`: its results, when the caller
    has them already (`run_single` of the same call and arguments)."""
    step = _step(f, d_out, n_diff)
    if single is None:
        single = run_single(reference or f, args, d_out, n_diff)
    placed = [x if s is None else jax.device_put(x, s) for x, s in zip(args, shardings)]
    compiled = step.lower(*placed).compile()
    counts = collectives(compiled.as_text())
    sharded = compiled(*placed)
    return single, _f64(sharded), counts, compiled.as_text()


def assert_same(single, sharded, tol: float) -> None:
    """Output and every gradient of the sharded step equal the unsharded ones (relative
    norm error <= tol)."""
    (_, out_ref), grads_ref = single
    (_, out), grads = sharded
    assert np.all(np.isfinite(out)), "sharded output has non-finite values"
    err = rel_error(out, out_ref)
    assert err <= tol, f"out: relative error {err:.3g} > {tol:g}"
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        err = rel_error(g, r)
        assert err <= tol, f"gradient {i}: relative error {err:.3g} > {tol:g}"
