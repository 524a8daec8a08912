"""The SLO judgements and goodput on hand-checked examples."""

from __future__ import annotations

import math
import socket

import pytest

from superinfer.engine.slo import SLO, p99_gap
from superinfer.workload.goodput import RequestTiming, summarize
from superinfer.workload.loadgen import LoadRequest, run_load

SLO_ = SLO(ttft_ms=500, tbt_ms=100)


def timing(arrival: float, *token_times: float) -> RequestTiming:
    return RequestTiming(arrival, tuple(token_times), SLO_)


def test_goodput_on_a_hand_checked_example():
    timings = [
        timing(0.0, 0.2, 0.25, 0.30, 0.35),  # TTFT 200 ms, gaps 50 ms: meets both
        timing(0.0, 0.9, 0.95, 1.00),  # TTFT 900 ms: misses TTFT
        # TTFT 100 ms; gaps 20, 20, 20, 20, 300 ms: mean 76 ms meets TBT, the p99 gap (~290 ms) does not
        timing(1.0, 1.1, 1.12, 1.14, 1.16, 1.18, 1.48),
        timing(2.0, 2.3),  # one token: TBT met trivially, TTFT 300 ms met
    ]
    report = summarize(timings, duration_s=4.0)
    assert report["requests"] == 4
    assert report["ttft_attainment"] == 0.75
    assert report["tbt_attainment"] == 0.75  # the stall fails the third by its p99 gap
    assert report["tbt_mean_attainment"] == 1.0  # its mean gap hides the stall
    assert report["goodput_share"] == 0.5  # the first and the last
    assert report["goodput_mean_share"] == 0.75
    assert report["goodput_rps"] == pytest.approx(2 / 4.0)
    assert report["throughput_tok_s"] == pytest.approx(14 / 4.0)
    # 10 gaps in all, one of them over 100 ms
    assert report["tbt_token_attainment"] == pytest.approx(9 / 10)


def test_p99_gap_is_the_worst_gap_for_short_requests():
    assert p99_gap([]) is None
    assert p99_gap([0.01, 0.5, 0.02]) == pytest.approx(0.02 + 0.98 * (0.5 - 0.02))  # interpolated, sorted
    assert timing(0.0, 0.1).tbt_met and timing(0.0, 0.1).tbt_mean_met


def test_no_requests_gives_nan_shares():
    report = summarize([])
    assert math.isnan(report["goodput_share"]) and math.isnan(report["ttft_attainment"])
    assert "goodput_rps" not in report


async def test_a_failed_request_counts_as_failed_and_meets_no_slo():
    with socket.socket() as s:  # a port nobody listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timings, _ = await run_load(f"http://127.0.0.1:{port}", "m", [LoadRequest("hi", 4, SLO_)])
    (failed,) = timings
    assert failed.error is not None and failed.token_times == ()
    report = summarize([failed, timing(0.0, 0.1, 0.15)])
    assert report["failed"] == 1 and report["requests"] == 2
    assert report["ttft_attainment"] == 0.5 and report["goodput_share"] == 0.5
