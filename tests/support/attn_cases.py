"""Attention test cases: random inputs for a described call, a backend run with
gradients, and the comparison against the float64 oracle (tests/oracle.py).

A `Case` says what to test in user terms (the arguments of `fused_attn`);
`run_case` runs it on a backend (the XLA backend by default, optionally with
forced tile sizes) and `check_case` asserts forward, lse and every gradient
against the oracle with the dtype's tolerance.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import oracle
from fusedattn.sequence import SequenceDescriptor
from fusedattn.validation import build_call

# Relative tolerance on ||x - ref|| / ||ref||, per dtype (the project's standard).
TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2, "float32": 1e-5}
PACKED_QKV = ("bs3hd", "sb3hd")
PACKED_KV = ("bshd_bs2hd", "sbhd_sb2hd")
SEQ_FIRST = ("sbhd", "sb3hd", "sbhd_sb2hd")


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    s_q: int = 20
    s_kv: int = 20
    h_q: int = 4
    h_kv: int = 2
    d_qk: int = 16
    d_v: int = 16
    dtype: str = "float32"
    layout: str = "bshd"
    mask: str = "none"
    window: Optional[Tuple[int, int]] = None
    bias: Optional[Tuple[bool, bool]] = None  # (per batch, per head); None = no bias
    softmax: str = "vanilla"
    sequence: str = "dense"                   # dense / padding / packed / packed-shared
    max_segments: int = 3
    dropout: float = 0.0
    score_mod: Optional[Callable] = None
    score_mod_args: Tuple = ()                # NumPy arrays
    scale: Optional[float] = None
    seed: int = 0

    def fixed(self) -> "Case":
        """The same case made legal: packed layouts force equal shapes; causal windows right=0."""
        c = self
        if c.layout in PACKED_QKV:
            c = dataclasses.replace(c, s_kv=c.s_q, h_kv=c.h_q, d_v=c.d_qk)
        if c.layout in PACKED_KV:
            c = dataclasses.replace(c, d_v=c.d_qk)
        if c.window is not None and c.mask != "none" and c.window[1] != 0:
            c = dataclasses.replace(c, window=(c.window[0], 0))
        return c

    def label(self) -> str:
        parts = [self.dtype, self.layout, self.mask, self.sequence,
                 f"q{self.s_q}kv{self.s_kv}", f"h{self.h_q}/{self.h_kv}", f"d{self.d_qk}/{self.d_v}"]
        if self.window:
            parts.append(f"w{self.window[0]},{self.window[1]}")
        if self.bias:
            parts.append("bias" + "".join("x" if f else "1" for f in self.bias))
        if self.softmax != "vanilla":
            parts.append(self.softmax)
        if self.score_mod is not None:
            parts.append(self.score_mod.__name__)
        return "-".join(parts)


def _segment_ids(rng, b: int, s: int, n_segments: int, lengths=None):
    """Sorted 1-based ids with trailing padding; returns ids and per-segment lengths."""
    ids = np.zeros((b, s), np.int32)
    if lengths is None:
        lengths = np.zeros((b, n_segments), np.int64)
        for row in range(b):
            cuts = np.sort(rng.integers(0, s + 1, size=n_segments))
            lengths[row] = np.diff(np.concatenate([[0], cuts]))
    for row in range(b):
        start = 0
        for seg, n in enumerate(lengths[row]):
            ids[row, start:start + n] = seg + 1
            start += n
    return ids, lengths


def _sequence(case: Case, rng):
    """(SequenceDescriptor or None, oracle keyword arguments)."""
    if case.sequence == "dense":
        return None, {}
    if case.sequence == "padding":
        q_len = rng.integers(1, case.s_q + 1, size=case.b).astype(np.int32)
        kv_len = rng.integers(1, case.s_kv + 1, size=case.b).astype(np.int32)
        q_len[0], kv_len[-1] = case.s_q, case.s_kv  # one full row each side
        return (SequenceDescriptor.from_lengths(q_len, kv_len),
                dict(q_lengths=q_len, kv_lengths=kv_len))
    q_ids, _ = _segment_ids(rng, case.b, case.s_q, case.max_segments)
    if case.sequence == "packed-shared":   # one set of ids for q and kv (s_q == s_kv)
        desc = SequenceDescriptor.from_segment_ids(q_ids, max_segments=case.max_segments)
        return desc, dict(q_segment_ids=q_ids, kv_segment_ids=q_ids)
    kv_ids, _ = _segment_ids(rng, case.b, case.s_kv, case.max_segments)
    desc = SequenceDescriptor.from_segment_ids(q_ids, kv_ids, max_segments=case.max_segments)
    return desc, dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def _to_user_layout(case: Case, q, k, v):
    """bshd q, k, v -> the (q, k, v) arguments for `case.layout`."""
    seq_first = case.layout in SEQ_FIRST
    t = (lambda x: jnp.swapaxes(x, 0, 1)) if seq_first else (lambda x: x)
    if case.layout in PACKED_QKV:
        return t(jnp.stack([q, k, v], axis=2)), None, None
    if case.layout in PACKED_KV:
        return t(q), t(jnp.stack([k, v], axis=2)), None
    return t(q), t(k), t(v)


def _grads_to_bshd(case: Case, gq, gk, gv):
    seq_first = case.layout in SEQ_FIRST
    t = (lambda x: np.swapaxes(x, 0, 1)) if seq_first else (lambda x: x)
    if case.layout in PACKED_QKV:
        packed = t(gq)
        return packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    if case.layout in PACKED_KV:
        packed = t(gk)
        return t(gq), packed[:, :, 0], packed[:, :, 1]
    return t(gq), t(gk), t(gv)


@dataclasses.dataclass
class Built:
    """A case's arrays: `args` for `fused_attn`, `ref_kwargs` for the oracle."""
    case: Case
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: Optional[jax.Array]
    offset: Optional[jax.Array]
    sequence: Optional[SequenceDescriptor]
    score_mod_args: Tuple[jax.Array, ...]
    d_out: jax.Array        # bshd cotangent in q's dtype
    ref_kwargs: dict
    rng: Optional[jax.Array] = None

    def options(self) -> dict:
        c = self.case
        return dict(bias=self.bias, sequence=self.sequence, mask=c.mask, window=c.window,
                    scale=c.scale, softmax=c.softmax, softmax_offset=self.offset,
                    dropout=c.dropout, rng=self.rng, score_mod=c.score_mod,
                    score_mod_args=self.score_mod_args, layout=c.layout)


