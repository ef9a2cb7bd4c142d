"""The one page-table builder (`page_tables`) and the one paged-metadata builder
(`paged_metadata`), over random layouts: pages in any order, tables narrower or wider than the
pages held, sequences placed in any rows."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from infer.cache.metadata import check_writes, paged_metadata
from infer.cache.page_allocator import SequencePages, page_tables


def random_layout(rng: random.Random) -> tuple[list[SequencePages], int, int, list[int] | None]:
    """Sequences holding disjoint, shuffled pages of a pool; a row count and a width; row_of."""
    page_size = rng.choice([1, 2, 4, 16])
    n = rng.randint(0, 6)
    rows = n + rng.randint(0, 3)
    pool = list(range(rng.randint(1, 64)))
    rng.shuffle(pool)
    seqs = []
    for _ in range(n):
        take = rng.randint(0, min(8, len(pool)))
        pages, pool = pool[:take], pool[take:]
        seq = SequencePages(page_size, pages)
        if take:
            seq.num_tokens = rng.randint((take - 1) * page_size, take * page_size)
        seqs.append(seq)
    width = rng.randint(1, 10)
    row_of = rng.sample(range(rows), n) if rng.random() < 0.6 else None
    return seqs, rows, width, row_of


@pytest.mark.parametrize("seed", range(300))
def test_page_tables_matches_a_reference(seed: int) -> None:
    rng = random.Random(seed)
    seqs, rows, width, row_of = random_layout(rng)
    table = page_tables(seqs, rows, width, row_of)
    assert table.dtype == np.int32 and table.shape == (rows, width)
    placed = list(range(len(seqs))) if row_of is None else row_of
    expected = [[0] * width for _ in range(rows)]
    for i, seq in zip(placed, seqs):
        for j, page in enumerate(seq.pages[:width]):  # pages past the width are left out
            expected[i][j] = page
    assert table.tolist() == expected
    # No sequence's page lands in another's row.
    for i, seq in zip(placed, seqs):
        others = {p for k, s in zip(placed, seqs) if k != i for p in s.pages}
        assert not others & set(table[i, :len(seq.pages)].tolist())


@pytest.mark.parametrize("seed", range(200))
def test_paged_metadata_refuses_a_write_past_the_pages_shown(seed: int) -> None:
    """Each row writes [cached, cached + q_len); that fits exactly when it stays within the pages
    the row holds and its table shows. Otherwise the error names the row and its request."""
    rng = random.Random(seed)
    seqs, rows, width, row_of = random_layout(rng)
    placed = list(range(len(seqs))) if row_of is None else row_of
    names = [f"request 'r{i}'" for i in range(len(seqs))]
    tokens = rng.choice([1, 4, 16])
    cached = np.zeros(rows, np.int32)
    q_lens = np.zeros(rows, np.int32)
    room = {}
    for i, seq in zip(placed, seqs):
        room[i] = min(len(seq.pages), width) * seq.page_size
        cached[i] = rng.randint(0, room[i] + 2)
        q_lens[i] = rng.randint(0, tokens)
    bad = [i for i in room if q_lens[i] > 0 and cached[i] + q_lens[i] > room[i]]
    if not bad:
        meta = paged_metadata(seqs, rows, width, cached, q_lens, tokens, row_of, names=names)
        assert np.asarray(meta.lengths).tolist() == (cached + q_lens).tolist()
        assert np.asarray(meta.q_lens).tolist() == q_lens.tolist()
        assert np.asarray(meta.positions).tolist() == (
            cached[:, None] + np.arange(tokens)[None, :]).tolist()
        assert np.asarray(meta.page_tables).tolist() == page_tables(
            seqs, rows, width, row_of).tolist()
        return
    first = min(bad)
    name = names[placed.index(first)]
    with pytest.raises(ValueError, match=rf"row {first} \({name}\) writes slots "
                                         rf"\[{cached[first]}, {cached[first] + q_lens[first]}\) "
                                         rf"but has room for {room[first]}"):
        paged_metadata(seqs, rows, width, cached, q_lens, tokens, row_of, names=names)


def test_paged_metadata_checks_a_chains_writes_past_its_tokens() -> None:
    """`write_ends`: a proposer's chain writes past its metadata's tokens; those writes are
    checked too, and the message names the request."""
    seq = SequencePages(4, [5, 2], num_tokens=6)
    six, one = np.array([6], np.int32), np.array([1], np.int32)
    paged_metadata([seq], 1, 2, six, one, 1, write_ends=np.array([8], np.int32),
                   names=["request 'a'"])
    with pytest.raises(ValueError, match=r"row 0 \(request 'a'\) writes slots \[6, 9\) but has "
                                         r"room for 8"):
        paged_metadata([seq], 1, 2, six, one, 1, write_ends=np.array([9], np.int32),
                       names=["request 'a'"])
    # A narrower table shows fewer slots than the pages hold: a write needing page 2 fails.
    with pytest.raises(ValueError, match=r"row 0 \(request 'a'\) writes slots \[6, 7\) but has "
                                         r"room for 4"):
        paged_metadata([seq], 1, 1, six, one, 1, names=["request 'a'"])
    with pytest.raises(ValueError, match="2 names for 1 sequences"):
        paged_metadata([seq], 1, 2, six, one, 1, names=["a", "b"])


@pytest.mark.parametrize("seed", range(20))
def test_check_writes_names_the_rows_whatever_is_given_per_row(seed: int) -> None:
    """Starts, ends and capacity each per row or one for all rows (the simple loop passes one
    start): every bad row is named in a ValueError. One start for all rows with a bad row past
    the first raised IndexError while the message was built."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(2, 6))
    starts = rng.integers(-2, 8, rows)
    ends = rng.integers(-2, 16, rows)
    capacity = rng.integers(4, 16, rows)
    for per_row in itertools.product([False, True], repeat=3):
        args = [x if p else int(x[0]) for x, p in zip((starts, ends, capacity), per_row)]
        s, e, c = map(np.atleast_1d, np.broadcast_arrays(*args))
        bad = [b for b in range(s.size) if e[b] > s[b] and (s[b] < 0 or e[b] > c[b])]
        if not bad:
            check_writes(*args)
            continue
        with pytest.raises(ValueError, match="write outside the KV cache") as info:
            check_writes(*args)
        assert all(f"row {b} writes" in str(info.value) for b in bad[:8]), (per_row, bad)
