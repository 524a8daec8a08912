"""What a shared production cluster does to the operator, against the kmock API emulator: concurrent
writers (409), children the API server rejects (422), failing /scale writes, operator restarts,
other autoscalers writing replicas, and the server-side selectors of its watches."""

from __future__ import annotations

import time
from collections import Counter

import kmock as km
import pytest

from superinfer.operator.api import names
from superinfer.operator.controller.kube_client import PODMONITORS, PODS, SERVICES, ApiError
from superinfer.operator.controller.reconcile import ISVC
from superinfer.operator.controller.timestamps import now_iso
from tests.operator.conftest import ISVC_RES, eventually, isvc
from tests.operator.test_operator_kmock import pod

DEP, SVC = "apps/v1/deployments", "v1/services"
TINY = {"model": {"uri": "preset://tiny"}, "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}}
AUTO = {**TINY, "autoscaling": {"enabled": True, "maxReplicas": 4, "intervalSeconds": 1, "initialDelaySeconds": 600}}


def autoscaler(running, name: str) -> dict:
    return (running.isvc(name).get("status") or {}).get("autoscaler") or {}


async def test_a_stale_write_gets_409_from_the_emulator_as_from_an_api_server(running):
    await running.create_isvc("tiny", TINY)
    stale = (await eventually(lambda: running.isvc("tiny")))["metadata"]["resourceVersion"]
    await running.api.patch(ISVC, "default", "tiny", {"spec": {"replicas": 2}})
    with pytest.raises(ApiError) as exc:
        await running.api.patch(
            ISVC, "default", "tiny", {"metadata": {"resourceVersion": stale}, "status": {"url": "x"}}, sub="status"
        )
    assert exc.value.status == 409


async def test_a_status_write_that_loses_a_race_is_recomputed_and_retried(running):
    conflict = running.kmock.refuse("PATCH", names.PLURAL, 409, "the object has been modified", subresource="status")
    await running.create_isvc("tiny", TINY)
    await running.wait_condition("tiny", "Validated", status="True")
    assert conflict.times == 0  # the first write was refused; a fresh read and write followed
    assert running.isvc("tiny")["status"]["observedGeneration"] == 1


async def test_a_child_the_api_server_rejects_gives_a_condition_that_says_what_to_fix(running):
    message = 'Deployment.apps "bad" is invalid: spec.template.spec.hostPID: Forbidden: not allowed here'
    # Refused without being stored (kmock's own error reactions store the write anyway, and a stored
    # Deployment could be reported on before the refusal, which made this test flaky).
    running.kmock.refuse("POST", "deployments", 422, message, times=1000)
    await running.create_isvc("bad", {**TINY, "template": {"hostPID": True}})
    cond = await running.wait_condition("bad", "WorkloadReady", reason="ChildRejected")
    assert message in cond["message"] and "spec.template" in cond["message"]
    ready = running.condition("bad", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ChildRejected")


async def test_a_failed_scale_write_is_not_recorded_as_applied(running):
    refused = running.kmock.refuse("PATCH", names.PLURAL, 403, "scale is forbidden here", subresource="scale")
    await running.create_isvc("auto", {**AUTO, "replicas": 6})  # over maxReplicas: the autoscaler scales down
    first = await eventually(lambda: autoscaler(running, "auto")["history"][0])
    assert (first["action"], first["toReplicas"], first["applied"]) == ("ScaleDown", 4, False)
    assert "scale is forbidden here" in first["message"]
    assert refused.times == 0
    # No cooldown was started by the write that did not happen: the next evaluation writes it.
    await eventually(lambda: running.isvc("auto")["spec"]["replicas"] == 4)
    done = await eventually(lambda: [h for h in autoscaler(running, "auto")["history"] if h["applied"]])
    assert (done[0]["fromReplicas"], done[0]["toReplicas"]) == (6, 4)
    assert autoscaler(running, "auto")["appliedReplicas"] == 4


async def test_after_a_restart_the_autoscaler_continues_from_its_status(running):
    now = time.time()
    earlier = {"time": now_iso(now - 30), "action": "ScaleUp", "reason": "SLODistress", "message": "burst",
               "fromReplicas": 1, "toReplicas": 2, "applied": True}  # fmt: skip
    body = isvc("auto", {**AUTO, "replicas": 2})
    body["status"] = {"autoscaler": {"history": [earlier], "lastDecision": earlier, "lastScaleTime": now_iso(now - 30),
                                     "startedAt": now_iso(now - 3600), "appliedReplicas": 2,
                                     "latencySamples": [{"batch": 8, "tbtSeconds": 0.03}]}}  # fmt: skip
    await running.api.create(ISVC, "default", body)  # what a previous operator process left behind
    await eventually(lambda: autoscaler(running, "auto")["lastDecision"]["reason"] != "SLODistress")
    saved = autoscaler(running, "auto")
    assert saved["history"][0] == earlier  # not overwritten by the first tick
    assert saved["lastScaleTime"] == now_iso(now - 30) and saved["startedAt"] == now_iso(now - 3600)
    assert saved["lastDecision"]["reason"] != "InitialDelay"  # warm-up counted from when it first started
    scaler = running.state.scalers["default", "auto"]
    assert scaler.memory.last_scale_at == pytest.approx(now - 30, abs=1)  # the cooldown goes on
    assert list(scaler.model.points) == [(8.0, 0.03)]


async def test_kubectl_scale_beside_an_active_autoscaler_is_reported(running):
    await running.create_isvc("auto", AUTO)
    await eventually(lambda: autoscaler(running, "auto").get("appliedReplicas") == 1)
    await running.api.patch(ISVC, "default", "auto", {"spec": {"replicas": 3}}, sub="scale")
    cond = await running.wait_condition("auto", "ScalingReady", reason="ExternalWriter")
    assert cond["status"] == "False" and "from 1 to 3 by another writer" in cond["message"]
    await eventually(lambda: running.obj(DEP, "auto")["spec"]["replicas"] == 3)  # the other writer wins


async def test_child_watches_select_our_objects_on_the_server(running):
    await running.create_isvc("tiny", TINY)
    await eventually(lambda: running.obj(DEP, "tiny"))
    watches = list(running.kmock[km.action.WATCH, km.resource(DEP)])
    assert watches
    selector = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.LABEL_SERVICE}"
    assert all(w.params.get("labelSelector") == selector for w in watches)
    isvc_watches = list(running.kmock[km.action.WATCH, km.resource(ISVC_RES)])
    assert isvc_watches and not any(w.params.get("labelSelector") for w in isvc_watches)


async def test_prometheus_is_the_admins_choice_not_the_tenants(running):
    """A tenant can ask for Prometheus metrics but not name a server: with none configured for the
    operator, the condition says where the admin sets it."""
    await running.create_isvc("prom", {**AUTO, "autoscaling": {**AUTO["autoscaling"], "metricsSource": "Prometheus"}})
    cond = await running.wait_condition("prom", "MetricsAvailable", status="False")
    assert "operator.prometheus.url" in cond["message"]
    await running.create_isvc("url", {**AUTO, "autoscaling": {**AUTO["autoscaling"], "prometheusUrl": "http://x"}})
    invalid = await running.wait_condition("url", "Validated", status="False")
    assert "prometheusUrl" in invalid["message"]


async def test_reconciling_reads_children_from_the_watch_not_the_api(running):
    await running.create_isvc("tiny", TINY)
    await running.wait_condition("tiny", "Validated", status="True")
    await eventually(lambda: running.obj(DEP, "tiny"))
    for n in range(3):  # pod events, each a reconciliation
        await running.api.create(PODS, "default", pod(f"tiny-{n}", "tiny", ready=True))
    await eventually(lambda: "in 3 pod(s)" in running.condition("tiny", "ModelReady")["message"])
    by_operator = [r for r in running.kmock if "kopf" not in r.headers.get("User-Agent", "")]
    children = {"deployments", "services", "poddisruptionbudgets", "podmonitors", "inferencepools", "pods"}
    of_children = [r for r in by_operator if r.resource is not None and r.resource.plural in children]
    creates = Counter((r.resource.plural, r.data["metadata"]["name"]) for r in of_children if r.method == "POST")
    # A reconciliation that ran before the watch delivered its own create gets a 409 and then
    # reads that one object (apply's retry); any other GET, or a LIST of pods, is a regression.
    conflicted = {key for key, n in creates.items() if n > 1}
    reads = [(r.method, r.resource.plural, r.name) for r in of_children
             if r.method == "GET" and (r.resource.plural, r.name) not in conflicted]  # fmt: skip
    assert reads == [], reads  # Kopf's indexes answer


POOLS = "inference.networking.k8s.io/v1/inferencepools"


async def test_routing_makes_and_removes_an_inference_pool(running):
    running.kmock.resources[POOLS] = running.kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    )  # fmt: skip
    routed = {**TINY, "routing": {"inferencePool": {"enabled": True, "endpointPicker": {"name": "picker"}}}}
    await running.create_isvc("chat", routed)
    pool = await eventually(lambda: running.obj(POOLS, "chat"))
    assert pool["spec"]["endpointPickerRef"]["name"] == "picker"
    assert pool["metadata"]["ownerReferences"][0]["name"] == "chat"
    cond = await running.wait_condition("chat", "RoutingReady", status="True")
    assert "HTTPRoute" in cond["message"]
    await running.api.patch(ISVC, "default", "chat", {"spec": {"routing": {"inferencePool": {"enabled": False}}}})
    await eventually(lambda: running.obj(POOLS, "chat") is None)
    await eventually(lambda: running.condition("chat", "RoutingReady") is None)


