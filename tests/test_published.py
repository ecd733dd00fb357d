"""The published-figures table is self-consistent: devices, papers and sources all resolve."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.emulate.papers import PAPERS
from runtime.emulate.published import ALIASES, SIBLINGS, SPECS, THROUGHPUTS, Spec, Throughput

PRECISIONS = {"fp32", "tf32", "amp"}


def _canonical(name: str) -> str:
    return ALIASES.get(name, name)


def test_dataclasses_are_frozen():
    for cls in (Spec, Throughput):
        assert dataclasses.fields(cls) and cls.__dataclass_params__.frozen


def test_spec_keys_names_and_rates():
    for key, spec in SPECS.items():
        assert spec.name == _canonical(key)
        assert spec.peak_fp32_tflops > 0 and spec.mem_bandwidth_gbs > 0 and spec.memory_gib > 0
        assert spec.peak_fp16_tflops is None or spec.peak_fp16_tflops > spec.peak_fp32_tflops
        assert spec.peak_tf32_tflops is None or spec.peak_tf32_tflops > spec.peak_fp32_tflops
        assert 2010 <= spec.year <= 2030
        assert spec.source.strip() and spec.full_name.strip()


def test_aliases_and_siblings_resolve():
    for alias, target in ALIASES.items():
        assert SPECS[alias] is SPECS[target]
    for device, sibling in SIBLINGS.items():
        assert device in SPECS and sibling in SPECS and device != sibling


def test_required_devices_are_present():
    for key in ("h100", "v100", "titanx-maxwell", "titanx", "p4000", "1080ti"):
        assert key in SPECS


@pytest.mark.parametrize("t", THROUGHPUTS, ids=lambda t: f"{t.device}-{t.model}-{t.batch}-{t.precision}")
def test_throughput_fields(t):
    assert t.device in SPECS and t.device not in ALIASES  # points are filed under the canonical key
    assert isinstance(t.batch, int) and t.batch >= 1
    assert t.samples_per_s > 0
    assert t.precision in PRECISIONS
    assert t.precision != "tf32" or SPECS[t.device].peak_tf32_tflops is not None
    assert t.precision != "amp" or SPECS[t.device].peak_fp16_tflops is not None
    for field in ("model", "unit", "framework", "source"):
        assert getattr(t, field).strip(), field


def test_no_duplicate_points():
    keys = [(t.device, t.model, t.batch, t.precision, t.framework) for t in THROUGHPUTS]
    assert len(keys) == len(set(keys))


def test_every_device_has_two_points_of_its_own_or_of_its_sibling():
    counts: dict[str, int] = {}
    for t in THROUGHPUTS:
        counts[t.device] = counts.get(t.device, 0) + 1
    for key in SPECS:
        device = _canonical(key)
        own = counts.get(device, 0)
        assert own >= 2 or counts.get(SIBLINGS.get(device, ""), 0) >= 2, key
        assert own == 0 or device not in SIBLINGS  # a sibling stands in only where nothing was published


def test_papers():
    assert set(PAPERS) == {"p3", "poseidon", "mstopk", "spectrain"}
    for name, paper in PAPERS.items():
        assert paper["gpu"] in SPECS, name
        assert paper["citation"].strip() and paper["title"].strip() and paper["gpu_status"].strip()
        assert paper["interconnect"].strip()
        assert paper["models"], name
        for model, facts in paper["models"].items():
            assert facts["batch_per_gpu"] is None or facts["batch_per_gpu"] >= 1, (name, model)
            assert facts["status"].strip()
        assert paper["claims"], name
        for claim in paper["claims"]:
            assert claim["claim"].strip() and claim["where"].strip() and claim["status"].strip()
