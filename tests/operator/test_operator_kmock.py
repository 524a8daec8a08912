"""The operator under Kopf against the kmock API emulator (no cluster, no controllers, no GC).

kmock runs no controllers, so these tests play the Deployment controller and the kubelet by
patching child status and creating pod objects themselves.
"""

from __future__ import annotations

import kmock as km

from superinfer.operator.api import names
from superinfer.operator.controller.kube_client import DEPLOYMENTS, PODS, SERVICES
from superinfer.operator.controller.reconcile import ISVC
from tests.operator.conftest import eventually

DEP, SVC, PDB, POD = "apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets", "v1/pods"
TINY = {"model": {"uri": "preset://tiny"}, "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}}


def pod(name: str, owner: str, *, ready: bool = False, phase: str = "Running", **status) -> dict:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    conditions += status.pop("conditions", [])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": names.child_labels(owner)},
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
        "status": {"phase": phase, "conditions": conditions, **status},
    }


async def test_create_makes_owned_children_and_status(running):
    await running.create_isvc("tiny", TINY)
    owner = running.isvc("tiny")
    for res in (DEP, SVC, PDB):
        child = await eventually(lambda res=res: running.obj(res, "tiny"))
        ref = child["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceService", "tiny", owner["metadata"]["uid"], True,
        )  # fmt: skip
        assert child["metadata"]["labels"][names.LABEL_SERVICE] == "tiny"
    status = await eventually(
        lambda: running.isvc("tiny").get("status", {}).get("conditions") and running.isvc("tiny")["status"]
    )
    assert status["observedGeneration"] == 1
    assert status["selector"] == names.selector_string("tiny")
    assert running.condition("tiny", "Validated")["status"] == "True"
    assert running.condition("tiny", "Ready")["status"] == "False"
    # No finalizer (owner references let the cluster delete children); annotations carry our brand.
    branded = await eventually(
        lambda: any(k.startswith(names.GROUP + "/") for k in running.isvc("tiny")["metadata"].get("annotations", {}))
    )
    assert branded and not running.isvc("tiny")["metadata"].get("finalizers")
    # No PodMonitor without the monitoring API.
    assert running.obj("monitoring.coreos.com/v1/podmonitors", "tiny") is None


async def test_ready_when_pods_and_deployment_are_ready(running):
    await running.create_isvc("tiny", TINY)
    await eventually(lambda: running.obj(DEP, "tiny"))
    await running.api.create(PODS, "default", pod("tiny-abc", "tiny", ready=True))
    await running.api.patch(DEPLOYMENTS, "default", "tiny",
                            {"status": {"replicas": 1, "readyReplicas": 1}}, sub="status")  # fmt: skip
    ready = await running.wait_condition("tiny", "Ready", status="True")
    assert ready["reason"] == "Ready"
    status = running.isvc("tiny")["status"]
    assert (status["readyReplicas"], status["replicas"]) == (1, 1)
    assert status["model"]["state"] == "Loaded"
    assert running.condition("tiny", "ServiceReady")["message"].startswith("serving at http://tiny.default.svc")


async def test_spec_change_patches_children(running):
    await running.create_isvc("tiny", TINY)
    dep = await eventually(lambda: running.obj(DEP, "tiny"))
    assert "2000" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    await running.api.patch(ISVC, "default", "tiny", {"spec": {"slo": {"ttftMs": 2000}, "replicas": 3}})

    def patched():
        d = running.obj(DEP, "tiny")
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        return d["spec"]["replicas"] == 3 and args[args.index("--ttft-slo-ms") + 1] == "2000"

    await eventually(patched)
    await eventually(lambda: running.isvc("tiny")["status"]["observedGeneration"] == 2)


