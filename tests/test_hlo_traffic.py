"""optax_gwt.hlo_traffic on small HLO texts whose traffic is known by hand (compiles for the chips:
tests/test_targets.py)."""

from __future__ import annotations

import pytest

from optax_gwt.hlo_traffic import entry_instructions, entry_traffic


def _hlo(*body: str) -> str:
    return "\n".join(["HloModule m", "", "ENTRY %main () -> f32[] {", *[f"  {line}" for line in body], "}"])


def test_plain_fusion_reads_operands_and_writes_results():
    text = _hlo(
        "%p0 = f32[8,128]{1,0} parameter(0)",
        "%p1 = bf16[8,128]{1,0} parameter(1)",
        "ROOT %f = f32[8,128]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%c",
    )
    t = entry_traffic(text, [1024])
    assert (t.bytes_read, t.bytes_written) == (1024 * 4 + 1024 * 2, 1024 * 4)
    assert (t.ops, t.fusions, t.kernels, t.full_size_reads, t.full_size_writes) == (1, 1, 1, 2, 1)


def test_on_chip_memory_spaces_move_nothing():
    """S(1) (VMEM) and S(6) (scalar memory) arrays are not main-memory traffic; S(0) is."""
    text = _hlo(
        "%p0 = f32[8,128]{1,0:T(8,128)} parameter(0)",
        "%a = f32[8,128]{1,0:T(8,128)S(1)} fusion(%p0), kind=kLoop, calls=%c",  # reads 4096, writes on chip
        "%s = s32[]{:T(128)S(6)} add(%x, %y)",
        "ROOT %b = f32[8,128]{1,0:T(8,128)S(0)} fusion(%a), kind=kLoop, calls=%d",  # reads on chip, writes 4096
    )
    t = entry_traffic(text, [1024])
    assert (t.bytes_read, t.bytes_written) == (4096, 4096)
    assert t.kernels == 2  # the scalar add is no array kernel
    assert t.scalar_kernels == 1  # it is a scalar op (a launch on a GPU)


def test_scalar_ops_are_counted_apart_from_array_kernels():
    """A fusion with a scalar and an array result is an array kernel; one with scalar results only
    (a tuple of them too) is a scalar op; parameters, constants and tuples are neither."""
    text = _hlo(
        "%p0 = f32[64]{0} parameter(0)",
        "%c = f32[] constant(1)",
        "%r = (f32[], f32[64]{0}) fusion(%p0), kind=kInput, calls=%c1",
        "%s1 = f32[] fusion(%c), kind=kLoop, calls=%c2",
        "%s2 = (f32[], s32[]) fusion(%s1), kind=kLoop, calls=%c3",
        "ROOT %t = (f32[], s32[]) tuple(%s1, %s1)",
    )
    t = entry_traffic(text, [64])
    assert (t.kernels, t.scalar_kernels) == (1, 2)


def test_async_copy_counted_once_at_its_real_size():
    """copy-start's result tuple holds both buffers; the copy reads its source once."""
    text = _hlo(
        "%p0 = f32[512,512]{1,0:T(8,128)} parameter(0)",
        "%cs = (f32[512,512]{1,0:T(8,128)S(1)}, f32[512,512]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%p0)",
        "%cd = f32[512,512]{1,0:T(8,128)S(1)} copy-done(%cs)",
        "ROOT %f = f32[512,512]{1,0:T(8,128)} fusion(%cd), kind=kLoop, calls=%c",
    )
    t = entry_traffic(text, [512 * 512])
    assert t.bytes_read == 512 * 512 * 4  # the copy's read; the fusion reads on chip
    assert t.bytes_written == 512 * 512 * 4  # the fusion's result
    assert (t.ops, t.kernels) == (2, 1)


def test_async_slices_read_their_part_and_bitcast_concats_are_free():
    text = _hlo(
        "%p0 = f32[512,512]{1,0:T(8,128)} parameter(0)",
        *[
            f"%ss{i} = ((f32[512,512]{{1,0:T(8,128)}}), f32[128,512]{{1,0:T(8,128)S(1)}}, s32[]{{:S(2)}}) "
            f"slice-start(%p0), slice={{[{128 * i}:{128 * (i + 1)}], [0:512]}}"
            for i in range(4)
        ],
        *[f"%sd{i} = f32[128,512]{{1,0:T(8,128)S(1)}} slice-done(%ss{i})" for i in range(4)],
        '%cc = f32[512,512]{1,0:T(8,128)S(1)} custom-call(%sd0, %sd1, %sd2, %sd3), custom_call_target="ConcatBitcast"',
        "ROOT %f = f32[512,512]{1,0:T(8,128)} fusion(%cc), kind=kLoop, calls=%c",
    )
    t = entry_traffic(text, [512 * 512])
    assert (t.bytes_read, t.bytes_written) == (512 * 512 * 4, 512 * 512 * 4)
    assert t.kernels == 1


