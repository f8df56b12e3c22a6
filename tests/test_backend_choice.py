"""Measured choice between rival backends (fusedattn.backend_choice) and the flash
backend's rules, on CPU: timings come from a fake measurement, the rivals are fakes."""
import types

import jax
import jax.numpy as jnp
import pytest

from fusedattn import dispatch, plan_cache

from fusedattn.dispatch import measure as backend_choice
from fusedattn.dispatch import registry
from fusedattn.backends import flash
from fusedattn.backends import native_op as native_call
from fusedattn.config import AttnConfig
from fusedattn.validation import build_call

Q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
BASE = AttnConfig(batch=2, s_q=128, s_kv=128, h_q=4, h_kv=4, d_qk=64, d_v=64,
                  dtype="bfloat16", scale=0.125)


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(backend_choice.ENV_MEASURE, raising=False)
    backend_choice.clear()
    dispatch.clear_cache()
    yield
    backend_choice.clear()
    dispatch.clear_cache()


class Measure:
    """A fake measurement: `timings[name]` = (forward s, forward+backward s)."""
    def __init__(self, timings):
        self.timings, self.calls = timings, []

    def __call__(self, config, candidates, step):
        self.calls.append(step)
        return [(name, self.timings[name][backend_choice.STEPS.index(step)])
                for name in candidates]


def choose(step, m, identity=None):
    return backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), step, m, identity=identity)


def test_each_step_gets_its_fastest_backend_measured_once():
    m = Measure({"cudnn": (1.0e-3, 4.0e-3), "flash": (1.1e-3, 3.5e-3)})
    inference, training = choose("inference", m), choose("training", m)
    assert (inference.backend, training.backend) == ("cudnn", "flash")
    assert inference.timings == (("cudnn", 1.0), ("flash", 1.1))  # ms
    assert training.timings == (("cudnn", 4.0), ("flash", 3.5))
    assert training.describe() == ("training (forward+backward: cudnn 4.000 ms, flash 3.500 "
                                   "ms; measured now) -> flash")
    assert choose("training", m) is training and m.calls == ["inference", "training"]
    with pytest.raises(ValueError, match="step must be one of"):
        choose("backward", m)


def test_ties_go_to_the_preferred_backend():
    m = Measure({"cudnn": (1e-3, 2e-3), "flash": (1e-3, 2e-3)})
    assert choose("inference", m).backend == choose("training", m).backend == "cudnn"


def test_a_choice_persists_for_the_next_process_on_the_same_machine():
    ident = {"gpu": "H100", "cudnn": "9.19.0"}
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    first = choose("training", m, ident)
    backend_choice.clear()  # a new process
    later = choose("training", m, ident)
    assert m.calls == ["training"] and later.source == "persistent cache"
    assert (later.backend, later.timings) == (first.backend, first.timings)
    choose("inference", m, ident)  # the other step was never measured
    backend_choice.clear()
    choose("training", m, {**ident, "gpu": "H200"})
    assert m.calls == ["training", "inference", "training"]  # another GPU measures again


def test_a_damaged_stored_choice_is_measured_again():
    ident = {"gpu": "H100"}
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    choose("training", m, ident)
    disk = backend_choice.stored_identity(ident, BASE, ("cudnn", "flash"), "training")
    plan_cache.store_json(disk, [["cudnn", -1], ["flash", 4.0]])
    backend_choice.clear()
    assert choose("training", m, ident).source == "measured now"
    assert len(m.calls) == 2


def test_a_choice_stored_by_an_earlier_revision_is_measured_again():
    """Entries of revision 2 held both steps in one entry; those from before flash
    trained every config (no revision in their key) no flash training time. Neither
    decides today's choice."""
    ident = {"gpu": "H100"}
    for old in ({**ident, "what": "backend-choice", "config": repr(BASE),
                 "candidates": ["cudnn", "flash"]},
                {**ident, "what": "backend-choice", "revision": 2, "config": repr(BASE),
                 "candidates": ["cudnn", "flash"]}):
        plan_cache.store_json(old, [["cudnn", 2.0, 5.0], ["flash", 1.0, None]])
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    choice = choose("training", m, ident)
    assert choice.source == "measured now" and choice.backend == "flash"


def test_a_failed_measurement_leaves_the_preference_and_says_why():
    def broken(config, candidates, step):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore")
    choice = choose("training", broken, {"gpu": "H100"})
    assert choice.backend == "cudnn" and choice.timings == ()
    assert "measuring cudnn and flash failed (RuntimeError: RESOURCE_EXHAUSTED: out of " \
        "memory): preference order decides" in choice.describe()


