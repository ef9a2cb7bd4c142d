import json

from experiments import kernel_lowering
from kernels_pallas.paged_attention import lowering


def test_prints_and_writes_every_cell(tmp_path, capsys) -> None:
    out = tmp_path / "lowering.jsonl"
    rows = kernel_lowering.run(platforms=["cuda"], kv_formats=["int4"], out=str(out))
    assert len(rows) == len(lowering.STEP_KINDS) * len(lowering.GEOMETRIES)
    stored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["outcome"] for r in stored] == [r["outcome"] for r in rows]
    # int4 at D = 80 is refused, and said so once for its four step kinds
    assert {r["geometry"] for r in rows if r["outcome"] == "refused"} == {"Phi-2"}
    text = capsys.readouterr().out
    assert "cuda: 10 of 15 cells lower" in text
    assert text.count("int4 needs an even head dim") == 1 and "(5 cells:" in text
