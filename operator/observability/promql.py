"""PromQL used by the Grafana dashboards and the PrometheusRule (one place, checked by a test)."""

from __future__ import annotations

from superinfer.engine.contract import SLO_CLASS_LABEL, metric

SEL = 'namespace=~"$namespace", model_name=~"$model"'  # Grafana template variables
RATE = "$__rate_interval"
SLO = metric("slo_requests") + "_total"
BY_CLASS = f"model_name, {SLO_CLASS_LABEL}"


def rate_sum(series: str, by: str = "model_name", sel: str = SEL, window: str = RATE, extra: str = "") -> str:
    matchers = ", ".join(m for m in (sel, extra) if m)
    selector = f"{series}{{{matchers}}}" if matchers else series
    return f"sum by ({by}) (rate({selector}[{window}]))"


def attainment(by: str = "model_name", sel: str = SEL, window: str = RATE) -> str:
    met = rate_sum(SLO, by, sel, window, 'ttft="met", tbt="met"')
    return f"{met} / {rate_sum(SLO, by, sel, window)}"


def ttft_attainment(by: str = "model_name", sel: str = SEL, window: str = RATE) -> str:
    met = rate_sum(SLO, by, sel, window, 'ttft="met"')
    return f"{met} / {rate_sum(SLO, by, sel, window)}"


def goodput(by: str = "model_name", sel: str = SEL, window: str = RATE) -> str:
    """Requests/s meeting both SLOs (each judged against its own class's targets)."""
    return rate_sum(SLO, by, sel, window, 'ttft="met", tbt="met"')


def per_request(counter: str, by: str = "model_name", sel: str = SEL, window: str = RATE) -> str:
    """A counter's rate per finished request, e.g. rotations per completed request."""
    return f"{rate_sum(counter, by, sel, window)} / {rate_sum(metric('requests_finished') + '_total', by, sel, window)}"


def quantile(q: float, histogram: str, by: str = "model_name", sel: str = SEL, window: str = RATE) -> str:
    inner = rate_sum(metric(histogram) + "_bucket", f"le, {by}", sel, window)
    return f"histogram_quantile({q}, {inner})"


def slo_line(kind: str, by: str = BY_CLASS) -> str:
    """The SLO target of each class (one line per class: their targets differ)."""
    return f'max by ({by}) ({metric("slo_target_seconds")}{{{SEL}, kind="{kind}"}})'


# ---- PrometheusRule -------------------------------------------------------------------------

RULE_WINDOWS = ("5m", "30m", "1h", "6h")
BY = "namespace, model_name"


def recording_name(window: str) -> str:
    return f"superinfer:slo_attainment:ratio_rate{window}"


def recording_rules() -> list[dict[str, str]]:
    rules = [{"record": recording_name(w), "expr": attainment(BY, "", w)} for w in RULE_WINDOWS]
    rules += [
        {
            "record": "superinfer:ttft_seconds:p90_5m",
            "expr": quantile(0.9, "time_to_first_token_seconds", BY, "", "5m"),
        },
        {"record": "superinfer:tbt_seconds:p90_5m", "expr": quantile(0.9, "time_between_tokens_seconds", BY, "", "5m")},
    ]
    return rules


def burn_rate_alerts(budget_placeholder: str) -> list[dict[str, object]]:
    """Multi-window burn-rate alerts (fast: 14.4x over 5m and 1h; slow: 6x over 30m and 6h)."""

    def burn(short: str, long: str, factor: float) -> str:
        return (
            f"(1 - {recording_name(short)}) > ({factor} * {budget_placeholder}) and "
            f"(1 - {recording_name(long)}) > ({factor} * {budget_placeholder})"
        )

    out: list[dict[str, object]] = []
    for name, short, long, factor, severity, wait in (
        ("SuperInferSLOBurnRateFast", "5m", "1h", 14.4, "critical", "2m"),
        ("SuperInferSLOBurnRateSlow", "30m", "6h", 6, "warning", "15m"),
    ):
        out.append(
            {
                "alert": name,
                "expr": burn(short, long, factor),
                "for": wait,
                "labels": {"severity": severity},
                "annotations": {
                    "summary": "{{ $labels.model_name }} in {{ $labels.namespace }} burns its SLO error budget "
                    f"{factor}x too fast",
                    "description": "Share of requests meeting TTFT and TBT SLOs is "
                    "{{ $value | humanizePercentage }} below budget; check the SLO dashboard and the "
                    "InferenceService's SLOMet and ScalingReady conditions.",
                },
            }
        )
    out.append(
        {
            "alert": "SuperInferReconcileErrors",
            "expr": "increase(superinfer_operator_reconcile_errors_total[15m]) > 0",
            "for": "15m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "The SuperInfer operator fails to reconcile {{ $labels.namespace }}/"
                "{{ $labels.inferenceservice }}",
                "description": "See the operator logs and kubectl describe sisvc.",
            },
        }
    )
    return out
