"""Names shared by the CRD, the handlers, the rendered children and the chart."""

from __future__ import annotations

GROUP = "serving.superinfer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("sisvc",)
CATEGORIES = ("superinfer",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels on every child object and on the engine pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/inferenceservice"
# The target label PodMonitors copy LABEL_SERVICE into, so PromQL can select one service.
PROMETHEUS_SERVICE_LABEL = "inferenceservice"
MANAGED_BY = "superinfer-operator"
APP_NAME = "superinfer"
COMPONENT_ENGINE = "engine"

# Kopf persistence (progress annotations, diff-base, finalizer) is branded with the group.
FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP
LAST_APPLIED = f"{GROUP}/last-applied"

# Things the engine containers are told.
CONTAINER_NAME = "engine"
DOWNLOAD_CONTAINER_NAME = "download"
PORT_NAME = "http"
METRICS_PORT_NAME = "http"

# GPU resource and node labels (NVIDIA device plugin / GPU feature discovery).
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
ARCH_LABEL = "kubernetes.io/arch"

# The operator container gets the default engine image through this variable.
ENGINE_IMAGE_ENV = "SUPERINFER_ENGINE_IMAGE"
DEFAULT_ENGINE_IMAGE = "ghcr.io/superinfer/superinfer:0.1.0"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select the engine pods of one InferenceService (stable for its lifetime)."""
    return {LABEL_SERVICE: name, LABEL_COMPONENT: COMPONENT_ENGINE}


def child_labels(name: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: name,
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    """The label selector as a string, as the /scale subresource and HPA want it."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
