"""bench/request_path.py: its figures per row (median of the runs' median steps, ours against the other layouts
within each repetition, the client's CPU per request, the supervision thread's CPU)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.request_path import DELAYS_S, LAYOUTS, Measurement, add_arguments, options, render


def test_each_row_gives_every_layouts_step_and_ours_against_the_others_within_each_repetition():
    nan = math.nan
    measurements = [
        Measurement("idle", 0.02, 0, 10.0, 0.0, nan, 0.0, 2.0),
        Measurement("direct", 0.02, 0, 10.5, 700.0, 0.60, 0.0, 2.5),
        Measurement("ours", 0.02, 0, 10.5, 690.0, 0.64, 0.024, 3.0),
        Measurement("idle", 0.02, 1, 12.0, 0.0, nan, 0.0, 3.5),
        Measurement("direct", 0.02, 1, 12.0, 710.0, 0.62, 0.0, 4.0),
        Measurement("ours", 0.02, 1, 12.6, 700.0, 0.66, 0.012, 4.5),
        Measurement("idle", 0.3, 0, 11.0, 0.0, nan, 0.0), Measurement("ours", 0.3, 0, 11.0, 53.0, 0.7, 0.006),
    ]
    text = render(measurements, seconds=12.0, reps=2)
    rows = text.split("| load average (1 min) as each run started |")[1]
    # Ours / no requests per repetition: 1.05 and 1.05; ours / TRL's path: 1.00 and 1.05. The supervision thread:
    # 24 and 12 ms of CPU over 12 s.
    assert ("| 0.02 s | 700 (690–710) | 11.0 (10.0–12.0) | 11.2 (10.5–12.0) | 11.6 (10.5–12.6) | 1.05 | "
            "1.02 (1.00–1.05) | 0.61 (0.60–0.62) | 0.65 (0.64–0.66) | 1.5 (1.0–2.0) | 3.2 (2.0–4.5) |") in rows
    assert "| 0.3 s | 53 | 11.0 | n/a | 11.0 | 1.00 | n/a | n/a | 0.70 | 0.5 | n/a |" in rows  # a layout not measured
    assert rows.index("| 0.3 s |") < rows.index("| 0.02 s |")  # the slowest request rate first
    assert "2 repetitions of 12 s" in text and LAYOUTS == ("idle", "direct", "ours")


def test_the_rows_and_repetitions_are_chosen_on_the_command_line_and_a_wrong_choice_is_named():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options(parser.parse_args(["--delays", "0.02", "--repetitions", "4"])) == {"delays": (0.02,),
                                                                                    "repetitions": 4}
    assert options(parser.parse_args([])) == {"delays": DELAYS_S, "repetitions": None}
    for wrong, named in ((["--delays", "fast"], "--delays"), (["--delays", "0"], "--delays"),
                         (["--repetitions", "0"], "--repetitions")):
        with pytest.raises(ValueError, match=named):
            options(parser.parse_args(wrong))
