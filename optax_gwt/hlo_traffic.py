"""Memory traffic of a compiled XLA program, read from its HLO text.

Counts, in the entry computation of ``compiled.as_text()`` and the bodies of the
loops it runs, the instructions that touch memory (fusions, custom calls, stand-alone ops; not
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
- a stand-alone ``slice`` or ``dynamic-slice`` reads only the elements it returns, and
  a fusion reads of an operand that it only takes dynamic slices of just those slices;
  a ``dynamic-update-slice`` (stand-alone, or a fusion's root on one of its operands)
  updates its buffer in place: it reads and writes the update only (the granularity
  of the chip's tiles is not modelled);
- a ``while`` loop moves what its body moves, times its trip count (XLA's
  ``known_trip_count``, or the constant its condition compares the counter with);
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
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


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
    attributes: str = ""  # what follows the operand list (``custom_call_target=...``); a constant's literal


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """Every computation of ``compiled.as_text()`` (fused ones, loop bodies, the entry), by name."""
    out: dict[str, list[Instruction]] = {}
    body: list[Instruction] | None = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            body = out.setdefault(header.group(1), [])
        elif line.startswith("}"):
            body = None
        elif body is not None:
            ins = _instruction(line)
            if ins is not None:
                body.append(ins)
    return out


def _instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, result_type, opcode, rest = m.groups()
    if opcode == "parameter":
        number = re.match(r"\d+", rest)
        assert number is not None, f"a parameter without its number: {line}"
        return Instruction(name, result_type, opcode, [], int(number.group()))
    args, _, attributes = rest.partition("),") if ")," in rest else (rest, "", "")
    if opcode == "constant":  # its literal
        return Instruction(name, result_type, opcode, [], None, args.rstrip(")"))
    return Instruction(name, result_type, opcode, re.findall(r"%([\w.\-]+)", args), None, attributes)


def _entry_name(hlo_text: str) -> str:
    entry = next(line for line in hlo_text.splitlines() if line.startswith("ENTRY"))
    match = _COMPUTATION.match(entry)
    assert match is not None, entry
    return match.group(1)


def entry_instructions(hlo_text: str) -> list[Instruction]:
    """The instructions of the entry computation of ``compiled.as_text()``, in order."""
    return computations(hlo_text)[_entry_name(hlo_text)]


def _moves(ins: Instruction, shapes: dict[str, list[Array]], starts: dict[str, Instruction], comps: dict):
    """(arrays read, arrays written) in main memory by one instruction, or None if it is free."""
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
    operands = [[a for a in shapes.get(op, []) if a.in_main_memory] for op in ins.operands]
    if ins.opcode in _SLICES:  # reads only what it returns
        operands = [result if operands and operands[0] else []]
    if ins.opcode.endswith("-start"):  # its -done writes the result
        written = []
    if ins.opcode == "dynamic-update-slice":  # in place: reads and writes the update
        update = operands[1]
        operands = [update]
        written = [Array(a.dtype, a.size, a.rank, True) for a in update] if written else []
    if ins.opcode == "fusion":
        operands, written = _fused_moves(ins, operands, result, comps)
    return [a for arrays in operands for a in arrays], written


def _fused_moves(ins: Instruction, operands: list, result: list[Array], comps: dict) -> tuple[list, list]:
    """A fusion's reads per operand and its writes, where its computation only slices an
    operand (``dynamic-slice``: it reads the slices) or updates one in place (a root
    ``dynamic-update-slice``: it writes the update and does not read the rest), as a
    loop body's fusions do with the arrays the loop carries."""
    called = re.search(r"calls=%?([\w.\-]+)", ins.attributes)
    body = comps.get(called.group(1)) if called else None
    if not body:
        return operands, [a for a in result if a.in_main_memory]
    by_name = {i.name: i for i in body}
    params = {i.name: i.parameter for i in body if i.opcode == "parameter"}
    root = body[-1]
    outputs = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    reads = [list(arrays) for arrays in operands]
    writes: list[Array] = []
    for out, array in zip(outputs, result, strict=False):
        buffer = out.operands[0] if out.opcode == "dynamic-update-slice" else None
        if buffer in params and array.in_main_memory:
            update = _arrays(by_name[out.operands[1]].result_type)
            writes += [Array(a.dtype, a.size, a.rank, True) for a in update]
            reads[params[buffer]] = []
        elif array.in_main_memory:
            writes.append(array)
    for name, k in params.items():
        users = [i for i in body if name in i.operands]
        if reads[k] and users and all(u.opcode == "dynamic-slice" and u.operands[0] == name for u in users):
            reads[k] = [Array(a.dtype, a.size, a.rank, True) for u in users for a in _arrays(u.result_type)]
    return reads, writes


