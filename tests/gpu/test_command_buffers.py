"""Native handlers stay correct with XLA's command buffers (CUDA graphs) on.

The handlers declare XLA's command-buffer trait, so XLA may capture them into
CUDA graphs; they must then do no host synchronisation and no allocation
during capture. Each case runs in a fresh process (XLA reads its flags once)
with command buffers forced on for custom calls (minimum graph size 1), and
checks that the captured step runs, replays bit-identically, and matches the
XLA backend. That XLA did capture our calls is seen from inside: each handler
counts its calls and those made while its stream was being captured
(`native.handler_counts()`); the HLO text cannot show it, since JAX 0.11's XLA
forms command buffers on the thunk sequence after the optimised HLO.

cuDNN graphs with ALiBi copy their slopes from host memory on every execute, so
they go through targets without the command-buffer trait (XLA runs them between
command buffers); their case checks that such a step, with command buffers on
for everything else, runs, replays identically, matches XLA and was never
called under capture.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent(r"""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import fusedattn
    backend, shape_q, shape_kv, target = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3]), sys.argv[4]
    alibi = fusedattn.score_mods.alibi(shape_q[2])
    padded = fusedattn.SequenceDescriptor.from_lengths(jnp.array([shape_q[1], 200]),
                                                       jnp.array([shape_kv[1], 180]))
    options = {"none": {}, "alibi": dict(mask="causal", score_mod=alibi),
               "alibi_padded": dict(mask="causal", score_mod=alibi, sequence=padded)}[sys.argv[5]]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)

    def step(q, k, v, backend):
        def loss(q, k, v):
            out = fusedattn.fused_attn(q, k, v, backend=backend, **options)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    fast = jax.jit(lambda q, k, v: step(q, k, v, backend))
    hlo = fast.lower(q, k, v).compile().as_text()
    runs = [jax.block_until_ready(fast(q, k, v)) for _ in range(3)]  # capture, then replays
    ref = jax.jit(lambda q, k, v: step(q, k, v, "xla"))(q, k, v)
    flat = lambda t: [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(t)]
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(flat(runs[-1]), flat(ref)))
    same = all(np.array_equal(a, b) for r in runs[1:] for a, b in zip(flat(r), flat(runs[0])))
    from fusedattn.backends import extension as native
    counts = {name: c for name, c in native.handler_counts().items() if name.startswith("fusedattn_")}
    print(json.dumps({"target_in_hlo": target in hlo, "handler_counts": counts,
                      "rel_err_vs_xla": rel, "replays_identical": same}))
""")


# (backend, q shape, kv shape, target in the HLO, options, handlers, captured?)
CASES = [
    ("cudnn", (2, 256, 8, 64), (2, 256, 8, 64), "fusedattn_cudnn", "none",
     ("fusedattn_cudnn_fwd", "fusedattn_cudnn_bwd"), True),
    # ALiBi lowered to a program: no host copies, captured like any graph
    ("cudnn", (2, 256, 8, 64), (2, 256, 2, 64), "fusedattn_cudnn", "alibi",
     ("fusedattn_cudnn_fwd", "fusedattn_cudnn_bwd"), True),
    # with padding lengths cuDNN's own ALiBi runs, whose execute copies the slopes
    ("cudnn", (2, 256, 8, 64), (2, 256, 2, 64), "fusedattn_cudnn_fwd_nocmdbuf", "alibi_padded",
     ("fusedattn_cudnn_fwd_nocmdbuf", "fusedattn_cudnn_bwd_nocmdbuf"), False),
    ("small_seq", (1024, 1, 8, 128), (1024, 16, 8, 128), "fusedattn_small_seq", "none",
     ("fusedattn_small_seq_fwd", "fusedattn_small_seq_bwd"), True),
]


@pytest.mark.parametrize("backend,shape_q,shape_kv,target,options,handlers,captured", CASES)
def test_handlers_with_command_buffers_on(backend, shape_q, shape_kv, target, options, handlers,
                                          captured):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    proc = subprocess.run([sys.executable, "-c", CHILD, backend, repr(shape_q), repr(shape_kv), target,
                           options],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["target_in_hlo"], result
    assert result["replays_identical"], result
    assert result["rel_err_vs_xla"] < 4e-2, result  # bf16 tolerance
    for name in handlers:  # (calls, calls made while XLA captured the stream)
        calls, under_capture = result["handler_counts"].get(name, (0, 0))
        assert calls > 0, (name, result)
        if captured:
            assert under_capture > 0, f"XLA never captured {name}: {result}"
        else:
            assert under_capture == 0, f"{name} ran under graph capture: {result}"
