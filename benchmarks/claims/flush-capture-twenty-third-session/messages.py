"""Each pipeline message's time on the wire, from tcpdump text of every host's eth0 and the run's --timeline.

usage: python messages.py DIR RATE_BIT_S  (DIR: h0.txt..h7.txt from `tcpdump -r hI.pcap -n -tt`, tl.json)
Writes DIR/msgs.json: per message its post time (the timeline's send), its first and last byte out of the
sender (after its link's tbf) and its last byte into the receiver, all in wall seconds, and how much data came
in to the sender while it went out (load, a share of the rate). A connection's bytes are matched to its
messages in order (each message its payload and a 16-byte header), resynchronised at each post time, since the
connection also carries small control messages; the first and last byte are read 1500 bytes inside the message.
"""
import bisect
import collections
import json
import re
import sys

T, rate = sys.argv[1], float(sys.argv[2]) / 8  # bytes/s
HDR = 16
pat = re.compile(r'^(\S+) IP (\S+)\.(\d+) > (\S+)\.(\d+): Flags \[([^\]]*)\], seq (\d+):(\d+).*length (\d+)')
ip = lambda r: f"10.213.0.{r + 1}"  # noqa: E731  (mpitrain cluster: rank r on host hr)
N = 8
out = {r: collections.defaultdict(list) for r in range(N)}  # egress data per connection
inn = {r: [] for r in range(N)}  # ingress data packets (t, bytes)
ing = {r: collections.defaultdict(list) for r in range(N)}  # ingress data per connection
for r in range(N):
    for line in open(f"{T}/h{r}.txt"):
        m = pat.match(line)
        if not m:
            continue
        t, sa, sp, da, dp, _, s0, s1, _ = m.groups()
        t, s0, s1 = float(t), int(s0), int(s1)
        if s1 <= s0:
            continue
        if sa == ip(r):
            out[r][(da, sp, dp)].append((t, s0, s1))
        elif da == ip(r):
            inn[r].append((t, s1 - s0))
            ing[r][(sa, sp, dp)].append((t, s0, s1))
d = json.load(open(f"{T}/tl.json"))
wall = d["otherData"]["origin_us"] / 1e6 if d["otherData"].get("clock") == "wall" else 0.0
sends = collections.defaultdict(list)
for e in d["traceEvents"]:
    if e.get("name", "").startswith("send ") and "to" in e.get("args", {}):
        sends[(e["pid"], e["args"]["to"])].append(e)


def frontier(packets, base):
    """(end offsets, times): the highest byte sent so far at each packet (retransmissions skipped)."""
    ends, times, hi = [], [], 0
    for t, a, b in sorted(packets):
        if b - base > hi:
            hi = b - base
            ends.append(hi)
            times.append(t)
    return ends, times


def at(ends, times, offset):
    i = bisect.bisect_left(ends, offset)
    return times[min(i, len(times) - 1)] if times else float("nan")


msgs = []
for (src, dst), es in sorted(sends.items()):
    es.sort(key=lambda e: e["ts"])
    conns = {k: v for k, v in out[src].items() if k[0] == ip(dst)}
    if not conns:
        continue
    key = max(conns, key=lambda k: sum(b - a for _, a, b in conns[k]))
    data = sorted(conns[key])
    base = data[0][1]
    ends, times = frontier(data, base)
    rends, rtimes = frontier(ing[dst].get((ip(src), key[1], key[2]), []), base)
    starts, stimes = [a - base for _, a, _ in data], [t for t, _, _ in data]
    pos = 0
    for e in es:
        post = e["ts"] / 1e6 + wall
        pos = max(pos, starts[min(bisect.bisect_left(stimes, post - 0.0005), len(starts) - 1)])
        n = e["args"]["bytes"] + HDR
        msgs.append(dict(src=src, dst=dst, name=e["name"], bytes=e["args"]["bytes"], post=post,
                         first=at(ends, times, pos + 1500), last=at(ends, times, pos + n - 1500),
                         rlast=at(rends, rtimes, pos + n - 1500)))
        pos += n
arrive = {r: sorted(inn[r]) for r in range(N)}
cum = {r: [0] for r in range(N)}
for r in range(N):
    for _, n in arrive[r]:
        cum[r].append(cum[r][-1] + n)
by_src = collections.defaultdict(list)
for m in msgs:
    by_src[m["src"]].append(m)
for src, ms in by_src.items():
    prev = 0.0
    for m in sorted(ms, key=lambda m: m["post"]):
        m["start"] = max(m["post"], prev)  # its sender's link free of its earlier messages
        ts = [t for t, _ in arrive[src]]
        i, j = bisect.bisect_left(ts, m["start"]), bisect.bisect_right(ts, m["last"])
        m["load"] = (cum[src][j] - cum[src][i]) / max(1e-6, m["last"] - m["start"]) / rate
        m["ideal"] = m["bytes"] / (rate * 0.95)
        prev = max(prev, m["last"])
json.dump(msgs, open(f"{T}/msgs.json", "w"))
print(f"{len(msgs)} messages -> {T}/msgs.json")
