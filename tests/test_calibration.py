"""runtime.emulate.calibration: every named device predicts the published throughputs it was fitted to within 15 %."""

from __future__ import annotations

from runtime.emulate.calibration import _points, fit, predictions
from runtime.emulate.devices import FITTED, device


def test_every_fitted_point_is_predicted_within_15_percent():
    rows = predictions()
    fitted = {id(t) for name in FITTED for t in _points(name)}
    assert {p.device.split(" ")[0] for p in rows} >= set(FITTED)
    off = [f"{p.device} {p.point.model} b{p.point.batch} {p.point.precision}: {p.error:+.1%}"
           for p in rows if id(p.point) in fitted and abs(p.error) > 0.15]
    assert not off, off


def test_the_v100_amp_refit_is_what_fit_finds():
    launch, eff, mem, worst = fit("v100", 20, own_memory=("amp",), keep_first=True)
    d = device("v100")
    assert (launch, mem) == (d.launch_s, d.memory_efficiency)
    assert {k: v for k, v in eff.items() if "amp" in k} == {k: v for k, v in d.efficiency.items() if "amp" in k}
    assert worst <= 0.15


def test_the_h100_fit_is_what_fit_finds():
    """The H100's efficiencies come from fit() over the published points and those measured on our box."""
    launch, eff, mem, worst = fit("h100", 28)
    d = device("h100")
    assert (launch, mem, eff) == (d.launch_s, d.memory_efficiency, d.efficiency)
    assert worst <= 0.15
