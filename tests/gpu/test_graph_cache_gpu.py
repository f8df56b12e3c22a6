"""The cuDNN graph cache on a CUDA GPU: eight threads tracing and running at once
(distinct and shared configs: no crash, one build per graph, correct results), the
LRU bound, persistent plans across processes (a second process loads its
graphs from the stored plans; damaged entries are ignored and rewritten), and
plan autotuning (the fastest plan runs and is correct, deterministic configs stay
deterministic, an evicted tuned graph comes back with its own plan)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import cudnn

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _on_cuda():
    if dispatch.current_platform() != "cuda":
        pytest.skip("needs a CUDA GPU (cuDNN)")


def _inputs(seed, b=2, s=256, h=4, d=64):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(k, (b, s, h, d), jnp.bfloat16) for k in keys)


def _step(scale, **options):
    """A jitted forward + backward of a config no other test builds (its scale)."""
    def loss(q, k, v, d_out):
        out = fusedattn.fused_attn(q, k, v, mask="causal", scale=scale, backend="cudnn",
                                   **options)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _reference(scale, args):
    def loss(q, k, v, d_out):
        out = fusedattn.fused_attn(q, k, v, mask="causal", scale=scale, backend="xla")
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)


def _close(got, want, tol=4e-2):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= tol * max(np.linalg.norm(w), 1e-6)


def test_eight_threads_trace_and_run_distinct_and_shared_configs():
    base = cudnn.graph_cache_stats()
    scales = [0.0711 + i * 1e-6 for i in range(4)]   # 4 fresh configs
    jobs = [scales[i % 4] for i in range(8)]          # each shared by two threads
    jobs[7] = scales[0]                               # and one by three
    args = [_inputs(i) for i in range(8)]
    results, errors = [None] * 8, []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            results[i] = jax.block_until_ready(_step(jobs[i])(*args[i]))
        except Exception as e:  # reported below, with the thread's index
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        _close(results[i], _reference(jobs[i], args[i]))
    after = cudnn.graph_cache_stats()
    # one build per graph of each distinct config: 3 graphs x 4 configs, no duplicate
    assert after["builds"] - base["builds"] == 12, (base, after)


def test_the_cache_is_bounded_and_an_evicted_graph_is_rebuilt():
    stats = cudnn.graph_cache_stats()
    try:
        cudnn.set_graph_cache_size(6)
        assert cudnn.graph_cache_stats()["entries"] <= 6
        steps = {s: _step(s) for s in (0.0811, 0.0812, 0.0813)}
        args = _inputs(11)
        first = {s: jax.block_until_ready(f(*args)) for s, f in steps.items()}
        now = cudnn.graph_cache_stats()
        assert now["entries"] <= 6 and now["evictions"] > stats["evictions"], now
        # the first config's graphs were evicted: its next call rebuilds (or reloads) them
        again = jax.block_until_ready(steps[0.0811](*args))
        _close(again, first[0.0811], tol=1e-2)
        assert cudnn.graph_cache_stats()["builds"] > now["builds"]
    finally:
        cudnn.set_graph_cache_size(stats["capacity"])


CHILD = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    import fusedattn
    from fusedattn.backends import cudnn
    from fusedattn.config import AttnConfig
    jax.devices()
    cfg = AttnConfig(batch=2, s_q=512, s_kv=512, h_q=4, h_kv=4, d_qk=128, d_v=128,
                     dtype="bfloat16", scale=0.0901, mask="causal")
    t0 = time.perf_counter()
    probe = cudnn.probe(cfg)
    probe_s = time.perf_counter() - t0
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, d = (jax.random.normal(x, (2, 512, 4, 128), jnp.bfloat16) for x in keys)
    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask="causal", scale=0.0901, backend="cudnn")
        return jnp.sum(out.astype(jnp.float32) * d.astype(jnp.float32))
    out = fusedattn.fused_attn(q, k, v, mask="causal", scale=0.0901, backend="cudnn")
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    np.savez(sys.argv[1], out=np.asarray(out, np.float32),
             **{n: np.asarray(g, np.float32) for n, g in zip(("dq", "dk", "dv"), grads)})
    print("RESULT" + json.dumps({"ok": probe.ok, "from_plan": probe.from_plan,
                                 "notes": probe.plan_notes, "probe_s": probe_s}))
""")


