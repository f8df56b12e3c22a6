"""Generated drop-in masks of the family `tracing.mask_program` rewrites: elementwise
functions of arrays read per query row or per key column and of positions, taken to
``[B|1, N|1, T, S]`` through the shape operations user code uses (broadcasts,
reshapes, transposes, reversals, slices, float round trips, jitted helpers), with
some values from operations that are not rewritten (read as arrays).."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def inputs(seed, B, T, S):
    """(r int32 [B, T], c int32 [B, S], g int32 [B]): small values, so equalities hold."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(0, 4, (B, T)), jnp.int32),
            jnp.asarray(rng.integers(0, 4, (B, S)), jnp.int32),
            jnp.asarray(rng.integers(0, 3, (B,)), jnp.int32))


def program(seed, B, N, T, S):
    """(fn(r, c, g) -> a boolean mask [B, 1|N, T, S], its text)."""
    rng = np.random.default_rng(seed)
    k = lambda: int(rng.integers(-2, 5))   # noqa: E731
    unary = [("-", lambda a: -a), ("abs", jnp.abs), ("%c", lambda a, c=int(rng.integers(2, 5)): a % c),
             ("*c", lambda a, c=k(): a * c), ("+c", lambda a, c=k(): a + c),
             ("<<1", lambda a: jnp.left_shift(a, 1)), (">>1", lambda a: jnp.right_shift(a, 1)),
             ("i8", lambda a: a.astype(jnp.int8).astype(jnp.int32)),
             ("clip", lambda a, c=k(): jnp.where(a > c, a, c)),
             ("cumsum", lambda a: jnp.cumsum(a, axis=-1) % 5)]   # (not rewritten: a leaf)
    binary = [("+", jnp.add), ("-", jnp.subtract), ("max", jnp.maximum), ("min", jnp.minimum)]

    def side(n, data, name):   # a [B, n] int32 value of one side
        leaves = [(name, lambda r, c, g: data(r, c)),
                  ("g", lambda r, c, g: jnp.broadcast_to(g[:, None], (B, n))),
                  ("pos", lambda r, c, g: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))),
                  ("rev", lambda r, c, g: data(r, c)[:, ::-1]),
                  # (a concatenation is not rewritten: a leaf, read through the slices)
                  ("shift", lambda r, c, g: jnp.concatenate([data(r, c)] * 2, 1)[:, 1:n + 1]),
                  ("stride", lambda r, c, g: jnp.concatenate([data(r, c)] * 2, 1)[:, 1::2])]

        def expr(depth):
            if depth == 0 or rng.random() < 0.3:
                return leaves[int(rng.integers(len(leaves)))]
            if rng.random() < 0.6:
                (u, f), (a, fa) = unary[int(rng.integers(len(unary)))], expr(depth - 1)
                return f"{u}({a})", lambda r, c, g: f(fa(r, c, g))
            (o, f), (a, fa), (b, fb) = binary[int(rng.integers(len(binary)))], expr(depth - 1), \
                expr(depth - 1)
            return f"({a} {o} {b})", lambda r, c, g: f(fa(r, c, g), fb(r, c, g))
        return expr(2)

    cmps = [("==", jnp.equal), ("<=", jnp.less_equal), (">", jnp.greater), ("!=", jnp.not_equal)]

    def mirrored(depth):   # fn(g, n): one expression of g and positions, for either side
        if depth == 0 or rng.random() < 0.3:
            return [("g", lambda g, n: jnp.broadcast_to(g[:, None], (B, n))),
                    ("pos", lambda g, n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32),
                                                          (B, n)))][int(rng.integers(2))]
        (u, f), (a, fa) = unary[int(rng.integers(len(unary) - 1))], mirrored(depth - 1)
        return f"{u}({a})", lambda g, n: f(fa(g, n))

    def pair():   # a [B, T, S] boolean term
        kind = rng.random()
        if kind < 0.3:    # the same expression of both sides (true or not on the diagonal)
            (a, fa), (cn, cf) = mirrored(2), cmps[int(rng.integers(len(cmps)))]
            return f"{a}[q] {cn} {a}[kv]", lambda r, c, g: cf(fa(g, T)[:, :, None],
                                                             fa(g, S)[:, None, :])
        if kind < 0.55:   # a row value against a column value
            (a, fa), (b, fb) = side(T, lambda r, c: r, "r"), side(S, lambda r, c: c, "c")
            cn, cf = cmps[int(rng.integers(len(cmps)))]
            return f"{a}[q] {cn} {b}[kv]", lambda r, c, g: cf(fa(r, c, g)[:, :, None],
                                                             fb(r, c, g)[:, None, :])
        if kind < 0.75:   # a flag of one side
            if rng.random() < 0.5:
                (a, fa), t = side(T, lambda r, c: r, "r"), k()
                return f"{a}[q] > {t}", lambda r, c, g: jnp.broadcast_to(
                    (fa(r, c, g) > t)[:, :, None], (B, T, S))
            (a, fa), t = side(S, lambda r, c: c, "c"), k()
            return f"{a}[kv] > {t}", lambda r, c, g: jnp.broadcast_to(
                (fa(r, c, g) > t)[:, None, :], (B, T, S))
        # positions: an iota pair, or jnp.tril (a jitted library call)
        if rng.random() < 0.3:
            d = int(rng.integers(-3, 4))
            return f"tril({d})", lambda r, c, g: jnp.broadcast_to(
                jnp.tril(jnp.ones((T, S), bool), d), (B, T, S))
        w, cn_cf = int(rng.integers(1, max(2, S))), cmps[int(rng.integers(len(cmps)))]
        return f"i - j {cn_cf[0]} {w} % 7", lambda r, c, g: cn_cf[1](
            lax.broadcasted_iota(jnp.int32, (B, T, S), 1) - lax.broadcasted_iota(
                jnp.int32, (B, T, S), 2), w % 7)

    terms = [pair() for _ in range(int(rng.integers(1, 4)))]
    text, fn = terms[0]
    for t, f in terms[1:]:
        op = int(rng.integers(4))
        name, join = [("&", jnp.logical_and), ("|", jnp.logical_or), ("^", jnp.logical_xor),
                      ("&~", lambda a, b: a & ~b)][op]
        text, fn = f"({text}) {name} ({t})", (lambda fa, fb, j: lambda r, c, g: j(
            fa(r, c, g), fb(r, c, g)))(fn, f, join)
    layouts = [
        ("[:, None]", lambda m: m[:, None]),
        ("heads", lambda m: jnp.broadcast_to(m[:, None], (B, N, T, S))),
        ("merged heads", lambda m: jnp.broadcast_to(m[:, None], (B, N, T, S)).reshape(
            B * N, T, S).reshape(B, N, T, S)),
        ("T and S swapped twice", lambda m: jnp.swapaxes(jnp.swapaxes(m, 1, 2)[:, None], 2, 3)),
        ("reversed twice", lambda m: m[:, ::-1, ::-1][:, None, ::-1, ::-1]),
        ("Flax float", lambda m: (m[:, None].astype(jnp.float32) != 0.0).astype(
            jnp.float32).astype(bool)),
        ("jitted helper", lambda m: jax.jit(lambda x: x[:, None] & True)(m)),
    ]
    lname, layout = layouts[int(rng.integers(len(layouts)))]
    return (lambda r, c, g: layout(fn(r, c, g))), f"{lname}: {text}"
