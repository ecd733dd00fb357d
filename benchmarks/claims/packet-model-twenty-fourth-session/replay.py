"""Replay a captured run's sends through a link model; compare each message's predicted arrival with the capture's."""
import gzip, json, sys, statistics, os
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)
from runtime.sim.engine import Engine, Event, Activity
from runtime.sim.cluster import Cluster, Host
from runtime.sim.packets import PacketLinks

D = os.path.join(ROOT, "benchmarks/claims/flush-capture-twenty-third-session")
cal = json.load(open(os.path.join(ROOT, "benchmarks/claims/validation-grid-pipelines-vgg19-8r-twenty-third-session-calibration.json")))
from mpicomm.emulation import link_burst
bps = 250e6
eff = cal["stream_efficiency"]["250mbit"]; cpb = cal["cpu_per_byte"]["250mbit"]; lat = cal["transport"]["latency"]
rate = bps / 8 * eff
burst = link_burst(bps)

def replay(mode, model, W=0, cpu=True):
    msgs = sorted(json.load(gzip.open(f"{D}/{mode}-messages.json.gz")), key=lambda m: m["post"])
    t0 = min(m["post"] for m in msgs)
    eng = Engine()
    pred = {}
    if model == "fluid":
        c = Cluster(nodes=8, bandwidth=bps, efficiency=eff, cpu_per_byte=cpb if cpu else 0.0, burst=burst,
                    latency=lat, shared_cores=2.0)
        hosts = [Host(eng, c, f"h{i}") for i in range(8)]
        queue = [None] * 8; idle_from = [0.0] * 8; left = [burst] * 8; fill = bps / 8
        def send(i, m):
            src, dst, nbytes = m["src"], m["dst"], m["bytes"]
            a, b = hosts[src], hosts[dst]
            loads = ((a.cores, c.cpu_per_byte / 2), (b.cores, c.cpu_per_byte / 2)) if c.cpu_per_byte else ()
            before, done = queue[src], Event(); queue[src] = done
            def go():
                yield eng.timeout(m["post"] - t0 + lat)
                if before is not None:
                    yield before
                tokens = min(burst, left[src] + (eng.now - idle_from[src]) * fill)
                free = min(tokens, nbytes)
                yield eng.start(Activity("x", nbytes - free, uses=((a.out, 1.0), (b.into, 1.0)), loads=loads))
                idle_from[src], left[src] = eng.now, tokens - free
                done.succeed(); pred[i] = eng.now
            eng.process(go())
    else:
        copy_rate = (2.0 / 8) / (cpb / 2) if cpu else 0.0
        links = PacketLinks(eng, 8, rate, burst, W, copy_rate=copy_rate)
        def send(i, m):
            def go():
                yield eng.timeout(m["post"] - t0 + lat)
                yield links.send(m["src"], m["dst"], m["bytes"])
                pred[i] = eng.now
            eng.process(go())
    for i, m in enumerate(msgs):
        send(i, m)
    eng.run()
    # Messages of 64 KiB or more after the first second whose capture matched cleanly (wire time within 0.5-5x the
    # rate's, first byte out within 100 ms of the post).
    errs = sorted((pred[i] - (m["rlast"] - t0)) * 1e3 for i, m in enumerate(msgs) if m["bytes"] >= 65536
                  and 0.5 < (m["rlast"] - m["first"]) / m["ideal"] < 5 and -0.001 < m["first"] - m["post"] < 0.1
                  and m["post"] - t0 > 1.0)
    tr = sorted((m["rlast"] - m["post"]) / m["ideal"] for m in msgs if m["bytes"] >= 65536)
    q = lambda v, p: v[int(p * (len(v) - 1))]
    return f"{mode:8s} {model:6s} W={W/1024:5.0f}K cpu={int(cpu)}: err ms median {q(errs,.5):+6.1f}  q25 {q(errs,.25):+6.1f} q75 {q(errs,.75):+6.1f}  q10 {q(errs,.1):+6.1f} q90 {q(errs,.9):+6.1f}  mean|e| {statistics.mean(abs(e) for e in errs):5.1f}"

for mode in ("flush", "vanilla"):
    print(replay(mode, "fluid"))
    print(replay(mode, "fluid", cpu=False))
    for W in (16 * 1024, 128 * 1024, 256 * 1024, 1 << 20):
        print(replay(mode, "packet", W, cpu=False))
