"""CUBIC (B) against BBR (A), the emulated hosts' TCP congestion control, alternated: medians over every round,
and p3's speed-up over DDP round by round."""

import collections
import glob
import json
import os
import statistics
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "sndbuf-nineteenth-session"))
from summary import ab_table  # noqa: E402 (the nineteenth session's A/B table)

ab_table(here, "BBR", "CUBIC")
print()
# p3 and DDP run in turn inside each round of a run: their ratio paired by round, under each congestion control.
ratios = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(here, "*-[AB][0-9].json"))):
    rows = {r["strategy"]: r["t_iter_rounds_s"] for r in json.load(open(path))["rows"]}
    ratios[os.path.basename(path)[-7]] += [d / p for p, d in zip(rows["p3"], rows["ddp"])]
for variant, name in (("A", "BBR"), ("B", "CUBIC")):
    r = ratios[variant]
    print(f"DDP / p3 (p3's speed-up), {name}: median {statistics.median(r):.3f} over {len(r)} rounds "
          f"({', '.join(f'{x:.3f}' for x in r)})")
