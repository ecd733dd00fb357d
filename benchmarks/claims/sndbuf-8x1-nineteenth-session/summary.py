"""UCX_TCP_SNDBUF=512kb (B) against the default socket buffers (A), alternated: medians over every round."""

import collections
import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
rounds = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(here, "*-[AB][0-9].json"))):
    variant = os.path.basename(path)[-7]  # A or B
    for r in json.load(open(path))["rows"]:
        rounds[(r["strategy"], r["bandwidth"], variant)] += r["t_iter_rounds_s"]
print("| strategy | link | default (A) | UCX_TCP_SNDBUF=512kb (B) | B / A |")
print("|---|---|---|---|---|")
for s, bw in sorted({(s, bw) for s, bw, _ in rounds}):
    a, b = rounds[(s, bw, "A")], rounds[(s, bw, "B")]
    if s == "compute" or not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"| {s} | {bw} | {ma:.4f} ({min(a):.4f}-{max(a):.4f}, {len(a)}) | {mb:.4f} ({min(b):.4f}-{max(b):.4f}, "
          f"{len(b)}) | {mb / ma:.3f} |")
