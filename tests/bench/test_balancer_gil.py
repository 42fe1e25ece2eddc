"""bench/balancer_gil.py: its figures per row (median of the runs' median steps, ratios to no balancer)."""

from __future__ import annotations

from bench.balancer_gil import LAYOUTS, Measurement, render


def test_each_row_gives_every_layouts_step_and_its_ratio_to_no_balancer():
    measurements = [
        *(Measurement("direct", 0.1, ms, 150.0) for ms in (10.0, 12.0)),
        *(Measurement("in-process", 0.1, ms, rate) for ms, rate in ((13.0, 140.0), (15.0, 150.0))),
        *(Measurement("own-process", 0.1, ms, 160.0) for ms in (11.0, 11.0)),
        Measurement("direct", 0.02, 10.0, 700.0), Measurement("in-process", 0.02, 15.0, 600.0),
    ]
    text = render(measurements, seconds=12.0, reps=2)
    rows = text.split("| in its own process / none |")[1]
    # Median steps 11, 14 and 11 ms: 1.27 and 1.00 of no balancer; the request rate only through a balancer.
    assert "| 0.1 s | 155 (140–160) | 11.0 (10.0–12.0) | 14.0 (13.0–15.0) | 11.0 | 1.27 | 1.00 |" in rows
    assert "| 0.02 s | 600 | 10.0 | 15.0 | n/a | 1.50 | n/a |" in rows  # a layout not measured says so
    assert rows.index("| 0.1 s |") < rows.index("| 0.02 s |")  # the slowest request rate first
    assert "2 repetitions of 12 s" in text and len(LAYOUTS) == 3
