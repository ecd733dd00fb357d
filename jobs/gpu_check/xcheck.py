"""gpu-check's cross-check: the throughput part's cluster again, its compute emulated from this GPU's own profile.

    python -m jobs.gpu_check.xcheck --real DIR/throughput.json --profile DIR/profiles/M-bB-GPU-tf32.json \\
        --json DIR/xcheck.json -- BENCH-ARGS...

BENCH-ARGS are the throughput part's `jobs.bench.strategies` arguments without --device and --json. The same
benchmark runs again with `--compute emulated:PROFILE` on this machine's CPU. Each rank then has a device of its
own, where the real run's ranks shared the one GPU, so the emulated step is stretched (--compute-scale) by how much
longer the real run's compute took than the profile's step. Then, for every strategy in both runs, T_iter and
T_comm side by side, real ÷ emulated: issue 27's emulated-against-real cross-check in one command. The emulated
run's own JSON and PNG are written beside the output (-emulated).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from jobs.common.inputs import InputError, JobParser, parse

__all__ = ["compare", "compute_scale", "main", "swapped", "table"]


def compute_scale(real_rows: list[dict], profile: dict) -> float:
    """The real run's compute per step (median over its rows) over the profile's step: 1 for a GPU per rank;
    about 2 for four ranks on one H200 (43.7 against 21.2 ms, 2026-12-04)."""
    return statistics.median(r["t_compute_s"] for r in real_rows) / profile["step_s"]


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def compare(real_rows: list[dict], emulated_rows: list[dict]) -> list[dict]:
    """For every strategy in both runs, in the real run's order: T_iter and T_comm (None where a strategy has
    none), real and emulated, and real ÷ emulated."""
    emulated = {r["strategy"]: r for r in emulated_rows}
    out = []
    for r in real_rows:
        e = emulated.get(r["strategy"])
        if e is None:
            continue
        row = dict(model=r["model"], strategy=r["strategy"], bandwidth=r["bandwidth"])
        for key in ("t_iter_s", "t_comm_s", "t_compute_s"):
            row[f"real_{key}"], row[f"emulated_{key}"] = r.get(key), e.get(key)
            row[f"{key.removesuffix('_s')}_ratio"] = _ratio(r.get(key), e.get(key))
        out.append(row)
    return out


def swapped(rows: list[dict]) -> list[tuple[str, str]]:
    """The pairs of strategies that the emulated run orders by T_iter the other way round from the real run."""
    return [(a["strategy"], b["strategy"]) for i, a in enumerate(rows) for b in rows[i + 1:]
            if (a["real_t_iter_s"] - b["real_t_iter_s"]) * (a["emulated_t_iter_s"] - b["emulated_t_iter_s"]) < 0]


def table(rows: list[dict]) -> str:
    """The comparison as markdown, one line per strategy."""
    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| strategy | T_iter real s | T_iter emulated s | real ÷ emulated | T_comm real s | T_comm emulated s | "
             "real ÷ emulated |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {cell(r['real_t_iter_s'], '.4f')} | {cell(r['emulated_t_iter_s'], '.4f')} "
                     f"| {cell(r['t_iter_ratio'], '.2f')} | {cell(r['real_t_comm_s'], '.4f')} | "
                     f"{cell(r['emulated_t_comm_s'], '.4f')} | {cell(r['t_comm_ratio'], '.2f')} |")
    pairs = swapped(rows)
    n = len(rows) * (len(rows) - 1) // 2
    lines += ["", f"ranking by T_iter: {n - len(pairs)} of {n} pairs in the same order"
              + (f"; swapped: {', '.join(f'{a}/{b}' for a, b in pairs)}" if pairs else "")]
    return "\n".join(lines)


def _read(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"xcheck: cannot read {what} {path}: {exc} (run gpu-check's throughput and profile parts "
                         "first)") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    bench = argv[argv.index("--") + 1:] if "--" in argv else []
    p = JobParser(prog="python -m jobs.gpu_check.xcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--real", required=True, help="the throughput part's JSON (real compute)")
    p.add_argument("--profile", required=True, help="this GPU's profile of the same model and batch")
    p.add_argument("--json", required=True, help="where the comparison goes (the emulated run beside it)")

    def check(_args) -> None:
        if not bench or any(a in ("--device", "--json", "--compute", "--compute-scale") for a in bench):
            raise InputError("", "give the throughput part's benchmark arguments after --, without --device, "
                                 "--json, --compute and --compute-scale")
    args = parse(p, argv[:argv.index("--")] if "--" in argv else argv, check)
    real = _read(args.real, "the real run")["rows"]
    profile = _read(args.profile, "the profile")
    scale = compute_scale(real, profile)
    emulated_json = os.path.splitext(args.json)[0] + "-emulated.json"
    cmd = [sys.executable, "-m", "jobs.bench.strategies", *bench, "--compute", f"emulated:{args.profile}",
           "--compute-scale", f"{scale:.4f}", "--json", emulated_json]
    print(f"xcheck: the real run's compute is {scale:.2f} x the profile's step "
          f"({statistics.median(r['t_compute_s'] for r in real) * 1e3:.1f} against {profile['step_s'] * 1e3:.1f} ms)",
          flush=True)
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"xcheck: the emulated run failed (exit {rc})", flush=True)
        return rc
    rows = compare(real, _read(emulated_json, "the emulated run")["rows"])
    doc = dict(meta=dict(real=args.real, profile=args.profile, emulated=emulated_json, compute_scale=scale,
                         command=" ".join(cmd)), rows=rows)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(rows))
    print(f"wrote {args.json}")
    return 0 if rows else 1


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
