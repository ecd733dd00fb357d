"""CUBIC (B) against BBR (A), the emulated hosts' TCP congestion control, alternated: medians over every round."""

import collections
import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
rounds = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(here, "*-[AB][0-9].json"))):
    name = os.path.basename(path)
    where, variant = name.rsplit("-", 2)[1], name[-7]  # p3-ddp-8x1-A1.json: 8x1, A
    for r in json.load(open(path))["rows"]:
        rounds[(where, r["strategy"], r["bandwidth"], variant)] += r["t_iter_rounds_s"]
print("| hosts x ranks | strategy | link | BBR (A) | CUBIC (B) | B / A |")
print("|---|---|---|---|---|---|")
for where, s, bw in sorted({k[:3] for k in rounds}):
    a, b = rounds[(where, s, bw, "A")], rounds[(where, s, bw, "B")]
    if s == "compute" or not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"| {where} | {s} | {bw} | {ma:.4f} ({min(a):.4f}-{max(a):.4f}, {len(a)}) | {mb:.4f} ({min(b):.4f}-"
          f"{max(b):.4f}, {len(b)}) | {mb / ma:.3f} |")

# p3 ÷ DDP round by round (the two run in turn inside each round of a run), under each congestion control.
ratios = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(here, "*-[AB][0-9].json"))):
    rows = {r["strategy"]: r["t_iter_rounds_s"] for r in json.load(open(path))["rows"]}
    ratios[os.path.basename(path)[-7]] += [d / p for p, d in zip(rows["p3"], rows["ddp"])]
for variant, name in (("A", "BBR"), ("B", "CUBIC")):
    r = ratios[variant]
    print(f"DDP / p3 (p3's speed-up), {name}: median {statistics.median(r):.3f} over {len(r)} rounds "
          f"({', '.join(f'{x:.3f}' for x in r)})")
