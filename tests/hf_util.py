"""Helpers for comparing against HF transformers."""

from __future__ import annotations

import numpy as np


def hf_logits(hf_model, token_ids: list[int]) -> np.ndarray:
    """Full-sequence logits [T, V] of a HF causal LM, float32."""
    import torch
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy(hf_model, token_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF `generate` greedy continuation with EOS never stopping it, and the top-2 logit margin
    of each step (to tell near-ties from real disagreements)."""
    import torch
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([token_ids]), max_new_tokens=steps, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True, temperature=None, top_p=None,
                                top_k=None)
    tokens = out.sequences[0, len(token_ids):].tolist()
    margins = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def agree_until_near_tie(ours: list[int], ref: list[int], margins: list[float],
                         tie: float = 1e-4) -> tuple[bool, str]:
    """Greedy runs must be equal up to the first step where the reference's top-2 margin is below
    `tie` (rounding may flip such a step, and everything after it may differ)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if margins[i] < tie:
            return True, f"near-tie at step {i} (margin {margins[i]:.2e}); equal before it"
        if a != b:
            return False, f"step {i}: ours {a} vs reference {b} (margin {margins[i]:.3e})"
    if len(ours) != len(ref):
        return False, f"lengths differ: {len(ours)} vs {len(ref)}"
    return True, "identical"
