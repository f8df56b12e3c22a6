"""The cuDNN backend on a CUDA GPU: forward, LSE and every gradient against a
float64 reference (jnp on the CPU with x64: an independent dense formulation of
the semantics in config.py) and against the XLA backend, over masks x
padding / packing x window x bias x softmax variants x GQA x head dims x
dtypes; padded positions exactly 0; deterministic backward bitwise repeatable;
dropout's forward and backward masks agree; explain() reasons."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import cudnn, native
from fusedattn.config import AttnConfig
from fusedattn.sequence import SequenceDescriptor

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 4e-2, "float16": 1e-2}


@pytest.fixture(autouse=True, scope="module")
def _on_cuda():
    if dispatch.current_platform() != "cuda":
        pytest.skip("needs a CUDA GPU")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 2
    s_q: int = 128
    s_kv: int = 128
    h_q: int = 4
    h_kv: int = 4
    d_qk: int = 64
    d_v: int = 64
    dtype: str = "bfloat16"
    mask: str = "none"
    window: Optional[Tuple[int, int]] = None
    bias: Optional[Tuple[int, int]] = None  # (batch dim, head dim) of the bias, 1 = broadcast
    softmax: str = "vanilla"
    sequence: str = "dense"  # dense | padding | packed
    layout: str = "bshd"     # bshd | sbhd | bs3hd | bshd_bs2hd
    deterministic: bool = False


CASES = [
    Case("dense"),
    Case("causal-fp16-d128", mask="causal", dtype="float16", d_qk=128, d_v=128),
    Case("bottom-right-sq<skv", mask="causal_bottom_right", s_q=64, s_kv=128),
    Case("window-both-sides", window=(32, 16)),
    Case("causal-window-d128", mask="causal", window=(40, 0), d_qk=128, d_v=128),
    Case("bias-1h", bias=(1, 4)),
    Case("bias-bh-causal", bias=(2, 4), mask="causal"),
    Case("off-by-one", softmax="off_by_one"),
    Case("learnable-fp16-d128", softmax="learnable", dtype="float16", d_qk=128, d_v=128),
    Case("gqa-8/2-causal-d128", h_q=8, h_kv=2, mask="causal", d_qk=128, d_v=128),
    Case("mqa-4/1", h_kv=1),
    Case("d256-causal", d_qk=256, d_v=256, mask="causal"),
    Case("dqk128-dv64", d_qk=128, d_v=64),
    Case("padding-causal", sequence="padding", mask="causal"),
    Case("padding-bottom-right", sequence="padding", mask="causal_bottom_right", s_q=64),
    Case("padding-window-fp16", sequence="padding", window=(24, 8), dtype="float16"),
    Case("padding-learnable", sequence="padding", softmax="learnable"),
    Case("packed-causal", sequence="packed", mask="causal"),
    Case("packed-gqa", sequence="packed", h_q=8, h_kv=2),
    Case("packed-bottom-right-window", sequence="packed", mask="causal_bottom_right",
         window=(16, 0)),
    Case("sbhd-causal", layout="sbhd", mask="causal"),
    Case("bs3hd", layout="bs3hd", mask="causal"),
    Case("bshd-bs2hd-gqa", layout="bshd_bs2hd", h_q=8, h_kv=2),
    Case("deterministic-bias", deterministic=True, bias=(1, 4), mask="causal"),
]


# ---- inputs ---------------------------------------------------------------------------
def _descriptor(case: Case, rng: np.random.Generator):
    if case.sequence == "padding":
        q_len = rng.integers(1, case.s_q + 1, case.b)
        q_len[0] = case.s_q  # one full row, one ragged
        kv_len = np.maximum(q_len * case.s_kv // case.s_q, 1) if case.s_kv != case.s_q else q_len
        if case.mask == "causal_bottom_right":
            kv_len = np.minimum(q_len + rng.integers(0, case.s_kv - case.s_q + 1, case.b), case.s_kv)
        return SequenceDescriptor.from_lengths(jnp.asarray(q_len, jnp.int32),
                                               jnp.asarray(kv_len, jnp.int32))
    if case.sequence == "packed":
        ids = np.zeros((case.b, case.s_q), np.int32)
        for r in range(case.b):  # 3 segments, then trailing padding
            cuts = np.sort(rng.choice(np.arange(8, case.s_q - 8), 3, replace=False))
            ids[r, :cuts[0]] = 1
            ids[r, cuts[0]:cuts[1]] = 2
            ids[r, cuts[1]:cuts[2]] = 3
        return SequenceDescriptor.from_segment_ids(jnp.asarray(ids), max_segments=3)
    return None


def _inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)

    q = normal(case.b, case.s_q, case.h_q, case.d_qk)
    k = normal(case.b, case.s_kv, case.h_kv, case.d_qk)
    v = normal(case.b, case.s_kv, case.h_kv, case.d_v)
    bias = None if case.bias is None else normal(case.bias[0], case.bias[1], case.s_q, case.s_kv)
    offset = jnp.asarray(rng.standard_normal(case.h_q), jnp.float32) \
        if case.softmax == "learnable" else None
    d_out = normal(case.b, case.s_q, case.h_q, case.d_v)
    return q, k, v, bias, offset, _descriptor(case, rng), d_out


def _to_layout(case: Case, q, k, v):
    """bshd q, k, v -> the case's layout arguments for fused_attn."""
    if case.layout == "sbhd":
        return tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    if case.layout == "bs3hd":
        return jnp.stack([q, k, v], axis=2), None, None
    if case.layout == "bshd_bs2hd":
        return q, jnp.stack([k, v], axis=2), None
    return q, k, v


