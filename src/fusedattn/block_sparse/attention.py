"""`block_sparse_attention`: attention that runs only the blocks a `BlockMap` lists.

On Hopper GPUs the Mosaic GPU kernels (`kernel_fwd`, `kernel_bwd`) run it, and the
backward of a documents mask or a dense mask, where the extension has it and
reproducible bits are not asked for, one native kernel (`kernel_bwd_fused`);
elsewhere (and with ``implementation="reference"``) the same list walks in plain JAX
(`reference`). Both save the base-2 log-sum-exp for the backward, which walks the
query-major lists for dq and the key-major lists for dk / dv.
`block_sparse_attention_backward` runs that backward alone, from a forward's
output and log-sum-exp (the fusedattn backend's two partitioned steps).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..inputs import value_mean
from ..partitioning import (KV_HEADS, KV_TOKENS, LSE_DIMS, Q_HEADS, Q_TOKENS, CallShape,
                            Dims, broadcast_dims, token_dims, typed_like)
from . import kernel_bwd, kernel_bwd_fused, kernel_fwd, reference, sharded, unseen_rows as unseen
from .block_map import BlockMap
from .documents import documents
from .kernel_mask import KernelMask, kernel_mask
from .kernel_parts import BLOCK, batch_tokens, whole
from .kernel_score import kernel_score
from .terms import Dense

IMPLEMENTATIONS = ("mosaic", "reference")
LAYOUTS = ("bshd", "sbhd")    # the token arrays' layouts the kernels read in place
# What a row that sees no key gives: 0 (fusedattn's rule), or the mean of all values
# (jax.nn's: every key weighted alike), written by the forward kernel itself.
UNSEEN_ROWS = ("zero", "mean")
# The implementations a sharded direct call runs under our partitioning rule: XLA sees
# the kernels as opaque calls, while it partitions the reference walks (plain JAX,
# differentiable twice) itself. Tests add "reference" to run the rule on CPU.
PARTITIONED = ("mosaic",)


def block_sparse_attention(q, k, v, block_map: BlockMap, *, scale: Optional[float] = None,
                           score_mod: Optional[Callable] = None, score_mod_args=(),
                           implementation: Optional[str] = None, unseen_rows: str = "zero",
                           layout: str = "bshd", partitioned: bool = True,
                           deterministic: bool = False):
    """Attention of q ``[b, s_q, h_q, d]`` over k, v ``[b, s_kv, h_kv, d]`` (bshd, or
    with ``layout="sbhd"`` sequence-first ``[s, b, h, d]``, the output too; h_q a
    multiple of h_kv) where `block_map` says which pairs are visible;
    ``score_mod(score, b, h, q_idx, kv_idx, *score_mod_args)`` rewrites the scaled
    score (elementwise JAX code; on GPU it runs inside the kernel, its reads of the
    args by position, batch or head hoisted out: `kernel_score`). Rows with no
    visible key give 0, or with ``unseen_rows="mean"`` the mean of all values (jax.nn's
    rule). Differentiable in q, k, v and the float args. Lengths need
    not be multiples of the block: the arrays are padded to whole blocks and the
    padding masked. `implementation`: "mosaic", "reference" or None (mosaic on a
    Hopper GPU, else reference). Under a jit whose inputs are sharded over the batch or
    heads each device runs its own shard (`sharded`; ``partitioned=False``: the caller
    runs this on one device's arrays already). ``deterministic=True``: a backward of
    the same bits run after run (the fused backward kernel adds dq with atomics)."""
    out, _ = _call(q, k, v, block_map, scale, score_mod, score_mod_args, implementation,
                   unseen_rows, layout, partitioned, deterministic)
    return out


def block_sparse_attention_with_lse(q, k, v, block_map: BlockMap, *, scale=None,
                                    score_mod=None, score_mod_args=(), implementation=None,
                                    unseen_rows="zero", layout="bshd", partitioned=True,
                                    deterministic=False):
    """(out, lse): lse is the fp32 natural log-sum-exp ``[b, h_q, s_q]`` (-inf on
    rows with no visible key)."""
    out, lse2 = _call(q, k, v, block_map, scale, score_mod, score_mod_args, implementation,
                      unseen_rows, layout, partitioned, deterministic)
    return out, lse2 * math.log(2.0)


def choose_implementation(q, implementation=None) -> str:
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        return implementation
    ok = q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in (64, 128)
    return "mosaic" if on_hopper() and ok else "reference"


def on_hopper() -> bool:
    """Whether JAX's first device is a Hopper GPU (what the Mosaic GPU kernels need)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def block_sparse_attention_backward(q, k, v, out, lse, d_out, block_map: BlockMap, *,
                                    scale=None, score_mod=None, score_mod_args=(),
                                    implementation=None, unseen_rows="zero", layout="bshd",
                                    partitioned=True, deterministic=False):
    """(dq, dk, dv, d_args) of `block_sparse_attention` at cotangent `d_out`, from the
    forward's `out` and natural `lse` (`block_sparse_attention_with_lse`): the backward
    kernels alone, for a caller that runs the forward and the backward as steps of its
    own. `d_args` has each score_mod_arg's gradient (None for integer ones): the
    kernels' gradients of the hoisted values (`kernel_score`) carried back through the
    hoisted reads by JAX, as `block_sparse_attention`'s derivative does (no
    ``s_q x s_kv`` array)."""
    t = _token_axis(layout)
    s_q, s_kv = q.shape[t], k.shape[t]
    mean_over, flag = _unseen_rule(unseen_rows, block_map, score_mod is not None, s_kv)
    fn, scale, impl, (q, k, v), ints, fused = _operands(
        q, k, v, block_map, scale, implementation, layout,
        _fused_asked(score_mod, deterministic))
    ints += (flag,)
    args = tuple(score_mod_args)
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(jnp.result_type(a), jnp.floating)]
    score_fn = []

    def hoisted(float_args):  # the values the kernels read, from the float args
        full = list(args)
        for i, x in zip(floats, float_args):
            full[i] = x
        fn, values = _score(score_mod, full, batch_tokens(q, t == 0)[0], q.shape[2], s_q,
                            s_kv)
        score_fn.append(fn)
        return values
    values, pullback = jax.vjp(hoisted, [args[i] for i in floats])
    whole = q.shape[t]
    # (padded rows see no key: lse -inf, output 0, as the forward gives them)
    lse2 = jnp.pad(lse.astype(jnp.float32) / math.log(2.0), ((0, 0), (0, 0), (0, whole - s_q)),
                   constant_values=-jnp.inf)
    out, d_out = (_pad_tokens(x, whole, t) for x in (out, d_out))
    steps = _steps(fn, scale, score_fn[0], impl, mean_over, t == 0, q, k, values, ints,
                   partitioned, fused, s_kv)
    dq, dk, dv, _, d_values, _ = _bwd(steps, (q, k, v, values, ints, out, lse2),
                                      (d_out, None))
    d_args = [None] * len(args)
    for i, g in zip(floats, pullback(d_values)[0]):
        d_args[i] = g
    return (_cut(dq, s_q, t), _cut(dk, s_kv, t), _cut(dv, s_kv, t), tuple(d_args))


