"""Generated masks of positions, and their built-in forms by exhaustive search: the
differential tests of `block_sparse.recognise` draw from here."""
import functools

import numpy as np

from fusedattn.block_sparse import builtin
from fusedattn.config import MASKS


def dense(s_q, s_kv, mask, window):
    iv = builtin.intervals(s_q, s_kv, mask, window)
    j = np.arange(s_kv)[None, :]
    return (j >= iv.lo[0][:, None]) & (j <= iv.hi[0][:, None])


def all_forms(s_q, s_kv):
    sides = range(-1, s_kv + 1)
    for mask in MASKS:
        for left in sides:
            for right in ((0,) if mask != "none" else sides):
                yield mask, (left, right)
        yield mask, None


def brute(fn, s_q, s_kv):
    i, j = np.arange(s_q)[:, None], np.arange(s_kv)[None, :]
    return np.broadcast_to(np.asarray(fn(0, 0, i, j)), (s_q, s_kv))


def exhaustive(m):
    """Whether any built-in form equals `m` on every pair (every row seeing a key)."""
    return np.ascontiguousarray(m).tobytes() in _masks_of_forms(*m.shape)


@functools.lru_cache(maxsize=None)
def _masks_of_forms(s_q, s_kv):
    """The dense mask of every built-in form of s_q x s_kv whose rows all see a key."""
    masks = (dense(s_q, s_kv, *f) for f in all_forms(s_q, s_kv))
    return frozenset(m.tobytes() for m in masks if m.any(axis=1).all())


ATOMS = (  # (name, fn(i, j, c)), c drawn per atom
    ("j<=i+c", lambda i, j, c: j <= i + c),
    ("i-j<c", lambda i, j, c: i - j < c),
    ("j-i<=c", lambda i, j, c: j - i <= c),
    ("j<c", lambda i, j, c: j < c),
    ("j>=c", lambda i, j, c: j >= c),
    ("i>=c", lambda i, j, c: i >= c),
    ("|i-j|<=c", lambda i, j, c: abs(i - j) <= c),
)


def generated(seed):
    rng = np.random.default_rng(seed)
    s_q, s_kv = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    if rng.random() < 0.5:
        s_kv = s_q
    n = int(rng.integers(1, 4))
    atoms = [(ATOMS[k], int(rng.integers(-3, 12))) for k in rng.integers(0, len(ATOMS), n)]
    ops = [rng.choice(["&", "|"], p=[0.8, 0.2]) for _ in range(n - 1)]

    def fn(b, h, i, j):
        (_, f), c = atoms[0]
        out = f(i, j, c)
        for ((_, f), c), op in zip(atoms[1:], ops):
            out = (out & f(i, j, c)) if op == "&" else (out | f(i, j, c))
        return out
    text = " ".join([f"{atoms[0][0][0]}[c={atoms[0][1]}]"] + [
        f"{op} {a[0]}[c={c}]" for (a, c), op in zip(atoms[1:], ops)])
    return fn, s_q, s_kv, text


def check_forms(form_of, seeds):
    """Check `form_of(fn, s_q, s_kv, dense mask) -> form or None` over generated masks
    against the exhaustive search: sound (a form equals the mask on every pair) and
    complete (found whenever one exists); asserts some were built-in, so soundness is
    exercised."""
    found = 0
    for seed in seeds:
        fn, s_q, s_kv, text = generated(seed)
        m = brute(fn, s_q, s_kv)
        form = form_of(fn, s_q, s_kv, m)
        if form is None:
            assert not exhaustive(m), f"seed {seed}: {text} ({s_q}x{s_kv}) is built-in, not found"
        else:
            found += 1
            assert np.array_equal(dense(s_q, s_kv, *form), m), f"seed {seed}: {text} -> {form}"
    assert found > 0  # the generator reaches built-in masks
