"""The API server's time format: RFC 3339 with second precision, in UTC (status times, conditions, Kueue)."""

from __future__ import annotations

import datetime


def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