def _call(q, k, v, bm, scale, score_mod, score_mod_args, implementation, unseen_rows, layout,
          partitioned, deterministic):
    t = _token_axis(layout)
    s_q, s_kv = q.shape[t], k.shape[t]
    mean_over, flag = _unseen_rule(unseen_rows, bm, score_mod is not None, s_kv)
    # (the mean of v an unseen row gives is taken from v before its padding: a sum of
    # the padded v fused with its pad ran slower. A constant to the vjp: the backward
    # adds its gradient to dv itself.)
    v_real = None if mean_over is None else jax.lax.stop_gradient(v)
    fn, scale, impl, (q, k, v), ints, fused = _operands(
        q, k, v, bm, scale, implementation, layout,
        _fused_asked(score_mod, deterministic))
    score, values = _score(score_mod, score_mod_args, batch_tokens(q, t == 0)[0], q.shape[2],
                           s_q, s_kv)
    ints += (flag,)
    steps = _steps(fn, scale, score, impl, mean_over, t == 0, q, k, values, ints,
                   partitioned, fused, s_kv)
    out, lse2 = _attention(steps, q, k, v, v_real, values, ints)
    return _cut(out, s_q, t), lse2[..., :s_q]


class _Steps(NamedTuple):
    """What a call's forward and backward steps share (static): the kernels' mask and
    score functions, how they run, and how a sharded call splits (`sharded`)."""
    fn: Callable
    scale: float
    score: Optional[Callable]
    impl: str
    mean_over: Optional[int]   # the keys an unseen row's mean takes, or None
    seq_first: bool            # the token arrays are sbhd
    shape: Optional[CallShape]  # the call's batch and heads; None: run unsplit
    # whether the functions read the batch / head number as values (`sharded`: asked
    # only where a split is decided)
    reads: Optional[Callable[[], Tuple[bool, bool]]]
    fused: bool                # the backward runs `kernel_bwd_fused` (`_fused_mask`)
    s_kv: int                  # keys before their padding to whole blocks

    def run(self, body, operands, dims):
        """``body(*operands)``, split by `sharded` where the call is partitioned;
        ``dims()``: the operands' and the results' `Dims`."""
        if self.shape is None:
            return body(*operands)
        return sharded.run(body, operands, *dims(), self.shape, self.reads)

    def q_dims(self) -> Dims:
        return token_dims(self.seq_first, Q_HEADS, Q_TOKENS)

    def kv_dims(self, token=KV_TOKENS) -> Dims:
        return token_dims(self.seq_first, KV_HEADS, token)

    @staticmethod
    def kernel_dims(values, ints):
        """Dims of the score values and the map's int operands (`_operands`' ints): each
        ``[B|1, H|1, ..]``, the mask arrays ``[B|1, ..]``."""
        fwd_lists, bwd_lists, qa, ka, dense, flag = ints
        def lead(x, heads=True):
            return None if x is None else broadcast_dims(x.shape, heads)
        return ((tuple(lead(x) for x in values),
                 tuple(lead(x) for x in fwd_lists), tuple(lead(x) for x in bwd_lists),
                 lead(qa, heads=False), lead(ka, heads=False), lead(dense),
                 None if flag is None else Dims((None,) * jnp.ndim(flag))))


