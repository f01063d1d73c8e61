"""What the TPU runtime reserves for a compiled program's temporaries (levanter.memory.tpu_reserve): the HBM
temporary allocation of the TPU compiler's buffer assignment, read from its dump, and the step's total
that counts it. The compiles target a v5e chip through the TPU compiler (libtpu) on this CPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from levanter.memory import compile_memory
from levanter.memory.tpu_reserve import DUMP_SUFFIX, ReserveDump, preallocated_temp, reserve_dump

try:
    import libtpu  # noqa: F401

    _NO_LIBTPU = ""
except ImportError as e:  # pragma: no cover -- CI installs it (.ci/run)
    _NO_LIBTPU = f"libtpu cannot be imported ({e}): pip install -e '.[tpu]'"
needs_libtpu = pytest.mark.skipif(bool(_NO_LIBTPU), reason=_NO_LIBTPU or "libtpu is installed")

# The lines of a buffer-assignment dump as XLA:TPU writes them (libtpu 0.0.42), with their values cut.
DUMP = """BufferAssignment:
allocation 0: size 512, constant:
 value: <40 constant.94..sunk @0> (size=512,offset=0): s32[]{:T(128)}
allocation 1: size 33554432, parameter 0, shape |f32[8,1024,1024]| at ShapeIndex {}, output shape is |f32[8,1024,1024]|, maybe-live-out:
allocation 2: size 8388608, parameter 1, shape |f32[2048,1024]| at ShapeIndex {}:
allocation 11: size 134431232, preallocated-temp:
 value: <11 lt.6 @0> (size=512,offset=134430720): pred[]{:T(512)}
