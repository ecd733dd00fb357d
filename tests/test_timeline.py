"""The timeline records well-formed Chrome-trace events from any thread, and dumps and merges them into valid traces."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from runtime.trace.timeline import Timeline, TimelineError, merge, summarize


def data_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] != "M"]


def thread_names(trace, pid):
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def by_name(trace):
    return {e["name"]: e for e in data_events(trace)}


def test_span_fields_and_nesting():
    tl = Timeline(rank=3)
    with tl.span("step 0", "step", batch=32):
        with tl.span("forward fc1", "compute"):
            pass
        with tl.span("forward fc2", "compute"):
            pass
    trace = tl.to_trace()
    events = data_events(trace)
    assert [e["name"] for e in events] == ["step 0", "forward fc1", "forward fc2"]  # by start, outer first
    for e in events:
        assert e["ph"] == "X" and e["pid"] == 3 and isinstance(e["tid"], int)
        assert isinstance(e["ts"], float) and e["dur"] >= 0
    step, fc1, fc2 = events
    assert step["cat"] == "step" and step["args"] == {"batch": 32} and "args" not in fc1
    assert step["ts"] <= fc1["ts"] and fc1["ts"] + fc1["dur"] <= fc2["ts"]
    assert fc2["ts"] + fc2["dur"] <= step["ts"] + step["dur"]
    assert len({e["tid"] for e in events}) == 1  # properly nested spans share their track's lane
    assert thread_names(trace, 3) == {0: "main"}
    meta = {e["name"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "M" and e["tid"] == 0}
    assert meta["process_name"] == {"name": "rank 3"} and meta["process_sort_index"] == {"sort_index": 3}


def test_an_empty_timeline_is_still_a_timeline():
    """Strategies guard with `if tl`: were an empty timeline false, nothing would ever record on a fresh one, and
    a span begun while it was empty (token None) would crash its end() once another thread had recorded."""
    assert Timeline(0) and Timeline(0, enabled=False) and len(Timeline(0)) == 0


def test_span_records_the_exception_and_lets_it_through():
    tl = Timeline(0)
    with pytest.raises(KeyError):
        with tl.span("forward fc1", "compute"):
            raise KeyError("x")
    assert data_events(tl.to_trace())[0]["args"] == {"error": "KeyError"}


def test_begin_end_instant_complete():
    tl = Timeline(1)
    tok = tl.begin("forward fc1", "compute", layer=0)
    tl.instant("posted", "comm", track="push", slice=2)
    tl.end(tok, out_shape=(4, 8))
    with pytest.raises(RuntimeError, match="ended twice"):
        tl.end(tok)
    t = time.perf_counter()
    tl.complete("wait slice 2", "comm", t, t + 0.0025, track="comm", bytes=1024)
    with pytest.raises(ValueError, match="before it starts"):
        tl.complete("bad", "comm", t, t - 1)
    events = by_name(tl.to_trace())
    fwd, posted, wait = events["forward fc1"], events["posted"], events["wait slice 2"]
    assert fwd["args"] == {"layer": 0, "out_shape": (4, 8)}
    assert fwd["ts"] <= posted["ts"] <= fwd["ts"] + fwd["dur"]
    assert posted["ph"] == "i" and posted["s"] == "t" and "dur" not in posted
    assert wait["ts"] == round(t * 1e6, 3) and wait["dur"] == pytest.approx(2500, abs=0.01)
    names = thread_names(tl.to_trace(), 1)
    assert names[fwd["tid"]] == "main" and names[posted["tid"]] == "push" and names[wait["tid"]] == "comm"
    assert sorted(names) == [0, 1, 2] and fwd["tid"] == 0  # small tids, "main" first, then by first use


def test_begin_and_end_on_different_threads():
    tl = Timeline(0)
    tokens = [tl.begin(f"push slice {i}", "comm", track="push", slice=i) for i in range(3)]
    worker = threading.Thread(target=lambda: [tl.end(tok, done=True) for tok in tokens])
    worker.start()
    worker.join()
    events = by_name(tl.to_trace())
    assert all(events[f"push slice {i}"]["args"] == {"slice": i, "done": True} for i in range(3))


def test_concurrent_recording_loses_nothing():
    tl = Timeline(0)
    n, start = 2000, threading.Barrier(3)

    def record(track):
        start.wait()
        for i in range(n):
            with tl.span(f"{track} {i}", "comm", track=track):
                tl.instant("tick", "comm", track=track)

    threads = [threading.Thread(target=record, args=(t,)) for t in ("comm", "push")]
    for t in threads:
        t.start()
    record("main")
    for t in threads:
        t.join()
    trace = tl.to_trace()
    events = data_events(trace)
    assert len(tl) == len(events) == 3 * 2 * n
    names = thread_names(trace, 0)
    assert sorted(names.values()) == ["comm", "main", "push"]  # each thread's spans nest: no extra lanes
    for track in ("main", "comm", "push"):
        assert sum(names[e["tid"]] == track and e["ph"] == "X" for e in events) == n


def test_overlapping_spans_spill_onto_extra_lanes():
    tl = Timeline(0)
    tl.complete("push slice 0", "comm", 1.0, 3.0, track="push")
    tl.complete("push slice 1", "comm", 2.0, 4.0, track="push")  # overlaps slice 0 without nesting
    tl.complete("push slice 2", "comm", 2.5, 2.8, track="push")  # nests in slice 0
    tl.complete("push slice 3", "comm", 3.0, 3.5, track="push")  # starts as slice 0 ends: nests in 1
    tl.complete("push slice 4", "comm", 3.2, 4.5, track="push")  # overlaps slice 1: a third lane
    trace = tl.to_trace()
    events, names = by_name(trace), thread_names(trace, 0)
    lane = {i: names[events[f"push slice {i}"]["tid"]] for i in range(5)}
    assert lane == {0: "push", 1: "push #2", 2: "push", 3: "push", 4: "push #3"}


def test_disabled_timeline_records_nothing(tmp_path):
    tl = Timeline(0, enabled=False)
    with tl.span("forward", "compute", x=1):
        pass
    tok = tl.begin("push", "comm")
    tl.end(tok)
    tl.end(tok)  # a disabled token never complains
    tl.instant("tick", "comm")
    tl.complete("wait", "comm", 2.0, 1.0)  # not even validated: nothing is recorded
    assert len(tl) == 0 and data_events(tl.to_trace()) == []
    assert tl.span("a", "b") is tl.begin("c", "d")  # one shared no-op object: no allocation per call
    tl.dump(str(tmp_path / "r0.json"))
    assert data_events(json.load(open(tmp_path / "r0.json"))) == []


def test_dump_writes_atomically_into_a_new_directory(tmp_path):
    tl = Timeline(2)
    with tl.span("forward fc1", "compute", n=np.int64(7), dtype=np.dtype("float32")):
        pass
    path = tmp_path / "traces" / "deeper" / "rank2.json"
    tl.dump(str(path))
    tl.dump(str(path))  # replacing an existing file works too
    assert os.listdir(path.parent) == ["rank2.json"]  # no temporary file left behind
    trace = json.load(open(path))
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"]["rank"] == 2 and trace["otherData"]["clock"] == "perf_counter"
    assert data_events(trace)[0]["args"] == {"n": 7, "dtype": "float32"}  # numpy args made JSON


def make_rank(rank, tmp_path, spans):
    tl = Timeline(rank)
    for name, track, start, end in spans:
        tl.complete(name, "comm", start, end, track=track)
    path = str(tmp_path / f"rank{rank}.json")
    tl.dump(path)
    return path


def test_merge_round_trip(tmp_path):
    p0 = make_rank(0, tmp_path, [("forward fc1", "main", 100.0, 100.5), ("push slice 0", "push", 100.2, 100.4)])
    p1 = make_rank(1, tmp_path, [("forward fc1", "main", 100.1, 100.7)])
    with open(p1) as f:
        trace = json.load(f)
    trace["traceEvents"][0]["pid"] = 99  # a stray pid is overridden by the file's rank
    with open(p1, "w") as f:
        json.dump(trace, f)
    out = tmp_path / "merged" / "all.json"
    summary = merge([p1, p0], str(out))
    assert summary["ranks"] == [0, 1] and summary["events"] == {0: 2, 1: 1} and summary["clock"] == "monotonic"
    assert summary["span_us"] == pytest.approx(700_000, abs=0.01)
    merged = json.load(open(out))
    assert merged["displayTimeUnit"] == "ms" and merged["otherData"]["ranks"] == [0, 1]
    meta = [e for e in merged["traceEvents"] if e["ph"] == "M"]
    assert {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"} == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"} == {0: 0, 1: 1}
    assert sorted(thread_names(merged, 0).values()) == ["main", "push"] and thread_names(merged, 1) == {0: "main"}
    events = {(e["pid"], e["name"]): e for e in data_events(merged)}
    assert {pid for pid, _ in events} == {0, 1}
    assert min(e["ts"] for e in events.values()) == 0
    assert events[0, "push slice 0"]["ts"] == pytest.approx(200_000, abs=0.01)
    assert events[1, "forward fc1"]["ts"] == pytest.approx(100_000, abs=0.01)  # offsets across ranks kept
    assert events[1, "forward fc1"]["dur"] == pytest.approx(600_000, abs=0.01)
    assert os.listdir(out.parent) == ["all.json"]


def test_merge_across_hosts_aligns_on_wall_time(tmp_path):
    paths = [make_rank(r, tmp_path, [("forward", "main", 10.0, 11.0)]) for r in (0, 1)]
    for rank, path in enumerate(paths):  # same monotonic times, but host 1's clock started 5 s later
        trace = json.load(open(path))
        trace["otherData"].update(host=f"node{rank}", wall_offset_us=1e15 + rank * 5e6)
        json.dump(trace, open(path, "w"))
    summary = merge(paths, str(tmp_path / "all.json"))
    assert summary["clock"] == "wall" and summary["span_us"] == pytest.approx(6e6)
    events = {e["pid"]: e for e in data_events(json.load(open(tmp_path / "all.json")))}
    assert events[0]["ts"] == 0 and events[1]["ts"] == pytest.approx(5e6)


@pytest.mark.parametrize("content,message", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"events": []}', "no 'traceEvents' list"),
    ('{"traceEvents": [{"ph": "X", "name": "a"}]}', "malformed event"),
    ('{"traceEvents": [{"ph": "X", "ts": 1, "dur": "long"}]}', "malformed event"),
    ('{"traceEvents": [], "otherData": {}}', "no integer otherData.rank"),
])
def test_merge_names_the_bad_file(tmp_path, content, message):
    good = make_rank(0, tmp_path, [("a", "main", 1.0, 2.0)])
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    with pytest.raises((TimelineError, FileNotFoundError), match=message) as info:
        merge([good, str(bad)], str(tmp_path / "out.json"))
    assert str(bad) in str(info.value)
    assert not (tmp_path / "out.json").exists()


def test_merge_rejects_duplicate_ranks_and_no_input(tmp_path):
    a = make_rank(0, tmp_path, [("a", "main", 1.0, 2.0)])
    b = str(tmp_path / "copy.json")
    with open(a) as src, open(b, "w") as dst:
        dst.write(src.read())
    with pytest.raises(TimelineError, match="both rank 0"):
        merge([a, b], str(tmp_path / "out.json"))
    with pytest.raises(TimelineError, match="no timeline files"):
        merge([], str(tmp_path / "out.json"))


def test_summarize_totals_and_busy_time(tmp_path):
    p0 = make_rank(0, tmp_path, [("push slice 0", "push", 1.000, 1.004), ("push slice 1", "push", 1.002, 1.006),
                                 ("wait slice 0", "comm", 1.010, 1.011)])
    p1 = make_rank(1, tmp_path, [("push slice 0", "push", 1.0, 1.001)])
    merged = str(tmp_path / "all.json")
    merge([p0, p1], merged)
    for path, ranks in ((merged, [0, 1]), (p0, [0])):
        summary = summarize(path)
        assert sorted(summary) == ranks
        push = summary[0]["comm"]["push"]
        assert push["count"] == 2 and push["total_ms"] == pytest.approx(8) and push["busy_ms"] == pytest.approx(6)
        assert summary[0]["comm"]["wait"]["total_ms"] == pytest.approx(1)
    assert summarize(merged)[1]["comm"]["push"]["busy_ms"] == pytest.approx(1)
