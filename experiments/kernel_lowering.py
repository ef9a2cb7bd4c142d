"""Which kernels lower for a real TPU and a real GPU, from any host: every KV format x kind of
attention step x model geometry, lowered for each platform by its real Mosaic or Triton rules
(`kernels_pallas.paged_attention.lowering`), no accelerator needed.

  python -m experiments.kernel_lowering
  python -m experiments.kernel_lowering --platforms=cuda --kv_formats=int4,int8

Prints one table per platform: a row per (format, step), a column per geometry. A cell reads
"lowers", "refused" (the entry point declined up front, its reason listed below the table) or
"FAILS" (a lowering crash: a bug). Writes one JSONL row per cell. Lowering is not compiling: Mosaic
and Triton still compile the lowered kernel on the device, which only
`experiments.device_check` on a GPU or TPU can show.
"""

from __future__ import annotations

from absl import flags

from kernels_pallas.kv_quant import PAGE_FORMATS, SUPPORTED_KV_FORMATS

FLAGS = flags.FlagValues()  # this experiment's own flags: see common.run_experiment
flags.DEFINE_list("platforms", ["tpu", "cuda"], "platforms to lower for", flag_values=FLAGS)
flags.DEFINE_list("kv_formats", list(SUPPORTED_KV_FORMATS + PAGE_FORMATS), "KV cache formats",
                  flag_values=FLAGS)
flags.DEFINE_string("out", "results/kernel_lowering.jsonl", "JSONL output", flag_values=FLAGS)


def run(*, platforms: list[str], kv_formats: list[str], out: str) -> list[dict]:
    """One row per cell of the matrix (platform, kv_format, step, geometry, outcome, detail);
    prints the tables. Raises SystemExit(1) after printing when a cell fails."""
    import dataclasses

    from experiments.common import ResultLog, markdown_table
    from kernels_pallas.kv_quant import resolve_kv_format
    from kernels_pallas.paged_attention import lowering

    formats = tuple(resolve_kv_format(f, page_formats=True) for f in kv_formats)
    log = ResultLog(out)
    rows = []
    for platform in platforms:
        cells = lowering.lowering_matrix(platforms=(platform,), kv_formats=formats)
        rows += [log.append({"experiment": "kernel_lowering", **dataclasses.asdict(c)})
                 for c in cells]
        table, reasons = [], {}
        for fmt in formats:
            for kind in lowering.STEP_KINDS:
                line = {"kv_format": fmt, "step": kind.name}
                for c in cells:
                    if c.kv_format == fmt and c.step == kind.name:
                        line[c.geometry] = {"fails": "FAILS"}.get(c.outcome, c.outcome)
                        if c.outcome != "lowers":
                            # one reason per constraint, whatever the call's shapes
                            reason = c.detail.split(" (q ")[0]
                            reasons.setdefault(reason, []).append(f"{fmt} {kind.name} {c.geometry}")
                table.append(line)
        columns = [("kv_format", "format"), ("step", "step")] + [
            (g.name, f"{g.name} (H={g.num_heads}, K={g.num_kv_heads}, D={g.head_dim})")
            for g in lowering.GEOMETRIES]
        print(f"\n{platform}: {sum(c.outcome == 'lowers' for c in cells)} of {len(cells)} cells lower\n")
        print(markdown_table(table, columns))
        for detail, where in reasons.items():
            print(f"\n- {detail}\n  ({len(where)} cells: {', '.join(where[:4])}"
                  f"{', ...' if len(where) > 4 else ''})")
    if any(r["outcome"] == "fails" for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    from experiments.common import run_main
    run_main(run, FLAGS)
