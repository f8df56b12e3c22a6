"""Any JAX score_mod / mask_mod lowered to cuDNN pointwise programs (CPU side):
the NumPy interpreter of each program against the JAX function itself (forward and
the bprop) on random scores, masks composed in, reasons for what cuDNN cannot
express, cache keys, lowering for CUDA without a GPU, and mask_mod on the XLA
backend against the float64 oracle. tests/gpu/test_flex_gpu.py runs the same
catalog (tests/flex_cases.py) on cuDNN."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac
from support import flex_cases as fc
import fusedattn
from support import oracle
from fusedattn import dispatch, score_mods
from support import flex_interpreter
from fusedattn.backends.cudnn.lowering import lower as flex_lowering
from fusedattn.backends import cudnn
from fusedattn.backends.cudnn import flex as cudnn_flex
from fusedattn.config import AttnConfig
from fusedattn.validation import build_call

B, S, H = 2, 24, 4


def _config(name, **change):
    mod, mask_mod, args, _ = fc.MODS[name]
    arrays = args(H, B, S)
    q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, change.pop("h_kv", H), 16), jnp.bfloat16)
    config, _ = build_call(q, kv, kv, score_mod=mod, mask_mod=mask_mod, score_mod_args=arrays,
                           **change)
    return config, arrays


VARIANTS = {"plain": {}, "causal": dict(mask="causal"), "window": dict(window=(6, 2)),
            "bottom_right": dict(mask="causal_bottom_right"), "gqa": dict(h_kv=2)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", fc.LOWERED)
def test_program_interpreter_matches_the_jax_function(name, variant):
    config, args = _config(name, **VARIANTS[variant])
    low = flex_lowering.lower(config, config.score_mod)
    inputs = low.evaluate(args, ())
    assert [tuple(x.shape) for x in inputs] == list(low.input_shapes)
    rng = np.random.default_rng(0)
    score = rng.standard_normal((B, H, S, S)).astype(np.float32)
    grad = rng.standard_normal((B, H, S, S)).astype(np.float32)
    q_idx, kv_idx = np.arange(S).reshape(1, 1, S, 1), np.arange(S).reshape(1, 1, 1, S)
    f = flex_lowering.masked_score_mod(config, config.score_mod, None)
    batch, head = jnp.arange(B).reshape(B, 1, 1, 1), jnp.arange(H).reshape(1, H, 1, 1)
    call = lambda s: f(s, batch, head, jnp.asarray(q_idx), jnp.asarray(kv_idx), *args)  # noqa: E731
    want = np.asarray(call(jnp.asarray(score)), np.float64)
    d_want = np.asarray(jax.grad(lambda s: jnp.sum(call(s) * grad))(jnp.asarray(score)))
    got = fc.program_scores(low, score, q_idx, kv_idx, inputs, args)
    d_got = fl_run(low.bprop, score, q_idx, kv_idx, inputs, grad, low.forward)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)  # the same pairs masked
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    # The bprop leaves masked pairs to cuDNN's P = 0 there: compare the visible ones.
    np.testing.assert_allclose(d_got[finite], d_want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["causal", "window", "bottom_right"])
@pytest.mark.parametrize("name", fc.LOWERED)
def test_every_mask_select_comes_after_its_score_chain(name, variant):
    """The frontend's own mask form, the one cuDNN skips hidden tiles in: each select to
    -inf right after its own comparison, whose chain of positions, inputs and constants
    comes right before it, after the value it masks (the native side generates a
    forward's indices from the latest float value, so they come from that value)."""
    config, _ = _config(name, **VARIANTS[variant])
    lines = flex_lowering.lower(config, config.score_mod).forward.split("|")
    parsed = [(line.split(":")[0], line.split(":")[1].split(",")) for line in lines]
    reads_score = []
    for op, args in parsed:
        reads_score.append(any(a == "s" or (a[0] == "v" and reads_score[int(a[1:])])
                               for a in args))
    selects = [i for i, (op, args) in enumerate(parsed) if op == "sel" and args[2] == "c-inf"]
    assert selects, lines
    for i in selects:
        assert parsed[i][1][0] == f"v{i - 1}", lines
        start = i - 1  # the comparison's chain: the score-independent lines before it
        while start > 0 and not reads_score[start - 1]:
            start -= 1
        stack = [i - 1]
        while stack:  # every line the comparison reads lies in its chain
            j = stack.pop()
            assert start <= j < i, lines
            stack += [int(a[1:]) for a in parsed[j][1] if a[0] == "v"]


def fl_run(program, score, q_idx, kv_idx, inputs, grad=None, forward=""):
    return flex_interpreter.interpret(program, score, q_idx, kv_idx,
                                   [np.asarray(x) for x in inputs], grad, forward)


def test_a_mask_inside_a_score_mod_leaves_a_linear_bprop():
    """The derivative of ``where(mask, f(s), -inf)`` is a select between constants for
    a linear f, which cuDNN's engines refuse; the bprop drops it (cuDNN's dS is 0 where
    the forward masked). A nonlinear f keeps it: its derivative may be NaN there."""
    config, _ = _config("masked_inside")
    assert flex_lowering.lower(config, config.score_mod).bprop == "id:g"
    tanh = lambda s, b, h, q, k: jnp.where(k <= q, jnp.tanh(s), -jnp.inf)  # noqa: E731
    config = dataclasses.replace(config, score_mod=tanh)
    assert "sel:" in flex_lowering.lower(config, tanh).bprop


def test_padding_lengths_are_composed_as_static_inputs():
    q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.bfloat16)
    seq = fusedattn.SequenceDescriptor.from_lengths(jnp.array([S, 7]), jnp.array([5, S]))
    config, inputs = build_call(q, q, q, mask="causal", sequence=seq,
                                score_mod=fc.MODS["relative_position"][0])
    low = flex_lowering.lower(config, config.score_mod)
    lengths = (seq.q_lengths.astype(jnp.int32), seq.kv_lengths.astype(jnp.int32))
    ins = [np.asarray(x) for x in low.evaluate((), lengths)]
    assert all(s[1:] == (1, 1, 1) for s in low.input_shapes)  # per-batch lengths only
    out = flex_interpreter.interpret(low.forward, np.zeros((B, H, S, S)),
                                  np.arange(S).reshape(1, 1, S, 1),
                                  np.arange(S).reshape(1, 1, 1, S), ins)
    vis, _, _ = oracle.visibility(B, S, S, mask="causal", q_lengths=np.array([S, 7]),
                                  kv_lengths=np.array([5, S]))
    np.testing.assert_array_equal(np.isfinite(out), np.broadcast_to(vis[:, None], out.shape))


