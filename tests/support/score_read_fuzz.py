"""A generator of score_mods that read arrays (tests/test_block_sparse_score_fuzz.py).

`program(seed)` draws a score_mod reading the score, b, h, q_idx, kv_idx and 1-3 of
`ARRAYS` (float tables per row / column / (batch, head), through ids or not; int arrays
read per side and combined across sides; 8-bit integers that wrap; uint32 ids past
float32's mantissa; bools; 16-bit float tables; a scalar; closed-over tables and
constants; reductions and cumulative sums on the device; tables read by a function of
q_idx - kv_idx, such as a T5 bucket), mixed with elementwise operations. Everything it
reads is by one side, by (b, h) only or by the diagonal, so every program must split
into hoisted values and a tile function. Shapes are tiny: `B x H x S_Q x S_KV`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn import score_mods

B, H, S_Q, S_KV = 2, 3, 7, 5
L, ND = 8, 4        # table length along positions (>= S_Q, S_KV); number of "documents"
F32 = jnp.float32

_rng = np.random.default_rng(0)
ARRAYS = {
    # integers: document ids, positions (negative too), 8-bit values, flags
    "doc": jnp.asarray(_rng.integers(0, ND, (B, L)), jnp.int32),
    "pos": jnp.asarray(_rng.integers(-20, 40, (B, L)), jnp.int32),
    "small": jnp.asarray(_rng.integers(-4, 4, (B, L)), jnp.int8),
    "flag": jnp.asarray(_rng.random((B, L)) < 0.5),
    "nb": jnp.asarray([3, 6], jnp.int32),  # per batch (a window, a prefix length)
    # ids past float32's 24-bit mantissa and across int32's sign bit (exact as words)
    "big": jnp.asarray(_rng.integers(2 ** 31 - 2, 2 ** 31 + 2, (B, L)), jnp.uint32),
    # floats: per (b, position), per (h, position), per document, per (h, document),
    # per (b, h, position), per head, per batch, a scalar, 16-bit float tables
    "tb": jnp.asarray(_rng.normal(size=(B, L)), F32),
    "th": jnp.asarray(_rng.normal(size=(H, L)), F32),
    "td": jnp.asarray(_rng.uniform(0.5, 1.5, (ND,)), F32),
    "thd": jnp.asarray(_rng.uniform(-1.0, 1.0, (H, ND)), F32),
    "gate": jnp.asarray(_rng.normal(size=(B, H, L)), F32),
    "vh": jnp.asarray(_rng.normal(size=(H,)), F32),
    "vb": jnp.asarray(_rng.normal(size=(B,)), F32),
    "temp": jnp.asarray(0.7, F32),
    "bf16": jnp.asarray(_rng.normal(size=(B, L)), jnp.bfloat16),
    "f16": jnp.asarray(_rng.normal(size=(B, L)), jnp.float16),
}
NAMES = tuple(ARRAYS)
BH_ONLY = "reads by (b, h) only"  # in `avail`: the program reads no array by position
CONST_F = np.linspace(-1.0, 1.0, L, dtype=np.float32)   # closed over: read like an arg
CONST_I = (np.arange(L, dtype=np.int32) * 5) % 7
# closed-over size-1 constants (jaxpr constants the tiles read, unlike inline literals)
CONST_S, CONST_1111 = jnp.asarray(0.75, F32), jnp.full((1, 1, 1, 1), -1.25, F32)
CONST_I8 = jnp.asarray(37, jnp.int8)
SCORE = jnp.asarray(_rng.normal(size=(B, H, S_Q, S_KV)) * 2.0, F32)
IDX = (jnp.arange(B)[:, None, None, None], jnp.arange(H)[None, :, None, None],
       jnp.arange(S_Q)[None, None, :, None], jnp.arange(S_KV)[None, None, None, :])


def arg_specs(args):
    return [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]


def pick(rng, options):
    return options[int(rng.integers(len(options)))]


# ---- the generator -------------------------------------------------------------------
# Expressions are closures over an environment e: the score "s", "b", "h", "q", "kv"
# and the program's arrays by name; `avail` is the set of arrays the program takes.

def _index(rng, side, avail, nested=True):
    """An index into [0, L) from one position (q or kv), maybe through an int array
    (with BH_ONLY, from b or h instead)."""
    pos = lambda e: e[side]  # noqa: E731
    if BH_ONLY in avail:
        pos = pick(rng, (lambda e: e["h"], lambda e: e["b"] * 3 + 1, lambda e: jnp.int32(2)))
    options = [lambda e: pos(e), lambda e: pos(e) // 2, lambda e: L - 1 - pos(e)]
    c = int(rng.integers(1, L))
    options += [lambda e: (pos(e) + c) % L, lambda e: jnp.minimum(pos(e), c)]
    if nested:
        inner = _index(rng, side, avail, nested=False)
        if "pos" in avail:
            options.append(lambda e: e["pos"][e["b"], inner(e)] % L)
        if "doc" in avail:
            options.append(lambda e: e["doc"][e["b"], inner(e)] * 2 + 1)
        options.append(lambda e: jnp.asarray(CONST_I)[inner(e)])
    return pick(rng, options)


def _ident(rng, side, avail):
    """A document-like id in [0, ND) of one position (maybe with the head mixed in)."""
    idx = _index(rng, side, avail)
    options = [lambda e: idx(e) % ND, lambda e: (idx(e) + e["h"]) % ND]
    if "doc" in avail:
        options += [lambda e: e["doc"][e["b"], idx(e)]] * 2
    if "pos" in avail:
        options.append(lambda e: e["pos"][e["b"], idx(e)] % ND)
    return pick(rng, options)


def _side_float(rng, side, avail):
    """A float read by one side: per row (side "q") or per column ("kv")."""
    idx, ident = _index(rng, side, avail), _ident(rng, side, avail)
    options = [lambda e: jnp.asarray(CONST_F)[idx(e)]]
    if "tb" in avail:
        options += [lambda e: e["tb"][e["b"], idx(e)],
                    lambda e: jnp.cumsum(e["tb"], axis=1)[e["b"], idx(e)] * 0.5]
    if "th" in avail:
        options.append(lambda e: e["th"][e["h"], idx(e)])
    if "td" in avail:
        options.append(lambda e: e["td"][ident(e)])
    if "thd" in avail:
        options.append(lambda e: e["thd"][e["h"], ident(e)])
    if "gate" in avail:
        options.append(lambda e: e["gate"][e["b"], e["h"], idx(e)])
    for name, dt in (("bf16", jnp.bfloat16), ("f16", jnp.float16)):
        if name in avail:  # 16-bit values, maybe combined in 16 bits on the tiles
            options += [lambda e, name=name: e[name][e["b"], idx(e)],
                        lambda e, name=name, dt=dt: e[name][e["b"], idx(e)] * dt(1.5),
                        lambda e, name=name: e[name][e["b"], idx(e)] * jnp.float32(0.5)]
    return pick(rng, options)


def _diag_float(rng, avail):
    """A float read by a function of q_idx - kv_idx (one value per run of diagonals)."""
    d = lambda e: e["q"] - e["kv"]  # noqa: E731
    c = int(rng.integers(0, 4))
    options = [lambda e: jnp.asarray(CONST_F)[jnp.clip(d(e) + c, 0, L - 1)]]
    if "th" in avail:
        options += [lambda e: e["th"][e["h"], jnp.abs(d(e)) % L],
                    lambda e: e["th"][e["h"], score_mods.t5_bucket(e["q"], e["kv"], L, 6)],
                    lambda e: e["th"][e["h"], score_mods.t5_bucket(
                        e["q"], e["kv"], L, 4, bidirectional=False)] * d(e).astype(F32)]
    if "tb" in avail:
        options.append(lambda e: e["tb"][e["b"], jnp.minimum(jnp.abs(e["kv"] - e["q"]), L - 1)])
    if "gate" in avail:
        options.append(lambda e: e["gate"][e["b"], e["h"], (d(e) // 2) % L])
    if "pos" in avail:  # an int read by the diagonal, on the tiles as a bit-cast word
        options.append(lambda e: e["pos"][e["b"], (d(e) + c) % L].astype(F32) * 0.1)
    return pick(rng, options)


def _bh_float(rng, avail):
    """A float read by (b, h) only (or by nothing: a scalar)."""
    c = int(rng.integers(L))
    options = [lambda e: jnp.asarray(CONST_F)[e["h"] + 1]]
    if "vh" in avail:
        options.append(lambda e: e["vh"][e["h"]])
    if "vb" in avail:
        options.append(lambda e: e["vb"][e["b"]])
    if "th" in avail:
        options += [lambda e: e["th"][e["h"], c],
                    lambda e: jnp.max(e["th"][e["h"]], axis=-1)]
    if "gate" in avail:
        options += [lambda e: e["gate"][e["b"], e["h"], c],
                    lambda e: jnp.sum(e["gate"][e["b"], e["h"]], axis=-1) * 0.2]
    if "tb" in avail:
        options += [lambda e: jax.nn.logsumexp(e["tb"][e["b"]], axis=-1),
                    lambda e: jnp.mean(e["tb"])]
    if "temp" in avail:
        options += [lambda e: e["temp"]] * 2
    if "td" in avail and "doc" in avail:
        options.append(lambda e: e["td"][e["doc"][e["b"], c]])
    if "thd" in avail:
        options.append(lambda e: e["thd"][e["h"], c % ND])
    return pick(rng, options)


def side_int(rng, side, avail):
    """An int32 read by one side (8-bit arithmetic may mix in the other side's read)."""
    idx = _index(rng, side, avail)
    options = [lambda e: jnp.asarray(CONST_I)[idx(e)]]
    for name in ("doc", "pos"):
        if name in avail:
            options += [lambda e, name=name: e[name][e["b"], idx(e)]] * 2
    if "flag" in avail:
        options.append(lambda e: e["flag"][e["b"], idx(e)].astype(jnp.int32))
    if "nb" in avail:
        options.append(lambda e: e["nb"][e["b"]])
    if "big" in avail:
        options.append(lambda e: (e["big"][e["b"], idx(e)] >> 29).astype(jnp.int32))
    if "small" in avail:
        other, c = _index(rng, pick(rng, ("q", "kv")), avail), int(rng.integers(20, 60))
        options += [lambda e: e["small"][e["b"], idx(e)].astype(jnp.int32),
                    # int8 arithmetic that wraps (on the tiles when `other` is the other side)
                    lambda e: (e["small"][e["b"], idx(e)] * jnp.int8(c)
                               - e["small"][e["b"], other(e)]).astype(jnp.int32)]
    return pick(rng, options)


def _int(rng, depth, avail):
    k = int(rng.integers(8 if depth > 0 else 4))
    if k == 0:
        return side_int(rng, pick(rng, ("q", "kv")), avail)
    if k == 1:
        name = pick(rng, ("q", "kv", "b", "h"))
        return lambda e: e[name]
    if k == 2:
        c = int(rng.integers(-3, 6))
        return lambda e: jnp.int32(c)
    if k == 3:  # per-row and per-column reads combined on the tiles
        r, c = side_int(rng, "q", avail), side_int(rng, "kv", avail)
        return lambda e: jnp.abs(r(e) - c(e))
    x, y = _int(rng, depth - 1, avail), _int(rng, depth - 1, avail)
    if k == 4:
        op = pick(rng, (jnp.add, jnp.subtract, jnp.maximum, jnp.minimum))
        return lambda e: op(x(e), y(e))
    if k in (5, 6):
        c = int(rng.integers(1, 4))
        unary = pick(rng, (lambda v: v // c, lambda v: v % c, lambda v: v * c, jnp.abs,
                            jnp.negative, lambda v: (v.astype(F32) * 0.5).astype(jnp.int32),
                            lambda v: (v.astype(jnp.int8) * CONST_I8).astype(jnp.int32)))
        return lambda e: unary(x(e))
    cond = _bool(rng, depth - 1, avail)
    return lambda e: jnp.where(cond(e), x(e), y(e))


def _bool(rng, depth, avail):
    k = int(rng.integers(6 if depth > 0 else 3))
    if k == 0 and "flag" in avail:
        idx = _index(rng, pick(rng, ("q", "kv")), avail)
        return lambda e: e["flag"][e["b"], idx(e)]
    if k == 0 and "big" in avail:  # uint32 words compared across the sides on the tiles
        i, j = _index(rng, "q", avail), _index(rng, "kv", avail)
        op = pick(rng, (jnp.equal, jnp.less, jnp.greater_equal))
        return lambda e: op(e["big"][e["b"], i(e)], e["big"][e["b"], j(e)])
    if k <= 1:
        x, y = _int(rng, depth, avail), _int(rng, depth, avail)
        op = pick(rng, (jnp.equal, jnp.not_equal, jnp.less, jnp.less_equal))
        return lambda e: op(x(e), y(e))
    if k == 2:
        x, y = _float(rng, min(depth, 1), avail), _float(rng, min(depth, 1), avail)
        op = pick(rng, (jnp.less, jnp.greater_equal))
        return lambda e: op(x(e), y(e))
    if k == 3:
        x = _bool(rng, depth - 1, avail)
        return lambda e: ~x(e)
    x, y = _bool(rng, depth - 1, avail), _bool(rng, depth - 1, avail)
    return (lambda e: x(e) & y(e)) if k == 4 else (lambda e: x(e) | y(e))


def _float(rng, depth, avail):
    k = int(rng.integers(16 if depth > 0 else 6))
    if k == 0:
        return lambda e: e["s"]
    if k in (1, 2):
        if k == 2 and BH_ONLY not in avail and rng.random() < 0.5:
            return _diag_float(rng, avail)
        return _side_float(rng, pick(rng, ("q", "kv")), avail)
    if k == 3:
        return _bh_float(rng, avail)
    if k == 4:
        c = float(rng.uniform(-2, 2))
        return pick(rng, (lambda e: jnp.float32(c), lambda e: CONST_S * c,
                           lambda e: CONST_1111))
    if k == 5:
        x, c = _int(rng, max(depth - 1, 0), avail), float(rng.uniform(0.05, 0.5))
        return lambda e: x(e).astype(F32) * c
    x, y = _float(rng, depth - 1, avail), _float(rng, depth - 1, avail)
    if k in (6, 7):
        op = pick(rng, (jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, jnp.minimum))
        return lambda e: op(x(e), y(e))
    if k in (8, 9):
        unary = pick(rng, (
            jnp.tanh, jax.nn.sigmoid, jnp.abs, jnp.negative, lambda v: v * 0.5,
            lambda v: jnp.exp(0.5 * jnp.tanh(v)), lambda v: jnp.clip(v, -2.0, 2.0),
            # (sqrt through rsqrt: Mosaic GPU lowers no sqrt, `mosaic_ops`)
            lambda v: (1.0 + v * v) * jax.lax.rsqrt(1.0 + v * v), lambda v: jnp.tanh(v) ** 2))
        return lambda e: unary(x(e))
    if k == 10:
        return lambda e: x(e) / (1.0 + jnp.abs(y(e)))
    if k in (11, 12):
        cond = _bool(rng, depth - 1, avail)
        return lambda e: jnp.where(cond(e), x(e), y(e))
    if k == 14:  # float -> 8-bit casts (XLA saturates) of exactly rounded values only, so
        # that no ulp of difference crosses an integer
        r, c = _side_float(rng, pick(rng, ("q", "kv")), avail), float(rng.uniform(10, 60))
        dt = pick(rng, (jnp.int8, jnp.uint8))
        return lambda e: (e["s"] * c + r(e)).astype(dt).astype(F32) * 0.01
    if k == 13:  # a float read per row or column times a position difference (ALiBi-like)
        r, i = _side_float(rng, pick(rng, ("q", "kv")), avail), _int(rng, 1, avail)
        return lambda e: r(e) * (e["kv"] - e["q"]).astype(F32) * 0.1 + x(e) * i(e).astype(F32)
    return lambda e: x(e) * y(e)


def _arg_read(rng, names):
    """A float32 value that reads one of the program's own args (so each program reads one)."""
    name, avail = pick(rng, names), set(names)
    side = pick(rng, ("q", "kv"))
    idx, ident = _index(rng, side, avail, nested=False), _ident(rng, side, avail)
    iq, ikv = _index(rng, "q", avail), _index(rng, "kv", avail)
    c = int(rng.integers(L))
    return {
        "doc": lambda e: e["doc"][e["b"], idx(e)].astype(F32) * 0.3,
        "pos": lambda e: jnp.abs(e["pos"][e["b"], iq(e)] - e["pos"][e["b"], ikv(e)]
                                 ).astype(F32) * 0.05,
        "small": lambda e: e["small"][e["b"], idx(e)].astype(F32),
        "flag": lambda e: jnp.where(e["flag"][e["b"], idx(e)], 0.5, -0.5),
        "tb": lambda e: e["tb"][e["b"], idx(e)],
        "th": lambda e: e["th"][e["h"], idx(e)],
        "td": lambda e: e["td"][ident(e)],
        "thd": lambda e: e["thd"][e["h"], ident(e)],
        "gate": lambda e: e["gate"][e["b"], e["h"], idx(e)],
        "vh": lambda e: e["vh"][e["h"]],
        "vb": lambda e: e["vb"][e["b"]] * (e["q"] - e["kv"]).astype(F32) * 0.1,
        "temp": lambda e: e["temp"] * e["q"].astype(F32),
        "bf16": lambda e: (e["bf16"][e["b"], iq(e)] - e["bf16"][e["b"], ikv(e)]).astype(F32)
        + e["bf16"][e["b"], c],
        "f16": lambda e: (e["f16"][e["b"], iq(e)] * e["f16"][e["b"], ikv(e)]).astype(F32),
        "nb": lambda e: jnp.where(e["kv"] < e["nb"][e["b"]], 0.5, -0.5),
        "big": lambda e: jnp.where(e["big"][e["b"], iq(e)] == e["big"][e["b"], ikv(e)],
                                   0.5, -0.5),
    }[name]


def program(seed):
    """(score_mod, args): a random score_mod reading the score and 1-3 arrays."""
    rng = np.random.default_rng(seed)
    names = tuple(sorted(rng.choice(NAMES, size=int(rng.integers(1, 4)), replace=False)))
    avail = set(names) | ({BH_ONLY} if rng.random() < 0.15 else set())
    # two subtrees (each often of one side only) mixed on the tiles
    x, y = _float(rng, int(rng.integers(1, 4)), avail), _float(rng, int(rng.integers(1, 3)), avail)
    cond = _bool(rng, 1, avail)
    body = pick(rng, (lambda e: x(e) + y(e), lambda e: x(e) * y(e),
                       lambda e: jnp.maximum(x(e), y(e)), lambda e: jnp.where(cond(e), x(e), y(e))))
    read = _arg_read(rng, names)
    top = pick(rng, (
        lambda e: body(e) + e["s"] * (1.0 + 0.5 * jnp.tanh(read(e))),
        lambda e: body(e) + e["s"] + read(e),
        lambda e: jnp.where(read(e) > 0, e["s"], 0.5 * e["s"]) + body(e),
        lambda e: jax.nn.sigmoid(read(e)) * e["s"] - body(e),
    ))

    def fn(s, b, h, q, kv, *arrays):
        e = dict(zip(names, arrays))
        e.update(s=s, b=b, h=h, q=q, kv=kv)
        return top(e)
    return fn, tuple(ARRAYS[n] for n in names)


def difference_program(seed):
    """(score_mod, args, spoiled): a random score_mod of the score, reads by q_idx - kv_idx
    and reads by (b, h); `spoiled` ones add a term of one position alone (a row or column
    read, a comparison, a product), so they read positions otherwise than by the
    difference."""
    rng = np.random.default_rng(seed)
    names = ("gate", "pos", "tb", "temp", "th", "vb", "vh")
    avail = set(names)
    terms = [pick(rng, (_diag_float, _bh_float))(rng, avail) for _ in range(int(rng.integers(1, 4)))]
    d = lambda e: e["q"] - e["kv"]  # noqa: E731
    c = int(rng.integers(1, 4))
    combine = pick(rng, (
        lambda e: sum(t(e) for t in terms) + e["s"],
        lambda e: e["s"] * (1.0 + 0.1 * jnp.tanh(terms[0](e))) + sum(t(e) for t in terms[1:]),
        lambda e: jnp.where(jnp.abs(d(e)) < c, e["s"] + terms[0](e), e["s"] - 1.0),
        lambda e: jnp.maximum(e["s"], terms[-1](e)) - (d(e) * d(e)).astype(F32) * 0.01,
    ))
    spoiled = bool(rng.random() < 0.4)
    spoil = pick(rng, (
        lambda e: e["tb"][e["b"], jnp.clip(e["q"], 0, L - 1)],
        lambda e: jnp.where(e["kv"] < c, 0.5, 0.0),
        lambda e: (e["q"] * 2 - e["kv"]).astype(F32) * 0.01,
        lambda e: (e["q"] + e["kv"]).astype(F32) * 0.01,
        lambda e: e["th"][e["h"], (e["q"] - e["kv"] + e["q"]) % L],
    ))

    def fn(s, b, h, q, kv, *arrays):
        e = dict(zip(names, arrays))
        e.update(s=s, b=b, h=h, q=q, kv=kv)
        return combine(e) + (spoil(e) if spoiled else 0.0)
    return fn, tuple(ARRAYS[n] for n in names), spoiled
