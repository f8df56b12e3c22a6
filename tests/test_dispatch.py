"""Dispatch: preference order, forced backends, reasons, caching and the log line."""
import logging
import types

import jax
import jax.numpy as jnp
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.dispatch import registry
from fusedattn.validation import build_call

Q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)


@pytest.fixture(autouse=True)
def fresh_cache():
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def test_cpu_picks_xla_and_explains_the_rest():
    plan = fusedattn.explain(Q, Q, Q, mask="causal")
    assert plan.platform == "cpu" and plan.chosen == "xla"
    reasons = dict(plan.reasons)
    assert set(reasons) == set(dispatch.ALL_BACKENDS)
    assert reasons["xla"] is None
    for name in ("cudnn", "ck", "small_seq"):
        assert reasons[name], f"{name} must say why it cannot run on the CPU"
    text = str(plan)
    assert ">> xla" in text and "chosen" in text


def test_forced_backend_that_cannot_serve_lists_every_reason():
    plan = fusedattn.explain(Q, Q, Q, backend="cudnn")
    assert plan.chosen is None
    with pytest.raises(dispatch.UnsupportedError) as err:
        plan.backend
    msg = str(err.value)
    assert "backend 'cudnn' cannot run" in msg
    for name in dispatch.ALL_BACKENDS:
        assert name in msg


def test_fused_attn_raises_for_unservable_forced_backend():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(dispatch.UnsupportedError, match="cudnn"):
        fusedattn.fused_attn(q, q, q, backend="cudnn")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        fusedattn.explain(Q, Q, Q, backend="flash2")


def test_environment_forces_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "ck")
    plan = fusedattn.explain(Q, Q, Q)
    assert plan.requested == "ck" and plan.chosen is None
    monkeypatch.setenv(dispatch.ENV_BACKEND, "xla")
    assert fusedattn.explain(Q, Q, Q).chosen == "xla"


def test_an_explicit_backend_argument_beats_the_environment(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "ck")
    assert fusedattn.explain(Q, Q, Q, backend="xla").chosen == "xla"


def test_preference_order_and_broken_backends(monkeypatch):
    """A backend whose supports() crashes (its extension fails to load, a bug) is a reason,
    not a crash."""
    cfg, _ = build_call(Q, Q, Q)

    def cannot_load(config):
        raise ImportError("libcudnn.so.9: cannot open shared object file")
    monkeypatch.setitem(registry.BACKENDS, "cudnn", types.SimpleNamespace(
        name="cudnn", platforms=("cuda",), supports=cannot_load))
    monkeypatch.setitem(registry.BACKENDS, "small_seq", types.SimpleNamespace(
        name="small_seq", platforms=("cuda",), supports=lambda c: 1 / 0))
    plan = dispatch.plan(cfg, platform="cuda")
    reasons = dict(plan.reasons)
    assert [n for n, _ in plan.reasons][:6] == ["small_seq", "block_sparse", "cudnn", "flash",
                                                "block_sparse_xla", "xla"]
    assert "ZeroDivisionError" in reasons["small_seq"]
    assert "libcudnn.so.9" in reasons["cudnn"]
    assert plan.chosen == "xla"


def test_plan_is_cached_and_logged_once(caplog):
    cfg, _ = build_call(Q, Q, Q, mask="causal_bottom_right")
    with caplog.at_level(logging.INFO, logger="fusedattn"):
        first = dispatch.plan(cfg)
        second = dispatch.plan(cfg)
    assert first is second
    lines = [r for r in caplog.records if "causal_bottom_right" in r.getMessage()]
    assert len(lines) == 1 and "-> xla" in lines[0].getMessage()


def test_platform_can_be_faked_for_tests(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    assert dispatch.current_platform() == "rocm"
    plan = fusedattn.explain(Q, Q, Q)
    assert [n for n, _ in plan.reasons][:3] == ["small_seq", "ck", "xla"]
