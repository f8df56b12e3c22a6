"""Does cuDNN's FP8 forward on this GPU depend on the tensors' layout, the plan, or the
data it is timed on? cudnn-frontend's own Python graphs on cupy buffers (no JAX),
every variant timed round-robin in one process, beside the BF16 graph of the same shape.

Variants: forward with q/k/v/o in BSHD (fusedattn's layout) or BHSD (cuDNN 9.19 refuses
a dim-major V: "the stride for the last dimension ... should be 1 for V"); stats on
(training) or off; data random or all ones; the backward in BSHD. Every plan that
heuristic modes A, B and FALLBACK list is timed, and each mode's own ranking printed.

    python benchmarks/tune/fp8_layouts.py [b s h d]
"""
from __future__ import annotations

import statistics
import sys

import cudnn
import cupy as cp

DT = cudnn.data_type


def strides(layout, b, s, h, d):
    """Strides of a [b, h, s, d] view for a tensor stored in `layout`."""
    return {"bshd": [s * h * d, d, h * d, 1],
            "bhsd": [h * s * d, s * d, d, 1],
            "bhds": [h * s * d, s * d, 1, s]}[layout]


def e4m3_data(n, random):
    if not random:
        return cp.full(n, 0x38, cp.uint8)  # 1.0
    rng = cp.random.default_rng(0)
    mag = rng.integers(0x20, 0x40, n, dtype=cp.uint8)  # 2^-3 .. ~1.9
    return mag | (rng.integers(0, 2, n, dtype=cp.uint8) << 7)


