"""What cuDNN plan autotuning gains per shape, and what it costs at the first build.

For each shape of bench_attention.py, causal and not, two configs that differ only in
an immaterial bit of their scale (so they are distinct graph-cache keys doing the
same work) are built fresh: one with the plan cuDNN's heuristics rank first, one
autotuned (every plan timed, the fastest kept). Reported:
- per graph: how many plans were timed, the heuristics' plan and the chosen one with
  their kernel times from the tuning loop (same buffers, same stream);
- the build wall time of each (the three graphs build concurrently);
- forward and forward+backward through fused_attn(backend="cudnn"), the two configs
  timed round-robin in one process, and the ratio tuned / heuristics.

    python -m benchmarks.bench_autotune [--quick]
"""
from __future__ import annotations

import argparse

import fusedattn
from benchmarks.bench_attention import SHAPES, QUICK, _inputs
from benchmarks.common import (device_meta, device_slug, print_table, run_main, step,
                               time_interleaved, warmed, write_results)
from fusedattn import dispatch, plan_cache
from fusedattn.backends import cudnn


def _probe(q, k, v, mask, scale, autotune):
    """The config's probe (built by explain's support check) and its build wall time."""
    cudnn.set_autotune(autotune)
    try:
        probe = cudnn.probe(fusedattn.explain(q, k, v, mask=mask, scale=scale,
                                              backend="cudnn").config)
        return probe, probe.wall_seconds
    finally:
        cudnn.set_autotune(None)


def bench(shapes):
    rows = []
    plan_cache.set_enabled(False)  # fresh builds, both ways
    for name, b, s, hq, hkv, d in shapes:
        q, k, v, do = _inputs(b, s, hq, hkv, d)
        for causal in (False, True):
            mask = "causal" if causal else "none"
            scales = {"heuristics": d ** -0.5, "autotuned": d ** -0.5 * (1 + 2.0 ** -20)}
            row = {"shape": name, "causal": causal}
            probes = {}
            for how, scale in scales.items():
                probes[how], row[f"{how} build s"] = _probe(q, k, v, mask, scale,
                                                            how == "autotuned")
            tuned = probes["autotuned"]
            row["plans"] = {g: t and t["plans"] for g, t in zip(cudnn.GRAPHS, tuned.tuning)}
            row["tuning"] = dict(zip(cudnn.GRAPHS, tuned.tuning))
            row["heuristics plans"] = dict(zip(cudnn.GRAPHS, probes["heuristics"].plan_names))
            row["kernel gain"] = {g: (t["heuristic_ms"] / t["chosen_ms"]) if t and t["chosen_ms"]
                                  else None for g, t in zip(cudnn.GRAPHS, tuned.tuning)}
            for mode in ("fwd", "fwd+bwd"):
                calls = {}
                for how, scale in scales.items():
                    fn = (lambda q, k, v, scale=scale: fusedattn.fused_attn(
                        q, k, v, mask=mask, scale=scale, backend="cudnn"))
                    f, args = step(fn, mode, q, k, v, do)
                    calls[how] = (warmed(f, *args), args)
                times = time_interleaved(calls)
                row[f"{mode} heuristics ms"] = 1e3 * times["heuristics"]
                row[f"{mode} autotuned ms"] = 1e3 * times["autotuned"]
                row[f"{mode} speedup"] = times["heuristics"] / times["autotuned"]
            rows.append(row)
            print(f"  {name} causal={causal}: plans {row['plans']}, kernel gain "
                  f"{row['kernel gain']}, fwd x{row['fwd speedup']:.3f}, "
                  f"fwd+bwd x{row['fwd+bwd speedup']:.3f}, build "
                  f"{row['heuristics build s']:.2f} s -> {row['autotuned build s']:.2f} s",
                  flush=True)
            for how in scales:
                print("   ", how, probes[how].describe().replace("\n", "\n    "), flush=True)
    plan_cache.set_enabled(None)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first shape only")
    args = parser.parse_args()
    meta = device_meta()
    if dispatch.current_platform() != "cuda":
        print("bench_autotune: needs a CUDA GPU; skipped")
        return
    rows = bench(QUICK if args.quick else SHAPES)
    print_table(rows, ["shape", "causal", "fwd speedup", "fwd+bwd speedup",
                       "heuristics build s", "autotuned build s"])
    print(write_results(f"autotune_{device_slug(meta)}", rows, meta))


if __name__ == "__main__":
    run_main(main)
