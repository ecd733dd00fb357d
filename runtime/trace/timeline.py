"""Per-rank Chrome-trace recorder (Perfetto, chrome://tracing) and a merger of the per-rank files."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time

# CLOCK_MONOTONIC on Linux: one clock for every process of a machine (network namespaces too),
# so traces of ranks on one host line up without any synchronisation.
_now = time.perf_counter


class TimelineError(ValueError):
    """A trace file that is not a timeline this module wrote, or a merge that cannot be done."""


# The span and token of a disabled timeline: one shared object, so a disabled call allocates nothing.
_NULL = contextlib.nullcontext()


def span_of(timeline, name: str, cat: str, **args):
    """timeline.span(name, cat, **args), or a shared do-nothing context where there is no timeline (None)."""
    return timeline.span(name, cat, **args) if timeline else _NULL


class _Span:
    """An open span: the token of begin() and the context manager of span()."""

    __slots__ = ("_tl", "name", "cat", "track", "start", "args")

    def __init__(self, tl, name, cat, track, args, start):
        self._tl, self.name, self.cat, self.track, self.args, self.start = tl, name, cat, track, args, start

    def __enter__(self):
        self.start = _now()  # a span() starts when entered, not when created
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        self._tl.end(self)
        return False


class Timeline:
    """Records one rank's spans and instants, on named tracks, for dump() to write as a Chrome trace."""

    def __init__(self, rank: int, enabled: bool = True):
        self.rank = int(rank)
        self.enabled = bool(enabled)
        # Events are plain tuples (ph, name, cat, track, start_s, end_s, args); all conversion waits
        # for dump. list.append is atomic (the GIL, or the list's own lock in free-threaded builds),
        # so the main and progress threads record concurrently without a lock of ours on the hot path.
        self._events: list[tuple] = []
        # Ranks on different hosts have unrelated monotonic clocks; merge() falls back to wall time.
        self._wall_offset = time.time() - _now()

    def __len__(self) -> int:
        return len(self._events)

    def __bool__(self) -> bool:
        # Callers guard with `if tl` (is there a timeline?); through __len__ alone an empty one is false,
        # so nothing would record until something else did, and a span begun then could not be ended.
        return True

    def span(self, name: str, cat: str, track: str = "main", **args):
        """A context manager recording one complete span."""
        return _Span(self, name, cat, track, args, 0.0) if self.enabled else _NULL

    def begin(self, name: str, cat: str, track: str = "main", **args):
        """Open a span and return its token for end(), which may be called on another thread."""
        return _Span(self, name, cat, track, args, _now()) if self.enabled else _NULL

    def end(self, token, **args) -> None:
        """Close a begin() token, from any thread; args are added to the span's."""
        if token is _NULL:
            return
        t = _now()
        if token._tl is None:
            raise RuntimeError(f"timeline span {token.name!r} ended twice")
        token._tl = None
        if args:
            token.args.update(args)
        self._events.append(("X", token.name, token.cat, token.track, token.start, t, token.args))

    def instant(self, name: str, cat: str, track: str = "main", **args) -> None:
        if self.enabled:
            t = _now()
            self._events.append(("i", name, cat, track, t, t, args))

    def complete(self, name: str, cat: str, start_s: float, end_s: float, track: str = "main", **args) -> None:
        """Add a span already measured with time.perf_counter()."""
        if not self.enabled:
            return
        if end_s < start_s:
            raise ValueError(f"timeline span {name!r} ends ({end_s}) before it starts ({start_s})")
        self._events.append(("X", name, cat, track, float(start_s), float(end_s), args))

    def to_trace(self) -> dict:
        """This rank's trace as a Chrome-trace dict (what dump() writes)."""
        events = self._events[:]  # a snapshot: other threads may go on recording
        order = {"main": 0}  # track -> rank of first use, "main" always first
        for ev in events:
            order.setdefault(ev[3], len(order))
        ordered, lanes = _lanes(events)
        names = {i: track for track, i in order.items()}
        tids = {key: tid for tid, key in enumerate(sorted({(order[events[i][3]], lanes[i]) for i in ordered}))}
        pid = self.rank
        out: list[dict] = _process_meta(pid)
        for (track, lane), tid in tids.items():
            label = names[track] if lane == 0 else f"{names[track]} #{lane + 1}"
            out += [_meta("thread_name", pid, tid, name=label), _meta("thread_sort_index", pid, tid, sort_index=tid)]
        for i in ordered:
            ph, name, cat, track, start, end, args = events[i]
            ev = {"name": name, "cat": cat, "ph": ph, "ts": round(start * 1e6, 3),
                  "pid": pid, "tid": tids[order[track], lanes[i]]}
            if ph == "X":
                ev["dur"] = round((end - start) * 1e6, 3)
            else:
                ev["s"] = "t"  # instant scoped to its track
            if args:
                ev["args"] = args
            out.append(ev)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"rank": pid, "host": socket.gethostname(), "clock": "perf_counter",
                              "wall_offset_us": round(self._wall_offset * 1e6, 3), "version": 1}}

    def dump(self, path: str) -> None:
        _write_json(path, self.to_trace())


