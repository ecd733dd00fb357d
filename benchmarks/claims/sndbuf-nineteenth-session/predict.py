"""What runtime.sim predicts for p3 on the emulated 8 hosts x 1 with 4 MiB (the kernel's) and 1 MiB send buffers."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from jobs.sim.validate import emulated_cluster  # noqa: E402
from jobs.simulate import modelled, parse_args  # noqa: E402
from runtime.sim import simulate  # noqa: E402

cal = json.load(open(os.path.join(ROOT, "benchmarks/claims/validation-grid-resnet50-v100-8r-sixteenth-session-calibration.json")))
prof = modelled(parse_args(["--model", "resnet50-224", "--compute", "emulated:v100", "--batch-size", "64"]))
cluster = emulated_cluster(8, "1gbit", cal, 2.0, device="gpu")  # the links as run; compute scaled to carry
for buffer in (4 << 20, 1 << 20):
    t = {f: simulate(prof.scaled(1 / f), cluster.with_(send_buffer=buffer), "p3").t_iter_s / f for f in (1, 2.5, 10)}
    print(f"send buffer {buffer >> 20} MiB: p3 T_iter {t[1]:.3f} / {t[2.5]:.3f} / {t[10]:.4f} s at 1 / 2.5 / 10 Gbit/s")
