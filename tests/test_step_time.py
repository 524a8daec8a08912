"""The online step-time model and the SLO-aware admission (TBT guard) built on it."""

from __future__ import annotations

import pytest

from superinfer.engine.core.policies import MIN_PREFILL_CHUNK, RotaryParams, RotaryPolicy, tbt_guard
from superinfer.engine.core.step_time import REFIT_EVERY, StepShape, StepTimeModel
from superinfer.engine.slo import SLO
from tests.test_core import make_request
from tests.test_rotary import Clock, rotary_scheduler, step


def test_the_model_recovers_a_linear_step_time_and_inverts_it():
    model = StepTimeModel(decay=1.0)
    for tokens, context in [(1, 100), (8, 300), (64, 800), (32, 50), (128, 4000), (5, 2000), (90, 10), (16, 16)]:
        model.observe(StepShape(tokens, context), 0.004 + 0.0002 * tokens + 0.001 * context / 1000)
    assert model.ready
    assert model.coefficients() == pytest.approx([0.004, 0.0002, 0.001], rel=1e-3)
    assert model.predict(StepShape(10, 1000)) == pytest.approx(0.004 + 0.002 + 0.001, rel=1e-3)
    assert model.time_for(10, 1000) == model.predict(StepShape(10, 1000))  # the same bits, no StepShape
    # 20 ms leave 20 - 4 - 2 (context) = 14 ms: 70 tokens
    assert model.tokens_within(0.020, 2000) == pytest.approx(70, abs=1)
    assert model.tokens_within(0.003, 0) == 0


def test_the_model_reports_how_far_off_it_was():
    """The mean |predicted - measured| over the measured time, from the first step it predicted."""
    model = StepTimeModel(decay=1.0, min_samples=2)
    model.observe(StepShape(1, 0), 0.011)
    model.observe(StepShape(3, 0), 0.013)
    assert model.relative_error == 0.0  # nothing predicted yet
    model.observe(StepShape(2, 0), 0.012)  # as predicted
    assert model.relative_error == pytest.approx(0.0, abs=1e-6)
    model.observe(StepShape(2, 0), 0.024)  # twice as long: off by 12 of 36 ms measured
    assert model.relative_error == pytest.approx(1 / 3, rel=1e-3)


def test_coefficients_never_go_negative_and_old_steps_fade():
    model = StepTimeModel(decay=0.5, min_samples=1)
    for tokens in range(1, 20):  # more context made these steps faster: noise, not physics
        model.observe(StepShape(tokens, 1000 * (20 - tokens)), 0.01 * tokens)
    assert all(c >= 0 for c in model.coefficients())
    for _ in range(40):  # the machine got twice as slow
        for tokens in (4, 40):
            model.observe(StepShape(tokens, 0), 0.02 * tokens)
    assert model.predict(StepShape(10, 0)) == pytest.approx(0.2, rel=0.05)


def guarded_scheduler(per_token_s: float, slo: SLO, running: int = 4, first_slo: SLO | None = None):
    """A rotary scheduler with `running` decoding requests (the first with `first_slo` if given)
    whose step model says: 10 ms a step plus `per_token_s` per token."""
    clock = Clock()
    s = rotary_scheduler(num_blocks=400, budget=256, max_seqs=64, clock=clock)
    for i in range(running):
        s.add(make_request(f"live{i}", 6, max_tokens=50, first_token=7 * i))
        s.requests[f"live{i}"].slo = first_slo if i == 0 and first_slo else slo
    step(s)
    step(s)  # all decoding now
    s.step_time = StepTimeModel()
    for _ in range(10):
        for tokens in (1, 6):
            s.step_time.observe(StepShape(tokens, 0), 0.010 + per_token_s * tokens)
    for i in range(6):
        s.add(make_request(f"new{i}", 6, max_tokens=50, first_token=50 + 7 * i))
    return s, clock


def test_guard_holds_new_requests_that_would_break_the_streaming_ones_tbt():
    s, clock = guarded_scheduler(0.010, SLO(ttft_ms=5000, tbt_ms=105))
    # A token's turn may take 84 ms (0.8 x 105): 10 + 10 x d ms for d decodes, so 7 may stream.
    guard = tbt_guard(s, clock.now, RotaryParams().tbt_headroom)
    assert guard is not None and guard.new_requests == 3
    assert guard.token_budget == 4 + MIN_PREFILL_CHUNK  # decodes alone leave room for 3 tokens: a minimum chunk
    decision = s.policy.decide(s, clock.now)
    assert [r.request_id for r in decision.admit] == ["new0", "new1", "new2"]
    assert decision.token_budget == guard.token_budget
    plan = step(s)
    assert plan.num_tokens <= guard.token_budget
    assert [r.request_id for r in s.waiting] == ["new3", "new4", "new5"], "the rest wait, in order"
    # The benchmarks' view of it: one step held new requests back; its cut budget was not all spent.
    assert (s.counters.guard_held_steps, s.counters.guard_capped_steps) == (1, 0)
    assert s.counters.guard_overdue_steps == 0 and not guard.overdue  # the model held them, not a late token
    figures = s.guard_figures()
    assert figures["guard_held_step_share"] == pytest.approx(1 / 3)  # of the three steps so far
    assert figures["step_model_ms"] == pytest.approx(10.0, rel=1e-3)
    assert figures["step_model_ms_per_token"] == pytest.approx(10.0, rel=1e-3)


