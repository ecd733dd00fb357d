"""The README's first example runs as printed, on 2 ranks, and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT
from mpicomm.launch import mpiexec


def readme_program() -> str:
    """The README's first complete program (section "Training:"), as printed."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Training:"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_first_training_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_program())
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", proc.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 0.8, proc.stdout
