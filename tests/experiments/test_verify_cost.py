"""experiments.verify_cost's HLO summary: it counts the optimized program's operations and the
shapes of its dots and copies (how the verify program's extra copies were found)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.verify_cost import print_hlo_summary


def test_the_hlo_summary_counts_dots_with_their_shapes(capsys) -> None:
    x, w = jnp.ones((3, 16)), jnp.ones((16, 8))
    text = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, w).compile().as_text()
    print_hlo_summary("tiny", text)
    out = capsys.readouterr().out
    assert out.startswith("tiny: ")
    assert "1 dot" in out.splitlines()[0] and "1 x dot f32[3,8]" in out
