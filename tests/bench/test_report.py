"""bench/report.py: how figures are written and how BENCHMARKS.md keeps the sections a partial run did not touch."""

from __future__ import annotations

import pytest

from bench.report import percentile, section_body, splice, spread, table


def test_spread_is_median_then_min_max():
    assert spread([3.0, 1.0, 2.0], "{:.1f}") == "2.0 (1.0–3.0)"
    assert spread([4.0, 1.0, 2.0, 3.0], "{:.2f}", " s") == "2.50 s (1.00–4.00)"


def test_spread_of_one_value_or_equal_values_has_no_range():
    assert spread([5.0], "{:.0f}") == "5"
    assert spread([2.0, 2.0], "{:.0f}") == "2"
    assert spread([]) == "n/a"


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50, 5),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 95, 10),
    ([7], 95, 7),
    ([3, 1, 2], 50, 2),
])
def test_percentile_is_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def test_splice_replaces_only_the_named_section():
    document = splice(splice("# Benchmarks", "pipeline", "old pipeline"), "stop", "old stop")
    updated = splice(document, "pipeline", "new pipeline")
    assert "new pipeline" in updated and "old pipeline" not in updated
    assert "old stop" in updated
    assert updated.index("new pipeline") < updated.index("old stop"), "a replaced section keeps its place"


def test_splice_appends_a_missing_section_once():
    document = splice("# Benchmarks", "e2e", "first")
    assert document.count("<!-- bench:e2e -->") == 1
    assert splice(document, "e2e", "second").count("<!-- bench:e2e -->") == 1


def test_table_is_markdown():
    assert table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_section_body_reads_back_what_splice_wrote():
    document = splice("# Benchmarks", "machine", "## Machine\n\ncores")
    assert section_body(document, "machine") == "## Machine\n\ncores"
    assert section_body(document, "e2e") is None


def test_a_full_bench_run_keeps_the_sections_measured_elsewhere():
    from bench.__main__ import HEADER, kept_sections

    before = ("# Benchmarks\n\n<!-- bench:device -->\nGPU figures\n<!-- /bench:device -->\n\n"
              "<!-- bench:builds -->\nbuild figures\n<!-- /bench:builds -->\n")
    document = kept_sections(before, HEADER)
    assert section_body(document, "device") == "GPU figures"
    assert section_body(document, "builds") == "build figures"
    assert kept_sections("", HEADER) == HEADER


def test_spread_leaves_out_nans_and_says_n_a_when_none_is_left():
    assert spread([2.0, float("nan"), 4.0], "{:.1f}") == "3.0 (2.0–4.0)"
    assert spread([float("nan")], "{:.1f}") == "n/a"
