"""The InferenceService API: generated CRD in sync and valid, examples valid, invalid specs rejected
with clear messages by all three validators (pydantic, the structural schema, and CEL)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from superinfer.operator import generate
from superinfer.operator.api import conditions, names, quantity
from superinfer.operator.api.crd import build_crd
from superinfer.operator.api.inference_service import InferenceService, InferenceServiceSpec
from superinfer.operator.api.openapi_schema import structural_problems
from superinfer.operator.api.validation import validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_generated_files_are_in_sync():
    assert generate.stale(ROOT) == [], "run: python -m superinfer.operator.generate"


def test_crd_is_valid_structural_and_complete():
    crd = yaml.safe_load((ROOT / generate.CRD_FILE).read_text())
    kubernetes_validate.validate(crd, "1.33", strict=True)
    assert structural_problems(crd_schema()) == []
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["sisvc"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "Replicas", "TTFT", "TBT", "Attainment", "Age", "URL"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # gt=0 became minimum + exclusiveMinimum: true (a number there is rejected by the API server).
    assert spec["slo"]["properties"]["ttftMs"]["minimum"] == 0
    assert spec["slo"]["properties"]["ttftMs"]["exclusiveMinimum"] is True
    assert spec["resources"]["properties"]["memory"]["x-kubernetes-int-or-string"] is True
    assert spec["template"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["model"]["properties"]["name"]["nullable"] is True


def test_structural_checker_catches_what_the_api_server_rejects():
    bad = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                            "b": {"type": "number", "exclusiveMinimum": 0}}}  # fmt: skip
    problems = structural_problems(bad)
    assert any(".a: type is required" in p for p in problems)
    assert any("exclusiveMinimum must be a boolean" in p for p in problems)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path):
    doc = yaml.safe_load(path.read_text())
    jsonschema.validate(doc, crd_schema(), cls=jsonschema.Draft4Validator)
    InferenceService.model_validate(doc)
    outcome = validate(doc["metadata"]["name"], doc["spec"])
    assert outcome.ok, outcome.problems


def test_two_examples_cover_cpu_and_gh200():
    specs = {p.name: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES}
    assert any(s["model"]["uri"] == "preset://tiny" and s["resources"]["gpus"] == 0 for s in specs.values())
    assert any("GH200" in s.get("scheduling", {}).get("gpuProduct", "") for s in specs.values())


BASE = {"model": {"uri": "preset://tiny"}}
INVALID = [
    ({"model": {"uri": "ftp://x"}}, "model.uri must start with one of hf://"),
    ({"model": {"uri": "pvc://claim-only"}}, "pvc://<claim>/<path/to/model>"),
    ({"slo": {"ttftMs": 0}}, "spec.slo.ttftMs: Input should be greater than 0"),
    ({"slo": {"attainmentTarget": 1.5}}, "spec.slo.attainmentTarget: Input should be less than or equal to 1"),
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas must not exceed"),
    ({"scheduling": {"gpuProduct": "NVIDIA-GH200-480GB", "arch": "amd64"}}, "GH200 nodes are arm64"),
    ({"resources": {"memory": "lots"}}, "not a Kubernetes quantity"),
    ({"engine": {"policy": "lifo"}}, "spec.engine.policy"),
    ({"engine": {"args": ["--port=9000"]}}, "engine.args must not set --port"),
    ({"engine": {"args": ["--warp-speed"]}}, "`superinfer serve` does not accept"),
    ({"kvCache": {"cpuOffload": {"size": "64Gi"}}, "resources": {"memory": "32Gi"}}, "at least 66Gi"),
    ({"resources": {"gpus": 0}, "scheduling": {"gpuProduct": "NVIDIA-H100"}}, "request at least one GPU"),
    ({"bogus": 1}, "spec.bogus: Extra inputs are not permitted"),
    ({"slo": {"classes": {"Gold": {"ttftMs": 1, "tbtMs": 1}}}}, "slo.classes names must be lowercase identifiers"),
    ({"slo": {"classes": {"default": {"ttftMs": 1, "tbtMs": 1}}}}, "slo.classes must not define 'default'"),
    ({"slo": {"classes": {"gold": {"ttftMs": 0, "tbtMs": 1}}}}, "classes.gold.ttftMs: Input should be greater"),
    ({"slo": {"classes": {"gold": {"ttftMs": 1}}}}, "spec.slo.classes.gold.tbtMs: Field required"),
    ({"slo": {"classes": {"gold": {"ttftMs": 1, "tbtMs": 1, "prio": 1}}}}, "spec.slo.classes.gold.prio: Extra inputs"),
    (
        {"slo": {"classes": {"gold": {"ttftMs": 1, "tbtMs": 1}}}, "engine": {"args": ["--slo-classes={}"]}},
        "must not set --slo-classes when slo.classes is set",
    ),
    ({"model": {"uri": "s3://bucket/llama"}}, "model.uri must start with one of hf://, pvc://, preset://"),
    ({"resources": {"memory": "-1Gi"}}, "must not be negative"),
    ({"engine": {"args": ["--api-key=sk-123"]}}, "set engine.apiKeySecretRef"),
    ({"replicas": -1}, "spec.replicas: Input should be greater than or equal to 0"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "cannot both be 0"),
    ({"scheduling": {"gpuProduct": "NVIDIA H100 80GB HBM3!"}, "resources": {"gpus": 1}}, "is not a label value"),
    ({"monitoring": {"labels": {"release": "prom stack"}}}, "which is not a valid label"),
]


def merged(patch: dict) -> dict:
    out = copy.deepcopy(BASE)
    out.update(patch)
    return out


@pytest.mark.parametrize(("patch", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_specs_get_actionable_messages(patch, message):
    outcome = validate("svc", merged(patch))
    assert not outcome.ok
    assert message in outcome.message


def test_a_name_too_long_for_the_endpoint_pickers_default_service_asks_for_its_name():
    name = "a" * 60
    spec = merged({"routing": {"inferencePool": {"enabled": True}}})
    assert "endpointPicker.name is needed" in validate(name, spec).message
    spec["routing"]["inferencePool"]["endpointPicker"] = {"name": "picker"}
    assert validate(name, spec).ok


def test_bad_names_are_rejected():
    assert "DNS-1035" in validate("9lives", BASE).message
    assert "DNS-1035" in validate("x" * 64, BASE).message


def test_schema_rejects_what_pydantic_rejects_without_cel():
    validator = jsonschema.Draft4Validator(crd_schema()["properties"]["spec"])
    for patch in ({"slo": {"ttftMs": 0}}, {"slo": {"attainmentTarget": 1.5}}, {"engine": {"policy": "lifo"}},
                  {"resources": {"memory": "lots"}}, {"autoscaling": {"minReplicas": 0}}):  # fmt: skip
        assert list(validator.iter_errors(merged(patch))), patch


def _cel_rules(schema: dict, path: str = "spec"):
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in schema.get("properties", {}).items():
        yield from _cel_rules(sub, f"{path}.{name}")


def _at(obj: dict, path: str):
    for part in path.split(".")[1:]:
        obj = obj.get(part, {}) if isinstance(obj, dict) else {}
    return obj


@pytest.mark.parametrize(("patch", "message"), [*INVALID[:2], *INVALID[4:6], ({}, None)])
def test_cel_rules_agree_with_python(patch, message):
    """Each CEL rule, evaluated on the defaulted object as the API server would, fails exactly
    where the Python twin does (and with the same message)."""
    raw = merged(patch)
    try:
        spec_dump = InferenceServiceSpec.model_validate(raw).dump()
    except ValueError:
        # Python rejects it; build the defaulted object without the rules to feed CEL.
        spec_dump = _defaulted_without_rules(raw)
    env = celpy.Environment()
    failed = []
    for path, rule in _cel_rules(crd_schema()["properties"]["spec"]):
        target = _at(spec_dump, path)
        if not target:
            continue
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(target)}):
            failed.append(rule["message"])
    if message is None:
        assert failed == []
    else:
        assert any(message in m for m in failed), failed


def _defaulted_without_rules(raw: dict) -> dict:
    """Apply the schema defaults (as the API server does) to a spec that fails validation."""
    defaults = InferenceServiceSpec.model_validate(BASE).dump()

    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        return over

    return merge(defaults, raw)


def test_cel_rules_exist_for_every_python_rule():
    cel = {rule["message"] for _, rule in _cel_rules(crd_schema()["properties"]["spec"])}
    assert len(cel) >= 5
    assert build_crd()["spec"]["names"]["kind"] == names.KIND


# ---- SLO classes --------------------------------------------------------------------------------

GOOD_CLASSES = {"interactive": {"ttftMs": 500, "tbtMs": 100, "priority": 1}, "batch_2": {"ttftMs": 30000, "tbtMs": 1e3}}


def test_slo_classes_are_accepted_by_every_validator():
    raw = merged({"slo": {"classes": GOOD_CLASSES}})
    jsonschema.validate(raw, crd_schema()["properties"]["spec"], cls=jsonschema.Draft4Validator)
    outcome = validate("svc", raw)
    assert outcome.ok, outcome.problems
    assert outcome.spec.slo.classes["batch_2"].priority == 0
    assert outcome.spec.dump()["slo"]["classes"]["interactive"] == {"ttftMs": 500, "tbtMs": 100, "priority": 1}
    assert validate("svc", merged({"slo": {"classes": {}}})).ok  # no named classes: every request is `default`


@pytest.mark.parametrize(
    "classes",
    [{"gold": {"ttftMs": 0, "tbtMs": 1}}, {"gold": {"ttftMs": 1}}, {"gold": {"ttftMs": 1, "tbtMs": 1, "priority": "x"}},
     {"gold": "fast"}, {f"c{i}": {"ttftMs": 1, "tbtMs": 1} for i in range(17)}],
)  # fmt: skip
def test_schema_rejects_bad_class_maps(classes):
    validator = jsonschema.Draft4Validator(crd_schema()["properties"]["spec"])
    assert list(validator.iter_errors(merged({"slo": {"classes": classes}})))
    assert not validate("svc", merged({"slo": {"classes": classes}})).ok


@pytest.mark.parametrize(
    ("names", "message"),
    [(["interactive", "batch_2"], None), (["Gold"], "lowercase identifiers"), (["9lives"], "lowercase identifiers"),
     (["a" * 64], "lowercase identifiers"), (["gold-tier"], "lowercase identifiers"), (["default"], "'default'")],
)  # fmt: skip
def test_class_name_cel_rules_agree_with_python(names, message):
    classes = {n: {"ttftMs": 1, "tbtMs": 1, "priority": 0} for n in names}
    slo_schema = crd_schema()["properties"]["spec"]["properties"]["slo"]
    env = celpy.Environment()
    target = celpy.json_to_cel({"classes": classes})
    failed = [r["message"] for r in slo_schema["x-kubernetes-validations"]
              if not env.program(env.compile(r["rule"])).evaluate({"self": target})]  # fmt: skip
    outcome = validate("svc", merged({"slo": {"classes": classes}}))
    if message is None:
        assert failed == [] and outcome.ok
    else:
        assert len(failed) == 1 and message in failed[0]
        assert failed[0] in outcome.message  # the same words from the API server and the operator
        cond = conditions.validated(outcome.problems)  # what the status shows when the CEL was bypassed
        assert (cond.type, cond.status, cond.reason) == ("Validated", "False", "InvalidSpec")
        assert failed[0] in cond.message


@pytest.mark.parametrize(("text", "value"), [("1E", 10**18), ("1Ei", 2**60), ("500m", 0.5), ("96Gi", 96 * 2**30),
                                             ("1e3", 1000), (8, 8), ("+2k", 2000)])  # fmt: skip
def test_quantities_parse_as_the_api_server_does(text, value):
    assert quantity.parse(text) == pytest.approx(value)
    assert re.match(quantity.PATTERN, str(text))


def test_negative_and_malformed_quantities_are_refused_by_the_pattern_too():
    for text in ("-1Gi", "1.5.5", "Gi", "1 Gi"):
        assert not re.match(quantity.PATTERN, text), text


def test_replicas_default_so_the_scale_subresource_always_reads():
    replicas = crd_schema()["properties"]["spec"]["properties"]["replicas"]
    assert replicas["default"] == 1
    spec = validate("svc", {**BASE, "replicas": 9, "autoscaling": {"enabled": True, "maxReplicas": 4}}).spec
    assert spec is not None and spec.effective_replicas() == 4  # the autoscaler's bounds hold
