"""Generated programs of exact primitives over positions: the differential tests of
`folding.host_value` (on the CPU, and against a GPU's compiled values) draw from here."""
import jax.numpy as jnp
import numpy as np
from jax import lax


def program(seed, S):
    """A random program of exact primitives over positions, an S x S boolean mask:
    (fn of a dummy input of at least S elements, its text)."""
    rng = np.random.default_rng(seed)
    unary = [("neg", lambda a: -a), ("abs", jnp.abs), ("T", lambda a: a.T),
             ("rev", lambda a: a[::-1]), ("roll", lambda a, c=int(rng.integers(1, 5)): jnp.roll(a, c)),
             ("%c", lambda a, c=int(rng.integers(2, 7)): a % c),
             ("*c", lambda a, c=int(rng.integers(-3, 4)): a * c),
             ("<<1", lambda a: jnp.left_shift(a, 1)), ("tril", jnp.tril),
             ("tile", lambda a: jnp.concatenate([a[:, S // 2:], a[:, :S // 2]], axis=1)),
             ("i32", lambda a: a.astype(jnp.int32))]
    binary = [("+", jnp.add), ("-", jnp.subtract), ("max", jnp.maximum), ("min", jnp.minimum),
              ("//", lambda a, b: a // jnp.where(b == 0, 1, b))]
    leaves = [("i", lambda x: lax.broadcasted_iota(jnp.int32, (S, S), 0)),
              ("j", lambda x: lax.broadcasted_iota(jnp.int32, (S, S), 1)),
              ("c", lambda x, c=int(rng.integers(-5, 20)): jnp.full((S, S), c, jnp.int32)),
              ("ones", lambda x: jnp.ones(x.shape[:1] * 2, jnp.int32)[:S, :S])]

    def expr(depth):
        if depth == 0 or rng.random() < 0.25:
            return leaves[int(rng.integers(len(leaves)))]
        if rng.random() < 0.5:
            (n, f), (a, fa) = unary[int(rng.integers(len(unary)))], expr(depth - 1)
            return f"{n}({a})", lambda x: f(fa(x))
        (n, f), (a, fa), (b, fb) = binary[int(rng.integers(len(binary)))], expr(depth - 1), \
            expr(depth - 1)
        return f"({a} {n} {b})", lambda x: f(fa(x), fb(x))

    (a, fa), (b, fb) = expr(3), expr(3)
    cmp = [("<=", jnp.less_equal), ("==", jnp.equal), (">", jnp.greater)][int(rng.integers(3))]
    logic = [("&", jnp.logical_and), ("|", jnp.logical_or), ("^", jnp.logical_xor)][
        int(rng.integers(3))]
    (c, fc) = expr(2)
    text = f"({a} {cmp[0]} {b}) {logic[0]} ({c} != 0)"
    return (lambda x: jnp.where(logic[1](cmp[1](fa(x), fb(x)), fc(x) != 0), True,
                                False).reshape(1, 1, S, S)), text
