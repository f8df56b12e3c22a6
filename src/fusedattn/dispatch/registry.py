"""Every backend by name: the one place that imports them all (dispatch asks each about a
config, in the preference order of `plan.PREFERENCE`)."""
from __future__ import annotations

from typing import Dict, Tuple

from ..backends import block_sparse, block_sparse_xla, ck, cudnn, flash, small_seq, xla
from ..backends.protocol import Backend

BACKENDS: Dict[str, Backend] = {b.name: b for b in (
    small_seq.BACKEND, block_sparse.BACKEND, cudnn.BACKEND, flash.BACKEND, ck.BACKEND,
    block_sparse_xla.BACKEND, xla.BACKEND)}
ALL_BACKENDS: Tuple[str, ...] = tuple(BACKENDS)


def load_backend(name: str) -> Backend:
    """The backend object called `name` (KeyError for an unknown name)."""
    return BACKENDS[name]
