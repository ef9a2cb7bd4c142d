"""The CPU dense kernel (kernels_cpu/dense.cc) against jnp's product: random shapes with every
tail (K and N off the 16- and 32-lane tiles, 1 to 40 rows: the few-row passes and the 12-row
register tiles with their tails, weights large enough to be split between threads), both layouts and both dtypes; a row's bits independent of the other rows and
of the thread split; gradients; errors; and `dense` taking it exactly where ROWS says.

On a CPU with AMX, bfloat16 products of TILES_FROM rows or more take AMX tiles:
their own shapes' test, and the bit-for-bit checks per path.

The kernel needs an x86-64 CPU with AVX-512 and a C++ compiler; elsewhere these tests skip and
`dense` keeps XLA's product (tests/model/test_dense.py covers that path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import dense as dense_cpu
from kernels_cpu.build import cpu_flags

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not dense_cpu.available(),
    reason="the CPU dense kernel needs XLA:CPU, x86-64 with AVX-512 and a C++ compiler")

multiply = jax.jit(dense_cpu.multiply, static_argnums=2)
reference = jax.jit(dense_cpu.reference, static_argnums=2)


def _operands(rng: np.random.Generator, m: int, k: int, n: int, layout: str, dtype
              ) -> tuple[jax.Array, jax.Array]:
    x = jnp.asarray(rng.standard_normal((m, k), np.float32)).astype(dtype)
    shape = (n, k) if layout == "nk" else (k, n)
    w = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    return x, w


def _assert_close(got: jax.Array, x: jax.Array, w: jax.Array, layout: str) -> None:
    """Equal to the float64 product of the same (rounded) inputs within float32 accumulation
    error: K terms, each product exact or rounded once, summed in some order."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = x64 @ (w64.T if layout == "nk" else w64)
    magnitude = np.abs(x64) @ np.abs(w64.T if layout == "nk" else w64)
    k = x.shape[1]
    bound = (k + 2) * np.finfo(np.float32).eps * magnitude + 1e-30
    assert got.shape == want.shape and got.dtype == jnp.float32
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"worst excess {np.max(err / bound):.2f}x the bound"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", dense_cpu.LAYOUTS)
def test_random_shapes_match_the_exact_product(layout, dtype) -> None:
    rng = np.random.default_rng(abs(hash((layout, str(dtype)))) % 2**32)
    for trial in range(25):
        m = int(rng.integers(1, 41))
        k = int(rng.choice([1, 2, 15, 16, 17, 31, 32, 33, int(rng.integers(1, 700))]))
        n = int(rng.choice([1, 7, 8, 9, 15, 16, 17, 33, int(rng.integers(1, 600))]))
        if trial % 5 == 0:  # past the threading threshold (512 KiB of weight)
            k, n = int(rng.integers(500, 700)), int(rng.integers(600, 1300))
        x, w = _operands(rng, m, k, n, layout, dtype)
        _assert_close(multiply(x, w, layout), x, w, layout)


def test_the_bfloat16_paths_of_cpus_without_avx512_bf16() -> None:
    """This machine's build multiplies bfloat16 pairs by VDPBF16PS; built with -mno-avx512bf16,
    the kernel widens bfloat16 in registers instead, as it does on AVX-512 CPUs without BF16.
    Those paths too match the exact product, and a row's bits do not depend on the others."""
    target = dense_cpu.KERNEL.register(("-mno-avx512bf16",))

    def without_bf16(x, w, layout):
        return dense_cpu._call(x, (w,), layout, target, tiles_from=0)[0]

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for layout in dense_cpu.LAYOUTS:
        for trial in range(10):
            m = int(rng.integers(1, 41))
            k = int(rng.choice([1, 15, 16, 17, 33, int(rng.integers(1, 700))]))
            n = int(rng.choice([1, 9, 17, 33, int(rng.integers(1, 600))]))
            if trial % 5 == 0:  # past the threading threshold
                k, n = int(rng.integers(500, 700)), int(rng.integers(600, 1300))
            x, w = _operands(rng, m, k, n, layout, jnp.bfloat16)
            got = without_bf16(x, w, layout)
            _assert_close(got, x, w, layout)
            row = int(rng.integers(0, m))
            alone = without_bf16(x[row:row + 1], w, layout)
            assert np.array_equal(np.asarray(alone[0]), np.asarray(got[row])), (seed, layout)