class Graph:
    """One sdpa graph (fp8 or bf16) with its buffers, each plan buildable by index."""

    def __init__(self, b, s, h, d, causal, fp8, qko_layout, v_layout, stats, random,
                 backward=False, modes=("A", "B", "FALLBACK"), build=True):
        self.handle = cudnn.create_handle()
        io = DT.FP8_E4M3 if fp8 else DT.BFLOAT16
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=DT.FLOAT,
                          compute_data_type=DT.FLOAT, handle=self.handle)
        dims = [b, h, s, d]
        q, k = (g.tensor(name=n, dim=dims, stride=strides(qko_layout, b, s, h, d), data_type=io)
                for n in "QK")
        v = g.tensor(name="V", dim=dims, stride=strides(v_layout, b, s, h, d), data_type=io)
        outs = []
        scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": DT.FLOAT}
        st = None
        if backward:
            o, d_o = (g.tensor(name=n, dim=dims, stride=strides(qko_layout, b, s, h, d), data_type=io)
                      for n in ("O", "dO"))
            st = g.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=DT.FLOAT)
            if fp8:
                sc = [g.tensor(name=f"s{i}", **scalar) for i in range(12)]
                grads = g.sdpa_fp8_backward(q, k, v, o, d_o, st, *sc, attn_scale=d ** -0.5,
                                            use_causal_mask=causal)
                outs = sc + [st] + list(grads[3:])
                for a in grads[3:]:
                    a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(DT.FLOAT)
            else:
                grads = g.sdpa_backward(q, k, v, o, d_o, st, attn_scale=d ** -0.5,
                                        use_causal_mask=causal)
                outs = [st]
            for x in grads[:3]:
                x.set_output(True).set_dim(dims).set_stride(strides(qko_layout, b, s, h, d)).set_data_type(io)
            big = (q, k, v, o, d_o) + tuple(grads[:3])
        elif fp8:
            sc = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.FLOAT)
                  for n in ("dq", "dk", "dv", "ds", "ss", "so")]
            o, st, amax_s, amax_o = g.sdpa_fp8(q, k, v, *sc, generate_stats=stats,
                                               attn_scale=d ** -0.5, use_causal_mask=causal)
            for a in (amax_s, amax_o):
                a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(DT.FLOAT)
            outs = sc + [amax_s, amax_o]
        else:
            o, st = g.sdpa(q, k, v, generate_stats=stats, attn_scale=d ** -0.5,
                           use_causal_mask=causal)
        if not backward:
            o.set_output(True).set_dim(dims).set_stride(strides(qko_layout, b, s, h, d)).set_data_type(io)
            big = (q, k, v, o)
            if stats:
                st.set_output(True).set_data_type(DT.FLOAT)
                outs.append(st)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
        g.check_support()
        self.graph = g
        self.names = [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
        if not build:
            return
        n = b * s * h * d
        width = 1 if fp8 else 2
        self.bufs = {t: (e4m3_data(n, random) if fp8 else
                         (cp.random.default_rng(0).standard_normal(n, cp.float32).astype(cp.float16)
                          if random else cp.ones(n, cp.float16)).view(cp.uint8))
                     for t in big}
        assert all(x.nbytes == n * width for x in self.bufs.values())
        for t in outs:
            self.bufs[t] = cp.ones(b * h * s if t is st else 4, cp.float32)
        self.pack = {t: x.data.ptr for t, x in self.bufs.items()}
        self.plans = []
        for i in range(g.get_execution_plan_count()):
            try:
                g.build_plan_at_index(i)
                ws = cp.empty(max(g.get_workspace_size_plan_at_index(i), 1), cp.uint8)
                self.plans.append((i, g.get_plan_name_at_index(i), ws))
            except Exception as e:  # noqa: BLE001 - a plan that does not build is reported
                print(f"    plan {i} does not build: {str(e).splitlines()[0][:120]}")

    def run(self, plan, reps):
        i, _, ws = plan
        for _ in range(reps):
            self.graph.execute_plan_at_index(self.pack, ws.data.ptr, i, handle=self.handle)


def time_all(cases, rounds=7, reps=20):
    """Median ms per call of each (name, graph, plan), round-robin."""
    times = {name: [] for name, _, _ in cases}
    for name, g, p in cases:
        g.run(p, 3)
    for _ in range(rounds):
        for name, g, p in cases:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            g.run(p, reps)
            end.record()
            end.synchronize()
            times[name].append(cp.cuda.get_elapsed_time(start, end) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    b, s, h, d = (int(x) for x in sys.argv[1:5]) if len(sys.argv) == 5 else (4, 4096, 16, 128)
    print(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}  "
          f"cuDNN {cudnn.backend_version()}  frontend {cudnn.__version__}  b{b} s{s} h{h} d{d}")
    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        cases = []
        variants = [("fwd bf16 bshd stats", False, "bshd", "bshd", True, True, False)]
        for qko in ("bshd", "bhsd"):
            for stats in (False, True):
                variants.append((f"fwd fp8 {qko} {'stats' if stats else 'nostats'}",
                                 True, qko, qko, stats, True, False))
        variants += [("fwd fp8 bshd nostats ones", True, "bshd", "bshd", False, False, False),
                     ("bwd bf16 bshd", False, "bshd", "bshd", True, True, True),
                     ("bwd fp8 bshd", True, "bshd", "bshd", True, True, True)]
        for name, fp8, qko, vl, stats, random, bwd in variants:
            args = (b, s, h, d, causal, fp8, qko, vl, stats, random, bwd)
            try:
                g = Graph(*args)
            except Exception as e:  # noqa: BLE001
                print(f"  causal={causal} {name}: refused: {str(e).splitlines()[0][:160]}")
                continue
            for mode in ("A", "B", "FALLBACK"):
                try:
                    print(f"  causal={causal} {name}: mode {mode} ranks "
                          f"{Graph(*args, modes=(mode,), build=False).names}")
                except Exception as e:  # noqa: BLE001
                    print(f"  causal={causal} {name}: mode {mode}: {str(e).splitlines()[0][:160]}")
            for p in g.plans:
                cases.append((f"{name} | plan {p[0]} {p[1]}", g, p, 2.5 if bwd else 1.0))
        res = time_all([c[:3] for c in cases])
        print(f"\ncausal={causal}  TFLOP/s (causal halved; backward counts 2.5x the forward)")
        for name, _, _, mult in cases:
            ms = res[name]
            print(f"  {mult * flops / ms / 1e9:7.1f}  {ms:.3f} ms  {name}")


if __name__ == "__main__":
    main()
