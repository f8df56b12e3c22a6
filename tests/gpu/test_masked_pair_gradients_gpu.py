"""A score_mod whose derivative is non-finite at masked pairs (``s * sqrt(i - j + 1)``
under causal, `support.masked_pair_cases`) on the GPU backends that run score_mods:
the block-sparse kernels select the score's gradient to 0 where P is 0 and match
the score_mod's finite twin; cuDNN's lowered bprop multiplies the derivative into
its dS, 0 there, so it still gives NaN (the documented limit of the cudnn backend)."""
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from support import masked_pair_cases as mp

pytestmark = pytest.mark.gpu


def _runs_on(backend, case):
    q = mp.inputs(jnp.bfloat16)[0]
    plan = fusedattn.explain(q, q, q, score_mod=mp.root_distance, backend=backend,
                             **mp.CASES[case])
    assert plan.chosen == backend, str(plan)


@pytest.mark.parametrize("case", ["causal mask_mod", "window mask_mod"])
def test_block_sparse_drops_the_masked_pairs_pullback(case):
    _runs_on("block_sparse", case)
    mp.check(mp.CASES[case], "block_sparse", jnp.bfloat16, tol=2e-3)


def test_cudnn_still_multiplies_the_masked_pairs_derivative():
    """When this fails, cuDNN's bprop drops the masked pairs too: update the
    score_mod docstring (`fused_attn`) and docs/decisions.md."""
    _runs_on("cudnn", "causal mask")
    q, k, v, do = mp.inputs(jnp.bfloat16)
    _, dq, _, _ = mp.grads(mp.CASES["causal mask"], mp.root_distance, q, k, v, do, "cudnn")
    assert not np.isfinite(dq).all()