def _lanes(events: list[tuple]) -> tuple[list[int], list[int]]:
    """Event indices by start (outer before inner), and a lane per event within its track.

    Viewers mis-draw or drop spans of one thread that overlap without nesting (slice pushes in
    flight together), so such a span moves to the first lane of its track where it nests.
    """
    ordered = sorted(range(len(events)), key=lambda i: (events[i][4], -events[i][5]))
    lane_of = [0] * len(events)
    stacks: dict[str, list[list[float]]] = {}  # track -> per lane, end times of the open spans
    for i in ordered:
        ph, _, _, track, start, end, _ = events[i]
        if ph != "X":
            continue
        lanes = stacks.setdefault(track, [])
        for lane, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                break
        else:
            lane, stack = len(lanes), []
            lanes.append(stack)
        stack.append(end)
        lane_of[i] = lane
    return ordered, lane_of


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _process_meta(rank: int) -> list[dict]:
    return [_meta("process_name", rank, 0, name=f"rank {rank}"), _meta("process_sort_index", rank, 0, sort_index=rank)]


def _jsonable(obj):
    # numpy scalars, 0-d tensors and the like passed as args: keep numbers as numbers
    with contextlib.suppress(Exception):
        return obj.item()
    return str(obj)


def _write_json(path: str, obj: dict) -> None:
    """Write via a temporary file in the same directory and os.replace: readers never see half a trace."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x") as f:
            json.dump(obj, f, default=_jsonable, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            trace = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"timeline file not found: {path}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TimelineError(f"timeline file {path}: not valid JSON ({e})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TimelineError(f"timeline file {path}: no 'traceEvents' list")
    for ev in trace["traceEvents"]:
        if not (isinstance(ev, dict) and isinstance(ev.get("ph"), str)
                and (ev["ph"] == "M" or isinstance(ev.get("ts"), (int, float)))
                and (ev["ph"] != "X" or isinstance(ev.get("dur"), (int, float)))):
            raise TimelineError(f"timeline file {path}: malformed event {str(ev)[:120]}")
    return trace


def merge(paths: list[str], out: str) -> dict:
    """Merge per-rank traces into one, a process per rank, the earliest event at 0; return a summary."""
    if not paths:
        raise TimelineError("merge: no timeline files given")
    loaded: dict[int, tuple[str, dict]] = {}
    for path in paths:
        trace = _load(path)
        other = trace.get("otherData")
        rank = other.get("rank") if isinstance(other, dict) else None
        if not isinstance(rank, int):
            raise TimelineError(f"timeline file {path}: no integer otherData.rank")
        if rank in loaded:
            raise TimelineError(f"timeline files {loaded[rank][0]} and {path} are both rank {rank}")
        loaded[rank] = (path, trace)
    # One host: the monotonic clocks are one clock. Several: only wall clocks (NTP) are comparable.
    cross_host = len({t["otherData"].get("host") for _, t in loaded.values()}) > 1
    shift = {rank: trace["otherData"].get("wall_offset_us") if cross_host else 0.0
             for rank, (path, trace) in loaded.items()}
    for rank, offset in shift.items():
        if not isinstance(offset, (int, float)):
            raise TimelineError(f"timeline file {loaded[rank][0]}: ranks span hosts but it has no wall_offset_us")
    data = {r: [e for e in t["traceEvents"] if e["ph"] != "M"] for r, (_, t) in loaded.items()}
    starts = [e["ts"] + shift[r] for r, evs in data.items() for e in evs]
    ends = [e["ts"] + e.get("dur", 0) + shift[r] for r, evs in data.items() for e in evs]
    t0 = min(starts, default=0.0)
    merged: list[dict] = []
    for rank in sorted(loaded):
        merged += _process_meta(rank)  # ours, so that sort order and labels follow the rank
        merged.extend(dict(e, pid=rank) for e in loaded[rank][1]["traceEvents"]
                      if e["ph"] == "M" and e.get("name") not in ("process_name", "process_sort_index"))
        merged.extend(dict(e, pid=rank, ts=round(e["ts"] + shift[rank] - t0, 3)) for e in data[rank])
    clock = "wall" if cross_host else "monotonic"
    _write_json(out, {"traceEvents": merged, "displayTimeUnit": "ms",
                      "otherData": {"ranks": sorted(loaded), "clock": clock, "origin_us": t0,
                                    "sources": [loaded[r][0] for r in sorted(loaded)]}})
    return {"ranks": sorted(loaded), "events": {r: len(data[r]) for r in sorted(loaded)},
            "span_us": round(max(ends, default=t0) - t0, 3), "clock": clock, "out": out}


def summarize(path: str) -> dict:
    """Per rank (pid), category and first word of the name: span count, summed and busy (union) ms.

    busy_ms < total_ms means spans of that kind overlapped (e.g. slice pushes in flight together).
    """
    spans: dict[tuple, list[tuple[float, float]]] = {}
    for ev in _load(path)["traceEvents"]:
        if ev["ph"] == "X":
            key = (ev.get("pid", 0), ev.get("cat", ""), str(ev.get("name", "")).split(" ", 1)[0])
            spans.setdefault(key, []).append((ev["ts"], ev["ts"] + ev.get("dur", 0)))
    result: dict[int, dict[str, dict[str, dict]]] = {}
    for (pid, cat, prefix), intervals in sorted(spans.items()):
        intervals.sort()
        busy, (lo, hi) = 0.0, intervals[0]
        for s, e in intervals[1:]:
            if s > hi:
                busy, lo, hi = busy + hi - lo, s, e
            else:
                hi = max(hi, e)
        busy += hi - lo
        result.setdefault(pid, {}).setdefault(cat, {})[prefix] = {
            "count": len(intervals), "total_ms": sum(e - s for s, e in intervals) / 1e3, "busy_ms": busy / 1e3}
    return result