async def test_deleted_child_is_recreated_and_drift_repaired(running):
    await running.create_isvc("tiny", TINY)
    await eventually(lambda: running.obj(SVC, "tiny") and running.obj(PDB, "tiny"))
    await running.api.delete(SERVICES, "default", "tiny")
    assert running.obj(SVC, "tiny") is None
    await eventually(lambda: running.obj(SVC, "tiny"))
    # Someone edits the Deployment by hand: the operator puts its image back.
    image = running.obj(DEP, "tiny")["spec"]["template"]["spec"]["containers"][0]["image"]
    hacked = {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "evil:latest"}]}}}}
    await running.api.patch(DEPLOYMENTS, "default", "tiny", hacked)
    await eventually(lambda: running.obj(DEP, "tiny")["spec"]["template"]["spec"]["containers"][0]["image"] == image)
    assert running.obj(DEP, "tiny")["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--model"


async def test_conflicts_are_retried(running):
    conflicts = running.kmock[km.method.POST, km.resource(DEP)][:1] << 409
    await running.create_isvc("tiny", TINY)
    dep = await eventually(lambda: running.obj(DEP, "tiny"))
    assert len(list(conflicts)) == 1  # the API answered 409 once; the operator carried on
    await eventually(lambda: running.condition("tiny", "WorkloadReady"))
    assert dep["spec"]["replicas"] == 1


async def test_invalid_spec_sets_validated_false_and_creates_nothing(running):
    bad = {**TINY, "model": {"uri": "ftp://weights"}, "slo": {"ttftMs": 0}}
    await running.create_isvc("broken", bad)
    cond = await eventually(lambda: running.condition("broken", "Validated"))
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    assert "model.uri must start with one of hf://" in cond["message"]
    assert "spec.slo.ttftMs" in cond["message"]
    ready = running.condition("broken", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert running.condition("broken", "WorkloadReady") is None  # does not apply: removed, not False
    assert running.isvc("broken")["status"]["selector"]
    assert running.obj(DEP, "broken") is None
    # A computed check (offload must fit in memory) also lands in Validated.
    await running.create_isvc("small", {**TINY, "kvCache": {"cpuOffload": {"size": "64Gi"}}})
    cond = await eventually(lambda: running.condition("small", "Validated"))
    assert cond["status"] == "False" and "raise resources.memory to at least 66Gi" in cond["message"]


async def test_crash_loop_and_insufficient_capacity(running):
    await running.create_isvc("tiny", {**TINY, "replicas": 2})
    await eventually(lambda: running.obj(DEP, "tiny"))
    crashing = pod("tiny-a", "tiny", containerStatuses=[{
        "name": "engine", "ready": False, "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": "model not found"}},
    }])  # fmt: skip
    pending = pod("tiny-b", "tiny", phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }])  # fmt: skip
    await running.api.create(PODS, "default", crashing)
    await running.api.create(PODS, "default", pending)
    model = await eventually(
        lambda: (c := running.condition("tiny", "ModelReady")) and c["reason"] == "CrashLoop" and c
    )
    assert "exit code 3" in model["message"] and "model not found" in model["message"]
    failure = running.isvc("tiny")["status"]["model"]["lastFailure"]
    assert (failure["reason"], failure["exitCode"]) == ("CrashLoop", 3)
    work = await eventually(
        lambda: (c := running.condition("tiny", "WorkloadReady")) and c["reason"] == "InsufficientCapacity" and c
    )
    assert "Insufficient nvidia.com/gpu" in work["message"]


async def test_delete_is_never_blocked_and_forgets_the_service(running):
    """Even with the autoscaler on (which a Kopf timer would hold with a finalizer) and no operator
    left to answer (helm uninstall), a delete goes through; the cluster's garbage collector deletes
    the children through their owner references (kmock has no collector, so they stay here)."""
    await running.create_isvc("tiny", {**TINY, "autoscaling": {"enabled": True, "initialDelaySeconds": 600}})
    await eventually(lambda: ("default", "tiny") in running.state.scalers)
    assert not running.isvc("tiny")["metadata"].get("finalizers")
    await running.api.delete(ISVC, "default", "tiny")
    await eventually(lambda: running.isvc("tiny") is None)
    await eventually(lambda: ("default", "tiny") not in running.state.scalers)
    assert ("default", "tiny") not in running.state.autoscaled
    assert running.obj(DEP, "tiny")["metadata"]["ownerReferences"][0]["name"] == "tiny"


async def test_scale_subresource_drives_the_deployment(running):
    spec = {**TINY, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "initialDelaySeconds": 600}}
    await running.create_isvc("auto", spec)
    await eventually(lambda: running.obj(DEP, "auto"))
    assert running.obj(DEP, "auto")["spec"]["replicas"] == 1  # minReplicas when spec.replicas is unset
    await running.api.patch(ISVC, "default", "auto", {"spec": {"replicas": 3}}, sub="scale")
    await eventually(lambda: running.obj(DEP, "auto")["spec"]["replicas"] == 3)
    # The autoscaler is on: it holds during the initial delay and says so.
    decision = await eventually(lambda: running.isvc("auto")["status"]["autoscaler"]["lastDecision"])
    assert decision["action"] == "Hold" and decision["reason"] == "InitialDelay"
    assert running.condition("auto", "ScalingReady")["status"] == "True"
    assert running.condition("auto", "MetricsAvailable") is not None


async def test_status_that_no_longer_applies_is_removed(running):
    spec = {**TINY, "autoscaling": {"enabled": True, "initialDelaySeconds": 600}}
    await running.create_isvc("auto", spec)
    await eventually(lambda: running.isvc("auto")["status"]["autoscaler"]["lastDecision"])
    assert running.condition("auto", "ScalingReady") is not None
    await running.api.patch(ISVC, "default", "auto", {"spec": {"autoscaling": {"enabled": False}}})
    await eventually(lambda: running.isvc("auto")["status"]["observedGeneration"] == 2)
    await eventually(lambda: "autoscaler" not in running.isvc("auto")["status"])
    assert running.condition("auto", "ScalingReady") is None and running.condition("auto", "MetricsAvailable") is None
    assert running.isvc("auto")["status"]["model"]["state"] == "Loading"
    # A spec that turns invalid keeps only what describes it (conditions, selector, url).
    await running.api.patch(ISVC, "default", "auto", {"spec": {"model": {"uri": "ftp://nope"}}})
    await running.wait_condition("auto", "Validated", status="False")
    await eventually(lambda: "model" not in running.isvc("auto")["status"])
    assert "desiredReplicas" not in running.isvc("auto")["status"]
