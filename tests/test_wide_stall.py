"""experiments.wide_stall: which samples' columns a search returned, matched to the truth."""

import torch

from experiments import wide_stall


def test_a_certified_batch_has_every_sample_found():
    b = wide_stall.batch("photos32", B=6, m=100, seed=0)
    r = wide_stall.attack(b, "photos32", seed=0, max_seconds=60)
    assert int(r["hit"].sum()) <= r["n_found"]  # a found column matches one sample at most
    if r["exact"]:  # certified: all B columns are the true ones
        assert bool(r["hit"].all())


def test_statistics_and_quartiles():
    b = wide_stall.batch("greys32", B=8, m=64, seed=1)
    assert 0.0 < b["inactive"] < 1.0 and -1.0 <= b["cos"] <= 1.0
    assert b["nn_jaccard"].shape == (8,) and bool((b["nn_jaccard"] <= 1.0).all())
    hit = torch.tensor([True, False] * 4)
    counts = wide_stall.by_quartile(torch.arange(8.0), hit).split(", ")
    assert counts == ["1/2", "1/2", "1/2", "1/2"]