def build(case: Case, sequence: Optional[Callable] = None) -> Built:
    """Random arrays for `case`. `sequence(case, rng) -> (descriptor, oracle kwargs)`
    replaces the case's own random padding / packing (a backend with narrower rules
    draws its own)."""
    case = case.fixed()
    rng = np.random.default_rng(case.seed)
    dt = jnp.dtype(case.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)
    q = normal(case.b, case.s_q, case.h_q, case.d_qk)
    k = normal(case.b, case.s_kv, case.h_kv, case.d_qk)
    v = normal(case.b, case.s_kv, case.h_kv, case.d_v)
    bias = None
    if case.bias is not None:
        shape = (case.b if case.bias[0] else 1, case.h_q if case.bias[1] else 1, case.s_q, case.s_kv)
        bias = normal(*shape)
    offset = None
    if case.softmax == "learnable":
        offset = jnp.asarray(rng.standard_normal(case.h_q), jnp.float32)
    sequence, seq_kwargs = (sequence or _sequence)(case, rng)
    d_out = normal(case.b, case.s_q, case.h_q, case.d_v)
    mod_args = tuple(jnp.asarray(a) for a in case.score_mod_args)
    f64 = lambda x: None if x is None else np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    ref_kwargs = dict(bias=f64(bias), mask=case.mask, window=case.window, scale=case.scale,
                      softmax=case.softmax, softmax_offset=f64(offset),
                      score_mod=case.score_mod, score_mod_args=case.score_mod_args,
                      d_out=f64(d_out), **seq_kwargs)
    rng_key = jax.random.PRNGKey(case.seed) if case.dropout > 0 else None
    return Built(case, q, k, v, bias, offset, sequence, mod_args, d_out, ref_kwargs, rng_key)