def _steps(fn, scale, score, impl, mean_over, seq_first, q, k, values, ints,
           partitioned, fused: bool, s_kv: int) -> _Steps:
    shape, reads = None, None
    if partitioned and impl in PARTITIONED:
        b, _ = batch_tokens(q, seq_first)
        _, _, qa, ka, dense, _ = ints
        shape = CallShape(b, q.shape[2], k.shape[2])
        # (how many row / column arrays the mask reads, and values the score reads:
        # mask arrays [B|1, n, s], score values [B|1, H|1, n, s])
        reads = functools.cache(functools.partial(
            sharded.reads_numbers, fn, score, 0 if qa is None else qa.shape[1],
            0 if ka is None else ka.shape[1], dense is not None,
            tuple(0 if x is None else x.shape[2] for x in values)))
    return _Steps(fn, scale, score, impl, mean_over, seq_first, shape, reads, fused, s_kv)


def _token_axis(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "bshd" else 0


def _bshd(x, seq_first: bool):
    """A token array in bshd, from sbhd where `seq_first` (and back: the same swap). XLA
    fuses the transpose into what reads it."""
    return jnp.swapaxes(x, 0, 1) if seq_first else x


def _cut(x, size: int, t: int):
    """The first `size` tokens of `x` (axis `t`)."""
    return x if x.shape[t] == size else jax.lax.slice_in_dim(x, 0, size, axis=t)


def _unseen_rule(unseen_rows: str, bm: BlockMap, has_score: bool, s_kv: int):
    """(how many keys an unseen row's mean takes, or None where such rows give 0 or the
    map leaves none; the device flag of `unseen_rows.gate`, or None)."""
    if unseen_rows not in UNSEEN_ROWS:
        raise ValueError(f"unseen_rows must be one of {UNSEEN_ROWS}, got {unseen_rows!r}")
    if unseen_rows == "zero":
        return None, None
    flag = unseen.gate(bm, has_score)
    if flag is False:
        return None, None
    return s_kv, (None if flag is True else flag)


def _score(score_mod, score_mod_args, batch, heads, s_q, s_kv):
    """(the kernels' score function or None, its (row, column) values padded to whole
    blocks and its values per run of diagonals: differentiable in the float args,
    `kernel_score`)."""
    score = kernel_score(score_mod, tuple(score_mod_args), batch, heads, s_q, s_kv)
    if score is None:
        return None, (None, None, None)
    return score.fn, (_pad_tokens(score.q_values, whole(s_q), axis=3),
                      _pad_tokens(score.kv_values, whole(s_kv), axis=3), score.d_values)


def _fused_asked(score_mod, deterministic: bool) -> bool:
    """Whether a call's options leave the fused backward possible (the mask and the
    arrays decide the rest: `_operands`)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    return score_mod is None and not deterministic


def _operands(q, k, v, bm, scale, implementation, layout, fused_asked=False):
    """(mask fn, scale, implementation, padded (q, k, v), the map's int arrays, whether
    the backward runs `kernel_bwd_fused`) of a call."""
    t = _token_axis(layout)
    _check(q, k, v, bm, t)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = choose_implementation(q, implementation)
    km = _fused_mask(bm, q, (k.dtype, v.dtype), t, impl) if fused_asked else None
    fused = km is not None
    km = _padded(km if fused else kernel_mask(bm.element), bm.s_q, bm.s_kv)
    # Lengths past a block boundary: the arrays padded to whole blocks (the map already
    # has the blocks; the key padding is masked in the last block, which is never full,
    # and the padded rows' outputs are cut off, so their cotangent is 0).
    q, k, v = (_pad_tokens(x, whole(x.shape[t]), t) for x in (q, k, v))
    fwd_lists = tuple(jnp.asarray(x, jnp.int32) for x in
                      (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
    bwd_lists = tuple(jnp.asarray(x, jnp.int32) for x in
                      (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices))
    return km.fn, scale, impl, (q, k, v), (fwd_lists, bwd_lists, km.q_arrays, km.kv_arrays,
                                           km.dense), fused


def _fused_mask(bm: BlockMap, q, kv_dtypes, t: int, impl: str) -> Optional[KernelMask]:
    """The kernel mask of a call whose backward `kernel_bwd_fused` takes, else None: a
    dense mask alone (its bits), or a documents mask alone with no factor of positions
    (as the kernel's words, which the Mosaic forward then reads too)."""
    terms = bm.element.terms
    # (the arrays before the ids: finding them hoists the mask_mod's reads, trace-time work)
    if len(terms) != 1 or kernel_bwd_fused.reason(
            q, seq_first=t == 0, implementation=impl, s_kv=bm.s_kv,
            kv_dtypes=kv_dtypes) is not None:
        return None
    if isinstance(terms[0], Dense):
        return kernel_mask(bm.element)
    docs = documents(terms[0], bm.element)
    if docs is None or docs.positions is not None:
        return None
    return KernelMask(*kernel_bwd_fused.words(docs, bm.s_q, bm.s_kv), None,
                      kernel_bwd_fused.visible)


def _pad_tokens(x, size: int, axis: int = 1):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _padded(km: KernelMask, s_q: int, s_kv: int) -> KernelMask:
    """The kernel mask over whole blocks: its arrays padded (a dense mask's words come
    whole), and keys past s_kv hidden."""
    if s_q % BLOCK == 0 and s_kv % BLOCK == 0:
        return km
    fn = km.fn
    if s_kv % BLOCK:
        def fn(b, h, q, kv, qv, kvv, d, inner=km.fn):
            return inner(b, h, q, kv, qv, kvv, d) & (kv < s_kv)
    return KernelMask(_pad_tokens(km.q_arrays, whole(s_q), axis=2),
                      _pad_tokens(km.kv_arrays, whole(s_kv), axis=2), km.dense, fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(steps: _Steps, q, k, v, v_real, values, ints):
    """`v_real` (None, or v before its padding, a constant: `_call`) gives the mean of
    its `steps.mean_over` keys per query head to rows that see no key; the backward
    adds that mean's gradient to dv."""
    return _forward(steps, q, k, v, v_real, values, ints)


def _forward(steps: _Steps, q, k, v, v_real, values, ints):
    fwd_lists, _, qa, ka, dense, flag = ints
    impl, seq_first = steps.impl, steps.seq_first

    def body(q, k, v, v_real, values, fwd_lists, qa, ka, dense, flag):
        fill = None
        if steps.mean_over is not None:
            fill = value_mean(_bshd(v_real, seq_first), q.shape[2],
                              lambda x: unseen.gated_token_sum(
                                  x, flag, kernel=impl == "mosaic" and not seq_first))
        km = KernelMask(qa, ka, dense, steps.fn)
        kw = dict(scale=steps.scale, score=steps.score, score_values=values, fill=fill)
        if impl == "mosaic":
            return kernel_fwd.forward(q, k, v, fwd_lists, km, seq_first=seq_first, **kw)
        # (the reference walks take bshd alone)
        out, lse2 = reference.forward(*(_bshd(x, seq_first) for x in (q, k, v)), fwd_lists,
                                      km, **kw)
        return _bshd(out, seq_first), lse2

    def dims():
        value_dims, list_dims, _, *mask_dims = steps.kernel_dims(values, ints)
        return ((steps.q_dims(), steps.kv_dims(), steps.kv_dims(),
                 None if v_real is None else steps.kv_dims(token=None), value_dims, list_dims,
                 *mask_dims), (steps.q_dims(), LSE_DIMS))
    return steps.run(body, (q, k, v, v_real, values, fwd_lists, qa, ka, dense, flag), dims)


def _fwd(steps, q, k, v, v_real, values, ints):
    out, lse2 = _forward(steps, q, k, v, v_real, values, ints)
    return (out, lse2), (q, k, v, values, ints, out, lse2)


def _bwd(steps: _Steps, res, cts):
    q, k, v, values, ints, out, lse2 = res
    do = cts[0].astype(q.dtype)
    fwd_lists, bwd_lists, qa, ka, dense, flag = ints
    impl, seq_first = steps.impl, steps.seq_first

    def body(q, k, v, values, fwd_lists, bwd_lists, qa, ka, dense, flag, out, lse2, do):
        km = KernelMask(qa, ka, dense, steps.fn)
        tokens = "sbhd" if seq_first else "bshd"
        delta = jnp.einsum(f"{tokens},{tokens}->bhs", out.astype(jnp.float32),
                           do.astype(jnp.float32))
        # A reduction of its own: fused into the stack below, XLA computed it element by
        # element in a loop fusion, which cost as much as a third of the backward.
        delta = jax.lax.optimization_barrier(delta)
        # +inf on rows with no visible key: their probabilities exp2(s - lse) are 0
        lse_delta = jnp.stack([jnp.where(lse2 == -jnp.inf, jnp.inf, lse2), delta], axis=2)
        kw = dict(scale=steps.scale, score=steps.score, score_values=values)
        dv_add = None
        if steps.mean_over is not None:
            # An unseen row's output is the mean of v: its cotangent reaches every key's dv
            # (added by the dk / dv kernel or the fused one; its probabilities, 0, give dq
            # and dk nothing).
            # A masked sum over the sequence reads dO once (as an einsum, XLA transposed dO
            # for a matmul first), where the gate is open.
            dv_add = unseen.gated_token_sum(_bshd(do, seq_first), flag, lse2,
                                            kernel=impl == "mosaic" and not seq_first
                                            ) / steps.mean_over
        if steps.fused:
            dq, dk, dv = kernel_bwd_fused.backward(q, k, v, do, lse_delta, bwd_lists, qa, ka,
                                                   dense, dv_add, scale=steps.scale,
                                                   s_kv=steps.s_kv)
            d_q_values = d_d_values = d_kv_values = None
        elif impl == "mosaic":
            dq, d_q_values, d_d_values = kernel_bwd.dq(q, k, v, do, lse_delta, fwd_lists, km,
                                                       seq_first=seq_first, **kw)
            dk, dv, d_kv_values = kernel_bwd.dkv(q, k, v, do, lse_delta, bwd_lists, km,
                                                 dv_add=dv_add, seq_first=seq_first, **kw)
        else:   # (the reference walks take bshd alone)
            bq, bk, bv, bdo = (_bshd(x, seq_first) for x in (q, k, v, do))
            dq, d_q_values, d_d_values = reference.dq(bq, bk, bv, bdo, lse_delta, fwd_lists,
                                                      km, **kw)
            dk, dv, d_kv_values = reference.dkv(bq, bk, bv, bdo, lse_delta, bwd_lists, km,
                                                dv_add=dv_add, **kw)
            dq, dk, dv = (_bshd(x, seq_first) for x in (dq, dk, dv))
        dk, dv = (_group_sum(x, k.shape[2]).astype(k.dtype) for x in (dk, dv))
        d_values = tuple(_summed_to(g, x) for g, x in
                         zip((d_q_values, d_kv_values, d_d_values), values))
        return dq, dk, dv, d_values

    def dims():
        value_dims, *map_dims = steps.kernel_dims(values, ints)
        qd, kvd = steps.q_dims(), steps.kv_dims()
        return ((qd, kvd, kvd, value_dims, *map_dims, qd, LSE_DIMS, qd),
                (qd, kvd, kvd, value_dims))
    dq, dk, dv, d_values = steps.run(
        body, (q, k, v, values, fwd_lists, bwd_lists, qa, ka, dense, flag, out, lse2, do), dims)
    # (each gradient typed as its primal, as a custom_vjp's must be: under Explicit axes
    # an axis the split gathered leaves the step's results typed unsplit)
    dq, dk, dv = (typed_like(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
    d_values = tuple(None if g is None else typed_like(g, x) for g, x in zip(d_values, values))
    zeros = jax.tree_util.tree_map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), ints)
    return dq, dk, dv, None, d_values, zeros


_attention.defvjp(_fwd, _bwd)


def _summed_to(grad, x):
    """A value-words gradient [B, H, n, S | K] summed to the words' broadcast shape (zeros
    where the kernels returned none: no value there is a float)."""
    if x is None:
        return None
    if grad is None:
        return jnp.zeros_like(x)
    axes = tuple(a for a in (0, 1) if x.shape[a] == 1 and grad.shape[a] != 1)
    return grad.sum(axes, keepdims=True) if axes else grad


def _group_sum(x, h_kv):
    """Per-query-head dk / dv [b, s, h_q, d] (or sbhd) -> [.., h_kv, d] summed over each
    group."""
    b, s, h, d = x.shape
    if h == h_kv:
        return x
    return x.reshape(b, s, h_kv, h // h_kv, d).astype(jnp.float32).sum(3)


def _check(q, k, v, bm: BlockMap, t: int):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be {'bshd' if t else 'sbhd'} with k.shape == v.shape, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    (b, s_q), h_q, d = batch_tokens(q, t == 0), q.shape[2], q.shape[3]
    s_kv = k.shape[t]
    if batch_tokens(k, t == 0)[0] != b or k.shape[3] != d or h_q % k.shape[2]:
        raise ValueError(f"k/v {k.shape} do not fit q {q.shape} (h_q must be a multiple of h_kv)")
    if tuple(bm.block) != (BLOCK, BLOCK):
        raise ValueError(f"block_sparse_attention needs a map of {BLOCK}x{BLOCK} blocks, "
                         f"got {bm.block}")
    if (bm.s_q, bm.s_kv) != (s_q, s_kv):
        raise ValueError(f"the map is for {bm.s_q}x{bm.s_kv}, q/k give {s_q}x{s_kv}")
    mb, mh = bm.shape[:2]
    if mb not in (1, b) or mh not in (1, h_q):
        raise ValueError(f"the map's batch/head axes {bm.shape[:2]} do not fit b={b}, h_q={h_q}")
