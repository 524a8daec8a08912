"""Entrypoint: `python -m superinfer.operator` runs the Kopf operator with a liveness endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf

from superinfer.operator.api import names
from superinfer.operator.autoscaling.prometheus_window import PrometheusSource
from superinfer.operator.controller.handlers import build_registry
from superinfer.operator.controller.state import Config

SETTINGS = kopf.OperatorSettings()
PROMETHEUS_TOKEN_ENV = "PROMETHEUS_BEARER_TOKEN"


async def login_from_environment() -> kopf.ConnectionInfo:
    """In-cluster service account, else kubeconfig (through the kubernetes client, as Kopf does)."""
    info = kopf.login_via_client(logger=logging.getLogger("superinfer.operator.login"), settings=SETTINGS)
    if info is None:
        raise kopf.LoginError("no in-cluster service account and no kubeconfig found")
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m superinfer.operator", description=__doc__)
    p.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable); "
                   "default: all namespaces")  # fmt: skip
    p.add_argument("--engine-image", default=os.environ.get(names.ENGINE_IMAGE_ENV, names.DEFAULT_ENGINE_IMAGE))
    p.add_argument("--pod-monitors", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--metrics-port", type=int, default=8080, help="operator metrics; 0 disables")
    p.add_argument("--liveness-port", type=int, default=8081, help="Kopf liveness probe (/healthz); 0 disables")
    p.add_argument("--peering", default="", help="Kopf peering name (needs the peering CRDs); default standalone")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--prometheus-url",
        default="",
        help="Prometheus for InferenceServices with "
        "autoscaling.metricsSource: Prometheus (the bearer token comes from $PROMETHEUS_BEARER_TOKEN)",
    )
    p.add_argument("--prometheus-ca-file", default="", help="CA bundle that signed Prometheus's TLS certificate")
    p.add_argument("--prometheus-insecure-skip-verify", action="store_true")  # fmt: skip
    return p.parse_args(argv)


def prometheus_source(args: argparse.Namespace) -> PrometheusSource | None:
    if not args.prometheus_url:
        return None
    return PrometheusSource(
        url=args.prometheus_url,
        bearer_token=os.environ.get(PROMETHEUS_TOKEN_ENV, ""),
        ca_file=args.prometheus_ca_file,
        insecure_skip_verify=args.prometheus_insecure_skip_verify,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config(
        login=login_from_environment,
        default_image=args.engine_image,
        podmonitor=args.pod_monitors,
        prometheus=prometheus_source(args),
    )
    registry, state = build_registry(config)
    if args.metrics_port:
        state.metrics.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=not args.peering,
            peering_name=args.peering or None,
            liveness_endpoint=liveness,
        )
    )