def run_backend(built: Built, tiling=None):
    """Run the XLA backend: (out bshd, lse, grads dict), all NumPy float64."""
    from fusedattn.backends import xla
    case = built.case
    uq, uk, uv = _to_user_layout(case, built.q, built.k, built.v)
    opts = built.options()
    config, _ = build_call(uq, uk, uv, **opts)

    def f(uq, uk, uv, bias, offset, mod_args):
        _, inputs = build_call(uq, uk, uv, **dict(opts, bias=bias, softmax_offset=offset,
                                                  score_mod_args=mod_args))
        return xla.attention_with_lse(config, inputs, tiling=tiling)

    (out, lse), vjp = jax.vjp(jax.jit(f), uq, uk, uv, built.bias, built.offset, built.score_mod_args)
    seq_first = case.layout in SEQ_FIRST
    d_out = jnp.swapaxes(built.d_out, 0, 1) if seq_first else built.d_out
    gq, gk, gv, gbias, goffset, gargs = vjp((d_out, jnp.zeros_like(lse)))
    as64 = lambda x: None if x is None else np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    out = np.asarray(out.astype(jnp.float32), np.float64)
    out = np.swapaxes(out, 0, 1) if seq_first else out
    dq, dk, dv = _grads_to_bshd(case, as64(gq), as64(gk), as64(gv))
    float_args = [g for g, a in zip(gargs, built.score_mod_args)
                  if jnp.issubdtype(a.dtype, jnp.floating)]
    grads = dict(dq=dq, dk=dk, dv=dv, dbias=as64(gbias), d_offset=as64(goffset),
                 d_score_mod_args=tuple(as64(g) for g in float_args))
    return out, np.asarray(lse, np.float64), grads


def oracle_for(built: Built, keep=None) -> oracle.Reference:
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    return oracle.attention(f64(built.q), f64(built.k), f64(built.v), keep=keep,
                            dropout=built.case.dropout, **built.ref_kwargs)


def rel_error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    scale = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (scale if scale > 0 else 1.0))


def assert_close(name: str, x, ref, tol: float) -> None:
    assert x is not None, f"{name}: backend returned no value"
    assert np.all(np.isfinite(x)), f"{name}: non-finite values"
    assert x.shape == ref.shape, f"{name}: shape {x.shape} != {ref.shape}"
    err = rel_error(x, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"


def check_case(case: Case, tiling=None, keep=None) -> None:
    """Forward, lse and all gradients of the XLA backend against the oracle."""
    built = build(case)
    case = built.case
    out, lse, grads = run_backend(built, tiling)
    ref = oracle_for(built, keep)
    tol = TOLERANCE[case.dtype]
    assert_close("out", out, ref.out, tol)
    finite = np.isfinite(ref.lse)
    assert np.array_equal(np.isfinite(lse), finite), "lse: empty rows differ"
    assert_close("lse", lse[finite], ref.lse[finite], max(tol, 1e-6))
    for name in ("dq", "dk", "dv"):
        assert_close(name, grads[name], getattr(ref, name), tol)
    if case.bias is not None:
        assert_close("dbias", grads["dbias"], ref.dbias, tol)
    if case.softmax == "learnable":
        assert_close("d_offset", grads["d_offset"], ref.d_offset, tol)
    assert len(grads["d_score_mod_args"]) == len(ref.d_score_mod_args)
    for i, (g, r) in enumerate(zip(grads["d_score_mod_args"], ref.d_score_mod_args)):
        assert_close(f"d_score_mod_args[{i}]", g, r, tol)
    assert_padding_zero(built, out)


def _padded(built: Built, side: str, s: int) -> np.ndarray:
    kw = built.ref_kwargs
    if f"{side}_lengths" in kw:
        return np.arange(s)[None, :] >= np.asarray(kw[f"{side}_lengths"])[:, None]
    if f"{side}_segment_ids" in kw:
        return np.asarray(kw[f"{side}_segment_ids"]) == 0
    return np.zeros((built.case.b, s), bool)


def padded_query_mask(built: Built) -> np.ndarray:
    """[b, s_q] True where the query is not a real token."""
    return _padded(built, "q", built.case.s_q)


def padded_key_mask(built: Built) -> np.ndarray:
    """[b, s_kv] True where the key is not a real token."""
    return _padded(built, "kv", built.case.s_kv)


def assert_padding_zero(built: Built, out: np.ndarray) -> None:
    pad = padded_query_mask(built)
    assert np.all(out[pad] == 0.0), "padded query positions must be exactly 0"
