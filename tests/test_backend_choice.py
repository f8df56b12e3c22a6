"""Measured choice between rival backends (fusedattn.backend_choice) and the flash
backend's rules, on CPU: timings come from a fake measurement, the rivals are fakes."""
import types

import jax
import jax.numpy as jnp
import pytest

from fusedattn import backend_choice, dispatch, plan_cache
from fusedattn.backends import flash, native_call
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
    def __init__(self, timings):
        self.timings, self.calls = timings, 0

    def __call__(self, config, candidates):
        self.calls += 1
        return [(name, *self.timings[name]) for name in candidates]


def test_each_step_gets_its_fastest_backend():
    m = Measure({"cudnn": (1.0e-3, 4.0e-3), "flash": (1.1e-3, 3.5e-3)})
    choice = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=None)
    assert (choice.inference, choice.training) == ("cudnn", "flash")
    assert choice.timings == (("cudnn", 1.0, 4.0), ("flash", 1.1, 3.5))  # ms
    assert "inference -> cudnn, training -> flash" in choice.describe()
    again = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=None)
    assert again is choice and m.calls == 1  # once per config


def test_ties_go_to_the_preferred_backend():
    m = Measure({"cudnn": (1e-3, 2e-3), "flash": (1e-3, 2e-3)})
    choice = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m)
    assert (choice.inference, choice.training) == ("cudnn", "cudnn")


def test_a_choice_persists_for_the_next_process_on_the_same_machine():
    ident = {"gpu": "H100", "cudnn": "9.19.0"}
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    first = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    backend_choice.clear()  # a new process
    later = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    assert m.calls == 1 and later.source == "persistent cache"
    assert (later.inference, later.training, later.timings) == \
        (first.inference, first.training, first.timings)
    backend_choice.clear()
    backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity={**ident, "gpu": "H200"})
    assert m.calls == 2  # another GPU measures again


def test_a_damaged_stored_choice_is_measured_again():
    ident = {"gpu": "H100"}
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    disk = backend_choice.stored_identity(ident, BASE, ("cudnn", "flash"))
    plan_cache.store_json(disk, [["cudnn", -1, 5.0], ["flash", 1.0, 4.0]])
    backend_choice.clear()
    assert backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident).source \
        == "measured now"
    assert m.calls == 2


def test_a_choice_stored_by_an_earlier_revision_is_measured_again():
    """Entries from before flash trained every config (no revision in their key) held
    no flash training time; they must not decide today's training backend."""
    ident = {"gpu": "H100"}
    old = {**ident, "what": "backend-choice", "config": repr(BASE),
           "candidates": ["cudnn", "flash"]}
    plan_cache.store_json(old, [["cudnn", 2.0, 5.0], ["flash", 1.0, None]])
    m = Measure({"cudnn": (2e-3, 5e-3), "flash": (1e-3, 4e-3)})
    choice = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    assert choice.source == "measured now" and choice.training == "flash"
    assert m.calls == 1


def test_rivals_only_when_the_group_leads_and_has_two():
    assert backend_choice.rivals("cuda", ["cudnn", "flash", "xla"]) == ("cudnn", "flash")
    assert backend_choice.rivals("cuda", ["small_seq", "cudnn", "flash", "xla"]) == ()
    assert backend_choice.rivals("cuda", ["cudnn", "xla"]) == ()
    assert backend_choice.rivals("cpu", ["xla"]) == ()


def _fake_rivals(monkeypatch):
    real = dispatch.load_backend

    def fake(name):
        if name in ("cudnn", "flash"):
            return types.SimpleNamespace(name=name, platforms=("cuda",), supports=lambda c: None)
        if name == "small_seq":
            return types.SimpleNamespace(name=name, platforms=("cuda",),
                                         supports=lambda c: "not small")
        return real(name)
    monkeypatch.setattr(dispatch, "load_backend", fake)


