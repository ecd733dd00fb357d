"""UCX_TCP_SNDBUF=512kb (B) against the default socket buffers (A), alternated: medians over every round."""

import collections
import glob
import json
import os
import statistics


def ab_table(here: str, a_label: str, b_label: str) -> None:
    """The A/B runs' JSON in `here` (NAME-A1.json, NAME-B1.json, ...): each (hosts x ranks, strategy, link)'s median
    over every round of A and of B, their range and count, and B / A."""
    rounds = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(here, "*-[AB][0-9].json"))):
        name = os.path.basename(path)
        where, variant = name.rsplit("-", 2)[1], name[-7]  # p3-ddp-8x1-A1.json: 8x1, A
        for r in json.load(open(path))["rows"]:
            rounds[(where, r["strategy"], r["bandwidth"], variant)] += r["t_iter_rounds_s"]
    print(f"| hosts x ranks | strategy | link | {a_label} (A) | {b_label} (B) | B / A |")
    print("|---|---|---|---|---|---|")
    for where, s, bw in sorted({k[:3] for k in rounds}):
        a, b = rounds[(where, s, bw, "A")], rounds[(where, s, bw, "B")]
        if s == "compute" or not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {where} | {s} | {bw} | {ma:.4f} ({min(a):.4f}-{max(a):.4f}, {len(a)}) | {mb:.4f} ({min(b):.4f}-"
              f"{max(b):.4f}, {len(b)}) | {mb / ma:.3f} |")


if __name__ == "__main__":
    ab_table(os.path.dirname(os.path.abspath(__file__)), "default", "UCX_TCP_SNDBUF=512kb")