allocation 12: size 109051904, color 1, preallocated-temp:
allocation 13: size 16, color 2, preallocated-temp:
allocation 14: size 512, color 6, preallocated-temp:
allocation 15: size 1024, thread-local:
"""


def test_the_reserve_is_the_hbm_temporary_allocation_only():
    # HBM is the default memory space (no color); VMEM (1), SMEM (2) and the others are not the chip's HBM,
    # and parameters, constants and thread-local buffers are not temporaries the runtime reserves.
    assert preallocated_temp(DUMP) == 134431232
    assert preallocated_temp(DUMP.replace("allocation 11: size 134431232, preallocated-temp:", "")) is None
    assert preallocated_temp("allocation 3: size 4096, color 0, preallocated-temp:\n") == 4096


def test_a_dump_directory_without_one_buffer_assignment_says_nothing(tmp_path):
    assert ReserveDump(str(tmp_path)).read() is None
    # XLA's CPU compiler names its dumps "...cpu_after_optimizations-...": not a TPU program's.
    (tmp_path / f"module_0002.jit_stage.cpu_{DUMP_SUFFIX}").write_text(DUMP)
    assert ReserveDump(str(tmp_path)).read() is None
    (tmp_path / f"module_0000.jit_f.cl_1.{DUMP_SUFFIX}").write_text(DUMP)
    assert ReserveDump(str(tmp_path)).read() == 134431232
    (tmp_path / f"module_0004.jit_g.cl_1.{DUMP_SUFFIX}").write_text(DUMP)
    assert ReserveDump(str(tmp_path)).read() is None  # two programs: which one is not known


def _layers(w, x):
    """Eight tanh layers scanned, their gradient and an SGD step: the backward pass keeps each layer's
    output (eight [4096, 1024] float32 activations, 128 MiB, more than a v5e core's 128 MiB of VMEM with
    the rest) in HBM."""

    def loss(w):
        def body(c, wl):
            h = jnp.tanh(c @ wl)
            return h, None

        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(h**2)

    return w - 0.1 * jax.grad(loss)(w)


@pytest.fixture
def no_compilation_cache():
    """JAX's persistent compilation cache off (as the slice plan has it): executables compiled for a chip
    this machine does not have cannot be read back from it."""
    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", saved)


@needs_libtpu
def test_a_program_compiled_for_a_v5e_chip_counts_the_runtime_reserve(no_compilation_cache):
    from levanter.memory.tpu_compile import slice_devices
    from levanter.memory.tpu_slices import parse_slice

    chip = jax.sharding.SingleDeviceSharding(slice_devices(parse_slice("v5e-1"))[0])
    w = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32, sharding=chip)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=chip)
    lowered = jax.jit(_layers, donate_argnums=0).lower(w, x)
    with reserve_dump() as dump:
        memory = compile_memory(lambda: lowered.compile(compiler_options=dump.options), reserve=dump)
    m = memory.compiled.memory_analysis()
    assert memory.temp == m.temp_size_in_bytes
    saved = 8 * 4096 * 1024 * 4  # the activations the backward pass reads
    assert saved <= memory.reserved <= memory.temp
    held = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    assert memory.total == held + memory.temp  # the compiler's figure, what checks and searches weigh
    assert memory.runtime_total == held + memory.reserved  # what the chip will report
    # The same program without the dump: the same executable's figures, no reserve.
    plain = compile_memory(lambda: lowered.compile())
    assert plain.reserved is None and plain.runtime_total is None
    assert (plain.temp, plain.total) == (memory.temp, memory.total)


@needs_libtpu
def test_a_compile_without_a_dump_finds_the_reserve_its_first_compile_recorded(no_compilation_cache, tmp_path):
    """A compile served from JAX's persistent cache writes no dump: the reserve read by the compile that
    filled the cache is recorded beside it, keyed by the program, and found again; another program finds
    none, and an unreadable record is no record."""
    from levanter.memory import with_recorded_reserve
    from levanter.memory.tpu_compile import slice_devices
    from levanter.memory.tpu_reserve import RECORDS
    from levanter.memory.tpu_slices import parse_slice

    devices = slice_devices(parse_slice("v5e-1"))
    chip = jax.sharding.SingleDeviceSharding(devices[0])

    def lowered(layers):
        w = jax.ShapeDtypeStruct((layers, 1024, 1024), jnp.float32, sharding=chip)
        x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=chip)
        return jax.jit(_layers, donate_argnums=0).lower(w, x)

    cache = str(tmp_path / "jax-cache")
    eight = lowered(8)
    with reserve_dump() as dump:
        first = compile_memory(lambda: eight.compile(compiler_options=dump.options), reserve=dump)
    assert first.reserved is not None
    assert with_recorded_reserve(first, eight, devices, cache) == first
    records = list((tmp_path / "jax-cache" / RECORDS).iterdir())
    assert len(records) == 1
    # As a compile served from the cache: the same program, no dump.
    again = compile_memory(lambda: eight.compile())
    assert again.reserved is None
    found = with_recorded_reserve(again, eight, devices, cache)
    assert found.reserved == first.reserved and found.runtime_total == first.runtime_total
    assert found.need == first.need < found.total  # the checks weigh the runtime's figure
    # Another program (four layers) has no record: the compiler's figure stands.
    four = lowered(4)
    other = with_recorded_reserve(compile_memory(lambda: four.compile()), four, devices, cache)
    assert other.reserved is None and other.need == other.total
    records[0].write_text("{not json")
    assert with_recorded_reserve(again, eight, devices, cache).reserved is None


@needs_libtpu
def test_a_kernel_refused_for_vector_memory_is_not_said_to_overflow_the_devices_memory(no_compilation_cache):
    """A Pallas kernel whose tiles overflow a v5e core's vector memory (megablox's gmm with the whole 4,096 x
    4,096 matrix as one tile), compiled by libtpu: the refusal is measured, but as a kernel's VMEM, not as the
    device's HBM, and the run's error says so."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    from levanter.memory.fit import does_not_fit
    from levanter.memory.tpu_compile import slice_devices
    from levanter.memory.tpu_slices import parse_slice

    chip = jax.sharding.SingleDeviceSharding(slice_devices(parse_slice("v5e-1"))[0])
    rows = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16, sharding=chip)
    w = jax.ShapeDtypeStruct((2, 4096, 4096), jnp.bfloat16, sharding=chip)
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=chip)
    lowered = jax.jit(lambda r, w, s: gmm(r, w, s, jnp.bfloat16, (512, 4096, 4096))).lower(rows, w, sizes)
    memory = compile_memory(lowered.compile)
    assert memory.oom is not None and memory.vector_memory, memory.oom
    assert memory.total is None and not memory.fits(16 * 2**30)
    text = does_not_fit(memory, 16 * 2**30, "v5e HBM per chip", "8 x 2048 tokens", [])
    assert "vector memory (VMEM)" in text and "is not what ran out" in text
    assert "more than the device has" not in text
