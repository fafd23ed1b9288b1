"""experiments.dp_span: the projection study runs and its numbers mean what they say."""

import pytest

from experiments import dp_span


def test_the_whole_space_as_span_gives_the_ceiling():
    # m = 16 < B + 40: the widest "span" is the whole column space, so projecting the true
    # columns onto it changes nothing and the least squares equal the ceiling's
    r = dp_span.one_batch("greys32", seed=0, f=0.3, B=4, m=16)
    assert 0.0 < r["share"] <= 1.0 + 1e-12
    assert r["wide"][40] == pytest.approx(r["ceiling"], abs=1e-6)


def test_main_appends_a_section_with_one_row_per_fraction(tmp_path):
    out = tmp_path / "dp.md"
    args = ["--dataset", "greys32", "--fracs", "0.1,0.3", "--batches", "2", "--batch-size", "4",
            "--width", "16", "--out", str(out)]
    assert dp_span.main(args) == 0
    text = out.read_text()
    assert "dp_span" in text and text.count("| `greys32` |") == 2
