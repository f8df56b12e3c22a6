"""How fast is a CuTe C++ block-sparse backward of our own, one kernel of five products
(`csrc/cuda/block_sparse_bwd/kernel.cuh`: dq added in f32 from the dk / dv walk), against
the two Mosaic GPU kernels of seven (`fusedattn.block_sparse.kernel_bwd`)?

Compiles the kernel with nvcc into shared objects, one per build switch (the whole
kernel, with S^T and dP^T waited for together or apart; without dq, the dk / dv part
alone or with the two warpgroups taking turns on the tensor cores), registers each as
an XLA FFI target, and times them round-robin with the Mosaic pair in one process on
the benchmark's documents (b4 s4096 h16 d128 bf16, 512/1024/512/2048, the map from
`from_segment_ids`), after checking every gradient the build computes against the
Mosaic kernels', there and on causal documents cut mid-block with padding (every part
of the element mask); dq's conversion from the f32 buffer, which every build pays
outside its kernel, is timed alone beside them.
Needs a Hopper GPU, nvcc, pybind11 and the CUTLASS headers (the `nvidia-cutlass`
wheel, or CUTLASS_INCLUDE).
`python -m benchmarks.tune.cute_bsa_bwd`

`--profile BUILD` (repeated for more) compiles only those builds and, after the checks,
runs each once beside the Mosaic pair between cuProfilerStart and Stop, for
`ncu --profile-from-start off` (no timing; with XLA_PYTHON_CLIENT_PREALLOCATE=false, or
ncu saves and restores the whole preallocated pool on every replay).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_interleaved
from benchmarks.tune.bsa_inputs import backward_inputs
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import kernel_bwd, kernel_bwd_fused

B, S, H, D = 4, 4096, 16, 128
DOCS = (512, 1024, 512, 2048)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = os.path.join(ROOT, "csrc", "cuda", "block_sparse_bwd")
# The kernel's other mask (a dense mask's bits) and its dv addend, both absent here.
NO_BITS, NO_ADD = np.zeros((0,), np.int32), np.zeros((0,), np.float32)
BUILDS = {"whole kernel": [], "whole kernel, split wait": ["-DFUSEDATTN_BSB_SPLIT_WAIT"],
          "no dq": ["-DFUSEDATTN_BSB_NO_DQ"],
          "no dq, turns": ["-DFUSEDATTN_BSB_NO_DQ", "-DFUSEDATTN_BSB_TURNS"]}


def _cutlass_include() -> str:
    if os.environ.get("CUTLASS_INCLUDE"):
        return os.environ["CUTLASS_INCLUDE"]
    spec = importlib.util.find_spec("cutlass_library")
    return os.path.join(list(spec.submodule_search_locations)[0], "source", "include")


def compile_builds(work: str, builds: dict) -> dict:
    """label -> path of a shared object exporting FusedattnBlockSparseBwd."""
    pybind = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                            capture_output=True, text=True).stdout.split()
    # (sm_90a code only: setmaxnreg and wgmma have no compute_90 form)
    common = ["nvcc", "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
              "--expt-relaxed-constexpr", "-Xptxas", "-v", "-shared", "-Xcompiler", "-fPIC",
              "-I", os.path.join(ROOT, "csrc", "common"),
              "-isystem", jax.ffi.include_dir(), "-isystem", _cutlass_include(), *pybind,
              os.path.join(SOURCES, "ffi.cu")]

    def build(item):
        label, flags = item
        path = os.path.join(work, f"build{list(builds).index(label)}.so")
        done = subprocess.run(common + flags + ["-o", path], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc ({label}):\n{done.stderr[-3000:]}")
        spills = sorted({ln.strip() for ln in done.stderr.splitlines() if "spill" in ln})
        print(f"{label}: {'; '.join(spills)}")
        # setmaxnreg's 2 x 240 + 24 registers a thread are what 168 at launch give the
        # CTA: with fewer, setmaxnreg.inc would wait forever.
        used = set(re.findall(r"Used (\d+) registers", done.stderr))
        if used != {"168"}:
            raise RuntimeError(f"nvcc ({label}): {sorted(used)} registers at launch, not 168")
        return label, path
    with ThreadPoolExecutor(len(builds)) as pool:
        return dict(pool.map(build, builds.items()))


def _profiler(on: bool):
    """cuProfilerStart / Stop (the driver's, which every CUDA process has loaded): the
    range ncu --profile-from-start off records."""
    call = getattr(ctypes.CDLL("libcuda.so.1"), "cuProfilerStart" if on else "cuProfilerStop")
    call.restype = ctypes.c_int
    result = call()   # (it acts on the thread's current context, which JAX may not have left)
    if result:
        raise RuntimeError(f"{call.__name__} failed: CUresult {result}")


def _words(ids, pad_id):
    """(id, valid) per token, int32 [B, 2, S]: the documents mask as the kernel reads it."""
    ids = jnp.asarray(ids, jnp.int32)
    valid = jnp.ones_like(ids) if pad_id is None else (ids != pad_id).astype(jnp.int32)
    return jnp.stack([ids, valid], axis=1)


def _ids(lengths, first_id=0):
    """[B, S] ids: documents of these lengths from `first_id` on, then padding id 0."""
    row = np.concatenate([np.full(n, first_id + i, np.int32) for i, n in enumerate(lengths)])
    return np.broadcast_to(np.pad(row, (0, S - row.size)), (B, S)).copy()


# (label, ids, pad_id, causal, keys at or past which are padding, timed): the benchmark's
# documents (whole blocks only), and causal documents of lengths that cut blocks, with
# padding, which runs every part of the element mask (checked, not timed).
CASES = [("documents", _ids(DOCS), None, False, S, True),
         ("causal documents cut mid-block, padded", _ids((300, 1000, 700, 2000), 1), 0, True,
          4000, False)]


def _check(label, got, ref, ids, pad_id, computes_dq):
    """Each gradient against the Mosaic kernels': relative L2 and the largest difference
    against the largest value (a wrong masked element moves the second); padded queries'
    dq exactly 0."""
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        if name == "dq" and not computes_dq:
            continue
        g = np.asarray(g, np.float32)
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        worst = np.abs(g - r).max() / np.abs(r).max()
        print(f"{label}: {name} relative L2 to the Mosaic kernels {err:.1e}, "
              f"largest difference {worst:.1e} of the largest value")
        assert err < 1e-2 and worst < 2e-2, (label, name, err, worst)
        if name == "dq" and pad_id is not None:
            assert not np.any(g[ids == pad_id]), (label, "padded queries' dq")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="append", default=[], help="a build to profile")
    profile = ap.parse_args().profile
    unknown = set(profile) - set(BUILDS)
    if unknown:
        raise SystemExit(f"--profile: unknown builds {sorted(unknown)}; known: {list(BUILDS)}")
    chosen = {k: v for k, v in BUILDS.items() if not profile or k in profile}
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
    scale = D ** -0.5
    calls = {}
    with tempfile.TemporaryDirectory() as work:
        builds = compile_builds(work, chosen)
        for i, (label, path) in enumerate(builds.items()):
            lib = ctypes.cdll.LoadLibrary(path)
            jax.ffi.register_ffi_target(f"fusedattn_cute_bsa_bwd_{i}",
                                        jax.ffi.pycapsule(lib.FusedattnBlockSparseBwd),
                                        platform="CUDA")
        for case, ids, pad_id, causal, s_kv_real, timed in CASES:
            bm = bs.from_segment_ids(jnp.asarray(ids), pad_id=pad_id,
                                     mask="causal" if causal else "none")
            args, by_q, by_kv, km = backward_inputs(bm, q, k, v, do)
            words = _words(ids, pad_id)

            def mosaic(q, k, v, do, lse_delta, by_q=by_q, by_kv=by_kv, km=km):
                dq, _, _ = kernel_bwd.dq(q, k, v, do, lse_delta, by_q, km, scale=scale)
                dk, dv, _ = kernel_bwd.dkv(q, k, v, do, lse_delta, by_kv, km, scale=scale)
                return dq, dk, dv
            mosaic = jax.jit(mosaic)
            ref = [np.asarray(x, np.float32) for x in mosaic(*args)]
            if timed:
                calls["mosaic (dq + dk/dv kernels)"] = (mosaic, args)
            # (the key blocks' CTAs longest walk first, as the package runs them, or in
            # index order)
            orders = {"": kernel_bwd_fused.launch_order(by_kv, B, H),
                      ", CTAs in index order": jnp.arange(B * H * (S // 128), dtype=jnp.int32)}
            for (i, label), (suffix, order) in itertools.product(enumerate(builds),
                                                                 orders.items()):
                def cute(q, k, v, do, lse_delta, target=f"fusedattn_cute_bsa_bwd_{i}",
                         by_kv=by_kv, words=words, causal=causal, s_kv_real=s_kv_real,
                         order=order):
                    per_head = jax.ShapeDtypeStruct((B, S, H, D), q.dtype)
                    dq, dk, dv = jax.ffi.ffi_call(
                        target, (jax.ShapeDtypeStruct((B, S, H, D), jnp.float32), per_head,
                                 per_head))(
                        q, k, v, do, lse_delta, *by_kv, words, words, NO_BITS, NO_ADD, order,
                        scale=np.float32(scale),
                        causal=causal, s_kv_real=np.int32(s_kv_real))
                    return (dq * scale).astype(q.dtype), dk, dv
                fn = jax.jit(cute)
                _check(f"{case} / {label}{suffix}", fn(*args), ref, ids, pad_id,
                       label.startswith("whole kernel"))
                if timed:
                    calls[label + suffix] = (fn, args)
        # What every CuTe build pays outside its kernel: dq's f32 buffer scaled to bf16.
        calls["dq's conversion alone"] = (jax.jit(lambda x: (x * scale).astype(jnp.bfloat16)),
                                          (jnp.zeros((B, S, H, D), jnp.float32),))
        for fn, a in calls.values():
            jax.block_until_ready(fn(*a))
        if profile:
            _profiler(True)
            for fn, a in calls.values():
                jax.block_until_ready(fn(*a))
            _profiler(False)
            return
        for name, t in time_interleaved(calls).items():
            print(f"backward {name} (documents): {t * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