def test_a_synchronous_slice_reads_what_it_returns():
    text = _hlo(
        "%p0 = f32[1024]{0} parameter(0)",
        "ROOT %s = f32[256]{0} slice(%p0), slice={[0:256]}",
    )
    t = entry_traffic(text, [1024])
    assert (t.bytes_read, t.bytes_written) == (1024, 1024)


def test_instructions_keep_their_attributes():
    text = _hlo(
        "%p0 = f32[4]{0} parameter(0)",
        'ROOT %c = f32[4]{0} custom-call(%p0), custom_call_target="Sharding"',
    )
    ins = entry_instructions(text)
    assert ins[1].operands == ["p0"] and 'custom_call_target="Sharding"' in ins[1].attributes


# A loop over a stack of 4 matrices of 8 x 128 float32 (4 KiB each): its body slices one
# matrix out of the carried stack `x`, computes, and writes it into the carried `out` in place.
_LOOP = """HloModule m

%slice_one (p0: f32[4,8,128], p1: s32[]) -> f32[1,8,128] {
  %p0 = f32[4,8,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,128}
  ROOT %e = f32[1,8,128]{2,1,0} exponential(%ds)
}

%put_one (q0: f32[4,8,128], q1: f32[1,8,128], q2: s32[]) -> f32[4,8,128] {
  %q0 = f32[4,8,128]{2,1,0} parameter(0)
  %q1 = f32[1,8,128]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,8,128]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
}

%body (t: (s32[], f32[4,8,128], f32[4,8,128])) -> (s32[], f32[4,8,128], f32[4,8,128]) {
  %t = (s32[], f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8,128]{2,1,0} get-tuple-element(%t), index=1
  %out = f32[4,8,128]{2,1,0} get-tuple-element(%t), index=2
  %one = f32[1,8,128]{2,1,0} fusion(%x, %i), kind=kLoop, calls=%slice_one
  %new = f32[4,8,128]{2,1,0} fusion(%out, %one, %i), kind=kLoop, calls=%put_one
  %c1 = s32[] constant(1)
  %next = s32[] add(%i, %c1)
  ROOT %r = (s32[], f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%next, %x, %new)
}

%cond (c: (s32[], f32[4,8,128], f32[4,8,128])) -> pred[] {
  %c = (s32[], f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (a: f32[4,8,128], b: f32[4,8,128]) -> f32[4,8,128] {
  %a = f32[4,8,128]{2,1,0} parameter(0)
  %b = f32[4,8,128]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%zero, %a, %b)
  %w = (s32[], f32[4,8,128]{2,1,0}, f32[4,8,128]{2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = f32[4,8,128]{2,1,0} get-tuple-element(%w), index=2
}
"""


# Per iteration: the first fusion reads one matrix of `x` (the slice, not the stack) and the
# counter (4 bytes), writes `one` (4 KiB); the second reads `one` and the counter and writes
# `one` into `out` in place (4 KiB, not the stack); the scalar add reads 8 bytes, writes 4.
_READ, _WRITTEN = 4100 + 4100 + 8, 4096 + 4096 + 4


def test_a_loop_moves_what_its_body_moves_times_its_trip_count():
    t = entry_traffic(_LOOP, [4 * 8 * 128])
    assert (t.bytes_read, t.bytes_written) == (4 * _READ, 4 * _WRITTEN)
    assert (t.kernels, t.scalar_kernels, t.full_size_reads, t.full_size_writes) == (8, 4, 0, 0)


def test_a_known_trip_count_is_taken_as_given():
    text = _LOOP.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"2"}}')
    assert entry_traffic(text, [4096]).bytes_read == 2 * _READ


def test_a_loop_of_unknown_trip_count_is_refused():
    text = _LOOP.replace("direction=LT", "direction=NE")
    with pytest.raises(ValueError, match="trip count"):
        entry_traffic(text, [4096])


def test_a_stand_alone_dynamic_update_slice_writes_its_update_in_place():
    text = _hlo(
        "%p0 = f32[64,128]{1,0} parameter(0)",
        "%p1 = f32[8,128]{1,0} parameter(1)",
        "%i = s32[] parameter(2)",
        "ROOT %d = f32[64,128]{1,0} dynamic-update-slice(%p0, %p1, %i, %i)",
    )
    t = entry_traffic(text, [64 * 128])
    assert (t.bytes_read, t.bytes_written) == (8 * 128 * 4, 8 * 128 * 4)
