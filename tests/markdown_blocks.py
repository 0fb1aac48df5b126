"""The runnable code blocks of the README and the documentation pages (shared by their tests).

A block is runnable when the line before its opening ```python fence is
``<!-- runnable -->``. Each such block is executed in-process, in a fresh
namespace, as a script would run it, and must finish within a few seconds on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
MARKER = "<!-- runnable -->"
_BLOCK = re.compile(r"^<!-- runnable -->[ \t]*\n```python[ \t]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def doc_pages() -> list[str]:
    """Every Markdown page of docs/ (the build folder left out), sorted."""
    pages = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    return sorted(p for p in pages if os.sep + "_build" + os.sep not in p)


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the opening fence, code)`` of every marked ```python block of `text`."""
    return [(text.count("\n", 0, m.start(1)), m.group(1)) for m in _BLOCK.finditer(text)]


def marker_lines(text: str) -> int:
    """How many lines of `text` are a runnable marker (each must open a block)."""
    return sum(line.strip() == MARKER for line in text.splitlines())


def blocks_of(paths: list[str]) -> list[tuple[str, int, str]]:
    """``(path, line, code)`` of the runnable blocks of each file of `paths`."""
    return [(path, line, code) for path in paths for line, code in runnable_blocks(read(path))]


def block_id(path: str, line: int) -> str:
    return f"{os.path.relpath(path, REPO)}:{line}"


@functools.cache
def run_block(path: str, line: int, code: str) -> str:
    """Executes one block as a script would run it; returns what it printed (once per block)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "__main__"})
    return out.getvalue()
