"""Progress of a training epoch, fit for where it lands: a tqdm bar on a terminal, plain lines in a log file."""

from __future__ import annotations

import math
import sys
import time

LINE_EVERY_S = 30.0  # a log line at least this often, however slow the steps
LINE_EVERY_FRACTION = 0.1  # and one every tenth of the epoch


class LineProgress:
    """`epoch 1/3: 120/400 steps, loss 0.532, 812 samples/s` every ~10 % of the epoch or every 30 s.

    tqdm redraws its bar with a carriage return many times a second: in an sbatch log every redraw is
    kept, so a log file gets these lines instead. Loss and samples/s are over the epoch so far; a step's loss of
    None (emulated compute computes none) leaves the loss out of the line rather than show a figure.
    """

    def __init__(self, total: int, label: str, samples_per_step: int, stream):
        self.total, self.label, self.samples_per_step, self.stream = total, label, samples_per_step, stream
        self.every = max(1, math.ceil(total * LINE_EVERY_FRACTION))
        self.start = self.last = time.monotonic()
        self.done, self.loss_sum, self.losses = 0, 0.0, 0

    def update(self, loss: float | None) -> None:
        self.done += 1
        if loss is not None:
            self.loss_sum += loss
            self.losses += 1
        now = time.monotonic()
        # The last step gets no line: the epoch's summary follows at once.
        if self.done < self.total and (self.done % self.every == 0 or now - self.last >= LINE_EVERY_S):
            self.last = now
            rate = self.done * self.samples_per_step / max(now - self.start, 1e-9)
            loss_text = f"loss {self.loss_sum / self.losses:.3f}, " if self.losses else ""
            print(f"{self.label}: {self.done}/{self.total} steps, {loss_text}{rate:.0f} samples/s", file=self.stream,
                  flush=True)

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar that disappears when the epoch ends, showing the loss every 20 steps."""

    def __init__(self, total: int, label: str, stream):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="step", leave=False, file=stream)

    def update(self, loss: float | None) -> None:
        self.bar.update(1)
        if loss is not None and self.bar.n % 20 == 1:
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def close(self) -> None:
        self.bar.close()


def epoch_progress(total: int, label: str, samples_per_step: int, bar_stream=None, line_stream=None):
    """A bar on `bar_stream` (stderr) if it is a terminal, else lines on `line_stream` (stdout).

    Lines go to stdout so that they stay in order with the job's other output in a log file.
    """
    bar_stream = sys.stderr if bar_stream is None else bar_stream
    if bar_stream.isatty():
        try:
            return BarProgress(total, label, bar_stream)
        except ImportError:
            pass
    return LineProgress(total, label, samples_per_step, sys.stdout if line_stream is None else line_stream)
