"""`fusedattn.dot_product_attention`: `jax.nn.dot_product_attention`'s signature and
semantics, dispatched through fusedattn's plan.

Switching a model over is changing one import. The arguments map onto
`fused_attn` as follows:

* ``bias`` (broadcastable to ``[B, N, T, S]``) is broadcast over T and S
  (fusedattn's bias broadcasts over batch and heads only); its gradient flows.
* ``mask`` (bool, True = attend) goes in as a mask: where a backend runs masks as
  block maps (block_sparse, on Hopper) only its visible blocks are computed; elsewhere
  it becomes jax.nn's additive term ``-0.7 * finfo(q.dtype).max`` where False, added
  to the bias (`explain` says which, and why).
* ``is_causal`` is the top-left causal mask; ``local_window_size`` an int
  (symmetric) or ``(left, right)`` window around the diagonal (right is 0 under
  a causal mask, where it has no effect).
* ``query_seq_lengths`` / ``key_value_seq_lengths`` are padding lengths; padded
  query rows give 0, as in jax.nn.
* ``implementation``: None picks the best backend (jax.nn's None means XLA);
  ``"xla"`` / ``"cudnn"`` or any fusedattn backend name forces one.

A query row that sees no key at all (its mask, causal / window / key padding
combined hide every key) averages all values, as jax.nn does, in every dtype; its
``return_residual`` log-sum-exp, and a padded query row's, is jax.nn's (-0.7 x
float32's largest value, in the inputs' dtype: -inf in float16) on every backend.
Inputs of rank below 4 get leading axes (jax.nn's rule); an empty batch gives an
empty result. Dtypes no fusedattn backend computes in (float64) run jax.nn's own
XLA path (captured when fusedattn is imported, so a monkeypatched jax.nn does not
recurse into this function), unless a fusedattn backend is named;
`fallback_reason` says whether a call falls back and why, and each reason is
logged once on the ``fusedattn`` logger; `explain` gives the plan a call follows.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .block_sparse.recognise import MAX_ELEMENTS as MAX_PAIRS, dense_form, form_text
from .config import DTYPES
from .inputs import value_mean
from .sequence import SequenceDescriptor
from .tracing.folding import host_value
from .tracing.mask_program import as_mask_mod
from .tracing.walk import is_input
from .validation import build_call

logger = logging.getLogger("fusedattn")
# jax.nn's function as it was at import: tests and users monkeypatch the name to this
# module's drop-in, and the fallback must not then call itself.
_JAX_NN_ATTENTION = jax.nn.dot_product_attention
_LOGGED = set()


def log_fallback(api: str, reason: str) -> None:
    """Log, once per (api, reason), that a drop-in ran the original's code instead."""
    if (api, reason) not in _LOGGED:
        _LOGGED.add((api, reason))
        logger.warning("%s: no fused kernel serves this call (%s); running the original's "
                       "own implementation", api, reason)


def fallback_reason(query, key, value, bias=None, mask=None, *,
                    implementation: Optional[str] = None, **_) -> Optional[str]:
    """Why `dot_product_attention` with these arguments runs jax.nn's own XLA path,
    or None when fusedattn's plan runs it."""
    dtypes = {jnp.result_type(x) for x in (query, key, value)}
    if implementation in (None, "xla") and any(jnp.dtype(d).name not in DTYPES for d in dtypes):
        return (f"dtype {', '.join(sorted(jnp.dtype(d).name for d in dtypes))}: fusedattn "
                f"computes in {DTYPES}")
    return None


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: Optional[float] = None,
                          is_causal: bool = False,
                          query_seq_lengths=None,
                          key_value_seq_lengths=None,
                          local_window_size: Union[int, Tuple[int, int], None] = None,
                          implementation: Optional[str] = None,
                          return_residual: bool = False):
    """Scaled dot-product attention with `jax.nn.dot_product_attention`'s signature.

    query ``[B, T, N, H]`` (or ``[T, N, H]``), key / value ``[B, S, K, H]``
    (``N % K == 0``). Returns the output shaped like query, and with
    ``return_residual=True`` also the log-sum-exp ``[B, T, N]`` (no gradient).
    """
    reason = fallback_reason(query, key, value, implementation=implementation)
    if reason is not None:
        log_fallback("dot_product_attention", reason)
        return _JAX_NN_ATTENTION(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation="xla",
            return_residual=return_residual)
    out_shape = np.shape(query)
    q, k, v, options = _arguments(query, key, value, bias, mask, scale, is_causal,
                                  query_seq_lengths, key_value_seq_lengths, local_window_size,
                                  implementation)
    if q.size == 0 or k.size == 0:
        # jax.nn's answer for an empty batch (or sequence): an empty (or zero) result.
        out = jnp.zeros(out_shape, q.dtype)
        return (out, jnp.zeros(out_shape[:-1], q.dtype)) if return_residual else out
    out = masked_attention(q, k, v, need_lse=return_residual, **options)
    if not return_residual:
        return out.reshape(out_shape)
    out, lse = out
    return out.reshape(out_shape), lse.reshape(out_shape[:-1])


