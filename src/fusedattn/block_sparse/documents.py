"""Documents masks: query ``i`` sees key ``j`` when their ids are equal (and both are
valid). Their block maps count ids per block instead of evaluating pairs
(`classify`), so this module finds the ids of a term that is one: segment ids, or a
mask_mod whose in-kernel form (`hoisting`) is ``row == column`` ANDed with per-row
and per-column booleans, as ``doc[b, q] == doc[b, kv]`` (flex_attention's documents
mask_mod) and its padding tests ``& (doc[b, q] != 0)`` are; a padding mask
(``valid[b, q] & valid[b, kv]``) is one document. Factors of the positions alone may
be ANDed in (``& (kv <= q)``, causal documents): they are kept as a static mask_mod,
whose blocks `classify` evaluates at trace time.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .dependence import Reads, specs_of
from .hoisting import Hoisted, Unsupported, hoist
from .terms import ElementMask, MaskMod, Segments
from ..jaxprs import SHAPE_ONLY


class Documents(NamedTuple):
    q_ids: object            # [B|1, s_q] integers
    kv_ids: object           # [B|1, s_kv] integers
    q_valid: Optional[object]   # [B|1, s_q] bool, or None: every row is valid
    kv_valid: Optional[object]  # [B|1, s_kv] bool, or None
    positions: Optional[MaskMod] = None   # a static mask_mod ANDed in, or None

    @property
    def batch(self) -> int:
        """The batch the ids and flags broadcast to (each may be 1)."""
        return max(np.shape(x)[0] for x in self[:4] if x is not None)


def documents(term, element: ElementMask) -> Optional[Documents]:
    """The ids of `term` if it is a documents mask, else None."""
    if isinstance(term, Segments):
        pad = term.pad_id
        valid = (lambda ids: None) if pad is None else (lambda ids: ids != pad)
        return Documents(term.q_ids, term.kv_ids, valid(term.q_ids), valid(term.kv_ids))
    if isinstance(term, MaskMod) and term.reads.args and term.q_pos is None:
        try:
            split = hoist(term.fn, specs_of(term.args), term.batch, term.heads, element.s_q,
                          element.s_kv)
        except Unsupported:
            return None    # (the kernel mask says why, when it is built)
        form = equality(split)
        if form is None:
            return None
        pair, row_flags, col_flags, at = form
        rows, cols = split.values(term.args)   # int32 [B|1, s]: bools as 0 / 1
        positions = MaskMod(split.positions_fn(at), reads=Reads(False, False, False),
                            batch=1, heads=1) if at else None
        # (no ``row == column`` factor: one document, the flags saying who is in it)
        q_ids, kv_ids = (rows[pair[0]], cols[pair[1]]) if pair else (
            np.zeros((1, element.s_q), np.int32), np.zeros((1, element.s_kv), np.int32))
        return Documents(q_ids, kv_ids, _all(rows, row_flags), _all(cols, col_flags),
                         positions)
    return None


def equality(split: Hoisted):
    """``((row value, column value), row flags, column flags, factors of positions)``,
    as indices into the in-kernel form's row / column values (the factors as its
    variables), when that form is ``row == column`` ANDed with boolean row and column
    values and booleans of the positions alone; else None. Without the equality (a
    padding mask: ``valid[b, q] & valid[b, kv]``) the pair is None."""
    eqns, rows, cols, out = split.in_kernel
    by_id = {id(o): e for e in eqns for o in e.outs}   # (literals are unhashable)
    producer = lambda v: by_id.get(id(v))   # noqa: E731

    def source(v):   # through reshapes and broadcasts, which change no value
        while producer(v) is not None and producer(v).prim.name in SHAPE_ONLY:
            v = producer(v).ins[0]
        return v

    factors, todo = [], [out]
    while todo:
        v = source(todo.pop())
        e = producer(v)
        if e is not None and e.prim.name == "and" and _is_bool(v):
            todo.extend(e.ins)
        else:
            factors.append(v)
    pairs, row_flags, col_flags, at = [], [], [], []
    for v in factors:
        e = producer(v)
        if _member(v, rows) and _is_bool(v):
            row_flags.append(_index(v, rows))
        elif _member(v, cols) and _is_bool(v):
            col_flags.append(_index(v, cols))
        elif _is_bool(v) and split.reads_positions_only(v):
            at.append(v)
        elif e is not None and e.prim.name == "eq":
            a, b = (source(x) for x in e.ins)
            if _member(b, rows) and _member(a, cols):
                a, b = b, a
            if not (_member(a, rows) and _member(b, cols)) or a.aval.dtype != b.aval.dtype \
                    or not _is_exact(a.aval.dtype):
                return None
            pairs.append((_index(a, rows), _index(b, cols)))
        else:
            return None   # any other factor (the head, arithmetic of ids): not ids
    if len(pairs) > 1:
        return None
    return (pairs[0] if pairs else None), tuple(row_flags), tuple(col_flags), tuple(at)


def _member(v, values) -> bool:
    return any(v is x for x in values)   # (variables compare by identity)


def _index(v, values) -> int:
    return next(i for i, x in enumerate(values) if v is x)


def _is_bool(v) -> bool:
    return np.dtype(v.aval.dtype) == np.bool_


def _is_exact(dtype) -> bool:
    """Values whose int32 form (`Hoisted.values`) keeps equality: integers up to 32 bits
    and bools (hoisting takes no wider ones)."""
    dtype = np.dtype(dtype)
    return dtype == np.bool_ or (np.issubdtype(dtype, np.integer) and dtype.itemsize <= 4)


def _all(values, flags):
    """The AND of the flagged values (0 / 1 ints) as bools, or None for no flag."""
    valid = None
    for f in flags:
        x = values[f] != 0
        valid = x if valid is None else valid & x
    return valid
