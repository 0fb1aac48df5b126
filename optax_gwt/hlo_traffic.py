"""Memory traffic of a compiled XLA program, read from its HLO text.

Counts, in the entry computation of ``compiled.as_text()``, the top-level
instructions that touch memory (fusions, custom calls, stand-alone ops; not
parameters, tuples, bitcasts or constants) and the bytes of their operands and
results that live in the device's main memory (HBM on a GPU or TPU, RAM on the
CPU). It reads the HLO of any backend, a deviceless compile for a GPU or TPU
included:

- an array whose layout names a memory space other than 0 (``{1,0:T(8,128)S(1)}``:
  a TPU's on-chip VMEM, scalar memory, semaphores) moves no main-memory bytes;
- an asynchronous copy or slice (``copy-start`` / ``slice-start`` ... ``-done``)
  is counted once, at its ``-done``: it reads from main memory as many bytes as it
  delivers (a slice reads only its part of the source) and writes them there only if
  its destination is in main memory; other ``*-start`` ops read their operands;
- a stand-alone ``slice`` or ``dynamic-slice`` reads only the elements it returns;
- custom calls that only reinterpret on-chip buffers (``ConcatBitcast``) move
  nothing and launch nothing.

An operand is "full-size" when its element count equals that of one of the given
parameter arrays: the number of full-size reads per parameter is how many times
the step streams each weight-sized array from memory.
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
_DMA_STARTS = {"copy-start", "slice-start"}  # what they deliver is what they read
_SLICES = {"slice", "dynamic-slice"}
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64)|c(?:64|128))\[([0-9,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


class Array(NamedTuple):
    """One array type written in HLO text."""

    dtype: str
    size: int  # elements
    rank: int
    in_main_memory: bool  # memory space 0 (HBM or RAM), not on-chip

    @property
    def nbytes(self) -> int:
        return self.size * _DTYPE_BYTES[self.dtype]


class Traffic(NamedTuple):
    """What the entry computation of one compiled program does to main memory.

    Attributes:
      ops: top-level instructions that touch memory (fusions included; an
        asynchronous copy or slice counted once).
      fusions: of which fusions.
      bytes_read: main-memory bytes they read.
      bytes_written: main-memory bytes they write.
      full_size_reads: main-memory operands of a parameter's full size, counted
        once per use.
      full_size_writes: main-memory results of a parameter's full size.
      full_size_read_elements: elements of those full-size operands; divided by
        the number of parameters, the full-size reads per parameter.
      kernels: programs the device launches: the ops that compute an array
        (rank >= 1), not the asynchronous copies and slices (DMA), not bitcasts.
      scalar_kernels: the ops that compute scalars only (rank 0): on a GPU each
        is a launch too; on a TPU the scalar unit runs them between kernels.
    """

    ops: int
    fusions: int
    bytes_read: int
    bytes_written: int
    full_size_reads: int
    full_size_writes: int
    full_size_read_elements: int
    kernels: int = 0
    scalar_kernels: int = 0


def _arrays(text: str) -> list[Array]:
    """Every array type written in `text` (a result type, possibly a tuple)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        shape = [int(d) for d in dims.split(",") if d]
        space = _MEMORY_SPACE.search(layout.split(":", 1)[1]) if ":" in layout else None
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out.append(Array(dtype, size, len(shape), space is None or space.group(1) == "0"))
    return out


class Instruction(NamedTuple):
    """One instruction of an HLO computation, as written in its text."""

    name: str
    result_type: str
    opcode: str
    operands: list[str]  # names of the operand instructions
    parameter: int | None  # the parameter number, for a ``parameter`` instruction
    attributes: str = ""  # what follows the operand list (``custom_call_target=...``, ...)


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
            args, _, attributes = rest.partition("),") if ")," in rest else (rest, "", "")
            out.append(Instruction(name, result_type, opcode, re.findall(r"%([\w.\-]+)", args), None, attributes))
    return out


def _moves(ins: Instruction, shapes: dict[str, list[Array]], starts: dict[str, Instruction]):
    """(arrays read, arrays written) in main memory by one top-level instruction, or None if it is free."""
    if ins.opcode in _FREE_OPS or ins.opcode in _DMA_STARTS:  # a DMA is counted at its -done
        return None
    if "Bitcast" in ins.attributes and ins.opcode == "custom-call":
        return None
    result = shapes[ins.name]
    written = [a for a in result if a.in_main_memory]
    if ins.opcode.endswith("-done"):
        start = starts.get(ins.operands[0]) if ins.operands else None
        if start is None or start.opcode not in _DMA_STARTS:
            return [], written  # its start read the operands
        from_main = any(a.in_main_memory for op in start.operands for a in shapes.get(op, []))
        return (result if from_main else []), written
    operands = [a for op in ins.operands for a in shapes.get(op, []) if a.in_main_memory]
    if ins.opcode in _SLICES:  # reads only what it returns
        operands = result if any(a.in_main_memory for a in shapes.get(ins.operands[0], [])) else []
    if ins.opcode.endswith("-start"):  # its -done writes the result
        written = []
    return operands, written


def entry_traffic(hlo_text: str, full_sizes: Iterable[int]) -> Traffic:
    """Counts the main-memory traffic of the entry computation of `hlo_text`.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()``, for any backend.
      full_sizes: element counts that are "full size" (those of the params).
    """
    full = set(int(n) for n in full_sizes)
    shapes: dict[str, list[Array]] = {}
    starts: dict[str, Instruction] = {}
    ops = fusions = kernels = scalar_kernels = read = written = full_reads = full_writes = full_elems = 0
    for ins in entry_instructions(hlo_text):
        shapes[ins.name] = _arrays(ins.result_type)
        if ins.opcode.endswith("-start"):
            starts[ins.name] = ins
        moved = _moves(ins, shapes, starts)
        if moved is None:
            continue
        reads, writes = moved
        ops += 1
        fusions += ins.opcode == "fusion"
        dma = ins.opcode.endswith("-done") or ins.opcode.endswith("-start")
        kernels += not dma and any(a.rank > 0 for a in shapes[ins.name])
        scalar_kernels += not dma and all(a.rank == 0 for a in shapes[ins.name])
        read += sum(a.nbytes for a in reads)
        written += sum(a.nbytes for a in writes)
        full_reads += sum(a.size in full for a in reads)
        full_elems += sum(a.size for a in reads if a.size in full)
        full_writes += sum(a.size in full for a in writes)
    return Traffic(ops, fusions, read, written, full_reads, full_writes, full_elems, kernels, scalar_kernels)