def _from_layout(case: Case, grads):
    """Gradients w.r.t. the layout arguments -> bshd dq, dk, dv."""
    if case.layout == "sbhd":
        return tuple(jnp.swapaxes(g, 0, 1) for g in grads)
    if case.layout == "bs3hd":
        return tuple(grads[0][:, :, i] for i in range(3))
    if case.layout == "bshd_bs2hd":
        return grads[0], grads[1][:, :, 0], grads[1][:, :, 1]
    return grads


# ---- the float64 reference -------------------------------------------------------------
def _token_info(case: Case, seq, s: int, side: str):
    """Per token: segment id (0 = not a token), position in its sequence, its length."""
    if seq is None:
        ids = np.ones((case.b, s), np.int64)
        return ids, np.broadcast_to(np.arange(s), (case.b, s)), np.full((case.b, s), s)
    lengths = np.asarray(getattr(seq, f"{side}_lengths"))
    if seq.kind == "padding":
        pos = np.broadcast_to(np.arange(s), (case.b, s))
        ids = (pos < lengths[:, None]).astype(np.int64)
        return ids, pos, np.broadcast_to(lengths[:, None], (case.b, s))
    ids = np.asarray(getattr(seq, f"{side}_segment_ids")).astype(np.int64)
    pos = np.asarray(getattr(seq, f"{side}_positions"))
    seg_len = np.take_along_axis(lengths, np.maximum(ids - 1, 0), axis=1)
    return ids, pos, np.where(ids > 0, seg_len, 0)


def _visible(case: Case, seq):
    qi, qp, ql = _token_info(case, seq, case.s_q, "q")
    ki, kp, kl = _token_info(case, seq, case.s_kv, "kv")
    vis = (qi[:, :, None] > 0) & (qi[:, :, None] == ki[:, None, :])
    off = (kl[:, None, :] - ql[:, :, None]) if case.mask == "causal_bottom_right" else 0
    i, j = qp[:, :, None] + off, kp[:, None, :]
    left, right = case.window if case.window else (-1, -1)
    if case.mask != "none":
        right = 0
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis, qi > 0, ki > 0  # [b, s_q, s_kv], [b, s_q], [b, s_kv]


