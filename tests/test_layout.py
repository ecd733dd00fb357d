"""The tree's shape: no import circle anywhere, data flowing one way, small modules, and jobs/ by family."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import ROOT

PACKAGES = ("mpicomm", "runtime", "datacache", "jobs")
MAX_LINES = 400
# Who may import whom (data flows one way: jobs -> runtime/datacache -> mpicomm).
MAY_IMPORT = {"mpicomm": {"mpicomm"}, "datacache": {"datacache", "mpicomm"},
              "runtime": {"runtime", "mpicomm"}, "jobs": set(PACKAGES)}


def modules() -> dict[str, str]:
    """{dotted name: path} of every module of the four packages (a package by its __init__)."""
    found = {}
    for top in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, f[:-3]), ROOT).split(os.sep)
                    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
    return found


def imports(name: str, path: str, known) -> set[str]:
    """The modules of the tree that `name` imports, at any depth of its code (a function's imports count)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    out = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_cycle_finder_finds_a_circle():
    """The check below can fail: a circle of three and a self-contained pair are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_anywhere(graph):
    assert cycles(graph) == [], "import circles (modules that import each other, directly or around a loop)"


def test_data_flows_one_way(graph):
    wrong = sorted(f"{a} imports {b}" for a, deps in graph.items() for b in deps
                   if b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]])
    assert wrong == [], "jobs -> runtime/datacache -> mpicomm"


def test_every_module_is_small():
    tests = [os.path.join(ROOT, "tests", f) for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")]
    big = {}
    for path in [*modules().values(), *tests]:
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            big[os.path.relpath(path, ROOT)] = lines
    assert big == {}, f"modules over {MAX_LINES} lines: split by concept"


def test_every_package_says_what_lives_there():
    for name, path in modules().items():
        if path.endswith("__init__.py"):
            with open(path) as f:
                doc = ast.get_docstring(ast.parse(f.read()))
            assert doc and "\n" not in doc.strip(), f"{name}/__init__.py: a one-line docstring, please"


def test_every_library_module_has_a_one_line_docstring():
    """A summary line each; the why goes in comments or the main class's docstring (jobs/ keep theirs: CLI help)."""
    wrong = []
    for name, path in sorted(modules().items()):
        if name.split(".")[0] != "jobs":
            with open(path) as f:
                doc = ast.get_docstring(ast.parse(f.read()))
            if not doc or "\n" in doc.strip():
                wrong.append(name)
    assert wrong == [], f"{len(wrong)} modules without a one-line docstring: {', '.join(wrong)}"


def test_jobs_root_holds_entry_points_and_sub_packages():
    """A module at jobs/'s top is something a user runs (a `__main__` block, or the command itself)."""
    top = os.path.join(ROOT, "jobs")
    for f in sorted(os.listdir(top)):
        path = os.path.join(top, f)
        if f in ("__init__.py", "__main__.py", "cli.py", "__pycache__"):
            continue
        if os.path.isdir(path):
            assert os.path.isfile(os.path.join(path, "__init__.py")), f"jobs/{f}/ is not a package"
            continue
        with open(path) as fh:
            assert '__name__ == "__main__"' in fh.read(), f"jobs/{f} is not an entry point: move it into a room"


def test_every_mpi_test_lives_in_a_file_named_for_it():
    """`-m mpi` skips importing the other test files (conftest's pytest_ignore_collect): a test marked mpi anywhere
    else would silently never run under mpiexec."""
    import re

    from conftest import MPI_FILES

    tests = os.path.join(ROOT, "tests")
    stray = []
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py") and not name.endswith(MPI_FILES):
            with open(os.path.join(tests, name)) as f:
                if re.search(r"\bpytest\.mark\.mpi\b|pytestmark\b.*\bmpi\b", f.read()):
                    stray.append(name)
    assert stray == [], f"tests marked mpi outside a *{MPI_FILES} file: {stray}"


def test_every_mpi_test_file_runs_on_two_nodes_and_the_override_is_exercised():
    """`make test-mpi-hosts` runs the whole MPI suite on 2 fake hosts (real node groups), so every file that reads
    the node layout sees two nodes; `make test-mpi-emulated` runs NODE_TESTS under the ranks_per_node override,
    which must include the override's own tests and the strategies end to end."""
    import re

    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    hosts = make[make.index("\ntest-mpi-hosts:"):]
    hosts = hosts[:hosts.index("\n\n")]
    assert "$(FAKE_HOSTS)" in hosts and "$(PYTEST_MPI)" in hosts and not re.search(r"test_\w+\.py|NODE_TESTS", hosts), \
        f"test-mpi-hosts must run the whole MPI suite on the fake hosts: {hosts!r}"
    listed = set(re.findall(r"test_\w+\.py", make[make.index("NODE_TESTS :="):make.index("test-mpi-emulated:")]))
    tests = os.path.join(ROOT, "tests")
    assert listed and all(os.path.exists(os.path.join(tests, n)) for n in listed), f"NODE_TESTS: {sorted(listed)}"
    assert {"test_topology_mpi.py", "test_transparency_mpi.py"} <= listed, f"NODE_TESTS: {sorted(listed)}"
