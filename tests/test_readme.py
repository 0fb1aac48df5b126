"""The README's runnable code blocks run as pasted (see tests/markdown_blocks.py)."""

from __future__ import annotations

import itertools
import re

import pytest

from markdown_blocks import MARKER, README, block_id, blocks_of, marker_lines, read, run_block

BLOCKS = blocks_of([README])


def test_every_marker_is_on_a_python_block():
    assert BLOCKS, f"no {MARKER} block in the README"
    assert marker_lines(read(README)) == len(BLOCKS), f"a {MARKER} line not directly above a ```python fence"


@pytest.mark.parametrize("path, line, code", BLOCKS, ids=[block_id(p, line) for p, line, _ in BLOCKS])
def test_runnable_block_runs(path, line, code):
    run_block(path, line, code)


def test_quickstart_loss_falls():
    """The first runnable block is the Quickstart: it prints ``loss X`` per step, falling."""
    printed = run_block(*BLOCKS[0])
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", printed)]
    assert len(losses) >= 3 and all(b < a for a, b in itertools.pairwise(losses)), printed


def test_readme_is_a_front_page():
    """At most 250 lines: the rest lives in docs/."""
    assert len(read(README).splitlines()) <= 250