def explain(query, key, value, bias=None, mask=None, *, scale: Optional[float] = None,
            is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
            local_window_size: Union[int, Tuple[int, int], None] = None,
            implementation: Optional[str] = None, **_) -> Union[dispatch.Plan, str]:
    """What `dot_product_attention` with these arguments runs, without running it: the
    `Plan` (``print`` it: every backend and its reason, and whether ``mask`` runs as a
    block map or as a bias, and why), or a line saying why jax.nn's own code runs.
    Arrays may be `jax.ShapeDtypeStruct`s."""
    reason = fallback_reason(query, key, value, implementation=implementation)
    if reason is not None:
        return f"dot_product_attention runs jax.nn's own implementation: {reason}"
    if 0 in np.shape(query) or 0 in np.shape(key):
        return "dot_product_attention of an empty batch or sequence: zeros, no kernel runs"

    def plan(query, key, value, bias, mask, q_len, kv_len):
        q, k, v, options = _arguments(query, key, value, bias, mask, scale, is_causal, q_len,
                                      kv_len, local_window_size, implementation)
        return masked_plan(q, k, v, **options)
    return traced_plan(plan, query, key, value, bias, mask, query_seq_lengths,
                       key_value_seq_lengths)


def traced_plan(fn, *arrays) -> dispatch.Plan:
    """The `Plan` ``fn(*arrays)`` returns, traced on abstract values: nothing runs, and
    arrays may be ShapeDtypeStructs."""
    if any(isinstance(x, jax.core.Tracer) for x in arrays) and \
            not any(isinstance(x, jax.ShapeDtypeStruct) for x in arrays):
        # Inside the caller's trace: a mask built there is read as the call reads it
        # (what `fn` stages into the trace is unused, and dropped when it compiles).
        return fn(*arrays)
    found = []
    # NumPy arrays stay NumPy (as in a call): a known mask is recognised as it is there.
    host = [x if isinstance(x, np.ndarray) else None for x in arrays]
    jax.eval_shape(
        lambda *traced: found.append(fn(*(x if h is None else h for x, h in zip(traced, host)))),
        *(None if h is not None else x for x, h in zip(arrays, host)))
    return found[0]


def _arguments(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
               key_value_seq_lengths, local_window_size, implementation):
    """jax.nn's arguments -> (q, k, v as 4-d, `masked_attention`'s options)."""
    q, k, v = (_as_4d(x, name, "[B, T|S, N|K, H]") for x, name in
               ((query, "query"), (key, "key"), (value, "value")))
    if v.shape != k.shape:
        raise ValueError(f"value shape {v.shape} must equal key shape {k.shape}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    backend = _backend(implementation)
    b, t, _, _ = q.shape
    s = k.shape[1]
    q_len = kv_len = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = _lengths(query_seq_lengths, "query_seq_lengths", b, t)
        kv_len = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s)
    window = _window(local_window_size, is_causal)
    return q, k, v, dict(bias=bias, mask=mask, is_causal=is_causal, window=window,
                         q_lengths=q_len, kv_lengths=kv_len,
                         scale=None if scale is None else float(scale), backend=backend)