@pytest.mark.parametrize("name", sorted(n for n, m in fc.MODS.items() if m[3]))
def test_what_cudnn_cannot_express_is_named(name):
    config, _ = _config(name)
    reason = cudnn.config_reason(config)
    assert reason is not None and fc.MODS[name][3] in reason, reason
    with pytest.raises(flex_lowering.Unsupported, match=fc.MODS[name][3]):
        flex_lowering.lower(config, config.score_mod)


def test_equal_lambdas_share_a_key_and_different_ones_do_not():
    make = lambda c: (lambda s, b, h, q, k: s + c * (q - k))  # noqa: E731
    keys = [cudnn.graph_key(_config_with(make(c))) for c in (0.5, 0.5, 0.25)]
    assert keys[0] == keys[1] and keys[0] != keys[2]
    assert "flex=" in keys[0] and "mask=0" in keys[0]
    tanh = cudnn.graph_key(_config_with(lambda s, b, h, q, k: jnp.tanh(s)))
    sigmoid = cudnn.graph_key(_config_with(lambda s, b, h, q, k: jax.nn.sigmoid(s)))
    assert tanh != sigmoid


@pytest.mark.parametrize("name", fc.LOWERED)
def test_a_lowering_inside_a_callers_jit_is_the_same_program(name):
    """Constants fold eagerly while a jit traces too (else they became static inputs:
    another program, another graph, and a softcap's bprop form cuDNN refuses)."""
    config, _ = _config(name)
    want = flex_lowering.lower(config, config.score_mod)
    got = []
    jax.jit(lambda x: got.append(flex_lowering.lower(config, config.score_mod)) or x)(1.0)
    assert (got[0].forward, got[0].bprop, got[0].input_shapes) == (
        want.forward, want.bprop, want.input_shapes)


