"""Every kernel lowered for a real TPU and a real GPU on this CPU: the Mosaic and Triton lowering
rules run, block-shape checks included, which interpret mode never does.

Each cell of the matrix (platform x KV format x step kind x model geometry) must lower to the
platform's kernel call, or be refused up front by the entry point with UnsupportedKernelConfig
naming the constraint; a lowering crash fails the test.
"""

import jax
import pytest

from kernels_pallas.kv_quant import PAGE_FORMATS, SUPPORTED_KV_FORMATS
from kernels_pallas.paged_attention import lowering
from kernels_pallas.paged_attention.api import UnsupportedKernelConfig

# What each platform's lowering emits for a Pallas kernel; the interpreter emits neither.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "xla.gpu.triton"}


def refused_on_purpose(kv_format: str, geometry: lowering.Geometry) -> bool:
    """int4 packs groups of 32 along the head dim, which 80 is not a multiple of; int4_kivi is
    the paged cache's own layout, which no kernel reads."""
    return kv_format in PAGE_FORMATS or (kv_format == "int4" and geometry.head_dim % 32 != 0)


@pytest.mark.parametrize("kv_format", SUPPORTED_KV_FORMATS + PAGE_FORMATS)
@pytest.mark.parametrize("platform", lowering.PLATFORMS)
def test_every_cell_lowers_or_is_refused(platform: str, kv_format: str) -> None:
    cells = lowering.lowering_matrix(platforms=(platform,), kv_formats=(kv_format,))
    assert len(cells) == len(lowering.STEP_KINDS) * len(lowering.GEOMETRIES)
    by_geometry = {g.name: g for g in lowering.GEOMETRIES}
    for cell in cells:
        where = f"{cell.platform} {cell.kv_format} {cell.step} {cell.geometry}: {cell.detail}"
        assert cell.outcome != "fails", where
        want = "refused" if refused_on_purpose(kv_format, by_geometry[cell.geometry]) else "lowers"
        assert cell.outcome == want, where
        if cell.outcome == "refused" and kv_format in PAGE_FORMATS:
            assert "attention_backend='reference'" in cell.detail, where
        elif cell.outcome == "refused":
            assert "head dim" in cell.detail and "D=80" in cell.detail, where


@pytest.mark.parametrize("platform", lowering.PLATFORMS)
def test_lowering_emits_the_platform_kernel(platform: str) -> None:
    """The matrix is only worth something if it lowers the compiled kernel, not the interpreter
    (which is plain XLA and lowers anywhere)."""
    for kind in lowering.STEP_KINDS:
        text = lowering.lower(platform, "int8", kind, lowering.GEOMETRIES[0]).as_text()
        assert KERNEL_CALL[platform] in text, kind


@pytest.mark.parametrize("page_size, head_dim, kv_format, gpu_refuses", [
    (16, 64, "int4", None), (12, 64, "bfloat16", "power-of-two page size, got G=12"),
    (16, 96, "int4", "power-of-two number of int4 groups, got 3"), (16, 96, "int8", None)])
def test_an_engine_on_a_gpu_host_refuses_what_its_kernel_cannot_lower(
        monkeypatch, page_size: int, head_dim: int, kv_format: str, gpu_refuses: str | None
        ) -> None:
    """EngineConfig.check_model (LLM before the read, an Engine when made) refuses the GPU
    kernel's limits on a GPU host; they surfaced only when the first step was traced there,
    and no CPU run met them (auto takes the TPU-style kernel here)."""
    from infer.engine.engine import EngineConfig
    from infer.model.config import get_config
    from kernels_pallas.paged_attention.api import check_backend_limits

    model = get_config("tiny").replace(head_dim=head_dim)
    config = EngineConfig(attention_backend="pallas", page_size=page_size,
                          kv_cache_dtype=kv_format)
    config.check_model(model)  # this CPU host: the TPU-style kernel takes all of them
    check_backend_limits("tpu", page_size, head_dim, kv_format)
    EngineConfig(page_size=page_size, kv_cache_dtype=kv_format).check_model(model)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    EngineConfig(page_size=page_size, kv_cache_dtype=kv_format).check_model(model)  # reference
    if gpu_refuses is None:
        config.check_model(model)
        return
    for check in (lambda: config.check_model(model),
                  lambda: check_backend_limits("gpu", page_size, head_dim, kv_format)):
        with pytest.raises(UnsupportedKernelConfig, match=gpu_refuses):
            check()


@pytest.mark.parametrize("page_size", [8, 12, 32])
def test_page_sizes(page_size: int) -> None:
    kind, geometry = lowering.STEP_KINDS[0], lowering.GEOMETRIES[1]
    lowering.lower("tpu", "bfloat16", kind, geometry, page_size=page_size)
    if page_size & (page_size - 1):
        with pytest.raises(UnsupportedKernelConfig, match=f"power-of-two page size, got G={page_size}"):
            lowering.lower("cuda", "bfloat16", kind, geometry, page_size=page_size)
    else:
        lowering.lower("cuda", "bfloat16", kind, geometry, page_size=page_size)


@pytest.mark.parametrize("platform", lowering.PLATFORMS)
def test_int4_head_dim_96(platform: str) -> None:
    """int4 at D = 96 (Phi-3-mini): 3 groups of 32. Mosaic lowers it; the GPU kernel loads a
    page's group scales as one [G, groups] block, which Triton cannot lower for 3 groups, so the
    entry points refuse it up front instead of failing inside Triton."""
    geometry = lowering.Geometry("D96", num_heads=32, num_kv_heads=32, head_dim=96)
    for kind in lowering.STEP_KINDS:
        cell = lowering.lower_cell(platform, "int4", kind, geometry)
        if platform == "tpu":
            assert cell.outcome == "lowers", cell
        else:
            assert cell.outcome == "refused", cell
            assert "power-of-two number of int4 groups, got 3" in cell.detail, cell
            assert "D=96" in cell.detail, cell


def test_unknown_platform() -> None:
    with pytest.raises(ValueError, match="platform must be one of"):
        lowering.lower("rocm", "float32", lowering.STEP_KINDS[0], lowering.GEOMETRIES[0])
