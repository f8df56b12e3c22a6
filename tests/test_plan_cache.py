"""The persistent cache (fusedattn.plan_cache) and the cuDNN probe's use of it, on CPU:
the native probe is a fake that records what it is handed."""
import logging
import os

import pytest

from fusedattn import plan_cache
from fusedattn.backends import cudnn
from fusedattn.backends.cudnn import graphs as cudnn_probe

IDENTITY = {"what": "test", "gpu": "H100", "key": "b1;sq64"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(plan_cache.ENV_ENABLED, raising=False)
    plan_cache.set_enabled(None)
    return tmp_path


def test_round_trip_and_one_file_per_identity(cache_dir):
    assert plan_cache.load(IDENTITY) is None
    assert plan_cache.store(IDENTITY, b"\x00plan\xff")
    assert plan_cache.load(IDENTITY) == b"\x00plan\xff"
    assert plan_cache.load({**IDENTITY, "gpu": "H200"}) is None  # another GPU: another entry
    assert plan_cache.store(IDENTITY, b"newer")  # overwritten in place
    assert plan_cache.load(IDENTITY) == b"newer"
    assert [p.name for p in cache_dir.iterdir()] == [plan_cache.path_of(IDENTITY).name]


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "header", "other_identity"])
def test_a_damaged_or_foreign_entry_is_ignored_then_rewritten(cache_dir, damage, caplog):
    plan_cache.store(IDENTITY, b"payload-bytes" * 10)
    path = plan_cache.path_of(IDENTITY)
    data = path.read_bytes()
    if damage == "flip":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "magic":
        data = b"x" + data[1:]
    elif damage == "header":
        data = data.replace(b'"size"', b'"siz"', 1)
    else:  # another identity's valid file under this identity's name (a hash collision)
        other = {**IDENTITY, "key": "other"}
        plan_cache.store(other, b"payload-bytes" * 10)
        data = plan_cache.path_of(other).read_bytes()
    path.write_bytes(data)
    with caplog.at_level(logging.INFO, logger="fusedattn"):
        assert plan_cache.load(IDENTITY) is None
    assert "ignoring cache entry" in caplog.text
    assert plan_cache.store(IDENTITY, b"rebuilt")
    assert plan_cache.load(IDENTITY) == b"rebuilt"


def test_off_switches(cache_dir, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_ENABLED, "0")
    assert plan_cache.directory() is None
    assert not plan_cache.store(IDENTITY, b"x") and plan_cache.load(IDENTITY) is None
    monkeypatch.setenv(plan_cache.ENV_ENABLED, "1")
    plan_cache.set_enabled(False)
    try:
        assert plan_cache.directory() is None
    finally:
        plan_cache.set_enabled(None)
    assert plan_cache.directory() == cache_dir


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(plan_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.directory() == tmp_path / "fusedattn"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_directory_warns_once_and_never_raises(tmp_path, monkeypatch, caplog):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.setenv(plan_cache.ENV_DIR, str(locked / "cache"))
    plan_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="fusedattn"):
        assert not plan_cache.store(IDENTITY, b"x")
        assert not plan_cache.store(IDENTITY, b"y")
    assert caplog.text.count("not writable") == 1


def test_no_temporary_file_is_left_behind(cache_dir):
    for i in range(5):
        plan_cache.store({**IDENTITY, "i": i}, b"x" * 1000)
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]
    assert len(list(cache_dir.iterdir())) == 5


def test_json_entries(cache_dir):
    assert plan_cache.store_json(IDENTITY, [["cudnn", 1.5, 2.5]])
    assert plan_cache.load_json(IDENTITY) == [["cudnn", 1.5, 2.5]]
    plan_cache.store(IDENTITY, b"{not json")
    assert plan_cache.load_json(IDENTITY) is None


# ---- the cuDNN probe with the persistent cache ---------------------------------------
class FakeNative:
    """Stands in for the extension: builds 'plans' named after the key, loads those given."""

    def __init__(self):
        self.given = []
        self.capacity = None

    def cudnn_device_identity(self):
        return {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "multiprocessors": 132}

    def cudnn_versions(self):
        return {"cudnn_runtime": 91900, "cudnn_frontend": 13200}

    def cudnn_set_cache_capacity(self, n):
        self.capacity = n

    def cudnn_check_support(self, key, plans, autotune=False):
        self.given.append(dict(plans))
        self.autotune = autotune
        fresh = {g: f"plan of {g} for {key}".encode() for g in cudnn.GRAPHS if g not in plans}
        return {"ok": True, "message": "", "workspace": {g: 16 for g in cudnn.GRAPHS},
                "from_plan": {g: g in plans for g in cudnn.GRAPHS}, "plans": fresh,
                "plan_notes": {}}