def _reference(case: Case, scale: float, visible, q, k, v, bias, offset):
    """Dense float64 attention in jnp (run on the CPU under x64)."""
    g = case.h_q // case.h_kv
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        s = s + bias
    vis = jnp.asarray(visible)[:, None]
    s = jnp.where(vis, s, -jnp.inf)
    if case.softmax == "vanilla":
        sink = None
    else:
        sink = jnp.zeros(case.h_q, s.dtype) if offset is None else offset
        sink = jnp.broadcast_to(sink[None, :, None, None], s.shape[:3] + (1,))
    full = s if sink is None else jnp.concatenate([s, sink], axis=-1)
    m = jnp.max(full, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(full - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e[..., :case.s_kv] / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    lse = (jnp.log(denom) + m)[..., 0]
    return out, lse


def _x64():
    """The float64 context manager under either of its JAX names."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64
    return enable_x64()


def _reference_results(case: Case, scale, visible, q, k, v, bias, offset, d_out):
    cpu = jax.devices("cpu")[0]
    with _x64():
        args = [None if x is None else jax.device_put(np.asarray(x, np.float64), cpu)
                for x in (q, k, v, bias, offset)]
        d_out64 = jax.device_put(np.asarray(d_out, np.float64), cpu)
        out, vjp = jax.vjp(lambda *a: _reference(case, scale, visible, *a)[0], *args)
        lse = _reference(case, scale, visible, *args)[1]  # outside the vjp: -inf rows
        grads = vjp(d_out64)
        return (np.asarray(out), np.asarray(lse),
                [None if gr is None else np.asarray(gr) for gr in grads])


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _run_cudnn(case: Case, q, k, v, bias, offset, seq, d_out, **extra):
    qa, ka, va = _to_layout(case, q, k, v)
    opts = dict(bias=bias, sequence=seq, mask=case.mask, window=case.window,
                softmax=case.softmax, softmax_offset=offset, deterministic=case.deterministic,
                layout=case.layout, backend="cudnn", **extra)
    diff_idx = [i for i, x in enumerate((qa, ka, va, bias, offset)) if x is not None]

    def f(*diff):
        full = [qa, ka, va, bias, offset]
        for i, x in zip(diff_idx, diff):
            full[i] = x
        fq, fk, fv, fb, fo = full
        out = fusedattn.fused_attn(fq, fk, fv, **{**opts, "bias": fb, "softmax_offset": fo})
        return jnp.swapaxes(out, 0, 1) if case.layout == "sbhd" else out

    out, vjp = jax.jit(lambda *d: jax.vjp(f, *d))(*[(qa, ka, va, bias, offset)[i]
                                                     for i in diff_idx])
    grads = dict(zip(diff_idx, vjp(d_out)))
    layout_grads = [grads[i] for i in range(3) if i in grads]
    dq, dk, dv = _from_layout(case, tuple(layout_grads))
    return out, dq, dk, dv, grads.get(3), grads.get(4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_against_float64_reference_and_xla(case: Case):
    q, k, v, bias, offset, seq, d_out = _inputs(case)
    scale = 1.0 / np.sqrt(case.d_qk)
    visible, q_valid, kv_valid = _visible(case, seq)
    ref_out, ref_lse, ref_grads = _reference_results(case, scale, visible, q, k, v, bias, offset,
                                                     d_out)
    # padded query rows get no cotangent (their output is defined as 0)
    out, dq, dk, dv, dbias, doffset = _run_cudnn(case, q, k, v, bias, offset, seq, d_out)
    tol = TOL[case.dtype]
    checks = {"out": (out, ref_out), "dq": (dq, ref_grads[0]), "dk": (dk, ref_grads[1]),
              "dv": (dv, ref_grads[2])}
    if bias is not None:
        checks["dbias"] = (dbias, ref_grads[3])
    if offset is not None:
        checks["doffset"] = (doffset, ref_grads[4])
    errors = {name: _rel(got, want) for name, (got, want) in checks.items()}
    assert all(np.isfinite(list(errors.values()))), errors
    assert max(errors.values()) < tol, errors

    # padded / unused positions are exactly zero
    qv = np.asarray(q_valid)[:, :, None, None]
    kvv = np.asarray(kv_valid)[:, :, None, None]
    assert np.all(np.where(qv, 0, np.asarray(out, np.float32)) == 0)
    assert np.all(np.where(qv, 0, np.asarray(dq, np.float32)) == 0)
    assert np.all(np.where(kvv, 0, np.asarray(dk, np.float32)) == 0)
    assert np.all(np.where(kvv, 0, np.asarray(dv, np.float32)) == 0)

    # the LSE at real query positions, and the XLA backend on the same inputs
    qa, ka, va = _to_layout(case, q, k, v)
    opts = dict(bias=bias, sequence=seq, mask=case.mask, window=case.window,
                softmax=case.softmax, softmax_offset=offset, layout=case.layout)
    from fusedattn.validation import build_call
    config, inputs = build_call(qa, ka, va, **opts)
    _, lse = jax.jit(lambda i: cudnn.attention_with_lse(config, i))(inputs)
    valid_rows = np.broadcast_to(np.asarray(q_valid)[:, None, :], ref_lse.shape)
    assert _rel(np.asarray(lse)[valid_rows], ref_lse[valid_rows]) < 1e-3
    xla_out = fusedattn.fused_attn(qa, ka, va, backend="xla", **opts)
    if case.layout == "sbhd":
        xla_out = jnp.swapaxes(xla_out, 0, 1)
    assert _rel(out, xla_out) < tol


def test_deterministic_backward_is_bitwise_repeatable():
    case = Case("det", b=2, s_q=512, s_kv=512, h_q=8, h_kv=2, d_qk=128, d_v=128, mask="causal",
                deterministic=True)
    q, k, v, bias, offset, seq, d_out = _inputs(case, seed=3)
    first = _run_cudnn(case, q, k, v, bias, offset, seq, d_out)
    for _ in range(3):
        again = _run_cudnn(case, q, k, v, bias, offset, seq, d_out)
        for a, b in zip(first[:4], again[:4]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_masks_agree_between_forward_and_backward():
    """O is linear in V (O = A V with A the dropped-out probabilities), so
    <dV, V> == <dO, O> holds only if the backward regenerates the forward's mask."""
    case = Case("dropout", s_q=256, s_kv=256, mask="causal")
    q, k, v, _, _, _, d_out = _inputs(case, seed=5)
    key = jax.random.PRNGKey(7)
    out, _, _, dv, _, _ = _run_cudnn(case, q, k, v, None, None, None, d_out, dropout=0.25, rng=key)
    lhs = float(jnp.vdot(dv.astype(jnp.float32), v.astype(jnp.float32)))
    rhs = float(jnp.vdot(d_out.astype(jnp.float32), out.astype(jnp.float32)))
    assert abs(lhs - rhs) <= 2e-2 * max(abs(rhs), 1.0), (lhs, rhs)
    run = jax.jit(lambda q, k, v, key: fusedattn.fused_attn(
        q, k, v, mask="causal", dropout=0.25, rng=key, backend="cudnn"))
    a, b, c = run(q, k, v, key), run(q, k, v, key), run(q, k, v, jax.random.PRNGKey(8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    plain = fusedattn.fused_attn(q, k, v, mask="causal", backend="cudnn")
    assert _rel(a, plain) > 0.05  # dropout did something


def test_explain_names_cudnn_or_gives_the_frontend_reason():
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    plan = fusedattn.explain(q, kv, kv, mask="causal")
    assert plan.chosen == "cudnn", str(plan)
    odd = jax.ShapeDtypeStruct((2, 256, 8, 36), jnp.bfloat16)  # head dim not a multiple of 8
    plan = fusedattn.explain(odd, odd, odd)
    reason = dict(plan.reasons)["cudnn"]
    assert plan.chosen != "cudnn" and reason.startswith("cuDNN:"), str(plan)
    assert "8" in reason, reason


def test_one_libcudnn_in_the_process():
    fusedattn.fused_attn(jnp.ones((1, 64, 2, 64), jnp.bfloat16), jnp.ones((1, 64, 2, 64), jnp.bfloat16),
                         jnp.ones((1, 64, 2, 64), jnp.bfloat16), backend="cudnn").block_until_ready()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if re.search(r"libcudnn\.so\.9$", line.strip())}
    assert len(paths) == 1, paths
    assert os.path.realpath(native.versions()["cudnn_library"]) == os.path.realpath(paths.pop())


def test_probe_reports_workspace_and_is_cached():
    cfg = AttnConfig(batch=2, s_q=512, s_kv=512, h_q=8, h_kv=8, d_qk=64,
                                      d_v=64, dtype="bfloat16", scale=0.125, mask="causal")
    first = cudnn.probe(cfg)
    assert first.ok and all(w >= 0 for w in first.workspace)
    assert cudnn.probe(cfg) is first
