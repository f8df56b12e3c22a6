"""Masks known at trace time on the GPU.

* `folding.host_value` evaluates on the host CPU what the GPU would compute: over
  generated programs its values equal the GPU's compiled ones, bit for bit.
* Flax's ``make_causal_mask`` built inside the jitted step goes through
  `fusedattn.flax.attention_fn` as ``mask="causal"`` on a vendor kernel (not the
  block-sparse map), with the output and every gradient against the float64 oracle
  (bf16, the project's tolerance `attn_cases.TOLERANCE`).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import jax_nn
from fusedattn.tracing.folding import host_value
from support import attn_cases as ac
from support import oracle
from support.folding_programs import program

pytestmark = pytest.mark.gpu


def test_host_values_equal_the_gpus():
    s = 40
    x = jnp.ones((s + 3,))
    assert x.devices().pop().platform == "gpu"
    for seed in range(120):
        fn, text = program(seed, s)
        seen = []
        compiled = np.asarray(jax.jit(lambda x: (seen.append(host_value(fn(x))), fn(x))[1])(x))
        assert seen[0] is not None and np.array_equal(seen[0], compiled), f"seed {seed}: {text}"


@pytest.mark.parametrize("b,s,h,d", [(2, 512, 4, 128), (1, 1000, 2, 64)])
def test_flax_causal_mask_in_jit_runs_as_causal(b, s, h, d, monkeypatch):
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in ks)
    plans, notes = [], []
    known = jax_nn._known_mask   # (the line the Flax call's own rewrite gives)
    monkeypatch.setattr(jax_nn, "_known_mask",
                        lambda *a: (lambda r: (notes.append(r[3]), r)[1])(known(*a)))

    def step(q, k, v, do):
        def f(q, k, v):
            mask = nn.make_causal_mask(jnp.ones(q.shape[:2]), dtype=jnp.bool_)
            plans.append(jax_nn.masked_plan(q, k, v, mask=mask))
            return fusedattn.flax.attention_fn(q, k, v, mask=mask)
        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(do)
    got = jax.jit(step)(q, k, v, do)
    plan = plans[0]
    assert plan.config.mask == "causal" and not plan.config.has_dense_mask, str(plan)
    assert plan.chosen in ("cudnn", "flash"), str(plan)
    assert "mask='causal'" in notes[-1]
    ref = oracle.attention(q, k, v, mask="causal", d_out=do)
    tol = ac.TOLERANCE["bfloat16"]
    for name, x, want in zip(("out", "dq", "dk", "dv"), got, (ref.out, ref.dq, ref.dk, ref.dv)):
        err = ac.rel_error(np.asarray(x, np.float64), want)
        assert err < tol, (name, err)
