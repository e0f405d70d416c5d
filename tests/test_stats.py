"""The log-bucket histograms: both ways of building them agree, and quantiles are within half a bucket."""

from __future__ import annotations

import random

import pytest

from steptimer._stats import LogHistogram, _histogram_py, bucket_index, histograms_of


@pytest.mark.parametrize("n", [1, 7, 300, 1000])
def test_numpy_and_python_binning_agree(n: int) -> None:
    rng = random.Random(n)
    values = [rng.choice([0.0, 1e-5, 0.5, 3.3, 100.0, 1e9, rng.random() * 10]) for _ in range(n)]
    # n >= 300 with two series goes through numpy; the reference is the per-value Python loop
    hists = histograms_of({("host", "x"): values, ("gpu", "y"): values[::-1]})
    ref = _histogram_py(values)
    for h in hists.values():
        assert h.counts == ref.counts
        assert h.count == n and h.min_ms == min(values) and h.max_ms == max(values)
        assert h.sum_ms == pytest.approx(sum(values), rel=1e-12)
    assert set(ref.counts) == {bucket_index(v) for v in values}


def test_quantiles_within_half_a_bucket_and_merge_adds_up() -> None:
    rng = random.Random(0)
    values = [rng.lognormvariate(0.0, 1.0) for _ in range(5000)]
    a, b = _histogram_py(values[:2000]), _histogram_py(values[2000:])
    merged = LogHistogram()
    merged.merge(a)
    merged.merge(b)
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        true = ordered[int(q * len(values)) - 1]
        assert merged.quantile_ms(q) == pytest.approx(true, rel=0.0051)
    assert merged.quantile_ms(1.0) == max(values)
    assert merged.count == 5000 and merged.sum_ms == pytest.approx(sum(values))
