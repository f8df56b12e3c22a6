"""cudnn-frontend's own attention graphs (sdpa / sdpa_fp8, forward or backward) on
cupy buffers: no JAX, no FFI. The ceiling our cuDNN calls are measured against
(`bench_fp8.py`) and the subject of `tune/fp8_kernels.py`. Needs cudnn-frontend's Python bindings
and cupy; importing this module without them raises ImportError.
"""
from __future__ import annotations

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


class RawCall:
    """A Graph's first built plan (the heuristics' first, where it builds) as a `fn()`
    that benchmarks/common.py's wall-clock timer can call."""

    def __init__(self, graph):
        self.graph = graph

    def __call__(self):
        self.graph.run(self.graph.plans[0], 1)
        return self

    def block_until_ready(self):
        cp.cuda.Device().synchronize()
        return self
