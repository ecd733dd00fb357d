"""gpu-check's report: which parts passed, their logs, and each part's figures, as markdown and JSON.

Plain functions of the parts' results and the files they wrote: the report is rewritten after every part, so a
run cut short still leaves one that says how far it got.
"""

from __future__ import annotations

import json
import os
import statistics

from jobs.gpu_check import pytest_log, xcheck
from jobs.gpu_check.runner import Result


def summarize(result: Result, folder: str) -> str:
    """Markdown of what the part found (its figures), or why there is none: never raises."""
    if result.status == "not run":
        return ""
    try:
        return SUMMARIES[result.kind](result, folder)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return f"(its output could not be read: {type(exc).__name__}: {exc})"


def pytest_summary(result: Result, folder: str) -> str:
    """pytest's last summary line and its FAILED/ERROR lines (-rfE), from the log."""
    lines = pytest_log.read(os.path.join(folder, result.log))
    failed = pytest_log.failures(lines)
    out = [f"pytest: {pytest_log.summary(lines) or 'no summary line (see the log)'}"]
    out += [f"- {line[:300]}" for line in failed[:20]]
    return "\n".join(out)


def _rows(folder: str, name: str) -> tuple[dict, list[dict]]:
    with open(os.path.join(folder, name)) as f:
        doc = json.load(f)
    return doc.get("meta", {}), doc["rows"]


