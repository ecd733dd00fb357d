"""MPICH's single-copy path inside a node: the rule read as MPICH reads it, and `mpitrain topology` saying it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from mpicomm.launch import mpiexec
from mpicomm.single_copy import single_copy

pytestmark = pytest.mark.timeout(120)
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."


def test_the_rule(tmp_path):
    yama = tmp_path / "ptrace_scope"
    assert single_copy("Open MPI v5.0.5", {})[0] is None
    assert single_copy(MPICH, {}, str(yama)) == (True, "no Yama ptrace_scope here")
    yama.write_text("1\n")
    on, why = single_copy(MPICH, {}, str(yama))
    assert not on and "ptrace_scope=1" in why and "sysctl kernel.yama.ptrace_scope=0" in why
    yama.write_text("0\n")
    assert single_copy(MPICH, {}, str(yama))[0] is True
    assert single_copy(MPICH, {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}, str(yama)) == (False, "MPIR_CVAR_CH4_CMA_ENABLE=0")
    assert single_copy(MPICH, {"MPIR_CVAR_CH4_CMA_ENABLE": "1"}, str(yama))[0] is True


def test_topology_says_whether_a_nodes_large_messages_take_one_copy(tmp_path):
    """Two ranks of one node, MPICH told to leave CMA off: the layout's JSON and its line say so."""
    out = tmp_path / "layout.json"
    env = dict(os.environ, PYTHONPATH=ROOT, MPIR_CVAR_CH4_CMA_ENABLE="0")
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "jobs.topology", "--json", str(out)],
                          capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["single_copy"] is False
    assert "large messages inside a node: through MPICH cells (MPIR_CVAR_CH4_CMA_ENABLE=0)" in proc.stdout