def test_rivals_only_when_the_group_leads_and_has_two():
    assert backend_choice.rivals("cuda", ["cudnn", "flash", "xla"]) == ("cudnn", "flash")
    assert backend_choice.rivals("cuda", ["small_seq", "cudnn", "flash", "xla"]) == ()
    assert backend_choice.rivals("cuda", ["cudnn", "xla"]) == ()
    assert backend_choice.rivals("cpu", ["xla"]) == ()


def _fake_rivals(monkeypatch):
    for name in ("cudnn", "flash"):
        monkeypatch.setitem(registry.BACKENDS, name, types.SimpleNamespace(
            name=name, platforms=("cuda",), supports=lambda c: None))
    monkeypatch.setitem(registry.BACKENDS, "small_seq", types.SimpleNamespace(
        name="small_seq", platforms=("cuda",), supports=lambda c: "not small"))


def test_dispatch_measures_each_step_when_first_needed_and_explain_shows_it(monkeypatch):
    _fake_rivals(monkeypatch)
    m = Measure({"cudnn": (1.0e-3, 4.0e-3), "flash": (1.2e-3, 3.0e-3)})
    monkeypatch.setattr(backend_choice, "measure_on_device", m)
    plan = dispatch.plan(build_call(Q, Q, Q)[0], platform="cuda")
    assert m.calls == []  # planning measures nothing
    assert plan.chosen == "flash" and m.calls == ["training"]
    text = str(plan)
    assert m.calls == ["training", "inference"]
    assert "measured: inference (forward: cudnn 1.000 ms, flash 1.200 ms; measured now) " \
        "-> cudnn" in text
    assert "measured: training (forward+backward: cudnn 4.000 ms, flash 3.000 ms; " \
        "measured now) -> flash" in text
    # a forced backend is never measured
    assert dispatch.plan(build_call(Q, Q, Q, mask="causal")[0], "cudnn", "cuda").rivals is None
    assert len(m.calls) == 2


def _traced_steps(monkeypatch, timings):
    """A plan between fake rivals whose native calls record (step, backend) as traced."""
    _fake_rivals(monkeypatch)
    m = Measure(timings)
    monkeypatch.setattr(backend_choice, "measure_on_device", m)
    seen = []

    def forward(backend, config, inputs, training):
        seen.append(("training" if training else "inference", backend))
        return inputs.q, (jnp.zeros(inputs.q.shape[:3], jnp.float32) if training else None)

    def backward(backend, config, inputs, out, lse, d_out):
        seen.append(("backward", backend))
        return inputs._replace(q=d_out, k=jnp.zeros_like(inputs.k), v=jnp.zeros_like(inputs.v))
    monkeypatch.setattr(native_call, "forward", forward)
    monkeypatch.setattr(native_call, "backward", backward)
    x = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    config, inputs = build_call(x, x, x)
    return dispatch.plan(config, platform="cuda"), inputs, m, seen


def test_a_training_step_measures_and_runs_only_the_training_choice(monkeypatch):
    plan, inputs, m, seen = _traced_steps(
        monkeypatch, {"cudnn": (1e-3, 4e-3), "flash": (2e-3, 3e-3)})
    jax.jit(jax.grad(lambda q: plan.run(inputs._replace(q=q)).astype(
        jnp.float32).sum()))(inputs.q)
    assert m.calls == ["training"]
    assert seen == [("training", "flash"), ("backward", "flash")]


def test_a_call_without_gradient_measures_and_runs_only_the_inference_choice(monkeypatch):
    plan, inputs, m, seen = _traced_steps(
        monkeypatch, {"cudnn": (1e-3, 4e-3), "flash": (2e-3, 3e-3)})
    jax.jit(lambda q: plan.run(inputs._replace(q=q)))(inputs.q)
    assert m.calls == ["inference"] and seen == [("inference", "cudnn")]


def test_measuring_off_or_failing_keeps_the_preference_order_and_says_so(monkeypatch):
    _fake_rivals(monkeypatch)
    cfg = build_call(Q, Q, Q)[0]
    monkeypatch.setenv(backend_choice.ENV_MEASURE, "0")
    plan = dispatch.plan(cfg, platform="cuda")
    assert plan.chosen == "cudnn" and plan.rivals is None
    assert "FUSEDATTN_MEASURE=0" in str(plan)
    monkeypatch.setenv(backend_choice.ENV_MEASURE, "1")
    dispatch.clear_cache()

    def broken(config, candidates, step):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    monkeypatch.setattr(backend_choice, "measure_on_device", broken)
    plan = dispatch.plan(cfg, platform="cuda")
    assert plan.chosen == "cudnn" and "measuring cudnn and flash failed" in str(plan)
    assert "out of memory" in str(plan)


