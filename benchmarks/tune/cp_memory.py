"""Where context parallelism's per-device memory goes: compile the forward+backward
step of one bench_sharding row and print XLA's memory plan, with the buffers
live at the peak from XLA's buffer assignment (dumped under /tmp/cp_memory_dump).

    python -m benchmarks.tune.cp_memory [--s 32768] [--strategy ring] [--zigzag-inputs]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.tune.cp_memory \
        --s 1024 --backend xla        (the harness on CPU)
"""
from __future__ import annotations

import argparse
import glob
import os

dump = "/tmp/cp_memory_dump"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                           " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run.*")

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.bench_sharding import _attention_case, _memory, _step  # noqa: E402
from fusedattn import ContextParallel  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--s", type=int, default=32768)
    p.add_argument("--strategy", default="ring")
    p.add_argument("--zigzag-inputs", action="store_true")
    p.add_argument("--backend", default="cudnn")
    p.add_argument("--top", type=int, default=25)
    o = p.parse_args()
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(devices, ("cp",))
    args, call = _attention_case(1, o.s, 16, 16, 128, o.backend)
    cp = ContextParallel("cp", strategy=o.strategy, mesh=mesh, reorder=not o.zigzag_inputs)
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in args]
    for name, fn, a in (("unsharded", _step(call()), args), ("sharded", _step(call(cp)), sharded)):
        mem = _memory(fn.lower(*a).compile())
        print(name, {k: round(v, 3) for k, v in mem.items()}, "GiB", flush=True)
    # The last two jit_run modules: the unsharded step, then the sharded one.
    reports = sorted(glob.glob(os.path.join(dump, "*jit_run*buffer-assignment.txt")),
                     key=os.path.getmtime)
    for path in reports[-2:]:
        with open(path) as f:
            text = f.read()
        at = text.find("Peak buffers")
        print(f"\n== {os.path.basename(path)}")
        print(text[at: at + 600 * o.top] if at >= 0 else "(no 'Peak buffers' section)")
    if not reports:
        print("no buffer assignment in", dump, sorted(os.listdir(dump))[:20])


if __name__ == "__main__":
    main()
