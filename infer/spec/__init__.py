"""Speculative decoding: proposers (n-gram, draft model, EAGLE head), exact verification,
tree speculation, training losses, stats."""
