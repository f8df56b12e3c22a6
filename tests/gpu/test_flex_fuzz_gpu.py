"""Fuzzed score_mods / mask_mods (tests/flex_fuzz.py) on cuDNN and on the block-sparse
kernels: forward and every gradient (q, k, v, float score_mod_args) of
`fused_attn(..., backend=...)` against the XLA backend on the same bf16 inputs, and where the two differ, against the
float64 oracle (tests/test_flex_fuzz.py ties the lowering to the function). A program
float32 cannot resolve (XLA as far from the oracle as the backend, or the oracle itself moved
past the tolerance when the scores move by 8 float32 ulps) is counted ill-conditioned,
and listed.
A program either matches, or is refused with the reason in explain() before any
kernel runs; a mismatch or a crash fails. Counts go to
$FUSEDATTN_FUZZ_OUT/flex_fuzz_gpu_<backend>.json (tried, ran, refused by reason,
mismatched) for benchmarks/results/. The block-sparse kernels (Mosaic GPU, Hopper) are
where `auto` sends the programs cuDNN refuses that have an in-kernel form.

    FUSEDATTN_FUZZ_OUT=$OUT pytest -q -s tests/gpu/test_flex_fuzz_gpu.py

FUSEDATTN_FUZZ_GPU_COUNT (default 500 on cuDNN; 100 on the block-sparse kernels, whose
Mosaic GPU kernels take seconds each to compile) and FUSEDATTN_FUZZ_SEED choose the programs;
FUSEDATTN_FUZZ_THREADS (default 4; 1 if a GPU run shows a race) how many programs compile at once;
FUSEDATTN_FUZZ_VERBOSE=1 prints each program before it runs."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from support import attn_cases as ac
from support import flex_fuzz as ff
from support import oracle
from fusedattn import score_mods

pytestmark = pytest.mark.gpu

COUNTS = {"cudnn": 500, "block_sparse": 100}
COUNT = int(os.environ.get("FUSEDATTN_FUZZ_GPU_COUNT", "0"))
SEED = int(os.environ.get("FUSEDATTN_FUZZ_SEED", "0"))
THREADS = int(os.environ.get("FUSEDATTN_FUZZ_THREADS", "4"))
VERBOSE = os.environ.get("FUSEDATTN_FUZZ_VERBOSE") == "1"
B, S, H, D = 2, 128, 4, 64  # small: one graph per program is the cost


def _inputs(program: ff.Program, rng: np.random.Generator):
    h_kv = 2 if program.variant == "gqa" else H

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    return (normal(B, S, H, D), normal(B, S, h_kv, D), normal(B, S, h_kv, D),
            normal(B, S, H, D), ff.arg_values(rng, B, H))


def _compiled(program: ff.Program, backend: str):
    """(program, explain's plan, compiled fwd+vjp of `backend` and xla, inputs) or the
    exception: everything up to running a kernel."""
    try:
        rng = np.random.default_rng(SEED * 100003 + program.index)
        q, k, v, d_out, args = _inputs(program, rng)
        options, _ = ff.call_options(program, S)
        # The backend's plan, asked for by name (`auto` may prefer another).
        plan = fusedattn.explain(q, k, v, score_mod_args=args, backend=backend, **options)
        if plan.chosen != backend:
            return program, plan, None, None
        floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

        def grads(backend):
            def f(q, k, v, float_args):
                full = list(args)
                for i, a in zip(floats, float_args):
                    full[i] = a
                return fusedattn.fused_attn(q, k, v, score_mod_args=tuple(full),
                                            backend=backend, **options)

            def run(q, k, v, fa, d_out):
                out, vjp = jax.vjp(f, q, k, v, fa)
                return (out,) + tuple(vjp(d_out))
            return run
        both = jax.jit(lambda *a: (grads(backend)(*a), grads("xla")(*a)))
        call = (q, k, v, [args[i] for i in floats], d_out)
        return program, plan, both.lower(*call).compile(), call
    except Exception as e:  # noqa: BLE001  (reported as a failure below)
        return program, e, None, None


def _compare(got, want):
    """The worst error over the outputs (inf where non-finite differs): L2 relative to the
    reference, or to a floor of 1e-2 per element where the reference is about zero (a
    gradient that is exactly 0 comes out as rounding noise from every float32 path)."""
    worst = 0.0
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = (np.asarray(jnp.asarray(x, jnp.float32) if not isinstance(x, np.ndarray)
                           else x, np.float64) for x in (g, w))
        if not np.array_equal(np.isfinite(g), np.isfinite(w)):
            return float("inf")
        fin = np.isfinite(w)
        floor = 1e-2 * np.sqrt(max(int(fin.sum()), 1))
        worst = max(worst, float(np.linalg.norm(g[fin] - w[fin])
                                 / max(np.linalg.norm(w[fin]), floor)))
    return worst


def _oracle(program: ff.Program, call, options, lengths):
    """The float64 oracle of the program's call: out and every gradient compared."""
    q, k, v, float_args, d_out = call
    rng = np.random.default_rng(SEED * 100003 + program.index)
    args = _inputs(program, rng)[4]
    score, mask = program.functions()
    mod = score if mask is None else score_mods.Masked(score, mask)
    seq = dict(q_lengths=np.asarray(lengths[0]), kv_lengths=np.asarray(lengths[1])) \
        if lengths else {}
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731

    def reference(score_mod):
        ref = oracle.attention(f64(q), f64(k), f64(v), mask=options.get("mask", "none"),
                               window=options.get("window"), score_mod=score_mod,
                               score_mod_args=[np.asarray(a) for a in args], d_out=f64(d_out),
                               **seq)
        return (ref.out, ref.dq, ref.dk, ref.dv, list(ref.d_score_mod_args))

    def nudged(s, b, h, q_idx, kv_idx, *a):  # the scores moved by about 8 float32 ulps
        x = mod(s, b, h, q_idx, kv_idx, *a)
        return x * (1.0 + 2.0 ** -20 * jnp.cos(7.0 * q_idx + 13.0 * kv_idx + h))
    return reference(mod), reference(nudged)


@pytest.mark.parametrize("backend", ["cudnn", "block_sparse"])
def test_fuzzed_programs_match_xla(backend):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    start = time.time()
    counts, refusals, failures, ill = collections.Counter(), collections.Counter(), [], []
    tol = ac.TOLERANCE["bfloat16"]
    count = COUNT or COUNTS[backend]
    programs = ff.draw(count, seed=SEED)
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for program, plan, compiled, call in pool.map(lambda p: _compiled(p, backend),
                                                       programs):
            counts["tried"] += 1
            if counts["tried"] % 25 == 0:
                print("after", counts["tried"], dict(counts), flush=True)
            if isinstance(plan, Exception):
                counts["errors"] += 1
                failures.append(f"{program.describe()}: {type(plan).__name__}: {plan}"[:500])
                print("FAILED:", failures[-1], flush=True)  # (kept if the run is cut short)
                continue
            if compiled is None:  # refused before any kernel ran, with its reason
                reason = dict(plan.reasons).get(backend, "")
                assert reason, (program.describe(), str(plan))
                refusals[reason.split(":")[0][:60] + ": " + reason.split(":")[-1][:80]] += 1
                continue
            counts[f"ran on {backend}"] += 1
            if VERBOSE:  # the last line names the program a crash happened in
                print("running", program.describe(), flush=True)
            got, want = compiled(*call)
            error = _compare(got, want)
            if error < tol:
                continue
            # Off from XLA: the float64 oracle decides. The backend within tolerance of it
            # is a match; where XLA (float32 too) is as far off, float32 cannot resolve
            # the program (catastrophic cancellation, saturated softmax): ill-conditioned.
            options, lengths = ff.call_options(program, S)
            ref, ref_nudged = _oracle(program, call, options, lengths)
            error_of_backend, xla_error = _compare(got, ref), _compare(want, ref)
            spread = _compare(ref_nudged, ref)
            if error_of_backend < tol:
                counts["matched the oracle, not XLA"] += 1
            elif not xla_error < tol or not spread < tol:
                counts["ill-conditioned in float32"] += 1
                ill.append(f"{program.describe()}: {backend} {error_of_backend:.3g}, XLA "
                           f"{xla_error:.3g} from the float64 oracle; scores moved by 8 ulps "
                           f"move it {spread:.3g}")
            else:
                counts["mismatched"] += 1
                failures.append(f"{program.describe()}: relative error {error_of_backend:.3g} "
                                f"from the float64 oracle (XLA {xla_error:.3g})")
                print("FAILED:", failures[-1], flush=True)
    counts["refused"] = sum(refusals.values())
    record = dict(backend=backend, counts=dict(counts), refused_by_reason=dict(refusals),
                  seed=SEED, shape=dict(b=B, s=S, h=H, d=D, dtype="bfloat16"), tolerance=tol,
                  wall_s=round(time.time() - start, 1), device=str(jax.devices()[0]),
                  jax=jax.__version__, failures=failures[:50],
                  ill_conditioned=ill[:50])
    print(json.dumps(record, indent=1))
    out_dir = os.environ.get("FUSEDATTN_FUZZ_OUT") or os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"flex_fuzz_gpu_{backend}.json"), "w") as f:
            json.dump(record, f, indent=1)
    assert counts["tried"] == count
    assert not failures, failures[:10]
