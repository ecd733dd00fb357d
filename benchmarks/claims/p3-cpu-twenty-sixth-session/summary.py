"""p3's exchange CPU by kind, from py-spy's raw samples of one rank (run.sh): the samples inside SlicedExchange.poll."""
import collections
import gzip
import sys

KINDS = [("SlicedExchange._try_aggregate", "summing pushes (torch add_, div_)"),
         ("RequestLog.isend", "posting sends (MPI, UCX)"), ("RequestLog.irecv", "posting receives (MPI, UCX)"),
         ("Testsome", "Testsome (MPI's progress: UCX, shared memory)"),
         ("SlicedExchange._share", "queueing results"), ("SlicedExchange._slice_done", "finishing slices")]
for path in sys.argv[1:]:
    kinds, total = collections.Counter(), 0
    for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if "SlicedExchange.poll" not in frames:
            continue
        total += int(n)
        rest = frames[frames.index("SlicedExchange.poll") + 1:]
        kind = next((k for frame, k in KINDS if frame in rest), None)
        if kind is None:  # libc without symbols right under a Python frame: the frames between were not unwound
            native = rest and rest[-1] not in ("SlicedExchange._complete", "SlicedExchange._send_from_queue")
            kind = "libc without symbols under _complete (MPI's calls; frames lost)" if native else \
                "Python bookkeeping"
        kinds[kind] += int(n)
    print(f"{path}: {total} samples in poll ({total / 200:.2f} s at 200 Hz)")
    for kind, n in kinds.most_common():
        print(f"  {100 * n / total:5.1f} %  {kind}")
