"""A user's plain `mpiexec -n 4 python train.py`: whatever one rank does wrong, every rank stops within 30 s,
non-zero, each printing the rank at fault and why; a script that ends well still ends well (mpicomm.failstop)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec

SCRIPT = os.path.join(ROOT, "tests", "failstop_script.py")
LIMIT = 30  # seconds every rank has to be gone in


def run(*args, env=None):
    """The script under a plain mpiexec (no `-m mpi4py`, no run_main), inside `timeout LIMIT`."""
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))  # a file's own directory comes first on sys.path
    cmd = ["timeout", "-k", "5", str(LIMIT), mpiexec(), "-n", "4", sys.executable, SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=LIMIT + 30)


def lines_of(proc, rank: int) -> str:
    return "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(f"[rank {rank}]"))


def assert_everyone_says(proc, culprit: int, *words):
    """A failed job (not timeout's 124), and every rank printed a line naming the culprit (the culprit: its error).

    Each rank leaves with status 1; mpiexec reports 1, or 9 for the ranks it killed once the first had gone."""
    assert proc.returncode in (1, 9), f"status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    for rank in range(4):
        said = lines_of(proc, rank)
        assert all(w in said for w in words), f"rank {rank} said:\n{said}\n--- all:\n{proc.stderr[-3000:]}"
        if rank != culprit:
            assert re.search(rf"rank {culprit}\b", said), f"rank {rank} does not name rank {culprit}:\n{said}"
    assert "left at exit" not in proc.stderr  # nothing was left posted either


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "hybcomm", "topk", "hier-topk"])
def test_a_rank_raising_mid_training_stops_every_rank(strategy):
    proc = run("raise", strategy)
    assert_everyone_says(proc, 1, "OSError: disk gone")
    assert "Traceback" in lines_of(proc, 1) and "after 20 steps" in lines_of(proc, 0)


def test_a_pipeline_stage_raising_stops_every_rank():
    assert_everyone_says(run("pipeline"), 1, "OSError: disk gone")


def test_a_rank_raising_before_wrapping_stops_the_ranks_waiting_in_wrap():
    proc = run("before-wrap")
    assert_everyone_says(proc, 1, "OSError: disk gone")
    assert "blocked in" in lines_of(proc, 0)  # the watcher thread stopped it: it waited in wrapping's Dup


def test_an_unknown_strategy_on_one_rank_stops_every_rank():
    assert_everyone_says(run("unknown-strategy"), 1, "unknown strategy 'nope'")


def test_a_rank_with_a_step_fewer_is_named_with_the_step_it_stopped_at():
    proc = run("uneven")
    assert_everyone_says(proc, 3, "CollectiveMismatchError", "rank 3: sum_over_ranks() after 9 steps",
                         "step #10")


@pytest.mark.parametrize("mode, says", [
    ("uneven-on", "rank 0, 1, 2: step #10; rank 3: sum_over_ranks() after 9 steps"),
    ("close-early", "rank 0, 1, 2: step #10; rank 3: close() after 9 steps")])
def test_under_p3_ranks_training_on_past_a_rank_that_stopped_stepping_hear_of_it_at_once(mode, says):
    """p3's step() leaves its agreement in flight and the next forward waits for the step's slices, which need
    rank 3's pushes: the agreement, completed meanwhile with rank 3's other round, names both on every rank at
    once; before, ranks 0-2 waited until the stall limit (600 s by default)."""
    assert_everyone_says(run(mode, "p3"), 0, "CollectiveMismatchError", says)


def test_a_rank_with_a_step_fewer_in_a_users_own_collective_is_found_by_the_stall_limit():
    proc = run("uneven-allreduce", "allreduce", env={"MPITRAIN_STALL_TIMEOUT": "6", "MPITRAIN_STALL_WARNING": "3"})
    assert_everyone_says(proc, 0, "StallError", "rank(s) [3] have not reached this point (step #10)")
    assert "failstop_script.py" in lines_of(proc, 3)  # where rank 3 was blocked: the user's Allreduce


def test_under_p3_a_step_fewer_before_a_users_own_collective_is_named_at_the_next_agreement():
    """p3's step() returns with its agreement in flight (runtime.stepping): the user's Allreduce completes, and the
    agreement, finished at close(), names the step each rank is at on every rank; no stall limit needed."""
    proc = run("uneven-allreduce", "p3")
    assert_everyone_says(proc, 0, "CollectiveMismatchError", "rank 0, 1, 2: step #10; rank 3: close() after 9 steps")


def test_a_rank_leaving_early_stops_every_rank():
    proc = run("exit")
    assert_everyone_says(proc, 2, "exited", "after 5 steps")


@pytest.mark.parametrize("mode", ["fine", "no-close"])
def test_a_script_that_ends_well_still_ends_well(mode):
    """Closing is agreed; a script that forgets close() on every rank still ends with status 0 on all."""
    proc = run(mode, "p3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(f"[rank {r}] done" in proc.stdout for r in range(4)) and "stopped" not in proc.stderr


def test_fail_stop_can_be_turned_off():
    """MPITRAIN_FAILSTOP=0: the old behaviour (the ranks waiting for the failed one are ended by the limit)."""
    proc = run("raise", "allreduce", env={"MPITRAIN_FAILSTOP": "0", "MPITRAIN_STALL_TIMEOUT": "4"})
    assert proc.returncode != 0 and "PeerFailedError: rank 1" not in proc.stderr


def interrupted(cmd, one_rank=False):
    """2 ranks of `cmd` under mpiexec, SIGINT once they train (to mpiexec, or to rank 1 alone); (proc, out, err)."""
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            start_new_session=True)
    try:
        # The job's first line comes after its collective start: every rank is in; the script's, from each rank
        # (two ranks' lines may come as one).
        first = line = proc.stdout.readline()
        while line and cmd[0] != "-m" and not all(f"[rank {r}] training" in first for r in range(2)):
            line = proc.stdout.readline()  # "" once the job has ended: the assertions below say how
            first += line
        time.sleep(1.0)
        if one_rank:
            os.kill(int(re.search(r"\[rank 1\] training, pid (\d+)", first).group(1)), signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, first + out, err


@pytest.mark.parametrize("launch", ["script", "job", "one rank"])
def test_ctrl_c_ends_every_rank_with_one_line_each_and_status_130(launch):
    """^C at mpiexec (which passes SIGINT to every rank): each rank says where it was in one line, no traceback
    a rank; the job ends with a shell's status for SIGINT. A user's script (sys.excepthook), a job (run_main),
    and SIGINT to rank 1 alone: rank 0 names it and where it was."""
    cmd = ["-m", "jobs.train", "--data", "synthetic", "--epochs", "1000"] if launch == "job" else \
        [SCRIPT, "interrupt", "p3"]
    proc, out, err = interrupted(cmd, one_rank=launch == "one rank")
    said = [line for line in err.splitlines() if line.startswith("[rank")]
    assert proc.returncode == 130, f"status {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    for rank in range(2):  # a rank that hears of the other's ^C before its own comes names that rank
        mine = [line for line in said if line.startswith(f"[rank {rank}] ")]
        own = r"KeyboardInterrupt: interrupted in .+ \(after \d+ steps\)"
        heard = rf"PeerFailedError: rank {1 - rank} stopped with KeyboardInterrupt: interrupted in "
        want = own if launch == "one rank" and rank == 1 else heard if launch == "one rank" else f"{own}|{heard}"
        assert len(mine) == 1 and re.match(rf"\[rank {rank}\] ({want})", mine[0]), \
            f"rank {rank} said {mine}:\n{err[-3000:]}"


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3", "pipeline"])
def test_a_loop_that_catches_ctrl_c_saves_on_every_rank_and_ends_well(strategy):
    """The README's loop that saves on ^C: each rank takes the interrupt at its own point (in the runtime's waits,
    in the model, in torch's optimizer), or hears of the other's first (PeerInterruptedError, a
    KeyboardInterrupt); opt.abort(exc) agrees nothing more, so the save and close() are this rank's own. The
    same with a 2-stage pipeline (spectrain) and pipe.abort(exc)."""
    proc, out, err = interrupted([SCRIPT, "catch-interrupt", strategy])
    assert proc.returncode == 0, f"status {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert all(f"[rank {r}] caught ^C, saved" in out and f"[rank {r}] done" in out for r in range(2)), out + err
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