async def test_routing_without_the_inference_extension_says_what_to_install(running):
    await running.create_isvc("chat", {**TINY, "routing": {"inferencePool": {"enabled": True}}})
    cond = await running.wait_condition("chat", "RoutingReady", status="False")
    assert cond["reason"] == "InferencePoolAPIMissing"
    assert running.condition("chat", "Ready")["reason"] != "InferencePoolAPIMissing"  # serving does not need it


async def test_an_object_of_the_same_name_that_another_owns_is_never_taken_over(running):
    """A Service the user made before (no owner) keeps its selector and gains no owner reference
    (which would have had the garbage collector delete it with the InferenceService)."""
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": "default"},
              "spec": {"selector": {"app": "users-own"}, "ports": [{"port": 80}]}}  # fmt: skip
    await running.api.create(SERVICES, "default", theirs)
    await running.create_isvc("x", TINY)
    cond = await running.wait_condition("x", "WorkloadReady", reason="ChildRejected")
    assert "already exists and this InferenceService does not own it" in cond["message"]
    service = running.obj(SVC, "x")
    assert service["spec"]["selector"] == {"app": "users-own"} and not service["metadata"].get("ownerReferences")


async def test_a_child_forbidden_by_a_policy_or_quota_gives_a_condition_not_endless_retries(running):
    message = 'deployments.apps "q" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=1'
    running.kmock.refuse("POST", "deployments", 403, message, times=1000)
    await running.create_isvc("q", TINY)
    cond = await running.wait_condition("q", "WorkloadReady", reason="ChildRejected")
    assert message in cond["message"] and "admission policy" in cond["message"]
    assert running.condition("q", "Ready")["reason"] == "ChildRejected"


