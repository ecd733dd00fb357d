"""Waited-for messages of pipeline timelines: transit (send to the receiver's wait's end) against the rate's time.

usage: python waits.py DIR[,DIR...] RATE_BIT_S  (each DIR with a --timeline tl.json; messages over 150 kB,
after the first step)
"""
import json
import statistics
import sys

rate = float(sys.argv[2]) / 8
for T in sys.argv[1].split(","):
    d = json.load(open(f"{T}/tl.json"))
    posts, waits = {}, {}
    for e in d["traceEvents"]:
        n = e.get("name", "")
        if n.startswith("send "):
            what = f"{'activation' if 'act' in n else 'gradient'} of micro-batch {int(n.split()[-1])} from stage {e['pid']}"
            posts[(e["args"]["to"], what)] = (e["ts"] / 1e6, e["args"]["bytes"])
        elif n.startswith("wait") and "waits_for" in e.get("args", {}):
            waits[(e["pid"], e["args"]["waits_for"])] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
    rows = [dict(transit=we - posts[k][0], ideal=posts[k][1] / (rate * 0.95), waited=we - ws)
            for k, (ws, we) in waits.items()
            if k in posts and int(k[1].split()[3]) >= 8 and posts[k][1] >= 150000]
    steps = (max(int(k[1].split()[3]) for k in posts) + 1) // 8 - 1
    tr = sorted(r["transit"] / r["ideal"] for r in rows)
    print(f"{T}: {len(rows)} waited-for messages ({len(rows) / steps:.1f} a step); transit / the rate's time: median "
          f"{statistics.median(tr):.2f}, p75 {tr[int(.75 * len(tr))]:.2f}, p90 {tr[int(.9 * len(tr))]:.2f}, max "
          f"{tr[-1]:.2f}; beyond the rate's time {1e3 * sum(max(0, r['transit'] - r['ideal']) for r in rows) / steps:.0f}"
          f" ms a step, waited {1e3 * sum(r['waited'] for r in rows) / steps:.0f} ms a step (all stages)")