def test_the_probe_stores_fresh_plans_and_hands_stored_ones_back(cache_dir):
    first, second = FakeNative(), FakeNative()
    r = cudnn_probe._check_support(first, "key-a")
    assert first.given == [{}] and not any(r["from_plan"].values())
    r = cudnn_probe._check_support(second, "key-a")  # a second process
    assert second.given == [{g: f"plan of {g} for key-a".encode() for g in cudnn.GRAPHS}]
    assert all(r["from_plan"].values())
    cudnn_probe._check_support(second, "key-b")  # another key: nothing stored for it
    assert second.given[-1] == {}


def test_stored_plans_are_per_gpu_and_versions(cache_dir):
    cudnn_probe._check_support(FakeNative(), "key-c")
    other_gpu = FakeNative()
    other_gpu.cudnn_device_identity = lambda: {"name": "NVIDIA H200", "sm": 90,
                                               "multiprocessors": 132}
    cudnn_probe._check_support(other_gpu, "key-c")
    assert other_gpu.given == [{}]
    newer = FakeNative()
    newer.cudnn_versions = lambda: {"cudnn_runtime": 92000, "cudnn_frontend": 13200}
    cudnn_probe._check_support(newer, "key-c")
    assert newer.given == [{}]


def test_graph_cache_size_setting(monkeypatch):
    with pytest.raises(ValueError, match="entries must be an int >= 1"):
        cudnn.set_graph_cache_size(0)
    with pytest.raises(ValueError, match="entries must be an int >= 1"):
        cudnn.set_graph_cache_size(True)
    fake = FakeNative()
    monkeypatch.setattr(cudnn_probe, "_size_applied", False)
    monkeypatch.setattr(cudnn_probe, "_graph_cache_size", None)
    monkeypatch.setenv(cudnn_probe.ENV_GRAPH_CACHE_SIZE, "12")
    cudnn_probe._apply_graph_cache_size(fake)
    assert fake.capacity == 12
    monkeypatch.setattr(cudnn_probe, "_size_applied", False)
    monkeypatch.setenv(cudnn_probe.ENV_GRAPH_CACHE_SIZE, "many")
    with pytest.raises(ValueError, match="FUSEDATTN_GRAPH_CACHE_SIZE must be an int"):
        cudnn_probe._apply_graph_cache_size(fake)


# ---- plan autotuning's switch -----------------------------------------------------
@pytest.fixture
def autotune_unset(monkeypatch):
    monkeypatch.delenv(cudnn_probe.ENV_AUTOTUNE, raising=False)
    cudnn_probe.set_autotune(None)
    yield
    cudnn_probe.set_autotune(None)


def test_autotune_switch(autotune_unset, monkeypatch):
    assert cudnn_probe.autotune_enabled() is cudnn_probe.AUTOTUNE_DEFAULT
    monkeypatch.setenv(cudnn_probe.ENV_AUTOTUNE, "1")
    assert cudnn_probe.autotune_enabled()
    cudnn.set_autotune(False)  # the call wins over the environment
    assert not cudnn_probe.autotune_enabled()
    cudnn.set_autotune(None)
    monkeypatch.setenv(cudnn_probe.ENV_AUTOTUNE, "yes")
    with pytest.raises(ValueError, match="FUSEDATTN_AUTOTUNE must be 0 or 1"):
        cudnn_probe.autotune_enabled()
    with pytest.raises(TypeError, match="enabled must be a bool or None"):
        cudnn.set_autotune("on")


def test_autotuned_plans_are_stored_apart_from_the_heuristics_ones(cache_dir, autotune_unset):
    cudnn.set_autotune(False)
    heuristic = FakeNative()
    cudnn_probe._check_support(heuristic, "key-t")
    assert heuristic.autotune is False
    cudnn.set_autotune(True)
    tuned = FakeNative()
    cudnn_probe._check_support(tuned, "key-t")
    # The heuristics' plans are not handed to a tuning probe: it times every plan.
    assert tuned.given == [{}] and tuned.autotune is True
    again = FakeNative()
    cudnn_probe._check_support(again, "key-t")  # a later process: the tuned plans load
    assert set(again.given[0]) == set(cudnn.GRAPHS)


def test_probe_describes_each_graphs_plan():
    tuned = {"plans": 3, "chosen": "eng1_k2=5", "chosen_ms": 1.5, "heuristic": "eng0",
             "heuristic_ms": 1.75, "note": ""}
    probe = cudnn_probe.Probe(True, "", plan_names=("eng0", "eng0", "eng1_k2=5"),
                              from_plan=(True, False, False), tuning=(None, None, tuned))
    text = probe.describe()
    assert "forward_inference: eng0 (stored plan)" in text
    assert "forward_training: eng0 (heuristics' first plan)" in text
    assert "backward: eng1_k2=5 (autotuned among 3: 1.500 ms, heuristics' eng0 1.750 ms)" in text
    assert cudnn_probe.Probe(False, "no engine").describe() == ""
