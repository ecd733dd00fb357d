"""mpitrain bench emulation: its tables, the compute scales' table of host CPU against the step's length, and the
floor under it (the thinnest step's host CPU after the host idled)."""

from __future__ import annotations

import json
import time

import pytest

from conftest import exit_in_process
from jobs.bench.emulation import main
from runtime.emulate import accelerator

QUICK = ["--models", "mlp", "--devices", "v100", "--steps", "3", "--warmup", "1", "--no-hooked", "--waits", "10",
         "--repeats", "1", "--idles", ""]


@pytest.fixture(autouse=True)
def fresh_accelerator():
    accelerator.deactivate()
    yield
    accelerator.deactivate()


def test_each_scale_runs_the_steps_with_the_modelled_times_scaled(tmp_path, capsys):
    out = tmp_path / "emulation.json"
    assert main(QUICK + ["--scales", "0.5,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    header = "| model | device | compute scale | modelled s/step | host CPU beyond landing, us/step |"
    assert header in text
    table = [line.split(" | ") for line in text.split(header)[1].splitlines()[2:4]]
    rows = json.loads(out.read_text())["rows"]
    plain = [r for r in rows if r["table"] == "steps"]
    scaled = {r["compute_scale"]: r for r in rows if r["table"] == "scales"}
    assert len(plain) == 1 and plain[0]["compute_scale"] == 1.0 and sorted(scaled) == [0.5, 4.0]
    for scale, row in scaled.items():
        assert row["model"] == "mlp" and row["hooks"] == "none"
        assert row["modelled_s"] == pytest.approx(scale * plain[0]["modelled_s"], rel=1e-6)
        assert row["t_iter_s"] >= row["modelled_s"] * 0.99  # the steps waited their scaled time
        printed = next(cells for cells in table if cells[2] == f"{scale:g}")
        assert int(printed[4]) == round(row["host_rest_s"] * 1e6)  # the table prints the row's figure
    assert (tmp_path / "emulation.png").exists()


def test_a_scale_must_be_positive(capsys):
    code, _, err = exit_in_process(main, QUICK + ["--scales", "1,0"], capsys)
    assert code == 2 and "--scales: every scale must be > 0" in err


def test_the_floor_table_times_each_work_after_each_idle(tmp_path, capsys):
    out = tmp_path / "emulation.json"
    assert main(QUICK[:-2] + ["--idles", "0,3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    header = "| host idle before, ms | work | host CPU, us (median) | shortest step within 2 %, ms |"
    assert header in text
    printed = [line.split(" | ") for line in text.split(header)[1].splitlines()[2:8]]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["table"] == "floor"]
    works = ["empty interval", "bare torch step", "emulated step"]
    assert [(r["idle_ms"], r["work"]) for r in rows] == [(i, w) for i in (0.0, 3.0) for w in works]
    for row, cells in zip(rows, printed):
        assert row["repeats"] == 10 and row["cpu_us"] > 0
        assert row["shortest_step_at_2pct_ms"] == pytest.approx(row["cpu_us"] / 0.02 / 1e3)
        assert cells[1] == row["work"] and float(cells[2]) == pytest.approx(row["cpu_us"], abs=0.05)
    assert accelerator.active() is None  # the emulation it made is gone again


def test_the_thinnest_emulated_step_is_an_emulated_training_step():
    from jobs.bench.wake_tax import _emulated_step

    step = _emulated_step()
    weight = step.model[0].weight
    assert hasattr(weight, "_emulated_grad") and accelerator.active() is not None  # emulate() put it in place
    step()
    assert weight.grad is not None and weight.grad.shape == weight.shape and weight.grad.abs().sum() > 0


def test_an_idle_must_not_be_negative(capsys):
    code, _, err = exit_in_process(main, QUICK[:-2] + ["--idles", "0,-1"], capsys)
    assert code == 2 and "--idles: every idle length must be >= 0 ms" in err


def test_a_block_is_never_shorter_than_its_model_on_a_loaded_host(monkeypatch):
    # A loaded host: the sync before the block wakes late. The first step's work (its zero_grad's memset, queued
    # after the last deadline) must still not start on the device's timeline before the block's clock did, or
    # T_iter comes out shorter than the work it ran (CI, 73a0d22: 1.2833 ms against 1.2978 modelled).
    from jobs.bench.emulation_steps import StepVariant
    from runtime.emulate.clock import Clock

    synced = Clock.sync

    def late(self):  # the block's first sync only: the steps' own syncs would hide the first step's head start
        synced(self)
        if late.first:
            late.first = False
            time.sleep(0.003)

    variant = StepVariant("mlp", "v100", scale=8)  # ~2.6 ms a step: the device, not the host, sets the pace
    variant.run(0, warmup=1)
    monkeypatch.setattr(Clock, "sync", late)
    for _ in range(3):
        late.first = True
        variant.run(3)
    assert all(b["t_iter"] >= b["t_model"] for b in variant.blocks), [(b["t_iter"], b["t_model"]) for b in variant.blocks]