def masked_attention(q, k, v, *, bias=None, mask=None, is_causal=False, window=None,
                     q_lengths=None, kv_lengths=None, scale=None, dropout=0.0, rng=None,
                     backend="auto", need_lse=False):
    """The core both drop-ins share: q ``[B, T, N, H]``, k / v ``[B, S, K, H]`` in a
    fusedattn dtype, bias and a boolean mask broadcastable to ``[B, N, T, S]``, with
    jax.nn's semantics (rows that see no key average all values; with `need_lse`, their
    log-sum-exp is jax.nn's, `_lse_seeing_nothing`)."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    mask, is_causal, window, note = _known_mask(mask, is_causal, window, (b, n, t, s), backend)
    plan, inputs, mask4, rows_see_keys = _planned(
        q, k, v, bias=bias, mask=mask, is_causal=is_causal, window=window, q_lengths=q_lengths,
        kv_lengths=kv_lengths, scale=scale, dropout=dropout, rng=rng, backend=backend, note=note)
    # block_sparse's lse is -inf exactly on the rows that see no key, at no extra cost:
    # those rows come from it instead of an S^2 pass over the mask. Where the plan asked
    # for jax.nn's rule (`_planned`), its kernel has written the mean there already.
    lse_marks_unseen = (not rows_see_keys and not plan.groups
                        and dispatch.runs_block_maps(plan.require()))
    filled = plan.config.unseen_rows == "mean"
    lse = None
    if need_lse or lse_marks_unseen:
        out, lse = plan.run_with_lse(inputs)
        lse = jax.lax.stop_gradient(lse)  # [B, N, T] fp32
    else:
        out = plan.run(inputs)
    padded = None if q_lengths is None else (jnp.arange(t) >= q_lengths[:, None])[:, None]
    if lse_marks_unseen:
        unseen = jnp.isneginf(lse)
        empty = unseen if padded is None else unseen & ~padded
    else:
        empty = _rows_seeing_nothing(mask4, is_causal, window, q_lengths, kv_lengths, b, t, s)
        unseen = empty if padded is None else padded if empty is None else empty | padded
    if empty is not None and not filled:
        # Kernels give such a row 0 (a mask, or no key in range) or shift it by the bias
        # constant (a no-op for softmax); jax.nn gives every key the same weight.
        mean = value_mean(v, n)
        out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean[:, None].astype(out.dtype),
                        out)
    if not need_lse:
        return out
    if unseen is not None:
        # (padded query rows included: jax.nn's padding mask hides every key from them)
        lse = jnp.where(unseen, _lse_seeing_nothing(s), lse)
    return out, jnp.swapaxes(lse, 1, 2).astype(k.dtype)  # [B, T, N]


def _lse_seeing_nothing(s: int):
    """jax.nn's log-sum-exp of a row that sees no key, in float32 (the caller casts it to
    the inputs' dtype, as jax.nn does: -inf in float16). jax.nn sets every hidden logit
    to -0.7 x float32's largest value (logits are float32 for every fusedattn dtype),
    whatever the bias, and takes the log-sum-exp of S such logits. Kernels give -inf
    (block_sparse) or a value shifted by the bias (the mask as a bias) there."""
    hidden = jnp.asarray(-0.7 * jnp.finfo(jnp.float32).max, jnp.float32)
    return hidden + jnp.log(jnp.float32(s))


def masked_plan(q, k, v, **options):
    """The `Plan` `masked_attention(q, k, v, **options)` follows (arrays may be
    ShapeDtypeStructs); ``print`` it for the backends, their reasons and the mask's route."""
    mask, is_causal, window, note = _known_mask(
        options.pop("mask", None), options.pop("is_causal", False), options.pop("window", None),
        (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), options.get("backend", "auto"))
    return _planned(q, k, v, mask=mask, is_causal=is_causal, window=window, note=note,
                    **options)[0]


def _known_mask(mask, is_causal, window, full, backend):
    """(mask, is_causal, window, the line explain() prints or ""): under `auto`, a
    boolean mask whose value is known at trace time (NumPy, or built from constants
    inside the caller's jit: Flax's ``make_causal_mask``, `folding.host_value`) that
    equals a built-in top-left causal mask or window on every pair, given as that:
    the vendor kernels skip its blocks themselves, and nothing is read on the device.
    `full` is ``(B, N, T, S)``; a mask of another shape is left for `_planned` to refuse."""
    _, _, t, s = full
    shape = np.shape(mask) if mask is not None else ()
    if (backend != "auto" or getattr(mask, "dtype", None) != np.bool_ or not 2 <= len(shape) <= 4
            or t * s > MAX_PAIRS or any(n not in (1, m) for n, m in zip(shape[::-1], full[::-1]))):
        return mask, is_causal, window, ""
    got = host_value(mask, reduce=_first_and_same)
    if got is None or not got[1]:
        return mask, is_causal, window, ""
    form = dense_form(np.broadcast_to(got[0], (t, s)), "causal" if is_causal else "none",
                      window)
    if form is None or form[0] not in ("causal", "none"):
        return mask, is_causal, window, ""
    return None, form[0] == "causal", form[1], (
        f"the mask equals {form_text(form)} on every pair (its value is known at trace time): runs "
        f"as that built-in mask")


