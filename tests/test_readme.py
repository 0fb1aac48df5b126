"""The README's runnable code blocks run as pasted.

A block is runnable when the line before its opening ```python fence is
``<!-- runnable -->``. Each such block is executed in-process, in a fresh
namespace, and must finish within a few seconds on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARKER = "<!-- runnable -->"
_BLOCK = re.compile(r"^<!-- runnable -->[ \t]*\n```python[ \t]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the opening fence, code)`` of every marked ```python block of `text`."""
    return [(text.count("\n", 0, m.start(1)), m.group(1)) for m in _BLOCK.finditer(text)]


@functools.lru_cache(maxsize=None)
def run_block(line: int, code: str) -> str:
    """Executes one block as a script would run it; returns what it printed (once per block)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def _readme() -> str:
    with open(README) as fh:
        return fh.read()


BLOCKS = runnable_blocks(_readme())


def test_every_marker_is_on_a_python_block():
    assert BLOCKS, f"no {MARKER} block in the README"
    marker_lines = sum(line.strip() == MARKER for line in _readme().splitlines())
    assert marker_lines == len(BLOCKS), f"a {MARKER} line not directly above a ```python fence"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_runnable_block_runs(line, code):
    run_block(line, code)


def test_quickstart_loss_falls():
    """The first runnable block is the Quickstart: it prints ``loss X`` per step, falling."""
    printed = run_block(*BLOCKS[0])
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", printed)]
    assert len(losses) >= 3 and all(b < a for a, b in zip(losses, losses[1:])), printed
