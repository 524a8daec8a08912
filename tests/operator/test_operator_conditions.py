"""Conditions from observed pods and Deployments (pure functions): what needs the user's or the
admin's action is what Ready reports, before what is still in progress."""

from __future__ import annotations

from superinfer.operator.api import conditions
from superinfer.operator.api.conditions import Observed
from superinfer.operator.controller.reconcile import status_changed
from tests.operator.test_operator_kmock import pod

DEPLOYMENT = {"status": {"readyReplicas": 0}}


def ready(obs: Observed) -> conditions.Cond:
    return conditions.compute(obs, [])[-1]


def test_a_pod_that_cannot_be_scheduled_is_what_ready_says_not_loading():
    pending = pod("a", "x", phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes: Insufficient gpu",
    }])  # fmt: skip
    cond = ready(Observed(desired_replicas=1, deployment=DEPLOYMENT, pods=[pending], service_exists=True))
    assert cond.reason == "InsufficientCapacity" and "Insufficient gpu" in cond.message
    # With nothing to act on, the model's loading still comes first.
    cond = ready(Observed(desired_replicas=1, deployment=DEPLOYMENT, pods=[], service_exists=True))
    assert cond.reason == "Loading"


def test_pods_refused_by_a_quota_show_as_replica_failure():
    refused = {"status": {"readyReplicas": 0, "conditions": [{
        "type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
        "message": 'pods "x-1" is forbidden: exceeded quota: gpus',
    }]}}  # fmt: skip
    cond = ready(Observed(desired_replicas=1, deployment=refused, service_exists=True))
    assert cond.reason == "ReplicaFailure" and "exceeded quota" in cond.message


def test_a_failing_download_init_container_and_a_missing_secret_are_failures():
    download = pod("a", "x", initContainerStatuses=[{
        "name": "download", "ready": False, "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "401 Client Error: gated repo"}},
    }])  # fmt: skip
    failure = conditions.pod_failure(download)
    assert failure is not None and failure.reason == "CrashLoop"
    assert "container download" in failure.message and "gated repo" in failure.message
    secret = pod("b", "x", phase="Pending", containerStatuses=[{
        "name": "engine", "ready": False,
        "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}},
    }])  # fmt: skip
    failure = conditions.pod_failure(secret)
    assert failure is not None and failure.reason == "FailedToLoad" and 'secret "hf" not found' in failure.message
    cond = ready(Observed(desired_replicas=1, deployment=DEPLOYMENT, pods=[secret], service_exists=True))
    assert cond.reason == "FailedToLoad"


def test_a_null_for_what_is_already_absent_writes_no_status():
    """(A failure without an exit code, an image pull, rewrote the status on every reconcile.)"""
    old = {"model": {"state": "FailedToLoad", "lastFailure": {"reason": "FailedToLoad", "message": "m"}}, "url": "u"}
    new = {"model": {"state": "FailedToLoad", "lastFailure": {"reason": "FailedToLoad", "message": "m",
                                                              "exitCode": None}}, "autoscaler": None}  # fmt: skip
    assert not status_changed(old, new)
    assert status_changed(old, {"model": {"state": "Loaded", "lastFailure": None}})
