"""The InferenceService CustomResourceDefinition, built from the pydantic models."""

from __future__ import annotations

from typing import Any

from superinfer.operator.api import names
from superinfer.operator.api.inference_service import InferenceServiceSpec, InferenceServiceStatus
from superinfer.operator.api.openapi_schema import openapi_schema

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "TTFT", "type": "number", "jsonPath": ".status.slo.ttftMs", "description": "p90 TTFT of all classes, ms"},
    {"name": "TBT", "type": "number", "jsonPath": ".status.slo.tbtMs", "description": "p90 TBT of all classes, ms"},
    {"name": "Attainment", "type": "number", "jsonPath": ".status.slo.attainment"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
]


def version_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "An LLM served by SuperInfer engines under TTFT/TBT SLOs.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(InferenceServiceSpec),
            "status": openapi_schema(InferenceServiceStatus),
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": names.CRD_NAME,
            "labels": {names.LABEL_NAME: names.APP_NAME},
        },
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": names.KIND + "List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
                "categories": list(names.CATEGORIES),
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": version_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }
