"""Create-or-patch decisions: what counts as drift, and the merge patch that repairs it."""

from __future__ import annotations

import copy
import json

from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.api.names import LAST_APPLIED
from superinfer.operator.controller.apply import patch_for, with_last_applied
from superinfer.operator.controller.render import Context, render_deployment


def deployment(resources: dict[str, str]) -> dict:
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "resources": {"gpus": 0, **resources}}
    )
    return with_last_applied(render_deployment(Context("t", "ns"), spec))


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def as_stored(desired: dict) -> dict:
    """What the API server hands back: defaults added, quantities in canonical form."""
    stored = copy.deepcopy(desired)
    stored["metadata"]["uid"] = "u1"
    stored["spec"]["progressDeadlineSeconds"] = 600
    c = container(stored)
    c["terminationMessagePath"] = "/dev/termination-log"
    c["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
    c["resources"]["requests"]["cpu"] = {"0.5": "500m"}.get(c["resources"]["requests"]["cpu"], "7")
    c["resources"]["requests"]["memory"] = c["resources"]["limits"]["memory"] = "1Gi"
    return stored


def test_server_defaults_and_canonical_quantities_are_not_drift():
    desired = deployment({"cpu": "0.5", "memory": "1024Mi"})
    assert patch_for(as_stored(desired), desired) is None


def test_empty_values_the_api_server_leaves_out_are_not_drift():
    """(An env var with an empty value came back without it: the Deployment was patched, and an
    Event posted, on every reconcile.)"""
    desired = deployment({"cpu": "0.5", "memory": "1Gi"})
    container(desired)["env"].append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})
    stored = as_stored(desired)
    del container(stored)["env"][-1]["value"]
    assert patch_for(stored, desired) is None
    container(stored)["env"][-1]["value"] = "0"  # a value we do not want is still drift
    assert patch_for(stored, desired) is not None


def test_a_different_quantity_is_drift():
    desired = deployment({"cpu": "2", "memory": "1Gi"})  # stored as cpu "7" by as_stored
    patch = patch_for(as_stored(desired), desired)
    assert patch is not None and container(patch)["resources"]["requests"]["cpu"] == "2"


def test_hand_edits_are_patched_back_and_dropped_keys_are_nulled():
    desired = deployment({"cpu": "0.5", "memory": "1Gi"})
    current = as_stored(desired)
    container(current)["image"] = "evil:latest"
    assert container(patch_for(current, desired))["image"] == container(desired)["image"]
    # A key we set last time and no longer render goes away explicitly (JSON merge patch null).
    last = json.loads(current["metadata"]["annotations"][LAST_APPLIED])
    last["spec"]["minReadySeconds"] = 10
    current["metadata"]["annotations"][LAST_APPLIED] = json.dumps(last)
    current["spec"]["minReadySeconds"] = 10
    patch = patch_for(current, desired)
    assert patch is not None and patch["spec"]["minReadySeconds"] is None