def test_a_score_mod_under_checkpoint_is_refused_by_name():
    """jax.checkpoint (a remat2 call) is not lowered to cuDNN: its derivative is not the
    form cuDNN fuses. The block-sparse kernels inline it (test_block_sparse_hoisting)."""
    config, _ = _config("softcap_scaled")
    wrapped = dataclasses.replace(config, score_mod=jax.checkpoint(config.score_mod))
    with pytest.raises(Exception, match="remat2"):
        flex_lowering.lower(wrapped, wrapped.score_mod)


def test_softcap_derivative_is_cudnns_tanh_bwd_with_the_gradient_first():
    low = flex_lowering.lower(_config_with(fc.MODS["softcap_scaled"][0]),
                              fc.MODS["softcap_scaled"][0])
    assert low.bprop.startswith("mul:g,c30.0|tanh_bwd:v0,w")


def _config_with(mod):
    q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.bfloat16)
    return build_call(q, q, q, mask="causal", score_mod=mod)[0]


def test_flex_calls_lower_for_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    dispatch.clear_cache()
    q = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    mod, _, args, _ = fc.MODS["alibi_lambda"]
    slopes = args(4, 2, 128)

    def loss(q, k, v, slopes):
        return fusedattn.fused_attn(q, k, v, mask="causal", score_mod=mod,
                                    score_mod_args=(slopes,)).astype(jnp.float32).sum()
    with cudnn.assume_supported(workspace_bytes=4096):
        plan = fusedattn.explain(q, q, q, mask="causal", score_mod=mod, score_mod_args=slopes)
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, q, q, *slopes).lower(
            lowering_platforms=("cuda",)).as_text()
    dispatch.clear_cache()
    assert plan.chosen == "cudnn", str(plan)
    assert "fusedattn_cudnn_fwd" in text and "fusedattn_cudnn_bwd" in text
    # slope * (k - q): the query's term leaves the program (flex_hoist)
    # the mask after the score_mod, its indices generated from the value it masks
    assert "flex=mul:a0,k|add:s,v0|ge:q,k|sel:v2,v1,c-inf;" in text


@pytest.mark.parametrize("name", ["prefix_lm", "window_plus_sink", "softcap_prefix_lm"])
def test_mask_mod_on_the_xla_backend_matches_the_oracle(name):
    mod, mask_mod, args, _ = fc.MODS[name]
    case = ac.Case(b=B, s_q=S, s_kv=S, h_q=H, h_kv=H, dtype="float32", mask="causal",
                   score_mod=score_mods.Masked(mod, mask_mod))
    ac.check_case(case)


def test_mask_mod_validation():
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        fusedattn.fused_attn(q, q, q, mask_mod=3)
    with pytest.raises(TypeError, match="mask_mod must return booleans"):
        fusedattn.fused_attn(q, q, q, mask_mod=lambda b, h, i, j: i - j)
    out = fusedattn.fused_attn(q + 1.0, q, q + jnp.arange(8.0)[None, :, None, None],
                               mask_mod=lambda b, h, i, j: j == 0)
    np.testing.assert_allclose(np.asarray(out), 0.0)  # only key 0 (value 0) is kept


@pytest.mark.parametrize("mod, error, fragment", [
    (lambda s, b, h, i, j: j <= i, TypeError, "mask_mod=lambda"),      # a mask as score_mod
    (lambda s, b, h, i, j: (s * 4).astype(jnp.int32), TypeError, "returned int32"),
    (lambda s, b, h, i, j: s + 1j, TypeError, "complex"),
    (lambda s, b, h, i, j: (s + i).astype(jnp.int8), TypeError, "floating dtype"),
])
def test_score_mod_results_of_other_dtypes_are_refused(mod, error, fragment):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(error, match=fragment):
        fusedattn.fused_attn(q, q, q, score_mod=mod)
    with pytest.raises(error, match=fragment):  # beside a mask_mod too
        fusedattn.fused_attn(q, q, q, score_mod=mod, mask_mod=lambda b, h, i, j: j <= i)