def _trip_count(loop: Instruction, comps: dict) -> int:
    """How many times a ``while`` runs its body: XLA's ``known_trip_count``, or the
    constant ``N`` its condition compares the counter with (``i < N``, from 0, as
    `jax.lax.scan` and `jax.lax.map` loop)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", loop.attributes)
    body = comps.get(condition.group(1), []) if condition else []
    literals = {i.name: i.attributes for i in body if i.opcode == "constant"}
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attributes and i.operands[-1] in literals:
            return int(literals[i.operands[-1]])
    raise ValueError(f"hlo_traffic: the trip count of {loop.name} is not known")


class _Counter:
    """`Traffic`'s sums, over a computation and the loops it runs."""

    def __init__(self, full_sizes: Iterable[int]):
        self.full = set(int(n) for n in full_sizes)
        self.sums = dict.fromkeys(Traffic._fields, 0)

    def count(self, instructions: list[Instruction], comps: dict, times: int = 1) -> None:
        shapes: dict[str, list[Array]] = {}
        starts: dict[str, Instruction] = {}
        for ins in instructions:
            shapes[ins.name] = _arrays(ins.result_type)
            if ins.opcode.endswith("-start"):
                starts[ins.name] = ins
            if ins.opcode == "while":  # its buffers are its operands', in place: its body moves the bytes
                body = re.search(r"body=%?([\w.\-]+)", ins.attributes)
                assert body is not None, ins
                self.count(comps[body.group(1)], comps, times * _trip_count(ins, comps))
                continue
            moved = _moves(ins, shapes, starts, comps)
            if moved is not None:
                reads, writes = moved
                self.add(ins, shapes[ins.name], reads, writes, times)

    def add(self, ins: Instruction, result: list[Array], reads: list[Array], writes: list[Array], times: int) -> None:
        dma = ins.opcode.endswith("-done") or ins.opcode.endswith("-start")
        for key, value in (
            ("ops", 1),
            ("fusions", ins.opcode == "fusion"),
            ("kernels", not dma and any(a.rank > 0 for a in result)),
            ("scalar_kernels", not dma and all(a.rank == 0 for a in result)),
            ("bytes_read", sum(a.nbytes for a in reads)),
            ("bytes_written", sum(a.nbytes for a in writes)),
            ("full_size_reads", sum(a.size in self.full for a in reads)),
            ("full_size_writes", sum(a.size in self.full for a in writes)),
            ("full_size_read_elements", sum(a.size for a in reads if a.size in self.full)),
        ):
            self.sums[key] += times * int(value)


def entry_traffic(hlo_text: str, full_sizes: Iterable[int]) -> Traffic:
    """Counts the main-memory traffic of the entry computation of `hlo_text`.

    A ``while`` loop counts as its body's traffic times its trip count.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()``, for any backend.
      full_sizes: element counts that are "full size" (those of the params).
    """
    comps = computations(hlo_text)
    counter = _Counter(full_sizes)
    counter.count(comps[_entry_name(hlo_text)], comps)
    return Traffic(**counter.sums)
