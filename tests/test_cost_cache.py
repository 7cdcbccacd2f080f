"""Draft costs cached on disk (selfspec.cost_cache): a second load reads them instead of measuring; a changed
key, a failed plain-step check, a corrupt entry or ``tune="refresh"`` measure them again; fixed-gamma drafts
never measure. No timing is asserted: the check's plain step is replaced by a chosen figure."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import tiny_model

import selfspec.cost_cache as cost_cache
from selfspec import DraftConfig, SelfSpec
from selfspec.costs import DraftCosts
from selfspec.kernels.build import cpu_extension

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT = DraftConfig(head="lm", exit_layer=2, tune="off")  # adaptive (gamma=None): needs the costs, no calibration


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    cpu_extension()  # the kernels from the usual cache first (built into an empty one, they take a minute)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def counted(monkeypatch):
    """Counts measure_draft_costs calls; the check's plain step is ``step["s"]`` seconds (no timing), and a measured
    shallow pass is capped at that step, so a busy machine cannot make a measurement implausible (measured again)."""
    calls: list[int] = []
    step = {"s": 0.01}
    real = cost_cache.measure_draft_costs

    def measure(split, head, **kw):
        calls.append(kw.get("exit_layer"))
        costs = real(split, head, **kw)
        return dataclasses.replace(costs, t_shallow=min(costs.t_shallow, step["s"]))

    monkeypatch.setattr(cost_cache, "measure_draft_costs", measure)
    monkeypatch.setattr(cost_cache, "plain_step", lambda split: step["s"])
    return calls, step


def load(draft: DraftConfig = DRAFT) -> SelfSpec:
    return SelfSpec(tiny_model("llama"), None, draft)


def entries() -> list:
    return sorted((cost_cache.cache_root() / "costs").glob("*.json"))


def test_draft_costs_round_trip_through_json():
    c = DraftCosts(2, 0.001, 0.0002, {1: 0.01, 4: 0.02}, {1: 0.001, 4: 0.003}, tree_width=3)
    assert DraftCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(KeyError):
        DraftCosts.from_dict({"exit_layer": 2})


def test_a_second_load_reads_the_costs_instead_of_measuring(counted):
    calls, _ = counted
    first = load()
    assert calls == [2] and len(entries()) == 1 and first.cost_cache.log == ["2: measured (no entry)"]
    second = load()  # a new load of the same model, head and depth on the same machine
    assert calls == [2] and second.cost_cache.log == ["2: cached"]
    assert second.draft_costs(second.head) == first.draft_costs(first.head)
    second.set_draft(DRAFT)  # within one load: from memory
    assert calls == [2] and second.cost_cache.log == ["2: cached"]


def test_another_depth_threads_or_kernel_build_measure_again(counted, monkeypatch):
    calls, _ = counted
    load()
    load(DraftConfig(head="lm", exit_layer=1, tune="off"))  # another depth: its own entry
    assert calls == [2, 1] and len(entries()) == 2
    torch.set_num_threads(2)  # restored by one_thread
    load()
    assert calls == [2, 1, 2]
    torch.set_num_threads(1)
    real_hash = cost_cache.kernel_source_hash
    monkeypatch.setattr(cost_cache, "kernel_source_hash", lambda: "other-kernels")  # the kernels rebuilt
    load()
    assert calls == [2, 1, 2, 2] and len(entries()) == 4
    monkeypatch.setattr(cost_cache, "kernel_source_hash", real_hash)
    assert load().cost_cache.log == ["2: cached"] and calls == [2, 1, 2, 2]  # the first entry is still valid


def test_a_plain_step_off_by_more_than_the_factor_measures_again(counted):
    calls, step = counted
    load()
    step["s"] = 0.01 * 1.2  # within CHECK_FACTOR: cached
    assert load().cost_cache.log == ["2: cached"] and calls == [2]
    step["s"] = 0.01 * 2  # slower by 2x (timed twice, both slow): measured again, the new step kept
    ss = load()
    assert calls == [2, 2] and ss.cost_cache.log[0].startswith("2: measured (plain step 0.0200 s, cached 0.0100 s")
    assert json.loads(entries()[0].read_text())["check_s"] == 0.02
    assert load().cost_cache.log == ["2: cached"] and calls == [2, 2]
    step["s"] = 0.02 / 2  # faster by 2x: measured again too
    load()
    assert calls == [2, 2, 2]


@pytest.mark.parametrize("garbage", ["", "{not json", "[]", '{"key": null}', "KEY"])
def test_a_corrupt_entry_is_measured_again(counted, garbage):
    calls, _ = counted
    first = load()
    path = entries()[0]
    if garbage == "KEY":  # the right key, costs missing a field
        data = json.loads(path.read_text())
        del data["costs"]["t_deep"]
        garbage = json.dumps(data)
    path.write_text(garbage)
    second = load()
    assert calls == [2, 2] and second.cost_cache.log == ["2: measured (no entry)"]
    assert second.draft_costs(second.head).exit_layer == first.draft_costs(first.head).exit_layer
    assert load().cost_cache.log == ["2: cached"]  # rewritten whole
    assert not list(path.parent.glob(".*.tmp"))  # no temporary file left behind


def test_refresh_measures_the_costs_again(counted):
    calls, _ = counted
    load()
    ss = load(DraftConfig(head="lm", exit_layer=2, tune="refresh"))  # calibrates, with fresh costs
    assert calls == [2, 2] and ss.cost_cache.log == ["2: measured (refresh)"]
    assert ss.tuning_result is not None
    again = load(DraftConfig(head="lm", exit_layer=2))  # tune='auto': the calibration and the costs cached
    assert calls == [2, 2] and again.cost_cache.log == ["2: cached"] and again.tuning_result == ss.tuning_result


def test_a_fixed_draft_neither_measures_nor_checks(monkeypatch):
    monkeypatch.setattr(cost_cache, "measure_draft_costs", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(cost_cache, "plain_step", lambda split: pytest.fail("checked"))
    ss = load(DraftConfig(head="lm", exit_layer=2, gamma=3, policy="confidence"))
    assert ss.cost_cache.log == [] and not entries()


def test_a_head_replaced_in_the_same_directory_is_calibrated_again(tmp_path):
    """The caches know a head by its directory, weights' size and a digest of its head_config.json: a head
    retrained in place (same architecture, same file size, another exit layer) gets new keys."""
    from selfspec.cost_cache import cost_key
    from selfspec.heads.io import load_head, new_head, save_head
    from selfspec.tuning import tuning_key

    ss = SelfSpec(tiny_model("llama"), None, DRAFT)
    keys, sizes = [], set()
    for k in (2, 0):  # the same deep head's shapes at two exit layers, saved into one directory in turn
        head = new_head("deep", ss.split, k)
        head.init_from_target()
        save_head(head, tmp_path / "head")
        loaded = load_head(tmp_path / "head", ss.split)
        keys.append((tuning_key(ss.split, loaded), cost_key(ss.split, loaded, 2)))
        sizes.add((tmp_path / "head" / "head.safetensors").stat().st_size)
    assert len(sizes) == 1 and keys[0][0] != keys[1][0] and keys[0][1]["head"]["id"] != keys[1][1]["head"]["id"]
    again = load_head(tmp_path / "head", ss.split)
    assert tuning_key(ss.split, again) == keys[1][0]  # unchanged head, unchanged key
    (tmp_path / "sub").mkdir()
    relative = load_head(tmp_path / "sub" / ".." / "head", ss.split)  # another path to the same head: the same keys
    assert tuning_key(ss.split, relative) == keys[1][0] and cost_key(ss.split, relative, 2) == keys[1][1]


def test_an_entry_with_a_shallow_pass_dearer_than_a_step_is_measured_again(counted):
    """Costs timed in a busy moment can pass the plain-step check (measured on this CPU: a tiny model's shallow
    pass cached at 40 ms against a 0.2 ms step); a shallow pass dearer than a whole step is measured again."""
    calls, step = counted
    load()
    path = entries()[0]
    data = json.loads(path.read_text())
    data["costs"]["t_shallow"] = 10 * data["check_s"]
    path.write_text(json.dumps(data))
    again = load()
    assert calls == [2, 2] and len(again.cost_cache.log) == 1
    assert again.cost_cache.log[0].startswith("2: measured (implausible: shallow pass ")
    assert load().cost_cache.log == ["2: cached"]  # the new entry is sound


def test_costs_measured_in_a_busy_moment_are_measured_once_more(counted, monkeypatch):
    """A fresh measurement whose shallow pass came out dearer than a whole step (a busy moment) is taken again,
    once, with the step timed beside it; the second one is what is cached."""
    calls, step = counted
    real = cost_cache.measure_draft_costs
    results: list[float] = []

    def busy_first(split, head, **kw):
        costs = real(split, head, **kw)
        if not results:  # the first measurement: its shallow pass as if every thread had waited for a time slice
            costs = dataclasses.replace(costs, t_shallow=10 * step["s"])
        results.append(costs.t_shallow)
        return costs

    monkeypatch.setattr(cost_cache, "measure_draft_costs", busy_first)
    ss = load()
    assert len(results) == 2 and results[0] == 10 * step["s"] and results[1] <= step["s"]
    assert ss.cost_cache.log == ["2: measured (no entry; implausible, measured again)"]
    assert ss.draft_costs(ss.head).t_shallow == results[1]
    assert load().cost_cache.log == ["2: cached"]  # the second measurement was written


def test_new_kernels_calibrate_again(monkeypatch):
    """The calibration's key holds the kernels' source hash, as the costs' does: its round overhead and choices were
    measured against those kernels' costs, so other kernels get a new calibration, not the old one's."""
    import selfspec.tuning as tuning

    ss = SelfSpec(tiny_model("llama"), None, DRAFT)
    before = tuning.tuning_key(ss.split, ss.head)
    monkeypatch.setattr(tuning, "kernel_source_hash", lambda: "other-kernels")
    after = tuning.tuning_key(ss.split, ss.head)
    assert after["kernels"] == "other-kernels" and before != after
    assert tuning.cache_path(before) != tuning.cache_path(after)