@pytest.mark.parametrize("change, words", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(layout="sbhd"), "layout sbhd"),
    (dict(qkv_packing="qkv"), "packed qkv"),
    (dict(sequence="padding"), "padding sequences"),
    (dict(d_qk=256, d_v=256), "head dim 256"),
    (dict(d_v=32), "d_qk 64 != d_v 32"),
    (dict(bias_shape=(1, 1, 128, 128)), "bias"),
    (dict(dropout=0.1), "dropout"),
    (dict(softmax="off_by_one"), "no sink"),
    (dict(deterministic=True), "atomics"),
    (dict(s_kv=256, mask="causal"), "aligns them bottom-right"),
    (dict(s_q=256, mask="causal_bottom_right"), "rows without keys"),
    (dict(precision="fp8"), "FP8"),
])
def test_flash_refuses_what_it_cannot_compute_exactly(change, words):
    import dataclasses
    why = flash.config_reason(dataclasses.replace(BASE, **change))
    assert why is not None and words in why, why


@pytest.mark.parametrize("change", [
    dict(), dict(mask="causal"), dict(s_kv=256, mask="causal_bottom_right"),
    dict(h_kv=1), dict(window=(32, 0), mask="causal"), dict(window=(16, 16)),
])
def test_flash_takes_what_it_computes_exactly(change):
    import dataclasses
    assert flash.config_reason(dataclasses.replace(BASE, **change)) is None


def test_flash_mask_arguments():
    import dataclasses
    assert flash._mask_args(BASE) == dict(softmax_scale=0.125, is_causal=False,
                                          window_size=(-1, -1))
    assert flash._mask_args(dataclasses.replace(BASE, mask="causal"))["is_causal"]
    band = flash._mask_args(dataclasses.replace(BASE, mask="causal", window=(32, 0)))
    assert band["window_size"] == (32, 0) and not band["is_causal"]


def test_flash_on_a_machine_without_it_says_how_to_get_it():
    why = flash.BACKEND.supports(BASE)
    assert why is not None and ("flash-attn3-jax" in why or "Hopper" in why)


def test_measuring_inside_a_jit_trace_runs_the_calls():
    """Dispatch measures while the user's function is being traced: the timed calls
    must execute (on their own thread), not be staged into that trace."""
    # Large enough that a training step (forward and backward) outlasts the forward
    # clearly on a busy CPU: at 64 tokens call overheads decided the order.
    x = jnp.ones((1, 512, 2, 64), jnp.float32)
    config = build_call(x, x, x)[0]
    found = []

    def traced(x):
        found.extend(backend_choice.measure_on_device(config, ("xla",), step)[0]
                     for step in backend_choice.STEPS)
        return x
    jax.jit(traced)(1.0)
    (name, fwd), (_, step) = found
    assert name == "xla" and fwd > 1e-6 and step > fwd


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_timing_inputs_are_random_numbers_of_sane_size(dtype):
    import numpy as np
    a, b = backend_choice._random_inputs(((64, 128), (64, 128)), jnp.dtype(dtype))
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.dtype == np.float32 and a.shape == (64, 128)
    assert 0.125 <= np.abs(a).min() and np.abs(a).max() < 2  # no zeros, infs or NaNs
    assert 0.4 < (a < 0).mean() < 0.6 and len(np.unique(a)) > 1000
    assert not np.array_equal(a, b) and not np.array_equal(a[:, 1:], b[:, :-1])


def test_a_large_config_is_timed_at_a_smaller_batch():
    import dataclasses
    big = dataclasses.replace(BASE, batch=64, s_q=4096, s_kv=4096, h_q=32, h_kv=32)
    seen = []

    def measure(config, candidates, step):
        seen.append(config)
        return [(name, 1e-3) for name in candidates]
    choice = backend_choice.choose(big, "cuda", ("cudnn", "flash"), "training", measure)
    assert seen[0] == dataclasses.replace(big, batch=4)  # 4 x 32 x 4096 = MAX_ROWS
    assert "at batch 4 of 64" in choice.describe()
    assert backend_choice.measured_config(BASE) is BASE
    padded = dataclasses.replace(big, sequence="padding")
    assert backend_choice.measured_config(padded) is padded  # lengths are per batch