def test_the_library_is_rebuilt_when_the_sources_or_the_compile_flags_change(monkeypatch,
                                                                            tmp_path) -> None:
    """The cache key covers what the library is built from: its source, the shared header and
    every flag of the command line, the ones build.py always passes as well as `extra_flags`;
    a library built otherwise is never loaded for it."""
    from kernels_cpu import build

    source = tmp_path / "kernel.cc"
    source.write_text("// one kernel\n")
    path = build.library_path(source)
    assert build.library_path(source) == path
    assert build.library_path(source, ("-mno-avx512bf16",)) != path
    monkeypatch.setattr(build, "FLAGS", tuple(f.replace("-O3", "-O2") for f in build.FLAGS))
    assert build.library_path(source) != path
    monkeypatch.undo()
    source.write_text("// another kernel\n")
    assert build.library_path(source) != path


def test_a_compiler_that_names_itself_on_stderr_still_builds(monkeypatch, tmp_path) -> None:
    """$CXX may be a wrapper that prints its --version on stderr (or prints nothing), or a
    command with arguments: the kernels are keyed by what it printed and built, not refused by
    an IndexError or a missing file."""
    import os

    from kernels_cpu import build

    source = tmp_path / "kernel.cc"
    source.write_text('extern "C" int infer_test_kernel() { return 7; }\n')
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    plain, compiler = build.library_path(source), " ".join(build._compiler())
    for name, version in (("stderr", f"{compiler} --version >&2"), ("silent", ":")):
        wrapper = tmp_path / name
        wrapper.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then {version}; exit 0; fi\n'
                           f'exec {compiler} "$@"\n')
        os.chmod(wrapper, 0o755)
        monkeypatch.setenv("CXX", str(wrapper))
        assert build.library_path(source) != plain
        assert build.build(source).exists()
    # A command with arguments, as make reads $CXX: it was run as one file name (ENOENT).
    monkeypatch.setenv("CXX", f"{compiler} -w")
    assert build.library_path(source) != plain
    assert build.build(source).exists()


def test_a_failed_build_says_why(monkeypatch, tmp_path, capsys) -> None:
    """A kernel that does not build is off with the compiler's reason on stderr: its `#error`
    line, not GCC's closing caret line under the source it quotes."""
    from kernels_cpu import build

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cc"
    source.write_text('#error "this CPU lacks what the kernel needs"\nint x;\n')
    kernel = build.Kernel(source, "Missing", "infer_test_missing")
    assert not kernel.available()
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("infer: the CPU kernel kernel is off") and said.endswith(
        'error: #error "this CPU lacks what the kernel needs"'), said


def test_a_built_library_is_readable_by_whom_the_umask_allows(monkeypatch, tmp_path) -> None:
    """build() leaves the library with the compiler's usual mode, readable by every user the
    umask lets read (another user of a shared $INFER_CACHE_DIR loads it), and nothing else in
    the cache: the file it was compiled into is its final one, renamed."""
    import os
    import stat

    from kernels_cpu import build

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cc"
    source.write_text('extern "C" int infer_test_kernel() { return 7; }\n')
    library = build.build(source)
    umask = os.umask(0)
    os.umask(umask)
    readable = (stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH) & ~umask
    assert stat.S_IMODE(library.stat().st_mode) & readable == readable, oct(library.stat().st_mode)
    assert sorted(p.name for p in library.parent.iterdir()) == [library.name]


def _multiply_with_tiles_from(tiles_from: int):
    return jax.jit(lambda x, w, layout: dense_cpu._call(x, (w,), layout,
                                                        tiles_from=tiles_from)[0],
                   static_argnums=2)


