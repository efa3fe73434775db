"""The LoRA bookkeeping without a model: the pool's residency (at most max_resident, the least
recently used adapter no request holds evicted, reloaded from its directory when needed), the
scheduler's ids (assigned in one place, never one still registered or draining, a load that
fails changing nothing), and the table every HTTP worker reads (a worker sees a load or an
unload with its next lookup; a new engine's table is never mistaken for the old one's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu.lora import LoraPool
from gpu.models.model_config import ModelConfig
from perf.lora_bench import write_random_adapter
from protocol.lora import LORA_MODULES, lora_target_set
from runtime.lora_registry import LoraRegistry
from runtime.scheduler.lora import LoraRefused, SchedulerLoras

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "vocab_size": 64,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def pool_of(model_dir: Path, max_resident: int, targets: tuple[str, ...] = ()) -> LoraPool:
    cfg = ModelConfig.from_dir(model_dir)
    return LoraPool(cfg, 8, lora_target_set(targets), torch.float32, torch.device("cpu"), "halves", max_resident)


def adapter(model_dir: Path, name: str, rank: int = 4, seed: int = 0) -> Path:
    return write_random_adapter(model_dir.parent / name, ModelConfig.from_dir(model_dir), rank, seed)


def adapters(model_dir: Path, names: list[str], rank: int = 4) -> list[str]:
    return [f"{n}={adapter(model_dir, n, rank, seed=i)}" for i, n in enumerate(names)]


def test_pool_evicts_the_least_recently_used_idle_adapter(model_dir):
    loras = SchedulerLoras(pool_of(model_dir, 2), adapters(model_dir, ["a", "b", "c"]), capacity=8)
    pool = loras.pool
    assert loras.ids == {"a": 1, "b": 2, "c": 3}
    assert list(pool.resident) == [1, 2] and pool.loads == 3  # c checked, then left on disk
    pool.hold(1)
    assert pool.make_resident(3)  # b is the idle one: evicted, whatever its age
    assert list(pool.resident) == [1, 3] and pool.evictions == 1 and pool.loads == 4
    pool.hold(3)
    assert not pool.make_resident(2)  # every slot held: b waits
    pool.release(1)
    assert pool.make_resident(2) and list(pool.resident) == [3, 2]
    resident = pool.resident[2]
    assert pool.make_resident(2) and pool.resident[2] is resident  # loaded once, not per request


def test_ids_are_never_reused_while_registered_or_draining(model_dir, monkeypatch):
    paths = dict(item.split("=") for item in adapters(model_dir, ["a", "b", "c"]))
    loras = SchedulerLoras(pool_of(model_dir, 4), [f"a={paths['a']}"], capacity=3)
    monkeypatch.setattr(loras, "_last_id", 65534)  # the next ids wrap past the u16 the record carries
    assert loras.load("b", paths["b"]) == 65535
    assert loras.unlist("b") == 65535 and "b" not in loras.ids and 65535 in loras.draining
    assert loras.load("c", paths["c"]) == 2  # 1 is a's; 65535 still drains
    loras.forget(65535)
    assert set(loras.pool.paths) == {1, 2}
    assert loras.unlist("nope") is None


def test_a_refused_load_changes_nothing(model_dir, tmp_path):
    paths = dict(item.split("=") for item in adapters(model_dir, ["a", "big"], rank=4))
    big = adapter(model_dir, "r16", 16, seed=5)
    loras = SchedulerLoras(pool_of(model_dir, 2), [f"a={paths['a']}"], capacity=2)
    before = (dict(loras.ids), dict(loras.pool.paths), loras.pool.loads, loras._last_id)
    for name, path, param, words in (
        ("a", paths["big"], "lora_name", "has already been loaded"),
        ("x", str(tmp_path), "lora_path", "no adapter_config.json"),
        ("x", str(big), "lora_path", "above --max-lora-rank 8"),
    ):
        with pytest.raises(LoraRefused) as e:
            loras.load(name, path)
        assert e.value.param == param and words in e.value.message
        assert (dict(loras.ids), dict(loras.pool.paths), loras.pool.loads, loras._last_id) == before
    loras.load("big", paths["big"])
    with pytest.raises(LoraRefused, match="--max-loaded-loras"):
        loras.load("x", paths["big"])


def test_target_modules_bound_what_adapters_may_target(model_dir):
    """SGLang's --lora-target-modules: its group names and `all` expand; an adapter that targets
    a projection outside them is refused naming it (adapter() targets all seven)."""
    assert lora_target_set(()) == lora_target_set(("all",)) == frozenset(LORA_MODULES)
    assert lora_target_set(("qkv_proj", "down_proj")) == {"q_proj", "k_proj", "v_proj", "down_proj"}
    with pytest.raises(ValueError, match="'mlp' is not a module"):
        lora_target_set(("mlp",))
    path = str(adapter(model_dir, "a"))
    loras = SchedulerLoras(pool_of(model_dir, 2, ("qkv_proj", "o_proj")), [], capacity=2)
    with pytest.raises(LoraRefused) as e:
        loras.load("a", path)
    assert e.value.param == "lora_path" and "targets down_proj, not among --lora-target-modules" in e.value.message
    everything = SchedulerLoras(pool_of(model_dir, 2, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")), [], 2)
    assert everything.load("a", path) == 1


def test_workers_see_each_change_with_their_next_lookup(tmp_path):
    stats = tmp_path / "engine-1.stats"
    writer = LoraRegistry.create(stats, 4)
    reader = LoraRegistry.open(stats, 4)
    assert reader is not None and LoraRegistry.open(tmp_path / "engine-2.stats", 4) is None
    writer.publish({"a": 1, "sql/v2": 7})
    assert reader.names() == {"a": 1, "sql/v2": 7} and reader.name_of(7) == "sql/v2"
    writer.publish({"a": 1})
    assert reader.names() == {"a": 1}
    writer.count(resident=1, loads=3, evictions=2)
    assert reader.counters() == {"count": 1, "resident": 1, "loads": 3, "evictions": 2}
    # a replaced engine writes the same file afresh: its first table is read, even if it looks alike
    again = LoraRegistry.create(stats, 4)
    again.publish({"b": 1})
    assert reader.names() == {"b": 1}
    assert LoraRegistry.open(stats, 8) is None  # a table shorter than the reader expects is not read
    for r in (writer, reader, again):
        r.close()


def test_a_pinned_adapter_is_never_evicted(model_dir):
    loras = SchedulerLoras(pool_of(model_dir, 3), adapters(model_dir, ["a", "b", "c"]), capacity=8)
    pool, paths = loras.pool, dict(item.split("=") for item in adapters(model_dir, ["p", "q", "r"]))
    assert list(pool.resident) == [1, 2, 3]
    p = loras.load("p", paths["p"], pinned=True)  # a full pool: the least recently used idle one makes room
    assert list(pool.resident) == [2, 3, p] and pool.pinned == {p} and pool.evictions == 1
    for lid in (1, 2, 3, 1, 2, 3):  # each in turn evicts the least recently used: never p
        assert pool.make_resident(lid) and p in pool.resident
    q = loras.load("q", paths["q"], pinned=True)
    with pytest.raises(LoraRefused) as e:  # a third pin would leave no slot for the others
        loras.load("r", paths["r"], pinned=True)
    assert e.value.param == "pinned" and "--max-loras-per-batch" in e.value.message
    assert "r" not in loras.ids and pool.pinned == {p, q}
    assert pool.make_resident(1) and set(pool.resident) == {p, q, 1}
    pool.hold(1)
    assert not pool.make_resident(2)  # the one unpinned slot is held: wait, evicting no pin
    loras.unlist("p")
    loras.forget(p)
    assert pool.pinned == {q} and pool.make_resident(2)


def test_lora_paths_take_sglangs_json_entries(model_dir):
    from protocol.lora import parse_lora_entries

    path = adapter(model_dir, "a")
    entries = [f"x={path}", json.dumps({"lora_name": "p", "lora_path": str(path), "pinned": True}), str(path)]
    assert parse_lora_entries(entries) == (("x", str(path), False), ("p", str(path), True), ("a", str(path), False))
    for bad in ('{"lora_name": "p"}', '{"lora_name": "p", "lora_path": "/x", "pinned": "yes"}', '{"x": 1}', "{"):
        with pytest.raises(ValueError, match="--lora-paths"):
            parse_lora_entries([bad])
    loras = SchedulerLoras(pool_of(model_dir, 2), entries[:2], capacity=8)
    assert loras.pool.pinned == {loras.ids["p"]}


def test_run_time_loads_are_kept_for_a_replacing_engine(model_dir, tmp_path):
    paths = dict(item.split("=") for item in adapters(model_dir, ["a", "b", "c"]))
    kept = tmp_path / "engine-1.lora-loads"
    first = SchedulerLoras(pool_of(model_dir, 4), [f"a={paths['a']}"], capacity=8)
    first.restore(kept)  # a server's first engine: nothing kept yet
    first.load("b", paths["b"], pinned=True)
    first.load("c", paths["c"])
    first.unlist("c")
    second = SchedulerLoras(pool_of(model_dir, 4), [f"a={paths['a']}"], capacity=8)
    second.restore(kept)
    assert set(second.ids) == {"a", "b"} and second.pool.pinned == {second.ids["b"]}
    Path(paths["b"], "adapter_config.json").unlink()  # gone since: left out, the rest served
    third = SchedulerLoras(pool_of(model_dir, 4), [f"a={paths['a']}"], capacity=8)
    third.restore(kept)
    assert set(third.ids) == {"a"} and json.loads(kept.read_text()) == []
