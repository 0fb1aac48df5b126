"""optax_gwt.hlo_traffic on small HLO texts whose traffic is known by hand (compiles for the chips:
tests/test_targets.py)."""

from __future__ import annotations

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