@pytest.mark.parametrize("tiles_from", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", dense_cpu.LAYOUTS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_thread_split(layout, dtype,
                                                                          tiles_from) -> None:
    """Row i of an M-row call is the one-row call's result bit for bit, and so is any column
    slice of it computed on its own (a different N, so a different split between threads and
    tiles). From 9 rows an [in, out] product takes the kernel's register tiles, so this also
    holds one path to the other; with tiles_from=1 on a CPU with AMX every bfloat16 product
    takes AMX tiles, at one row as at 30. A NaN in one row stays in that row."""
    multiply_ = _multiply_with_tiles_from(tiles_from)
    rng = np.random.default_rng(7)
    for m, k, n in [(9, 577, 1100), (4, 64, 50), (13, 300, 700), (30, 1537, 611)]:
        x, w = _operands(rng, m, k, n, layout, dtype)
        x = x.at[2, 5].set(jnp.nan)
        whole = np.asarray(multiply_(x, w, layout))
        assert np.isnan(whole[2]).all() and not np.isnan(np.delete(whole, 2, axis=0)).any()
        for i in range(m):
            np.testing.assert_array_equal(np.asarray(multiply_(x[i:i + 1], w, layout))[0],
                                          whole[i])
        for lo, hi in [(0, 17), (n // 3, n - 5), (n - 1, n)]:
            part = w[lo:hi] if layout == "nk" else w[:, lo:hi]
            np.testing.assert_array_equal(np.asarray(multiply_(x, part, layout)),
                                          whole[:, lo:hi])


@pytest.mark.skipif("amx_bf16" not in cpu_flags().split(), reason="needs a CPU with AMX-BF16")
def test_amx_tiles_match_the_exact_product_and_keep_a_rows_bits_among_tiled_calls() -> None:
    """bfloat16 products from TILES_FROM rows go to AMX tiles here, in both layouts: random
    shapes with every tail (K off the 32-deep tile steps, N off the 128-column strips, the
    32-column groups and the [N, K] layout's 32-row units, rows off the 16-row tiles and 32-row
    pairs of tiles, weights below and above the threading threshold) match the exact product,
    and a row's bits among other rows are its bits among any other set of rows of a tiled
    call."""
    expected = {layout: 0 for layout in dense_cpu.LAYOUTS} if dense_cpu.BATCH_INVARIANT else \
        dense_cpu.TILES_AMX
    assert dense_cpu.TILES_FROM == expected
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for layout in dense_cpu.LAYOUTS:
        least = dense_cpu.TILES_AMX[layout]
        tiled = _multiply_with_tiles_from(least)
        for trial in range(16):
            m = int(rng.choice([least, 16, 17, 32, 33, int(rng.integers(least, 80))]))
            k = int(rng.choice([31, 32, 33, 96, 97, 576, int(rng.integers(1, 1600))]))
            n = int(rng.choice([1, 31, 33, 127, 129, int(rng.integers(1, 1300))]))
            if trial % 4 == 0:  # past the threading threshold
                k, n = int(rng.integers(500, 700)), int(rng.integers(600, 1300))
            if layout == "nk" and trial % 2:  # whole tile steps of K: the tiles' own case
                k = 32 * int(rng.integers(1, 30))
            x, w = _operands(rng, m, k, n, layout, jnp.bfloat16)
            got = tiled(x, w, layout)
            _assert_close(got, x, w, layout)
            row = int(rng.integers(0, m))
            others = jnp.asarray(rng.standard_normal((int(rng.integers(least, 40)), k),
                                                     np.float32))
            mixed = jnp.concatenate([others, x[row:row + 1]]).astype(jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(tiled(mixed, w, layout))[-1],
                                          np.asarray(got[row]),
                                          err_msg=f"seed {seed}, {layout} m={m} k={k} n={n}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", dense_cpu.LAYOUTS)
def test_a_group_of_weights_gives_each_products_bits(layout, dtype) -> None:
    """multiply_group(x, ws) is multiply(x, w) for each w, bit for bit, whatever the group's
    sizes: few rows and tiled rows, weights below and above the threading threshold side by
    side (their units then share the threads), one weight empty of columns."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    group = jax.jit(dense_cpu.multiply_group, static_argnums=2)
    for _ in range(6):
        m = int(rng.choice([1, 2, 5, 8, 9, 13, int(rng.integers(1, 40))]))
        k = int(rng.choice([17, 96, 97, int(rng.integers(1, 700))]))
        ns = [int(rng.choice([0, 1, 33, int(rng.integers(1, 1300))]))
              for _ in range(int(rng.integers(1, 4)))]
        x = jnp.asarray(rng.standard_normal((m, k), np.float32)).astype(dtype)
        ws = tuple(jnp.asarray(rng.standard_normal((n, k) if layout == "nk" else (k, n),
                                                   np.float32)).astype(dtype) for n in ns)
        outs = group(x, ws, layout)
        assert len(outs) == len(ws)
        for w, out in zip(ws, outs):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(multiply(x, w, layout)),
                                          err_msg=f"seed {seed}, m={m} k={k} ns={ns}")


def test_gradients_are_the_reference_products() -> None:
    rng = np.random.default_rng(3)
    for layout in dense_cpu.LAYOUTS:
        x, w = _operands(rng, 3, 40, 24, layout, jnp.float32)

        def loss(product):
            return lambda x, w: jnp.sum(jnp.sin(product(x, w, layout)))

        got = jax.grad(loss(dense_cpu.multiply), argnums=(0, 1))(x, w)
        want = jax.grad(loss(dense_cpu.reference), argnums=(0, 1))(x, w)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    x, w = _operands(rng, 3, 40, 24, "kn", jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((40, 7), np.float32))

    def group_loss(product):
        return lambda x, ws: sum(jnp.sum(jnp.sin(out)) for out in product(x, ws))

    got = jax.grad(group_loss(lambda x, ws: dense_cpu.multiply_group(x, ws, "kn")),
                   argnums=(0, 1))(x, (w, w2))
    want = jax.grad(group_loss(lambda x, ws: [dense_cpu.reference(x, v, "kn") for v in ws]),
                    argnums=(0, 1))(x, (w, w2))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_bad_operands_are_refused() -> None:
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="layout"):
        dense_cpu.multiply(x, jnp.ones((8, 4), jnp.float32), "mk")
    with pytest.raises(ValueError, match="disagree on K"):
        dense_cpu.multiply(x, jnp.ones((4, 8), jnp.float32), "kn")
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        dense_cpu.multiply(x, jnp.ones((8, 4), jnp.bfloat16), "kn")
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        dense_cpu.multiply(x.astype(jnp.float16), jnp.ones((8, 4), jnp.float16), "kn")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        dense_cpu.multiply(x[None], jnp.ones((8, 4), jnp.float32), "kn")
    with pytest.raises(ValueError, match="at least one weight"):
        dense_cpu.multiply_group(x, (), "kn")
    with pytest.raises(ValueError, match="disagree on K"):
        dense_cpu.multiply_group(x, (jnp.ones((8, 4)), jnp.ones((7, 4))), "kn")


def test_the_custom_call_refuses_strips_it_cannot_read() -> None:
    """What Python's checks keep from the kernel, the kernel refuses itself: strips of another
    dtype than float32, strips beside an [in, out] weight in one group, strips of another width,
    strips of the "nk" layout."""
    x = jnp.ones((3, 8), jnp.float32)
    strips = dense_cpu.pack(jnp.ones((8, 64), jnp.float32))
    out = lambda *ns: tuple(jax.ShapeDtypeStruct((3, n), jnp.float32) for n in ns)
    call = lambda x, ws, ns, nk=False: jax.ffi.ffi_call(dense_cpu.TARGET, out(*ns))(
        x, *ws, nk=nk, tiles_from=np.int64(0))
    for args, match in [
            ((x.astype(jnp.bfloat16), (strips.astype(jnp.bfloat16),), (64,)), "float32"),
            ((x, (strips, jnp.ones((8, 64), jnp.float32)), (64, 64)), "all weights packed"),
            ((x, (jnp.ones((4, 8, 16), jnp.float32),), (64,)), "all weights packed"),
            ((x, (strips,), (64,), True), "float32 \"kn\" weights")]:
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(*args))


def test_the_custom_call_refuses_outputs_of_another_shape() -> None:
    """The kernel writes [M, N] floats per weight: an output of any other shape is refused, not
    written past its end (these are as large or larger, so the old binding wrote in bounds and
    said nothing; smaller ones crashed the process)."""
    rng = np.random.default_rng(3)
    for layout in dense_cpu.LAYOUTS:
        for dtype in (jnp.float32, jnp.bfloat16):
            m, k, n = (int(v) for v in rng.integers(1, 40, size=3))
            x, w = _operands(rng, m, k, n, layout, dtype)
            for shape in [(n, m) if m != n else (m, n + 1), (m, 2 * n), (m * n,), (m, n, 1),
                          (m + 1, n)]:
                call = jax.ffi.ffi_call(dense_cpu.TARGET, jax.ShapeDtypeStruct(shape, jnp.float32))
                with pytest.raises(Exception, match=r"\[M, N\]"):
                    jax.block_until_ready(call(x, w, nk=layout == "nk", tiles_from=np.int64(0)))


def test_dense_runs_the_kernel_exactly_where_rows_says() -> None:
    """`infer.model.llama.dense` hands a product to the kernel iff its (layout, dtype, rows) is
    in ROWS, under every leading shape a step gives; either way the value is the product's."""
    from infer.model.llama import dense

    rng = np.random.default_rng(11)
    cases = [("bte,ef->btf", "kn"), ("btf,fe->bte", "kn"), ("...e,ve->...v", "nk")]
    for dtype in (jnp.float32, jnp.bfloat16):
        for equation, layout in cases:
            # 1-9 rows, and each range's last row count and the one after it.
            ends = {max(r) for r in dense_cpu.ROWS.values() if max(r) < 4096}
            for m in sorted(set(range(1, 10)) | {e + d for e in ends for d in (0, 1)}):
                lead = (1, m) if equation.startswith("bt") else (m,)
                k, n = 48, 80
                x = jnp.asarray(rng.standard_normal((*lead, k), np.float32))
                w_shape = (n, k) if layout == "nk" else (k, n)
                w = jnp.asarray(rng.standard_normal(w_shape, np.float32)).astype(dtype)
                fn = jax.jit(lambda x, w: dense(x, w, equation))
                text = fn.lower(x, w).as_text()
                expected = m in dense_cpu.ROWS.get((layout, jnp.dtype(dtype)), ())
                assert (dense_cpu.TARGET in text) == expected, (dtype, equation, m)
                got = fn(x, w)
                assert got.shape == (*lead, n)
                _assert_close(got.reshape(m, n), x.reshape(m, k).astype(dtype), w, layout)


def test_rows_table_follows_the_cpus_amx_flag() -> None:
    """The AMX table iff amx_bf16 is one of the flags (not a prefix of another); both tables
    give the kernel the 1-4-row products of decode steps, where XLA reads weights slowly on
    every machine measured, and the AMX table keeps batched bfloat16 products for XLA."""
    line = "flags\t\t: fpu sse2 avx512f avx512_bf16 {} avx512vl"
    assert dense_cpu.rows_for(line.format("amx_tile amx_bf16")) is dense_cpu.ROWS_AMX
    for other in ("amx_tile", "amx_bf16x", ""):
        assert dense_cpu.rows_for(line.format(other)) is dense_cpu.ROWS_AVX512
    for table in (dense_cpu.ROWS_AMX, dense_cpu.ROWS_AVX512):
        for layout in dense_cpu.LAYOUTS:
            for dtype in dense_cpu.DTYPES:
                assert set(range(1, 5)) <= set(table[(layout, dtype)]), (layout, dtype)
    for flags in (line.format("amx_bf16"), line.format("")):
        table = dense_cpu.rows_for(flags, batch_invariant=True)
        assert all(table[key] == range(1, 1 << 31) for key in dense_cpu.ROWS_AVX512)
        assert dense_cpu.tiles_from_for(flags, batch_invariant=True) == {"kn": 0, "nk": 0}
    assert dense_cpu.ROWS is dense_cpu.rows_for(cpu_flags(), dense_cpu.BATCH_INVARIANT)
    # AMX tiles take the batched bfloat16 products where the CPU has them.
    on = dense_cpu.tiles_from_for(line.format("amx_tile amx_bf16"))
    assert on == dense_cpu.TILES_AMX and min(on.values()) > 1
    for other in ("amx_tile", "amx_bf16x", ""):
        assert dense_cpu.tiles_from_for(line.format(other)) == {"kn": 0, "nk": 0}
    assert dense_cpu.TILES_FROM == dense_cpu.tiles_from_for(cpu_flags(),
                                                            dense_cpu.BATCH_INVARIANT)


BATCH_INVARIANT_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from infer.model.llama import dense
from kernels_cpu import dense as dense_cpu
assert dense_cpu.BATCH_INVARIANT
rng = np.random.default_rng(int(__import__("sys").argv[1]))
for equation, shape in [("mk,kn->mn", (576, 1536)), ("...e,ve->...v", (4096, 576))]:
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
        x = jnp.asarray(rng.standard_normal((300, 576), np.float32))
        one = np.asarray(jax.jit(lambda x: dense(x, w, equation))(x[:1]))
        for m in rng.choice(np.arange(2, 301), 4, replace=False):
            many = np.asarray(jax.jit(lambda x: dense(x, w, equation))(x[:m]))
            np.testing.assert_array_equal(many[0], one[0], err_msg=f"{equation} {dtype} {m}")
"""


def test_batch_invariant_mode_gives_a_row_the_same_bits_in_every_step_size() -> None:
    """With INFER_BATCH_INVARIANT=1, `dense` at random row counts up to 300 (decode rows,
    verify rows, prefill chunks) gives a row the bits of the one-row product, in both layouts
    and dtypes: the property greedy speculative decoding needs to equal plain greedy decoding
    bit for bit. (Without it, on a machine whose XLA multiplies bfloat16 on AMX, the rows past
    ROWS_AMX's ranges take XLA's GEMM and differ in their last bits.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "INFER_BATCH_INVARIANT": "1"}
    seed = str(np.random.default_rng().integers(1 << 16))
    done = subprocess.run([sys.executable, "-c", BATCH_INVARIANT_CHECK, seed], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-3000:]}"


def test_dense_leaves_products_under_a_mesh_to_xla() -> None:
    """Under a mesh XLA partitions the product; a custom call would have to be gathered whole."""
    from infer.model.llama import dense

    mesh = jax.make_mesh((1,), ("data",))
    x = jnp.ones((1, 1, 48), jnp.float32)
    w = jnp.ones((48, 80), jnp.bfloat16)
    with jax.set_mesh(mesh):
        text = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf")).lower(x, w).as_text()
    assert dense_cpu.TARGET not in text
    assert dense_cpu.TARGET in jax.jit(lambda x, w: dense(x, w, "bte,ef->btf")).lower(
        x, w).as_text()


def test_dense_group_is_dense_per_weight_in_one_call() -> None:
    """`dense_group` gives each weight's `dense` bit for bit: one kernel call for the whole group
    where `dense` takes the kernel, XLA's products past ROWS."""
    from infer.model.llama import dense, dense_group

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for dtype in (jnp.float32, jnp.bfloat16):
        past = max(dense_cpu.ROWS[("kn", jnp.dtype(dtype))]) + 1
        for m in (1, 4, 12, *([past] if past < 4096 else [])):
            x = jnp.asarray(rng.standard_normal((1, m, 64), np.float32))
            ws = tuple(jnp.asarray(rng.standard_normal((64, n), np.float32)).astype(dtype)
                       for n in (96, 32, 32))
            fn = jax.jit(lambda x, ws: dense_group(x, ws, "bte,ef->btf"))
            calls = fn.lower(x, ws).as_text().count(dense_cpu.TARGET)
            assert calls == (1 if m < past else 0), (dtype, m, calls)
            for w, got in zip(ws, fn(x, ws)):
                want = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf"))(x, w)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pack_is_the_tile_layout_and_unpack_its_inverse() -> None:
    """packed[t, q, j, h] = w[2q + h, 16t + j], checked element by element on random shapes;
    unpack gives the weight back; shapes off the 32-multiples are refused."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for _ in range(5):
        k, n = 32 * int(rng.integers(1, 8)), 32 * int(rng.integers(1, 8))
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        packed = dense_cpu.pack(w)
        assert packed.shape == (n // 16, k // 2, 16, 2) and dense_cpu.is_packed(packed)
        w, packed = np.asarray(w), np.asarray(packed)
        t, q, j, h = (rng.integers(0, s, 50) for s in packed.shape)
        np.testing.assert_array_equal(packed[t, q, j, h], w[2 * q + h, 16 * t + j])
        np.testing.assert_array_equal(np.asarray(dense_cpu.unpack(jnp.asarray(packed))), w)
    for shape in [(48, 64), (64, 48), (64,)]:
        with pytest.raises(ValueError):
            dense_cpu.pack(jnp.zeros(shape, jnp.bfloat16))


def test_packs_bfloat16_weights_of_whole_tiles_where_the_tiles_run_and_float32_strips() -> None:
    tiles = dense_cpu.TILES_FROM["kn"] > 0 and dense_cpu.TILED_WEIGHTS
    assert dense_cpu.packs(jnp.zeros((64, 96), jnp.bfloat16)) == (
        tiles and bool(dense_cpu.KERNEL.library().InferDenseTilesPermitted()))
    assert dense_cpu.packs(jnp.zeros((50, 96), jnp.float32)) == dense_cpu.TILED_WEIGHTS
    for w in [jnp.zeros((48, 96), jnp.bfloat16), jnp.zeros((64, 80), jnp.bfloat16),
              jnp.zeros((2, 64, 96), jnp.bfloat16), jnp.zeros((64, 80), jnp.float32),
              jnp.zeros((2, 64, 96), jnp.float32), jnp.zeros((64, 96), jnp.float16)]:
        assert not dense_cpu.packs(w)


def test_float32_pack_is_strips_and_unpack_its_inverse() -> None:
    """packed[t, k, j] = w[k, 32t + j], element by element on random shapes (any K); unpack
    gives the weight back; N off the 32-multiples is refused."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for _ in range(5):
        k, n = int(rng.integers(1, 300)), 32 * int(rng.integers(1, 8))
        w = rng.standard_normal((k, n)).astype(np.float32)
        packed = np.asarray(dense_cpu.pack(jnp.asarray(w)))
        assert packed.shape == (n // 32, k, 32) and dense_cpu.is_packed(packed)
        t, kk, j = (rng.integers(0, s, 50) for s in packed.shape)
        np.testing.assert_array_equal(packed[t, kk, j], w[kk, 32 * t + j])
        np.testing.assert_array_equal(np.asarray(dense_cpu.unpack(jnp.asarray(packed))), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        dense_cpu.pack(jnp.zeros((64, 48), jnp.float32))


def test_float32_strips_give_the_weights_bits_at_every_row_count() -> None:
    """A float32 weight stored as strips multiplies to the [K, N] weight's bits at 0-200 rows
    (the few-row passes, the 12-row register tiles and their tails) and any K, each row's bits
    the same alone and among others, a NaN kept to its row, within the exact product's bound;
    threads split the strips."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for trial in range(4):
        k, n = int(rng.integers(1, 700)), 32 * int(rng.integers(1, 40))
        if trial == 0:  # past the threading threshold, and more than one block of weight rows
            k, n = 576, 1536
        x_all, w = _operands(rng, 201, k, n, "kn", jnp.float32)
        packed = dense_cpu.pack(w)
        for m in [0, 1, 2, 8, 9, 11, 12, 13, 24, 31, 32, 33, int(rng.integers(34, 202))]:
            x = x_all[:m] if m < 3 else x_all[:m].at[1, 0].set(jnp.nan)
            _check_packed_product(rng, x, packed, w, multiply, f"seed {seed}, m={m} k={k} n={n}")


def test_dense_takes_float32_strips_to_the_kernel_at_any_row_count() -> None:
    """`dense` sends float32 strips to the kernel at any row count (past ROWS too): the
    kernel's product of the [K, N] weight, bit for bit; under a mesh XLA's, unpacked."""
    from infer.model.llama import dense

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    w = jnp.asarray(rng.standard_normal((72, 96), np.float32))
    packed = dense_cpu.pack(w)
    fn = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf"))
    for m in (1, 8, 32, max(dense_cpu.ROWS[("kn", jnp.dtype(jnp.float32))]) + 1):
        x = jnp.asarray(rng.standard_normal((1, m, 72), np.float32))
        assert dense_cpu.TARGET in fn.lower(x, packed).as_text(), m
        np.testing.assert_array_equal(np.asarray(fn(x, packed))[0],
                                      np.asarray(multiply(x[0], w, "kn")), err_msg=m)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        assert dense_cpu.TARGET not in fn.lower(x, packed).as_text()
        np.testing.assert_array_equal(np.asarray(fn(x, packed)), np.asarray(fn(x, w)))


def _check_packed_product(rng: np.random.Generator, x: jax.Array, packed: jax.Array,
                          w: jax.Array, peer, label: str) -> None:
    """x times `packed` (`w` in the kernel's layout), x's row 1 NaN from 3 rows: `peer(x, w,
    "kn")`'s bits, a random row's bits the same alone, the NaN kept to its row, the rest within
    the exact bound."""
    m, n = x.shape[0], dense_cpu.unpack(packed).shape[1]
    got = np.asarray(multiply(x, packed, "kn"))
    assert got.shape == (m, n), label
    if m == 0:
        return
    np.testing.assert_array_equal(got, np.asarray(peer(x, w, "kn")), err_msg=label)
    row = int(rng.integers(0, m))
    np.testing.assert_array_equal(np.asarray(multiply(x[row:row + 1], packed, "kn"))[0],
                                  got[row], err_msg=f"{label} row {row}")
    if m >= 3:
        assert np.isnan(got[1]).all() and not np.isnan(np.delete(got, 1, axis=0)).any(), label
        x, got = x.at[1].set(0), np.delete(got, 1, axis=0)
        _assert_close(jnp.asarray(got), jnp.delete(x, 1, axis=0), w, "kn")
    else:
        _assert_close(jnp.asarray(got), x, w, "kn")


needs_packing = pytest.mark.skipif(
    not dense_cpu.packs(jnp.zeros((32, 32), jnp.bfloat16)),
    reason="weights are packed only where the kernel runs AMX tiles (amx_bf16, permitted)")


@needs_packing
def test_a_packed_weight_gives_the_tiles_bits_at_every_row_count() -> None:
    """Through a packed weight every row count takes the tiles, reading the weight as stored:
    the bits of the per-call packing path (tiles_from=1) at 0-100 rows (the 16-row tiles and
    32-row pairs with their tails), each row's bits the same alone and among others, a NaN
    kept to its row, within the exact product's bound; threads split 32-column groups."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    tiled = _multiply_with_tiles_from(1)
    for trial in range(4):
        k, n = 32 * int(rng.integers(1, 50)), 32 * int(rng.integers(1, 50))
        if trial == 0:  # past the threading threshold
            k, n = 576, 1536
        packed_w = None
        for m in [0, 1, 2, 15, 16, 17, 31, 32, 33, int(rng.integers(34, 101))]:
            x, w = _operands(rng, m, k, n, "kn", jnp.bfloat16)
            if packed_w is None:
                w_, packed_w = w, dense_cpu.pack(w)
            x = x if m < 3 else x.at[1, 3].set(jnp.nan)
            _check_packed_product(rng, x, packed_w, w_, tiled, f"seed {seed}, m={m} k={k} n={n}")


@needs_packing
def test_dense_takes_packed_weights_to_the_kernel_and_unpacks_them_for_xla() -> None:
    """`dense` sends a packed weight to the kernel at any row count (past ROWS too); under a mesh,
    and in the backward pass, XLA multiplies the unpacked weight: the same product as the
    weight as stored, within float32 accumulation error, and the same gradients."""
    from infer.model.llama import dense, xla_dense

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 96), np.float32)).astype(jnp.bfloat16)
    packed = dense_cpu.pack(w)
    fn = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf"))
    for m in (1, 8, max(dense_cpu.ROWS[("kn", jnp.dtype(jnp.bfloat16))]) + 1):
        x = jnp.asarray(rng.standard_normal((1, m, 64), np.float32))
        assert dense_cpu.TARGET in fn.lower(x, packed).as_text()
        _assert_close(fn(x, packed)[0], x[0].astype(jnp.bfloat16), w, "kn")
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        assert dense_cpu.TARGET not in fn.lower(x, packed).as_text()
        np.testing.assert_array_equal(np.asarray(fn(x, packed)),
                                      np.asarray(jax.jit(xla_dense, static_argnums=2)(
                                          x, w, "bte,ef->btf")))
    loss = lambda x, w: jnp.sum(jnp.sin(dense_cpu.multiply(x, w, "kn")))
    x = jnp.asarray(rng.standard_normal((5, 64), np.float32)).astype(jnp.bfloat16)
    gx, gp = jax.grad(loss, argnums=(0, 1))(x, packed)
    gx_want, gw_want = jax.grad(lambda x, w: jnp.sum(jnp.sin(dense_cpu.reference(x, w, "kn"))),
                                argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(gx_want, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dense_cpu.unpack(gp), np.float32),
                               np.asarray(gw_want, np.float32), rtol=1e-2, atol=1e-2)