def _first_and_same(mask):
    """(the mask of the first batch entry and head, whether every other one equals it),
    reduced without forming another copy of the mask."""
    rows = mask.reshape((-1,) + mask.shape[-2:])   # (NumPy or jnp alike)
    return rows[0], (rows == rows[:1]).all()


_PROGRAM_NOTE = ("the mask is computed elementwise from arrays read per query row or per key "
                 "column and from positions (`tracing.mask_program`): runs as a mask_mod over "
                 "those arrays, no S^2 mask read")
_INPUT_NOTE = ("the mask is an input of the function being traced (an argument of its jit, "
               "or of a jax.checkpoint, lax.scan or Flax nn.remat inside it), so "
               "its structure is not visible in this trace; built inside that function, "
               "closed over, or given as mask_mod=, it can run as a built-in mask or a "
               "mask_mod")


def _planned(q, k, v, *, bias=None, mask=None, is_causal=False, window=None, q_lengths=None,
             kv_lengths=None, scale=None, dropout=0.0, rng=None, backend="auto", note="", **_):
    """(plan, inputs, the mask as 4-d or None, whether every row is known to see a key)
    of a drop-in call. The boolean mask goes in as a mask: dispatch runs it as a block
    map where a backend takes one, else as jax.nn's additive bias (`inputs.mask_as_bias`);
    under `auto`, one built in the caller's trace from per-row and per-column arrays runs
    as a mask_mod over them (`tracing.mask_program`) where that reaches block_sparse, row
    groups or a built-in mask. Where the chosen backend writes jax.nn's rows that see no
    key itself (``averages_unseen_rows``), the plan asks it to (`AttnConfig.unseen_rows`);
    else `masked_attention` overwrites them."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    mask4 = None if mask is None else _as_4d(mask, "mask")
    if mask4 is not None and mask4.dtype != jnp.bool_:
        raise TypeError(f"mask must be a boolean array (True = attend), got {mask4.dtype}; an "
                        f"additive mask goes in bias")
    sequence = None if q_lengths is None else SequenceDescriptor.from_lengths(q_lengths,
                                                                             kv_lengths)
    common = dict(bias=_broadcast(bias, "bias", b, n, t, s), sequence=sequence,
                  mask="causal" if is_causal else "none", window=window, scale=scale,
                  dropout=dropout, rng=rng)
    dense, plan, rows_see_keys = _broadcast(mask4, "mask", b, n, t, s), None, False
    found = as_mask_mod(dense) if backend == "auto" else None
    if found is not None:
        config, inputs = build_call(q, k, v, mask_mod=found.program,
                                    score_mod_args=found.args, **common)
        # (trials are planned quietly: only the plan that runs is logged, below)
        plan = dispatch.plan(config, backend, quiet=True)
        if (plan.groups or dispatch.runs_block_maps(plan.preferred)
                or (plan.preferred and plan.rewritten)) and _program_beats_mask(
                    plan, q, k, v, dense, common, backend):
            note = "; ".join(filter(None, (note, f"{_PROGRAM_NOTE}: "
                                           f"{found.program.expression()}", plan.rewritten)))
            # (block_sparse marks the rows that see no key by its lse; every row of a
            # rewritten or grouped plan sees one)
            mask4 = None
            # (a mask true on the diagonal leaves each row its own key; windows and
            # top-left causal keep it)
            rows_see_keys = found.diagonal and t <= s and kv_lengths is None
        else:
            plan = None    # (elsewhere the mask runs as it is)
    if plan is None:
        config, inputs = build_call(q, k, v, dense_mask=dense, **common)
        plan = dispatch.plan(config, backend, quiet=True)
        if backend == "auto" and mask4 is not None and is_input(mask4):
            note = "; ".join(filter(None, (note, _INPUT_NOTE)))
    chosen = plan.preferred and dispatch.load_backend(plan.preferred)
    if getattr(chosen, "averages_unseen_rows", False) and not rows_see_keys:
        mean = dataclasses.replace(config, unseen_rows="mean")
        if chosen.supports(dispatch.config_for(mean, plan.preferred)) is None:
            config = mean
    plan = dispatch.plan(config, backend)
    if note:
        plan = dataclasses.replace(plan, rewritten=note)
    return plan, inputs, mask4, rows_see_keys


# The block map walked in XLA: slower than any vendor kernel running the mask as it is.
_WALKS = "block_sparse_xla"


def _program_beats_mask(plan, q, k, v, dense, common, backend) -> bool:
    """Whether a mask program's `plan` is to run rather than the mask as it is: always,
    except where the program would be walked in XLA while a kernel runs the mask (a
    bias on cuDNN, every tile, is faster than the walks: docs/decisions.md)."""
    if plan.groups or plan.preferred != _WALKS:
        return True
    as_is = dispatch.plan(build_call(q, k, v, dense_mask=dense, **common)[0], backend,
                          quiet=True)
    return as_is.preferred in (_WALKS, "xla")


def _rows_seeing_nothing(mask4, is_causal, window, q_lengths, kv_lengths, b, t, s):
    """[B|1, N|1, T]: True where a (real) query row sees no key, or None if none can."""
    if mask4 is None and kv_lengths is None and (window is None or t <= s):
        return None  # every row sees at least its diagonal (or, causal, key 0)
    i = jnp.arange(t)[None, :]
    # (a side of -1 is unbounded, as in fused_attn's windows)
    lo = jnp.zeros((1, t), jnp.int32) if window is None or window[0] < 0 else i - window[0]
    hi = jnp.full((1, t), s - 1)
    if is_causal:
        hi = jnp.minimum(hi, i)
    if window is not None and window[1] >= 0:
        hi = jnp.minimum(hi, i + window[1])
    if kv_lengths is not None:
        hi = jnp.minimum(hi, kv_lengths[:, None] - 1)
    lo, hi = lo[:, None], hi[:, None]  # [B|1, 1, T]
    if mask4 is None:
        empty = jnp.maximum(lo, 0) > hi
    else:
        j = jnp.arange(s)
        seen = mask4 & (j >= lo[..., None]) & (j <= hi[..., None])
        empty = ~jnp.any(seen, axis=-1)
    if q_lengths is not None:
        empty = empty & (i < q_lengths[:, None])[:, None]
    return empty


def _backend(implementation: Optional[str]) -> str:
    if implementation is None:
        return "auto"
    if implementation in dispatch.ALL_BACKENDS:
        return implementation
    raise ValueError(f"implementation must be None or one of {dispatch.ALL_BACKENDS}, got "
                     f"{implementation!r}")


def _as_4d(x, name: str, what: str = "broadcastable to [B, N, T, S]"):
    """jax.nn's rule: fewer than 4 dimensions get leading axes of size 1."""
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dimensions ({what}), got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _broadcast(x, name, b, n, t, s):
    """A bias or mask broadcastable to [B, N, T, S] -> [1|B, 1|N, T, S] (the batch and
    head axes stay broadcast, as fusedattn takes them)."""
    if x is None:
        return None
    x = _as_4d(x, name)
    full = (b, n, t, s)
    try:
        np.broadcast_shapes(x.shape, full)
    except ValueError:
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to "
                         f"[B, N, T, S] = {full}") from None
    return jnp.broadcast_to(x, tuple(1 if i < 2 and x.shape[i] == 1 else full[i]
                                     for i in range(4)))


def _lengths(x, name: str, b: int, full: int):
    if x is None:
        return jnp.full((b,), full, jnp.int32)
    x = jnp.asarray(x)
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int32 array of shape ({b},), got {x.dtype} {x.shape}")
    return x.astype(jnp.int32)


def _window(size, is_causal: bool):
    if size is None:
        return None
    left, right = (size, size) if isinstance(size, int) else tuple(size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {size!r}")
    return (left, 0) if is_causal else (left, right)