async def test_autoscaling_turned_off_forgets_its_scaler(running):
    await running.create_isvc("auto", AUTO)
    await eventually(lambda: ("default", "auto") in running.state.scalers)
    await running.api.patch(ISVC, "default", "auto", {"spec": {"autoscaling": {"enabled": False}}})
    await eventually(lambda: ("default", "auto") not in running.state.scalers)
    assert ("default", "auto") not in running.state.autoscaled


async def test_pod_monitors_left_from_a_run_with_them_go_under_pod_monitors_never(running):
    """The operator under test runs with --pod-monitors=never; a PodMonitor an earlier run made
    for the service (owned by it, with its labels) is deleted rather than left to the garbage
    collector."""
    monitors = "monitoring.coreos.com/v1/podmonitors"
    running.kmock.resources[monitors] = running.kmock.ResourceInfo(
        kind="PodMonitor", singular="podmonitor", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    )  # fmt: skip
    await running.create_isvc("tiny", TINY)
    owner = await eventually(lambda: running.isvc("tiny"))
    ref = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "tiny", "uid": owner["metadata"]["uid"],
           "controller": True}  # fmt: skip
    old = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
           "metadata": {"name": "tiny", "namespace": "default", "labels": names.child_labels("tiny"),
                        "ownerReferences": [ref]}, "spec": {}}  # fmt: skip
    await running.api.create(PODMONITORS, "default", old)
    await eventually(lambda: running.obj(monitors, "tiny") is not None)
    await eventually(lambda: running.obj(monitors, "tiny") is None)
