"""A static mask that is exactly a built-in one: causal, a sliding window, a band; or
that is one in each of two runs of query rows.

A mask_mod of positions alone (``(j <= i) & (i - j < 512)``) may describe a mask the
vendor kernels already run with their own block skipping, through ``mask=`` and
``window=``. `builtin_form` finds that form, if there is one, by evaluating the mask
on the host at trace time (every pair, so the answer is exact, never a guess from a
few rows) and comparing each row's visible keys with the built-in intervals
(`builtin.intervals`, the semantics every backend follows).

`row_groups` goes one step further: rows ``[0, t)`` and ``[t, s_q)`` may each be a
built-in form against a range of keys of their own. Prefix-LM (``(j <= i) | (j <
P)``) is rows ``[0, P)`` seeing keys ``[0, P)`` unmasked and the rest bottom-right
causal against every key: two vendor calls whose rows are simply put together.

A mask is recognised only when every row sees one contiguous, non-empty run of keys,
so the rule for rows that see no key never comes into it.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import numpy as np

from . import builtin
from .classify import CHUNK_ELEMENTS, host_eval
from .terms import Dense, ElementMask

Form = Tuple[str, Optional[Tuple[int, int]]]   # (mask, window) as `fused_attn` takes them
# (query rows [r0, r1), keys [k0, k1), the form of that sub-grid, its own positions)
Group = Tuple[Tuple[int, int], Tuple[int, int], Form]
# Pairs evaluated at most (about a second of trace time); longer masks are not recognised.
MAX_ELEMENTS = 1 << 26
# Split rows tried at most (each where a row's first or last key changes its step).
MAX_SPLITS = 24


def builtin_form(element: ElementMask) -> Optional[Form]:
    """``(mask, window)`` whose built-in mask equals the static `element` (a mask_mod's
    term ANDed with the call's own built-in intervals) on every pair, or None. Masks
    past `MAX_ELEMENTS` pairs are not evaluated (None)."""
    return whole_form(row_groups(element), element.s_kv)


def form_text(form: Form) -> str:
    """A form as `fused_attn`'s arguments read: ``mask='causal', window=(511, 0)``."""
    mask, window = form
    return f"mask={mask!r}" + (f", window={window}" if window else "")


def dense_form(mask: np.ndarray, mask_kind: str = "none", window=None) -> Optional[Form]:
    """``(mask, window)`` whose built-in mask equals the host boolean `mask` ``[s_q,
    s_kv]`` ANDed with `mask_kind` / `window`, or None."""
    s_q, s_kv = mask.shape
    return builtin_form(ElementMask([Dense(mask[None, None]), builtin.intervals(
        s_q, s_kv, mask_kind, window)], s_q, s_kv))


def whole_form(groups: Optional[Tuple[Group, ...]], s_kv: int) -> Optional[Form]:
    """The form of `row_groups`' answer when it is one form of every row and key."""
    if groups is None or len(groups) != 1 or groups[0][1] != (0, s_kv):
        return None
    return groups[0][2]


def row_groups(element: ElementMask) -> Optional[Tuple[Group, ...]]:
    """The static `element` as one built-in form of all rows and keys, else as one or
    two runs of rows, each a built-in form of a range of keys: groups that together
    equal the mask on every pair, or None."""
    s_q, s_kv = element.s_q, element.s_kv
    rows = row_runs(element)
    if rows is None or (rows[0] > rows[1]).any():   # (a row that sees no key)
        return None
    lo, hi = rows
    form = _fit(lo, hi, s_kv)
    if form is not None:
        return (((0, s_q), (0, s_kv), form),)
    whole = _group(lo, hi, 0, s_q)   # every row against a narrower range of keys
    if whole is not None:
        return (whole,)
    for t in _splits(lo, hi):
        groups = (_group(lo, hi, 0, t), _group(lo, hi, t, s_q))
        if None not in groups:
            return groups
    return None


def _fit(lo, hi, s_kv) -> Optional[Form]:
    """The built-in form of rows seeing keys ``[lo, hi]`` of ``s_kv``, or None."""
    s_q = len(lo)
    # (the causal forms first: backends have fast paths for them)
    for form in sorted(_candidates(lo, hi, s_q, s_kv), key=lambda f: f[0] == "none"):
        iv = builtin.intervals(s_q, s_kv, *form)
        if np.array_equal(iv.lo[0], lo) and np.array_equal(iv.hi[0], hi):
            return form
    return None


def _group(lo, hi, r0: int, r1: int) -> Optional[Group]:
    """Rows [r0, r1) as a built-in form of the keys they see, or None."""
    k0, k1 = int(lo[r0:r1].min()), int(hi[r0:r1].max()) + 1
    form = _fit(lo[r0:r1] - k0, hi[r0:r1] - k0, k1 - k0)
    return None if form is None else ((r0, r1), (k0, k1), form)


def _splits(lo, hi) -> Tuple[int, ...]:
    """Rows to split at: around each row where the first or last key changes its step
    from the row before; none when there are more than `MAX_SPLITS`."""
    steps = np.stack([np.diff(lo), np.diff(hi)])
    changes = 1 + np.flatnonzero((steps[:, 1:] != steps[:, :-1]).any(axis=0))
    # (a kink row r ends the first run, t = r + 1, or starts the second, t = r; a first
    # or last run of one row has no kink to show)
    rows = [r + d for r in changes.tolist() for d in (1, 0, 2)] + [1, len(lo) - 1]
    rows = [t for t in dict.fromkeys(rows) if 0 < t < len(lo)]
    return tuple(rows) if len(rows) <= MAX_SPLITS else ()


def row_runs(element: ElementMask) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Each row's first and last visible key of the static `element`, when every row
    sees one run of keys or none (``lo = s_kv, hi = -1``); None otherwise, or past
    `MAX_ELEMENTS` pairs."""
    if not element.static or element.s_q * element.s_kv > MAX_ELEMENTS:
        return None
    return _row_intervals(element.for_host())


def _row_intervals(element: ElementMask):
    """Each row's first and last visible key (none: ``s_kv, -1``), or None when a row
    sees a run with a gap."""
    s_q, s_kv = element.s_q, element.s_kv
    kv = np.arange(s_kv, dtype=np.int32).reshape(1, 1, 1, -1)
    zero = np.zeros((1, 1, 1, 1), np.int32)
    step = max(1, CHUNK_ELEMENTS // s_kv)
    lo, hi = np.empty(s_q, np.int64), np.empty(s_q, np.int64)
    for start in range(0, s_q, step):
        q = np.arange(start, min(start + step, s_q), dtype=np.int32)
        with host_eval():
            vis = np.asarray(element(zero, zero, q.reshape(1, 1, -1, 1), kv))
        vis = np.broadcast_to(vis, (1, 1, len(q), s_kv))[0, 0]
        count = vis.sum(axis=1)
        first = vis.argmax(axis=1)
        last = s_kv - 1 - vis[:, ::-1].argmax(axis=1)
        empty = count == 0
        if (~empty & (count != last - first + 1)).any():
            return None
        lo[q], hi[q] = np.where(empty, s_kv, first), np.where(empty, -1, last)
    return lo, hi


def _candidates(lo, hi, s_q, s_kv) -> Iterator[Form]:
    """The built-in forms the rows could be: each side's width read off the first row
    where that side is bounded, for top-left and bottom-right alignment."""
    i = np.arange(s_q)
    for offset in dict.fromkeys((0, s_kv - s_q)):
        bounded_hi, bounded_lo = hi < s_kv - 1, lo > 0
        right = int((hi - i - offset)[bounded_hi][0]) if bounded_hi.any() else -1
        left = int((i + offset - lo)[bounded_lo][0]) if bounded_lo.any() else -1
        if (bounded_hi.any() and right < 0) or (bounded_lo.any() and left < 0):
            continue
        if right == 0:
            yield ("causal" if offset == 0 else "causal_bottom_right",
                   None if left == -1 else (left, 0))
        elif offset == 0:
            yield "none", None if (left, right) == (-1, -1) else (left, right)
