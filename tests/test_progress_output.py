"""jobs.common.progress: a tqdm bar only on a terminal, plain periodic lines in a log file."""

from __future__ import annotations

import io
import os
import pty

from jobs.common.progress import BarProgress, LineProgress, epoch_progress


def test_a_terminal_gets_a_bar_a_file_gets_lines(tmp_path):
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty, open(tmp_path / "log", "w") as log:
        bar = epoch_progress(10, "epoch 1/1", 64, bar_stream=tty, line_stream=log)
        assert isinstance(bar, BarProgress)
        bar.close()
        assert isinstance(epoch_progress(10, "epoch 1/1", 64, bar_stream=log, line_stream=log), LineProgress)
    os.close(leader)


def test_lines_every_tenth_of_the_epoch_without_carriage_returns():
    out = io.StringIO()
    progress = LineProgress(40, "epoch 2/3", 64, out)
    for step in range(40):
        progress.update(1.0 + step)
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(":")[1].split()[0] for line in lines] == [f"{n}/40" for n in range(4, 40, 4)]
    assert lines[0].startswith("epoch 2/3: 4/40 steps, loss 2.500, ") and lines[0].endswith(" samples/s")