def _child(cache_dir, out_path):
    env = dict(os.environ, FUSEDATTN_CACHE_DIR=str(cache_dir))
    env.pop("FUSEDATTN_PLAN_CACHE", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(out_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    # XLA repeats its own errors after a failed one: show each distinct line once.
    lines = (re.sub(r"^[EWI]\d{4} [\d:.]+ +\d+ ", "", x) for x in done.stderr.splitlines())
    assert done.returncode == 0, "\n".join(dict.fromkeys(lines))[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):]), dict(np.load(out_path))


def test_a_second_process_loads_the_stored_plans(tmp_path):
    cache = tmp_path / "cache"
    cold, first = _child(cache, tmp_path / "a.npz")
    assert cold["ok"] and cold["from_plan"] == [False] * 3, cold
    assert len(list(cache.iterdir())) == 3  # one serialized plan per graph
    warm, second = _child(cache, tmp_path / "b.npz")
    assert warm["ok"] and warm["from_plan"] == [True] * 3, warm
    np.testing.assert_array_equal(second["out"], first["out"])  # the same plan ran
    for name in ("dq", "dk", "dv"):
        w = first[name]
        assert np.linalg.norm(second[name] - w) <= 1e-2 * np.linalg.norm(w)
    print(f"probe: cold process {cold['probe_s']:.3f} s, warm {warm['probe_s']:.3f} s")

    for entry in cache.iterdir():  # damage every entry: ignored, rebuilt, rewritten
        data = bytearray(entry.read_bytes())
        data[-10] ^= 0xFF
        entry.write_bytes(bytes(data))
    damaged, third = _child(cache, tmp_path / "c.npz")
    assert damaged["ok"] and damaged["from_plan"] == [False] * 3, damaged
    np.testing.assert_array_equal(third["out"], first["out"])
    healed, _ = _child(cache, tmp_path / "d.npz")
    assert healed["from_plan"] == [True] * 3, healed


@pytest.fixture
def autotuned():
    cudnn.set_autotune(True)
    yield
    cudnn.set_autotune(None)


def _tuning(scale, args, **options):
    plan = fusedattn.explain(*args[:3], mask="causal", scale=scale, backend="cudnn", **options)
    probe = cudnn.probe(plan.config)
    print(plan)
    return probe


@pytest.mark.parametrize("d", [64, 128])
def test_autotuned_graphs_run_the_fastest_plan_and_are_correct(autotuned, d):
    scale = 0.0733 + d * 1e-6
    args = _inputs(21, s=512, d=d)
    got = jax.block_until_ready(_step(scale)(*args))
    _close(got, _reference(scale, args))
    probe = _tuning(scale, args)
    for graph, tuned in zip(cudnn.GRAPHS, probe.tuning):
        assert tuned is not None, graph
        if tuned["plans"] > 1:
            assert tuned["chosen_ms"] <= tuned["heuristic_ms"], (graph, tuned)
        else:
            assert tuned["note"], (graph, tuned)
    assert "autotune" in str(fusedattn.explain(*args[:3], mask="causal", scale=scale,
                                                backend="cudnn"))


def test_an_autotuned_deterministic_backward_is_bitwise_reproducible(autotuned):
    scale = 0.0744
    args = _inputs(22, s=512, d=128)
    step = _step(scale, deterministic=True)
    first, second = (jax.block_until_ready(step(*args)) for _ in range(2))
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _close(first, _reference(scale, args))
    assert all(t is not None for t in _tuning(scale, args, deterministic=True).tuning)


def test_an_evicted_autotuned_graph_comes_back_with_its_own_plan(autotuned):
    stats = cudnn.graph_cache_stats()
    try:
        steps = {s: _step(s) for s in (0.0821, 0.0822, 0.0823)}
        args = _inputs(23)
        first = jax.block_until_ready(steps[0.0821](*args))
        cudnn.set_graph_cache_size(3)  # only the last config's three graphs stay
        for s in (0.0822, 0.0823):
            jax.block_until_ready(steps[s](*args))
        before = cudnn.graph_cache_stats()
        again = jax.block_until_ready(steps[0.0821](*args))
        after = cudnn.graph_cache_stats()
        # rebuilt from the plan autotuning chose, not from the heuristics
        assert after["from_plans"] > before["from_plans"], (before, after)
        np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(first[0]))
    finally:
        cudnn.set_graph_cache_size(stats["capacity"])
