"""What the block-sparse kernels cannot evaluate is refused at dispatch, naming it
(`block_sparse.mosaic_ops`): a mask_mod or score_mod using an operation that Mosaic
GPU cannot compile would otherwise fail when its kernel compiles. On CPU the
backend's Hopper check is patched to pass and its kernels are the reference list
walks (conftest's `hopper_reference`), so dispatch and the fallback run whole."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn.block_sparse import mosaic_ops
from support.block_sparse_cases import oracle, rel_error

B, S, H, D = 2, 256, 4, 64
F32, I32 = (jax.ShapeDtypeStruct((), t) for t in (jnp.float32, jnp.int32))
INDEX = (I32,) * 4


@pytest.fixture(autouse=True)
def hopper(hopper_reference):
    yield


def power_mod(s, b, h, q, kv):
    return s + 0.1 * jnp.power(jnp.abs(s) + 0.5, 1.5)


def floor_blocks(b, h, q, kv):   # floor: a kernel form from round (`mosaic_ops.FORMS`)
    return jnp.floor(q / 64.0) == jnp.floor(kv / 64.0)


def cbrt_pattern(b, h, q, kv):     # cbrt: no lowering, no form
    return jnp.cbrt(((q * 7 + kv * 3) % 64).astype(jnp.float32)) < 3.0


@pytest.mark.parametrize("registry", ["read", "unreadable"])
def test_missing_names_what_no_kernel_evaluates(registry, monkeypatch):
    if registry == "unreadable":   # then the list of what the lowering lacked decides
        monkeypatch.setattr(mosaic_ops, "lowered", lambda: None)
    elif mosaic_ops.lowered() is None:
        pytest.fail("this JAX's Mosaic GPU lowering registry cannot be read")
    assert mosaic_ops.missing(power_mod, F32, *INDEX, derivative_of=0) == ["pow"]
    assert mosaic_ops.missing(cbrt_pattern, *INDEX) == ["cbrt"]
    assert mosaic_ops.missing(lambda s, b, h, q, kv: s + jax.scipy.special.erf(s),
                              F32, *INDEX, derivative_of=0) == ["erf"]
    assert mosaic_ops.missing(lambda s, b, h, q, kv: jax.lax.cond(h > 1, jnp.floor, jnp.ceil, s),
                              F32, *INDEX, derivative_of=0) == ["cond"]
    sqrt_lowers = registry == "read" and "sqrt" in mosaic_ops.lowered()
    assert mosaic_ops.missing(lambda s, b, h, q, kv: jnp.sqrt(jnp.abs(s) + 1.0) + s,
                              F32, *INDEX, derivative_of=0) == ([] if sqrt_lowers else ["sqrt"])
    for fn in (lambda s, b, h, q, kv: jnp.clip(s, -2.0, 2.0),
               lambda s, b, h, q, kv: s + jnp.floor(q / 64.0) - jnp.ceil(kv / 64.0),
               lambda s, b, h, q, kv: jnp.where(~(q == kv) | (h > 1), s ** -2, s ** 0),
               lambda s, b, h, q, kv: s * jax.nn.sigmoid(s) + 0.1 * ((q - kv) // 16),
               lambda s, b, h, q, kv: jnp.where(kv <= q, 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
               lambda s, b, h, q, kv: s + jnp.round(q * 0.01) + (q - kv) % 3):
        assert mosaic_ops.missing(fn, F32, *INDEX, derivative_of=0) == []


def _qkvo(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (B, S, H, D), jnp.bfloat16) for k in keys]


def _check(options, want_backend, words):
    q, k, v, do = _qkvo()
    plan = fusedattn.explain(q, k, v, **options)
    assert plan.chosen == want_backend, str(plan)
    assert all(w in dict(plan.reasons)["block_sparse"] for w in words), str(plan)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, **options)),
                       q, k, v)
    got = (out, *vjp(do))
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    visible = np.asarray(options["mask_mod"](0, 0, i, j)) if "mask_mod" in options else \
        (j <= i) if options.get("mask") == "causal" else np.ones((S, S), bool)
    ref_out, _, ref = oracle(q, k, v, np.broadcast_to(visible, (B, H, S, S)), D ** -0.5,
                             options.get("score_mod"), do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (ref_out, *ref[:3])):
        assert rel_error(np.asarray(g, np.float32), w) < 4e-2, name


def test_a_score_mod_with_an_operation_no_kernel_lowers_runs_elsewhere():
    """cuDNN has no extension here, so the call falls to XLA, with the reason."""
    _check(dict(score_mod=power_mod, mask="causal"), "xla",
           ("the kernels cannot evaluate the score_mod 'pow'", "Mosaic GPU cannot compile"))


def test_a_mask_mod_with_an_operation_no_kernel_lowers_walks_its_map_in_xla():
    _check(dict(mask_mod=cbrt_pattern), "block_sparse_xla",
           ("the kernels cannot evaluate the mask_mod 'cbrt'",))


def test_a_mask_mod_with_a_kernel_form_runs_on_the_kernels():
    _check(dict(mask_mod=floor_blocks), "block_sparse", ())


def test_a_score_mod_whose_shard_form_the_kernels_lack_stays_with_xla(monkeypatch):
    """Under a head split the shard reads h as its first head plus its own (`native_op`).
    With a lowering that has no round (so no floor, which fmod's derivative needs), a
    float fmod of h * (i - j) runs as written, where nothing differentiates it, but on
    the shards it is a value to hoist by i - j, whose runs are too many: the call stays
    with XLA whole."""
    registry = mosaic_ops.lowered()
    if registry is None:
        pytest.fail("this JAX's Mosaic GPU lowering registry cannot be read")
    monkeypatch.setattr(mosaic_ops, "lowered", lambda: registry - {"round"})
    q, k, v, _ = _qkvo()
    plan = fusedattn.explain(q, k, v, score_mod=lambda s, b, h, i, j:
                             s + jnp.fmod(0.1 * h * (i - j), 3.0))
    assert plan.chosen == "xla", str(plan)
    assert dict(plan.reasons)["block_sparse"].startswith(
        "on a shard of a batch / head split"), str(plan)


@pytest.mark.parametrize("round_lowers", [True, False])
def test_an_operation_whose_derivative_the_kernels_lack_is_refused(round_lowers, monkeypatch):
    """fmod's derivative in its divisor needs floor, whose kernel form needs round:
    read per head, the divisor cannot be hoisted, so without round the call is refused."""
    registry = mosaic_ops.lowered()
    if registry is None:
        pytest.fail("this JAX's Mosaic GPU lowering registry cannot be read")
    if not round_lowers:
        monkeypatch.setattr(mosaic_ops, "lowered", lambda: registry - {"round"})
    q, k, v, _ = _qkvo()
    plan = fusedattn.explain(q, k, v, score_mod=lambda s, b, h, i, j, p: s + jnp.fmod(s, p[h]),
                             score_mod_args=(jnp.linspace(1.0, 2.0, H),))
    if round_lowers:
        assert plan.chosen == "block_sparse", str(plan)
    else:
        assert "its rem of values of the score" in dict(plan.reasons)["block_sparse"], str(plan)
