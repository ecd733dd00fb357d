"""Every ```python and ```bash block of README.md and slurm/README.md runs as printed here, or says right above it
why not (the markers: tests/readme_blocks.py).

Python blocks run as MPI programs, `timeout 120 mpiexec -n 2 python FILE` (`run on N ranks`: -n N), after their
`run with:` prelude.
Shell blocks run with `bash -e` in an empty directory holding `.venv` (a link to this interpreter's venv, so
that `source .venv/bin/activate` works as the README says) and that venv's bin first on PATH, so `mpitrain`
and `mpiexec` are its own; PYTHONPATH is this checkout, which the venv's editable install points at anyway.
A block fails on a non-zero exit, a traceback, requests left at MPI_Finalize, or an `expect:` not met.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from readme_blocks import DOCS, RUNNABLE, blocks, parse, plan, shell_script

from conftest import ROOT
from mpicomm.launch import mpiexec

BLOCKS = [b for doc in DOCS for b in blocks(doc) if b.lang in RUNNABLE or plan(b).problems]
BLOCK_TIMEOUT = 240  # a whole shell block; one Python program gets 120 s, as the README's MPI examples would
BAD_OUTPUT = ("Traceback (most recent call last)", "[mpitrain] left at exit")


def run(cmd, cwd, timeout):
    """(returncode, stdout, stderr); the command's whole process group is killed if it outlives `timeout`."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


def test_the_docs_have_the_blocks_this_test_expects():
    """The parser finds the README's blocks: an empty list would pass every block test trivially."""
    readme = [b for b in BLOCKS if b.doc == "README.md"]
    assert len(readme) >= 20 and {b.lang for b in readme} == {"python", "bash"}
    assert any(b.heading.startswith("Training:") and b.lang == "python" and not plan(b).skip for b in readme)


WRONG = """
# A section
<!-- not run: slow -->
```bash
mpitrain train
```
<!-- note: an editor's comment -->
```python
print(1)
```
```sh
mpitrain --help
```
```
mpiexec -n 4 mpitrain train
```
<!-- run appending to "mpitrain bench": --rounds 1 -->
```bash
mpitrain train --help
mpiexec -n 2 mpitrain train \\
    --epochs 3 --json 'a#b.json'   # two epochs more
```
"""


def test_a_block_that_neither_runs_nor_says_why_fails():
    """The ways a new block could slip through: each one is a problem of that block, named."""
    problems = [" ".join(plan(b).problems) for b in parse(WRONG, "WRONG.md")]
    assert "say what it needs" in problems[0] and "not a marker" in problems[1]
    assert "write ```bash" in problems[2] and "tag it ```bash" in problems[3]
    assert "no command line of the block holds it" in problems[4]
    last = parse(WRONG.replace("mpitrain bench", "mpitrain train"), "WRONG.md")[-1]
    assert shell_script(last, plan(last)).split("\n")[:2] == [
        "mpitrain train --help", "mpiexec -n 2 mpitrain train --epochs 3 --json 'a#b.json' --rounds 1  # two epochs more"]


@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.id}-{b.lang}" for b in BLOCKS])
def test_block_runs_or_says_why_not(block, tmp_path):
    p = plan(block)
    assert not p.problems, f"{block.id} (section {block.heading!r}): " + "; ".join(p.problems)
    if p.skip is not None:
        pytest.skip(f"not run: {p.skip}")
    if block.lang == "python":
        program = tmp_path / "snippet.py"
        program.write_text(p.prelude + block.code)
        cmd = ["timeout", "-k", "5", "120", mpiexec(), "-n", str(p.ranks), sys.executable, str(program)]
        code, out, err = run(cmd, tmp_path, 120)
        shown = program.read_text()
    else:
        if sys.prefix == sys.base_prefix:
            pytest.skip("the shell blocks assume the venv of make setup; this interpreter is not in a venv")
        script = tmp_path / "snippet.sh"
        shown = shell_script(block, p)
        script.write_text(shown + "\n")
        os.symlink(sys.prefix, tmp_path / ".venv")
        code, out, err = run(["timeout", "-k", "5", str(BLOCK_TIMEOUT), "bash", "-e", str(script)], tmp_path,
                             BLOCK_TIMEOUT)
    where = f"{block.id} (section {block.heading!r}) ran as:\n{shown}\nstdout:\n{out[-2500:]}\nstderr:\n{err[-4000:]}"
    assert code == 0, f"exit {code}: {where}"
    bad = [s for s in BAD_OUTPUT if s in err]
    assert not bad, f"{bad}: {where}"
    missed = [e.pattern for e in p.expect if not re.search(e, out)]
    assert not missed, f"expected {missed} in stdout: {where}"
