"""The docs' code blocks and the markers right above them: what tests/test_readme_snippets.py runs, and how.

A fenced ```python or ```bash block runs as printed unless HTML comments on the lines right above its
fence say otherwise (invisible on GitHub, plain in the source, next to what they change):

    <!-- not run: REASON -->         not run here, and why (specific: what it needs, what tests it instead)
    <!-- run with: CODE -->          python: CODE (one line or several) runs first, in the same program;
                                     for fragments that use a model or data defined elsewhere
    <!-- run on N ranks -->          python: mpiexec -n N (default 2), for a program that needs more
    <!-- run appending to "CMD": ARGS -->
                                     bash: ARGS goes at the end of every command line holding CMD (before
                                     its comment; not on --help lines); options given twice take the last
                                     value, so this shortens a run (--epochs 1) without touching what the
                                     reader copies. The test's failure message shows the script as run.
    <!-- expect: REGEX -->           stdout must match REGEX (re.search)

Any other comment right above a fence, a ```sh/```py/... fence, or an untagged block that holds
commands or Python fails the test: a new snippet cannot slip in unrun.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass, field

from conftest import ROOT

DOCS = ("README.md", "slurm/README.md")
RUNNABLE = ("python", "bash")
ALIASES = {"sh": "bash", "shell": "bash", "console": "bash", "zsh": "bash", "shell-session": "bash",
           "py": "python", "python3": "python", "pycon": "python"}
# An untagged (or otherwise tagged) block that starts a line like this is code that would escape the harness.
LOOKS_LIKE_CODE = re.compile(r"^\s*(\$ |mpiexec |mpitrain |python |sbatch |srun |make |import |from \S+ import )", re.M)
MIN_REASON = 20  # characters: "not run: slow" says nothing


@dataclass
class Block:
    doc: str
    line: int  # the opening fence, 1-based
    lang: str
    code: str
    heading: str
    markers: list[str]  # the texts of the HTML comments right above the fence, top to bottom

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Plan:
    """How a block runs: `skip` (the reason) or `prelude`, `appends` [(command, args)], `expect` [regex]."""

    skip: str | None = None
    ranks: int = 2
    prelude: str = ""
    appends: list = field(default_factory=list)
    expect: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def blocks(doc: str) -> list[Block]:
    """Every fenced block of `doc` (a path under the repository root), with the section it sits in."""
    with open(os.path.join(ROOT, doc)) as f:
        return parse(f.read(), doc)


def parse(text: str, doc: str) -> list[Block]:
    lines = text.split("\n")
    found, heading, i = [], "", 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m is None:
            if lines[i].startswith("#"):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        found.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", heading, _markers(lines, i)))
        i = end + 1
    return found


def _markers(lines: list[str], fence: int) -> list[str]:
    found, j = [], fence - 1
    while j >= 0 and lines[j].rstrip().endswith("-->"):
        k = j
        while k > 0 and "<!--" not in lines[k]:
            k -= 1
        text = "\n".join(lines[k:j + 1]).strip()
        found.insert(0, text.removeprefix("<!--").removesuffix("-->").strip())
        j = k - 1
    return found


def plan(block: Block) -> Plan:
    """The block's markers read; every way they can be wrong is a problem, named."""
    p = Plan()
    if block.lang not in RUNNABLE:
        if block.lang in ALIASES:
            p.problems.append(f"```{block.lang}: write ```{ALIASES[block.lang]}, which this harness runs")
        elif LOOKS_LIKE_CODE.search(block.code):
            p.problems.append(f"a {'```' + block.lang if block.lang else 'untagged'} block holding commands or "
                              "Python: tag it ```bash or ```python")
        else:
            p.skip = f"a ```{block.lang} block, not code"
        return p
    for text in block.markers:
        appending = re.match(r'run appending to "([^"]+)":\s*(.+)$', text, re.S)
        if text.startswith("not run:"):
            p.skip = " ".join(text.removeprefix("not run:").split())
            if len(p.skip) < MIN_REASON:
                p.problems.append(f"<!-- not run: {p.skip} -->: say what it needs and what tests it instead")
        elif re.fullmatch(r"run on [1-9][0-9]* ranks", text) and block.lang == "python":
            p.ranks = int(text.split()[2])
        elif text.startswith("run with:") and block.lang == "python":
            p.prelude += textwrap.dedent(text.removeprefix("run with:").strip("\n")).strip() + "\n"
        elif appending and block.lang == "bash":
            command, args = appending.group(1), " ".join(appending.group(2).split())
            if not _holding(block.code, command):
                p.problems.append(f'<!-- run appending to "{command}" -->: no command line of the block holds it')
            p.appends.append((command, args))
        elif text.startswith("expect:"):
            try:
                p.expect.append(re.compile(text.removeprefix("expect:").strip()))
            except re.error as exc:
                p.problems.append(f"<!-- {text} -->: {exc}")
        else:
            p.problems.append(f"<!-- {text[:60]} -->: not a marker for a ```{block.lang} block "
                              "(see tests/readme_blocks.py)")
    if p.skip is not None and (p.prelude or p.appends or p.expect or p.ranks != 2):
        p.problems.append("a block that is not run takes no other marker")
    return p


def _holding(code: str, command: str) -> list[int]:
    pattern = re.compile(rf"(^|\s){re.escape(command)}(\s|$)")
    commands = [split_comment(line)[0] for line in logical_lines(code)]
    return [n for n, cmd in enumerate(commands) if pattern.search(cmd) and "--help" not in cmd.split()]


def logical_lines(code: str) -> list[str]:
    """The shell's command lines: a backslash at the end of a line continues it."""
    return re.sub(r"[ \t]*\\\n\s*", " ", code).split("\n")


def split_comment(line: str) -> tuple[str, str]:
    """(command, `# comment`) of one shell line; a # inside quotes or a word is not a comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def shell_script(block: Block, p: Plan) -> str:
    """The block as it runs: its command lines, with the appended arguments where the markers say."""
    lines = logical_lines(block.code)
    for command, args in p.appends:
        for n in _holding(block.code, command):
            cmd, comment = split_comment(lines[n])
            lines[n] = f"{cmd.rstrip()} {args}" + (f"  {comment}" if comment else "")
    return "\n".join(lines)


def readme_program() -> str:
    """The README's first complete program (section "Training:"), as printed."""
    return next(b.code for b in blocks("README.md") if b.heading.startswith("Training:") and b.lang == "python")