def test_mask_mod_results_are_checked():
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="pass it as score_mod"):
        fusedattn.fused_attn(q, q, q, mask_mod=lambda b, h, i, j: (i - j) * 0.5)
    with pytest.raises(ValueError, match="elementwise"):
        fusedattn.fused_attn(q, q, q, mask_mod=lambda b, h, i, j: jnp.ones((1, 1, 5, 5), bool))
    assert fusedattn.fused_attn(q, q, q, mask_mod=lambda b, h, i, j: True).shape == q.shape


def test_alibi_with_another_head_count_is_refused():
    q = jnp.zeros((1, 8, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"alibi\(8\) on a call with 4 query heads"):
        fusedattn.fused_attn(q, q, q, mask="causal", score_mod=score_mods.alibi(8))
    with pytest.raises(ValueError, match=r"alibi\(2\)"):
        fusedattn.fused_attn(q, q, q, score_mod=score_mods.alibi(2),
                             mask_mod=lambda b, h, i, j: j <= i)
    fusedattn.fused_attn(q, q, q, mask="causal", score_mod=score_mods.alibi(4))


def test_same_config_fields_for_masked_mods():
    """mask_mod arrives as a score_mod (score_mods.Masked), equal when its parts are."""
    f, g = (lambda b, h, i, j: j <= i), (lambda b, h, i, j: j <= i)
    assert score_mods.Masked(None, f) == score_mods.Masked(None, f)
    assert score_mods.Masked(None, f) != score_mods.Masked(None, g)
    cfg = dataclasses.replace(AttnConfig(batch=1, s_q=8, s_kv=8, h_q=2, h_kv=2, d_qk=16, d_v=16,
                                         dtype="bfloat16"), score_mod=score_mods.Masked(None, f))
    assert "mask_mod" in cfg.short()


@pytest.mark.parametrize("name", ["per_head_scale", "alibi_lambda", "per_batch_scale",
                                  "alibi_builtin", "head_mask_mod", "softcap_prefix_lm"])
def test_score_mods_under_a_split_read_the_calls_batch_and_head_numbers(name):
    """Under a batch and head split each device computes rows b0.. and heads h0.. of
    the call; the partitioning rule hands the score_mod those numbers (not the shard's
    own 0..), so per-head slopes, per-batch arguments and head-reading masks give the
    unsplit call's result. Native calls are run around the XLA kernels here (a CUDA
    call cannot compile on this host); cuDNN's lowered programs read the same
    arguments."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fusedattn.backends import xla

    from fusedattn.backends import native_op as native_call
    if name == "alibi_builtin":
        mod, mask_mod, args = score_mods.alibi(4), None, ()
    elif name == "head_mask_mod":
        mod, mask_mod, args = None, (lambda b, h, q, k: (k <= q) | (h == 1)), ()
    else:
        mod, mask_mod, make, _ = fc.MODS[name]
        args = make(4, 2, 16)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shard = NamedSharding(mesh, P("dp", None, "tp"))
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v, d_out = (jax.random.normal(x, (2, 16, 4, 16), jnp.float32) for x in keys)

    def loss(run):
        def f(q, k, v):
            config, inputs = build_call(q, k, v, score_mod=mod, mask_mod=mask_mod,
                                        score_mod_args=args)
            return jnp.sum(run(config, inputs) * d_out)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    split = loss(lambda c, i: native_call.attention("xla", c, i)[0])(
        *(jax.device_put(x, shard) for x in (q, k, v)))
    whole = loss(lambda c, i: xla.attention_with_lse(c, i)[0])(q, k, v)
    for got, want in zip(jax.tree_util.tree_leaves(split), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi_lambda", "alibi_builtin"])
def test_a_shards_lowered_program_reads_the_calls_heads(name):
    """What cuDNN runs on the second of two head shards: its per-head input holds the
    call's heads 2 and 3 (the built-in ALiBi, whose cuDNN form would compute slopes for
    the shard's own head count, is lowered as a program there)."""
    from fusedattn.backends import native_op as native_call
    if name == "alibi_builtin":
        q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.bfloat16)
        config, _ = build_call(q, q, q, score_mod=score_mods.alibi(H))
        args = ()
    else:
        config, args = _config(name)
    shard = native_call._on_shard(dataclasses.replace(config, h_q=H // 2, h_kv=H // 2))
    assert cudnn.config_reason(shard) is None
    low = flex_lowering.lower(shard, shard.score_mod)
    got = low.evaluate(tuple(args) + (jnp.int32(0), jnp.int32(H // 2)), ())
    slopes = score_mods.alibi_slopes(H)[H // 2:]
    assert [tuple(x.shape) for x in got] == [(1, H // 2, 1, 1)]
    np.testing.assert_allclose(np.asarray(got[0]).reshape(-1), slopes, rtol=1e-6)


def test_inputs_that_vary_over_the_batch_run_per_entry():
    """cuDNN 9.19 misreads per-batch score_mod tensors (tests/gpu/test_flex_gpu.py
    measures it), so what reads the batch index, per-batch args or padding lengths runs
    one batch entry at a time (tests/test_native_op_per_entry.py); per-head and
    positional mods run whole."""
    per_batch, _ = _config("per_batch_scale")
    padded, _ = _config("relative_position", sequence=fusedattn.SequenceDescriptor.from_lengths(
        jnp.array([S, 7]), jnp.array([5, S])))
    for config in (per_batch, padded):
        assert cudnn.config_reason(config) is None and cudnn_flex.per_entry(config)
    for name in ("per_head_scale", "relative_position", "causal_mask_mod"):
        config = _config(name)[0]
        assert cudnn.config_reason(config) is None and not cudnn_flex.per_entry(config), name


@pytest.mark.parametrize("mod, static_first", [
    (lambda s, b, h, i, j, w: jax.nn.sigmoid(s) * w[h] * jnp.exp(w[h]), "mul:a"),
    (lambda s, b, h, i, j, w: s + s * w[h], "add:c1.0,a"),
])
def test_bprop_multiplies_static_values_in_after_the_gradient(mod, static_first):
    """cuDNN's backward crashed (a misaligned address) on a product of two per-head
    values computed before the gradient: the lowering multiplies each into the
    gradient instead, and what still computes static values alone is refused."""
    q = jax.ShapeDtypeStruct((B, S, H, 16), jnp.bfloat16)
    config, _ = build_call(q, q, q, score_mod=mod, score_mod_args=(jnp.linspace(0.5, 1.5, H),))
    low = flex_lowering.lower(config, config.score_mod)
    assert not flex_lowering.unbroadcast(low.bprop.split("|")), low.bprop
    assert low.bprop.startswith("mul:g,") and static_first not in low.bprop, low.bprop
    assert cudnn.config_reason(config) is None
    kept = "max:a0,a1|mul:g,v0"  # a static max: not moved, so refused
    assert flex_lowering.unbroadcast(kept.split("|")) == ["max:a0,a1"]


def test_scores_provably_large_are_refused():
    """lowering.ranges bounds the forward program; past ranges.LIMIT cuDNN's backward is
    far off (tests/gpu/test_flex_gpu.py still_loses_large_scores)."""
    q = jax.ShapeDtypeStruct((B, 128, H, 16), jnp.bfloat16)
    big, _ = build_call(q, q, q, mask="causal",
                        score_mod=lambda s, b, h, i, j: 2.0 * s + 1e5 * j.astype(jnp.float32))
    assert "reach 1.27e+07" in cudnn.config_reason(big)
    small, _ = build_call(q, q, q, mask="causal",
                          score_mod=lambda s, b, h, i, j: 2.0 * s + 1e2 * j.astype(jnp.float32))
    assert cudnn.config_reason(small) is None
