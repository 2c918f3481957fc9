"""Parts of a layer-major pass (csrc/engine/layer.c): a sparse layer's attention and routing a part
of the rows at a time, each part's reads fired as it routes, then the experts over all the rows.
Whatever the parts, the pass gives the same bits and reads the same blobs as in one part."""
import numpy as np
import pytest

import pysmoe
from test_prefill import assert_identical, budgets, run_path

KEYS = ("blob_reads", "bytes_read", "cache_hits", "cache_misses", "union_sizes")


@pytest.mark.parametrize("budget", ["zero", "small", "all"])
def test_parts_give_the_bits_and_reads_of_one_part(tiny_vault, budget):
    vault = pysmoe.open_vault(tiny_vault)
    ids = [int(i) for i in np.random.default_rng(11).integers(0, vault.config["vocab_size"], size=41)]
    kw = dict(threads=2, chunk=40, cache_bytes=budgets(vault)[budget])
    one = run_path(vault, ids, "layer-major", part_rows=40, **kw)
    assert_identical(run_path(vault, ids, "token-serial", **kw), one)
    reads_one = prefill_reads(vault, ids, part_rows=40, **kw)
    for part_rows in (1, 3, 8, 39, 0):
        assert_identical(one, run_path(vault, ids, "layer-major", part_rows=part_rows, **kw))
        # the same union, acquired in the same order: each expert read once a layer, as in one part
        assert prefill_reads(vault, ids, part_rows=part_rows, **kw) == reads_one, part_rows


def prefill_reads(vault, ids, **kw):
    """The read counters of a cold prefill alone. (What a small cache holds after it depends on the
    order the reads landed in, so the decode steps after it may read a blob more or less.)"""
    with vault.session(context=512, **kw) as s:
        s.prefill(ids)
        st = s.stats()
    return {k: st[k] for k in KEYS}


def test_parts_submit_their_reads_as_they_route(tiny_vault):
    """Parts are not only bit-neutral but there: each part submits its own reads, so a cold pass in
    parts of one row issues more (shorter) read requests than in one part, for the same blobs."""
    vault = pysmoe.open_vault(tiny_vault)
    ids = [int(i) for i in np.random.default_rng(13).integers(0, vault.config["vocab_size"], size=40)]
    counts = {}
    for part_rows in (40, 1):
        with vault.session(threads=2, chunk=40, cache_bytes=vault.expert_bytes * 2, part_rows=part_rows,
                           context=64) as s:
            s.prefill(ids)
            counts[part_rows] = s.stats()
    assert counts[1]["blob_reads"] == counts[40]["blob_reads"]
    assert counts[1]["read_requests"] > counts[40]["read_requests"]


def test_parts_on_a_glm_vault(tiny_glm_vault):
    """Biases, the grouped sigmoid router and the shared expert after the parts' routing."""
    vault = pysmoe.open_vault(tiny_glm_vault)
    ids = [int(i) for i in np.random.default_rng(12).integers(0, vault.config["vocab_size"], size=30)]
    kw = dict(threads=2, chunk=32, cache_bytes=0)
    one = run_path(vault, ids, "layer-major", part_rows=32, **kw)
    for part_rows in (1, 5, 0):
        assert_identical(one, run_path(vault, ids, "layer-major", part_rows=part_rows, **kw))


def test_part_rows_is_checked(tiny_vault):
    vault = pysmoe.open_vault(tiny_vault)
    for bad in (-1, 1 << 32, 2.5, "8"):
        with pytest.raises(pysmoe.InvalidArgument, match="part_rows"):
            vault.session(part_rows=bad)
