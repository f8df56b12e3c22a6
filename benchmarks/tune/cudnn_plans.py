"""Every execution plan cuDNN offers for our attention graphs, timed: does the plan
its heuristics pick (index 0) leave speed on the table?

Builds the graphs with cudnn-frontend's Python bindings (no JAX) at b4 s4096 h16
d128, BF16 and FP8, forward (inference) and backward, causal and not; builds every
plan of heuristic modes A and FALLBACK and times each with CUDA events. Prints
one line per plan: index, name, ms, TFLOP/s (BF16 FLOP count, causal halved).

    python -m benchmarks.tune.cudnn_plans [--shape b,s,h,d]
"""
from __future__ import annotations

import argparse
import time

import cudnn
import cupy as cp

DT = cudnn.data_type


def _t(g, name, dims, dtype):
    strides = [dims[1] * dims[2] * dims[3], dims[3], dims[1] * dims[3], 1] if dims[3] > 1 \
        else [dims[1] * dims[2], dims[2], 1, 1]
    return g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)


def _out(t, dims, dtype):
    strides = [dims[1] * dims[2] * dims[3], dims[3], dims[1] * dims[3], 1]
    t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(dtype)


def _scalar_out(t):
    t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(DT.FLOAT)


def build(kind, fp8, causal, b, s, h, d, handle, modes=None, policy=None, timings=None):
    """The graph, its variant pack and the buffers behind it. `modes` (heuristic modes,
    default A and FALLBACK) and `policy` (default: build every plan) as cudnn-frontend
    takes them; `timings`, if a dict, gets each build stage's seconds."""
    io = DT.FP8_E4M3 if fp8 else DT.BFLOAT16
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=DT.FLOAT,
                      compute_data_type=DT.FLOAT, handle=handle)
    dims = [b, h, s, d]
    q, k, v = (_t(g, n, dims, io) for n in "QKV")
    tensors = [q, k, v]
    scal = lambda n: _t(g, n, [1, 1, 1, 1], DT.FLOAT)  # noqa: E731
    if kind == "fwd":
        if fp8:
            sc = [scal(n) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
            o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *sc, generate_stats=False,
                                              attn_scale=d ** -0.5, use_causal_mask=causal)
            _scalar_out(amax_s)
            _scalar_out(amax_o)
            tensors += sc + [amax_s, amax_o]
        else:
            o, _ = g.sdpa(q, k, v, generate_stats=False, attn_scale=d ** -0.5,
                          use_causal_mask=causal)
        _out(o, dims, io)
        tensors.append(o)
    else:
        o, do = _t(g, "O", dims, io), _t(g, "dO", dims, io)
        stats = _t(g, "Stats", [b, h, s, 1], DT.FLOAT)
        tensors += [o, do, stats]
        if fp8:
            sc = [scal(f"s{i}") for i in range(12)]
            dq, dk, dv, *amax = g.sdpa_fp8_backward(q, k, v, o, do, stats, *sc,
                                                     attn_scale=d ** -0.5, use_causal_mask=causal)
            for a in amax:
                _scalar_out(a)
            tensors += sc + amax
        else:
            dq, dk, dv = g.sdpa_backward(q, k, v, o, do, stats, attn_scale=d ** -0.5,
                                         use_causal_mask=causal)
        for t in (dq, dk, dv):
            _out(t, dims, io)
        tensors += [dq, dk, dv]
    stages = (("validate", g.validate), ("build_operation_graph", g.build_operation_graph),
              ("create_execution_plans", lambda: g.create_execution_plans(
                  modes or [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])),
              ("check_support", g.check_support),
              ("build_plans", lambda: g.build_plans(policy or cudnn.build_plan_policy.ALL)))
    for stage, run in stages:
        t0 = time.perf_counter()
        run()
        if timings is not None:
            timings[stage] = time.perf_counter() - t0
    elements = b * s * h * d
    pack = {}
    keep = []
    for t in tensors:
        n = 16 if t.get_dim() == [1, 1, 1, 1] else (b * h * s * 4 if t.get_dim()[3] == 1
                                                    else elements * 2)
        buf = cp.zeros(n, cp.uint8)
        if t.get_dim() == [1, 1, 1, 1]:
            buf = cp.ones(4, cp.float32)
        keep.append(buf)
        pack[t] = buf.data.ptr
    return g, pack, keep


def time_plans(g, pack, handle, flops):
    rows = []
    for i in range(g.get_execution_plan_count()):
        try:
            ws = cp.empty(max(g.get_workspace_size_plan_at_index(i), 1), cp.uint8)
            for _ in range(2):
                g.execute_plan_at_index(pack, ws.data.ptr, i, handle=handle)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(10):
                g.execute_plan_at_index(pack, ws.data.ptr, i, handle=handle)
            stop.record()
            stop.synchronize()
            ms = cp.cuda.get_elapsed_time(start, stop) / 10
            rows.append((i, g.get_plan_name_at_index(i), ms, flops / ms / 1e9))
        except Exception as e:  # a plan that does not run: say so, go on
            rows.append((i, f"{type(e).__name__}: {str(e)[:80]}", float("nan"), float("nan")))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,4096,16,128")
    b, s, h, d = (int(x) for x in parser.parse_args().shape.split(","))
    handle = cudnn.create_handle()
    for kind in ("fwd", "bwd"):
        for fp8 in (False, True):
            for causal in (False, True):
                flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (
                    1.0 if kind == "fwd" else 2.5)
                label = f"{kind} {'fp8' if fp8 else 'bf16'} {'causal' if causal else 'full'}"
                try:
                    g, pack, keep = build(kind, fp8, causal, b, s, h, d, handle)
                    for i, name, ms, tf in time_plans(g, pack, handle, flops):
                        print(f"{label:22s} plan {i:2d} {ms:8.3f} ms {tf:7.1f} TFLOP/s  {name}",
                              flush=True)
                except Exception as e:
                    print(f"{label:22s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
