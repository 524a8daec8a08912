"""RFC 3339 timestamps (seconds, UTC) as Kubernetes writes them, to and from epoch seconds."""

from __future__ import annotations

import datetime

ISO = "%Y-%m-%dT%H:%M:%SZ"


def now_iso(clock_value: float) -> str:
    return datetime.datetime.fromtimestamp(clock_value, tz=datetime.timezone.utc).strftime(ISO)


def parse_iso(text: str) -> float:
    return datetime.datetime.strptime(text, ISO).replace(tzinfo=datetime.timezone.utc).timestamp()
