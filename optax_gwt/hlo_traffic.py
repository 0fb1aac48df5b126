"""Memory traffic of a compiled XLA program, read from its HLO text.

Counts, in the entry computation of ``compiled.as_text()``, the top-level
instructions that touch memory (fusions, custom calls, stand-alone ops; not
parameters, tuples, bitcasts or constants) and the bytes of their operands and
results. An operand is "full-size" when its element count equals that of one of
the given parameter arrays: the number of full-size reads per parameter is how
many times the step streams each weight-sized array from memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_FREE_OPS = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
}
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64)|c(?:64|128))\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


class Traffic(NamedTuple):
    """What the entry computation of one compiled program does to memory.

    Attributes:
      ops: top-level instructions that touch memory (fusions included).
      fusions: of which fusions.
      bytes_read: bytes of all their operands.
      bytes_written: bytes of all their results.
      full_size_reads: operands of a parameter's full size, counted once per use.
      full_size_writes: results of a parameter's full size.
      full_size_read_elements: elements of those full-size operands; divided by
        the number of parameters, the full-size reads per parameter.
    """

    ops: int
    fusions: int
    bytes_read: int
    bytes_written: int
    full_size_reads: int
    full_size_writes: int
    full_size_read_elements: int


def _arrays(text: str) -> list[tuple[str, int]]:
    """(dtype, element count) of every array type written in `text`."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) if dims else 1
        out.append((dtype, n))
    return out


class Instruction(NamedTuple):
    """One instruction of an HLO computation, as written in its text."""

    name: str
    result_type: str
    opcode: str
    operands: list[str]  # names of the operand instructions
    parameter: int | None  # the parameter number, for a ``parameter`` instruction


def entry_instructions(hlo_text: str) -> list[Instruction]:
    """The instructions of the entry computation of ``compiled.as_text()``, in order."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, result_type, opcode, rest = m.groups()
        if opcode == "parameter":
            number = re.match(r"\d+", rest)
            assert number is not None, f"a parameter without its number: {line}"
            out.append(Instruction(name, result_type, opcode, [], int(number.group())))
        else:
            operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0] if ")," in rest else rest)
            out.append(Instruction(name, result_type, opcode, operands, None))
    return out


def entry_traffic(hlo_text: str, full_sizes: Iterable[int]) -> Traffic:
    """Counts the memory traffic of the entry computation of `hlo_text`.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.
      full_sizes: element counts that are "full size" (those of the params).
    """
    full = set(int(n) for n in full_sizes)
    shapes: dict[str, list[tuple[str, int]]] = {}
    ops = fusions = read = written = full_reads = full_writes = full_elems = 0
    for ins in entry_instructions(hlo_text):
        result = _arrays(ins.result_type)
        shapes[ins.name] = result
        if ins.opcode in _FREE_OPS:
            continue
        ops += 1
        fusions += ins.opcode == "fusion"
        for op in ins.operands:
            for dtype, n in shapes.get(op, []):
                read += n * _DTYPE_BYTES[dtype]
                full_reads += n in full
                full_elems += n if n in full else 0
        for dtype, n in result:
            written += n * _DTYPE_BYTES[dtype]
            full_writes += n in full
    return Traffic(ops, fusions, read, written, full_reads, full_writes, full_elems)