def mstopk_summary(result: Result, folder: str) -> str:
    """One line per size and density: MSTopK's and torch.topk's median times, the speed ratio, the mass kept."""
    meta, rows = _rows(folder, "mstopk.json")
    ref = {(r["d"], r["density"]): r for r in rows if r["impl"] == "torch.topk"}
    lines = [f"{meta.get('device', meta.get('target', '?'))}, torch {meta.get('torch', '?')}, "
             f"{meta.get('repeats', '?')} timed calls per row",
             "", "| d | density | MSTopK ms | torch.topk ms | MSTopK ÷ topk speed | mass ratio |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["impl"] == "torch.topk":
            continue
        topk = ref[(r["d"], r["density"])]
        lines.append(f"| {r['d']:,} | {r['density']:g} | {r['median_s'] * 1e3:.3f} | {topk['median_s'] * 1e3:.3f} | "
                     f"{r['speedup_vs_topk']:.2f}x | {r['mass_ratio']:.6f} |")
    return "\n".join(lines)


def overhead_summary(result: Result, folder: str) -> str:
    """Per model and strategy on one rank: the plain step, the strategy's step, and the difference (the staging
    and the runtime's host work: one rank sends nothing), per round then the median."""
    _, rows = _rows(folder, "overhead.json")
    lines = [_devices(rows), "", "| model | strategy | plain step ms | step ms | overhead ms | × plain |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        plain, mine = r["t_compute_rounds_s"], r["t_iter_rounds_s"]
        extra = statistics.median(a - b for a, b in zip(mine, plain))
        lines.append(f"| {r['model']} | {r['strategy']} | {r['t_compute_s'] * 1e3:.1f} | {r['t_iter_s'] * 1e3:.1f} | "
                     f"{extra * 1e3:+.1f} | {r['t_iter_s'] / r['t_compute_s']:.2f} |")
    return "\n".join(lines)


def throughput_summary(result: Result, folder: str) -> str:
    """One row per strategy: samples/s with its interval, T_iter, T_compute, T_comm, overlap; the full table (every
    column of `mpitrain bench strategies`) is in the log and the JSON."""
    _, rows = _rows(folder, "throughput.json")
    lines = [_devices(rows), "", "| model | strategy | bandwidth | ranks | samples/s | (low-high) | T_iter s | "
             "T_compute s | T_comm s | overlap eff. |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r["samples_per_s_ci"]
        comm = "-" if r.get("t_comm_s") is None else f"{r['t_comm_s']:.4f}"
        over = "-" if r.get("overlap_efficiency") is None else f"{r['overlap_efficiency']:.2f}"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['bandwidth']} | {r['ranks']} | {r['samples_per_s']:.1f} "
                     f"| ({lo:.1f}-{hi:.1f}) | {r['t_iter_s']:.4f} | {r['t_compute_s']:.4f} | {comm} | {over} |")
    return "\n".join(lines)


def profile_summary(result: Result, folder: str) -> str:
    """The profile's step and compute, its layers, the copy rate it measured, where it is."""
    path = result.outputs[0]
    with open(os.path.join(folder, path)) as f:
        p = json.load(f)
    compute = sum(l["fwd_s"] + l["bwd_s"] for l in p["layers"]) + p["optimizer_s"] + p["other_s"]
    copy = p.get("copy_gbs") or 0
    return (f"{p['model']}, batch {p['batch_size']}: step {p['step_s'] * 1e3:.2f} ms, compute "
            f"{compute * 1e3:.2f} ms over {len(p['layers'])} layers, pinned copies {copy:.1f} GB/s; "
            f"{p.get('machine', '')}; use it as --compute emulated:{path}")


def xcheck_summary(result: Result, folder: str) -> str:
    """Real against emulated, per strategy, and the stretch the emulation was given."""
    with open(os.path.join(folder, "xcheck.json")) as f:
        doc = json.load(f)
    return (f"compute emulated from {doc['meta']['profile']}, stretched {doc['meta']['compute_scale']:.2f}x (the real "
            "run's compute over the profile's step: ranks there share the GPU)\n\n" + xcheck.table(doc["rows"]))


def log_summary(result: Result, folder: str) -> str:
    return ""


SUMMARIES = {"pytest": pytest_summary, "mstopk": mstopk_summary, "overhead": overhead_summary,
             "throughput": throughput_summary, "profile": profile_summary, "xcheck": xcheck_summary,
             "log": log_summary}


def _devices(rows) -> str:
    seen = dict.fromkeys(f"{r.get('device', '?')} ({r.get('device_name', '?')}), CUDA {r.get('cuda', '?')}, "
                         f"{r.get('transport', '?')}" for r in rows)
    return "devices: " + "; ".join(seen)


def document(results: list[Result], meta: dict, folder: str, pending: list[str] = ()) -> dict:
    """The JSON report: meta, each part's result with its summary, the parts not yet run, the verdict."""
    parts = [dict(r.to_json(), summary=summarize(r, folder)) for r in results]
    failed = [r.name for r in results if not r.passed]
    return dict(meta=meta, parts=parts, pending=list(pending), failed=failed,
                passed=not failed and not pending, complete=not pending)


def markdown(doc: dict) -> str:
    """The report for a reader: the verdict, one line per part, then each part's figures or its log's tail."""
    meta, parts = doc["meta"], doc["parts"]
    verdict = ("all parts passed" if doc["passed"] else
               f"FAILED: {', '.join(doc['failed'])}" if doc["failed"] else "running")
    if doc["pending"]:
        verdict += f" (not finished: {', '.join(doc['pending'])} still to run)"
    lines = [f"# gpu-check, {meta.get('date', '')}", "",
             f"{meta.get('gpu', '?')}; {meta.get('machine', '')}; torch {meta.get('torch', '?')}, CUDA "
             f"{meta.get('cuda', '?')}; commit {meta.get('commit') or 'unknown'}", "",
             f"**{verdict}**", "", "| part | status | s | limit s | log |", "|---|---|---:|---:|---|"]
    lines += [f"| {p['name']} | {p['status']}{': ' + p['problem'] if p['problem'] else ''} | {p['seconds']:.0f} | "
              f"{p['limit_s']:.0f} | [{p['log']}]({p['log']}) |" for p in parts]
    for p in parts:
        lines += ["", f"## {p['name']}: {p['title']}", "", f"`{p['command']}`", "",
                  f"{p['status']} in {p['seconds']:.0f} s" + (f" ({p['problem']})" if p["problem"] else "")]
        if p["summary"]:
            lines += ["", p["summary"]]
        if p["status"] != "passed" and p["tail"]:
            lines += ["", "The log's last lines:", "", "```", *p["tail"], "```"]
    return "\n".join(lines) + "\n"


def write_report(folder: str, results: list[Result], meta: dict, pending: list[str] = ()) -> dict:
    """FOLDER/report.json and FOLDER/report.md, each replaced whole (a kill mid-write leaves the last one)."""
    doc = document(results, meta, folder, pending)
    os.makedirs(folder, exist_ok=True)
    for name, text in (("report.json", json.dumps(doc, indent=1)), ("report.md", markdown(doc))):
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
    return doc