def test_dispatch_measures_rivals_and_explain_shows_the_timings(monkeypatch):
    _fake_rivals(monkeypatch)
    m = Measure({"cudnn": (1.0e-3, 4.0e-3), "flash": (1.2e-3, 3.0e-3)})
    monkeypatch.setattr(backend_choice, "measure_on_device", m)
    plan = dispatch.plan(build_call(Q, Q, Q)[0], platform="cuda")
    assert plan.chosen == "flash" and plan.choice.inference == "cudnn"
    text = str(plan)
    assert "measured forward / forward+backward (measured now)" in text
    assert "cudnn 1.000 / 4.000 ms" in text and "flash 1.200 / 3.000 ms" in text
    # a forced backend is never measured
    assert dispatch.plan(build_call(Q, Q, Q, mask="causal")[0], "cudnn", "cuda").choice is None
    assert m.calls == 1


def test_plan_runs_a_split_choice_through_native_call_with_both_backends(monkeypatch):
    _fake_rivals(monkeypatch)
    monkeypatch.setattr(backend_choice, "measure_on_device",
                        Measure({"cudnn": (1e-3, 4e-3), "flash": (2e-3, 3e-3)}))
    seen = []
    monkeypatch.setattr(native_call, "attention",
                        lambda backend, config, inputs: (seen.append(backend) or ("out", None)))
    config, inputs = build_call(jnp.ones((2, 128, 4, 64), jnp.bfloat16),
                                jnp.ones((2, 128, 4, 64), jnp.bfloat16),
                                jnp.ones((2, 128, 4, 64), jnp.bfloat16))
    plan = dispatch.plan(config, platform="cuda")
    assert plan.attention(inputs) == "out" and seen == [("cudnn", "flash")]


def test_measuring_off_or_failing_keeps_the_preference_order_and_says_so(monkeypatch):
    _fake_rivals(monkeypatch)
    cfg = build_call(Q, Q, Q)[0]
    monkeypatch.setenv(backend_choice.ENV_MEASURE, "0")
    plan = dispatch.plan(cfg, platform="cuda")
    assert plan.chosen == "cudnn" and plan.choice is None
    assert "FUSEDATTN_MEASURE=0" in str(plan)
    monkeypatch.setenv(backend_choice.ENV_MEASURE, "1")
    dispatch.clear_cache()

    def broken(config, candidates):
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


def test_a_backend_that_must_not_train_is_chosen_only_for_inference():
    ident = {"gpu": "H100"}
    m = Measure({"cudnn": (1.0e-3, 4.0e-3), "flash": (0.9e-3, None)})
    choice = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    assert (choice.inference, choice.training) == ("flash", "cudnn")
    assert "flash 0.900 / n/a ms" in choice.describe()
    backend_choice.clear()
    stored = backend_choice.choose(BASE, "cuda", ("cudnn", "flash"), m, identity=ident)
    assert stored.source == "persistent cache" and stored.training == "cudnn"


def test_measuring_inside_a_jit_trace_runs_the_calls():
    """Dispatch measures while the user's function is being traced: the timed calls
    must execute (on their own thread), not be staged into that trace."""
    config = build_call(jnp.ones((1, 64, 2, 16), jnp.float32), jnp.ones((1, 64, 2, 16), jnp.float32),
                        jnp.ones((1, 64, 2, 16), jnp.float32))[0]
    found = []

    def traced(x):
        found.append(backend_choice.measure_on_device(config, ("xla",)))
        return x
    jax.jit(traced)(1.0)
    (name, fwd, step), = found[0]
    assert name == "xla" and fwd > 1e-6 and step > fwd


def test_a_large_config_is_timed_at_a_smaller_batch():
    import dataclasses
    big = dataclasses.replace(BASE, batch=64, s_q=4096, s_kv=4096, h_q=32, h_kv=32)
    seen = []

    def measure(config, candidates):
        seen.append(config)
        return [(name, 1e-3, 2e-3) for name in candidates]
    choice = backend_choice.choose(big, "cuda", ("cudnn", "flash"), measure)
    assert seen[0] == dataclasses.replace(big, batch=4)  # 4 x 32 x 4096 = MAX_ROWS
    assert "at batch 4 of 64" in choice.describe()
    assert backend_choice.measured_config(BASE) is BASE
    padded = dataclasses.replace(big, sequence="padding")
    assert backend_choice.measured_config(padded) is padded  # lengths are per batch