def test_a_request_waits_its_own_turn_not_the_tightest_slo_s():
    """No request starts while a streaming one has waited its whole turn for a token, but a turn
    is 0.8 x that request's own TBT SLO: a batch request (1 s) that waited 200 ms does not hold
    up an interactive one (100 ms turns: 80 ms), which the model says fits."""
    s, clock = guarded_scheduler(0.0001, SLO(ttft_ms=500, tbt_ms=100), 2, SLO(ttft_ms=30_000, tbt_ms=1000))
    batch, interactive = s.requests["live0"], s.requests["live1"]
    clock.now = interactive.t_last_token + 0.05
    batch.t_last_token = clock.now - 0.2
    guard = tbt_guard(s, clock.now, 0.8)
    assert guard.new_requests == 6 and not guard.overdue
    interactive.t_last_token = clock.now - 0.09  # past its own 80 ms turn
    guard = tbt_guard(s, clock.now, 0.8)
    assert guard.new_requests == 0 and guard.overdue


def test_a_request_whose_wait_already_broke_its_tbt_holds_nobody_up():
    """A streaming request that has waited longer than its TBT SLO since its last token has lost
    it (its next gap will break it), before that token comes: the guard neither protects it nor
    holds new requests for it. Before, one such request (a recomputed one that could not fit
    back, say) stopped every new request until its token came."""
    s, clock = guarded_scheduler(0.0001, SLO(ttft_ms=5000, tbt_ms=100), 2)
    stalled = make_request("stalled", 6, max_tokens=50, first_token=90)
    s.add(stalled)  # waiting again with tokens out, as after a recompute
    stalled.token_ids.append(5)
    stalled.t_first_token = stalled.t_last_token = clock.now
    clock.now += 0.09  # past its 80 ms turn, within its 100 ms SLO: it holds new requests
    assert tbt_guard(s, clock.now, 0.8).new_requests == 0
    clock.now += 0.02  # past its SLO: lost, and the running two have their turns
    for r in s.running:
        r.t_last_token = clock.now - 0.01
    assert tbt_guard(s, clock.now, 0.8).new_requests == 6
    clock.now += 0.2  # the running ones waited past their SLO too: nothing is left to protect
    assert tbt_guard(s, clock.now, 0.8) is None


def test_guard_lets_everything_in_when_the_slo_is_loose_or_unreachable():
    s, _ = guarded_scheduler(0.0001, SLO(ttft_ms=5000, tbt_ms=100))
    guard = tbt_guard(s, s.clock(), 0.8)
    assert guard is not None and guard.new_requests == 6 and guard.token_budget > 256
    # One request alone would miss a 5 ms TBT on this machine: nothing to protect, no guard.
    s, _ = guarded_scheduler(0.0001, SLO(ttft_ms=5000, tbt_ms=5))
    assert tbt_guard(s, s.clock(), 0.8) is None


def test_guard_is_off_without_measured_steps_or_when_disabled():
    clock = Clock()
    s = rotary_scheduler(clock=clock)
    s.add(make_request("a", 6, max_tokens=10))
    step(s)
    assert tbt_guard(s, s.clock(), 0.8) is None  # two steps are not enough to trust a model
    s, clock = guarded_scheduler(0.010, SLO(ttft_ms=5000, tbt_ms=100))
    s.policy = RotaryPolicy(RotaryParams(slo_admission=False))
    decision = s.policy.decide(s, clock.now)
    assert len(decision.admit) == 6 and decision.token_budget is None


def test_no_guard_while_only_decodes_run_and_nothing_waits():
    """With every running request decoding and nothing waiting or rotated out, the guard's token
    budget could not bind (it leaves a token for each running request): decide skips it. A
    running request with a prefill chunk left brings it back."""
    s, clock = guarded_scheduler(0.001, SLO(ttft_ms=5000, tbt_ms=105))
    for r in list(s.waiting):
        s.abort(r.request_id)
    assert s.policy.decide(s, clock.now).token_budget is None
    s.add(make_request("long", 200, max_tokens=5))
    step(s)  # its first chunk: the guard's token budget leaves the rest for later
    long = s.requests["long"]
    assert long in s.running and long.num_computed_tokens < 200
    assert s.counters.guard_capped_steps == 1  # that step spent the budget the guard cut
    guard = tbt_guard(s, clock.now, RotaryParams().tbt_headroom)
    assert guard is not None
    assert s.policy.decide(s, clock.now).token_budget == guard.token_budget


def test_a_warm_model_refits_every_few_steps():
    """Once warm, the fit is redone every REFIT_EVERY observations, not after each: it follows
    the machine within a few steps, at a fraction of the cost."""
    model = StepTimeModel(decay=0.9, min_samples=4)
    for tokens in [1, 8, 16, 32] * 4:  # 16 samples: past the warm-up
        model.observe(StepShape(tokens, 0), 0.01 + 0.001 * tokens)
    before = model.predict(StepShape(10, 0))
    assert before == pytest.approx(0.02, rel=1e-3)
    observed = model.samples
    while (observed + 1) % REFIT_EVERY:  # the machine got twice as slow; no refit yet
        model.observe(StepShape(10, 0), 0.04)
        observed += 1
        assert model.predict(StepShape(10, 0)) == before
    model.observe(StepShape(10, 0), 0.04)  # the refit
    assert model.predict(StepShape(10, 0)) > before
