"""fractal-opt export --to cluster / kubernetes: each part's command, and manifests that pass their schemas.

The Kubernetes objects are validated against Kubernetes' own JSON schemas (the kubernetes-validate
package ships them, strict: unknown fields fail), and KServe's LLMInferenceService against its CRD
schema, vendored in tests/export/schemas/ (its source and what was trimmed are in the file's
$comment), with its pod template against Kubernetes' PodSpec.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fractal_opt.core.errors import RecipeError
from fractal_opt.export import Where
from fractal_opt.export.cluster import export_cluster
from fractal_opt.layers.hardware import Runtime
from fractal_opt.layers.placement import Replicas, Split
from fractal_opt.tower.plan import Plan

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs kubernetes-validate (Kubernetes' JSON schemas)")
jsonschema = pytest.importorskip("jsonschema")

K8S = "1.30.0"
KSERVE_SCHEMA = Path(__file__).parent / "schemas" / "kserve-llminferenceservice-v1alpha2.json"
WHERE = Where(model="/data/SmolLM2-135M-Instruct.gguf", threads=2)
LLAMA = Runtime(backend="llama_cpp", path="native").apply(Plan(source="m")).replace_section("scheduling", batching="continuous", max_concurrency=8)
VLLM = Runtime(backend="vllm").apply(Plan(source="m")).replace_section("hardware", device="cuda")


def _k8s_valid(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def test_a_split_plan_is_each_machine_s_rpc_server_then_the_front_llama_server():
    out = export_cluster(Split().apply(LLAMA), "cluster", where=WHERE)
    names = [where for where, _, _ in out.parts]
    assert names[0].startswith("machine RPC_HOST_1") and names[1].startswith("machine RPC_HOST_2") and names[2].startswith("the front machine")
    assert out.parts[0][1][:2] == ["rpc-server", "--host"] and "--threads" in out.parts[0][1]
    front = out.parts[2][1]
    assert front[front.index("--rpc") + 1] == "RPC_HOST_1:50052,RPC_HOST_2:50052" and "--n-gpu-layers" in front
    assert "no authentication" in out.to_text()


def test_replicas_are_pinned_servers_and_haproxy_with_its_configuration():
    out = export_cluster(Replicas(count=2, cores=1).apply(LLAMA), "cluster", where=WHERE)
    assert [p[1][:3] for p in out.parts[:2]] == [["taskset", "--cpu-list", "0-0"], ["taskset", "--cpu-list", "1-1"]]
    assert out.parts[2][1] == ["haproxy", "-db", "-f", "haproxy.cfg"]
    assert "server r1 127.0.0.1:8002" in out.files["haproxy.cfg"] and "bind 127.0.0.1:8000" in out.files["haproxy.cfg"]
    assert not [name for name, _, _ in out.lost if name.startswith("scheduling.replica")]


def test_a_vllm_plan_carries_its_three_degrees():
    plan = Replicas(count=2).apply(Split(tensor=2, pipeline=2).apply(VLLM))
    command = export_cluster(plan, "cluster", where=WHERE).parts[0][1]
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"):
        assert command[command.index(flag) + 1] == "2"


@pytest.mark.parametrize("plan", [Replicas(count=2, cores=1).apply(LLAMA), LLAMA, Split(tensor=2).apply(VLLM)], ids=["llama-replicas", "llama", "vllm-tp2"])
def test_the_kubernetes_manifests_pass_kubernetes_schemas(plan):
    """A Deployment and a Service, strict against Kubernetes' schemas (an unknown or mistyped field fails)."""
    out = export_cluster(plan, "kubernetes", where=WHERE, replicas=3)
    docs = list(yaml.safe_load_all(out.files["kubernetes.yaml"]))
    assert [d["kind"] for d in docs] == ["Deployment", "Service"] and docs[0]["spec"]["replicas"] == 3
    for doc in docs:
        _k8s_valid(doc)


def test_the_schemas_catch_a_broken_manifest():
    """The validation can fail: a replica count written as text is refused."""
    docs = list(yaml.safe_load_all(export_cluster(LLAMA, "kubernetes", where=WHERE).files["kubernetes.yaml"]))
    docs[0]["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        _k8s_valid(docs[0])


def test_a_vllm_plan_is_also_a_kserve_llm_inference_service():
    """LLMInferenceService (serving.kserve.io/v1alpha2) with the plan's parallelism passes KServe's CRD schema; its pod template passes PodSpec."""
    out = export_cluster(Split(tensor=2, pipeline=2).apply(VLLM), "kubernetes", where=WHERE, replicas=2)
    doc = yaml.safe_load(out.files["llminferenceservice.yaml"])
    assert doc["spec"]["parallelism"] == {"tensor": 2, "pipeline": 2} and doc["spec"]["replicas"] == 2
    jsonschema.validate(doc, json.loads(KSERVE_SCHEMA.read_text()))
    _k8s_valid({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "template"}, "spec": doc["spec"]["template"]})  # the template is a PodSpec
    doc["spec"]["parallelism"]["tensor"] = 0  # KServe's minimum is 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, json.loads(KSERVE_SCHEMA.read_text()))


def test_a_split_over_rpc_servers_has_no_kubernetes_form():
    with pytest.raises(RecipeError, match="--to cluster"):
        export_cluster(Split().apply(LLAMA), "kubernetes", where=WHERE)


def test_a_transformers_plan_has_no_cluster_form():
    with pytest.raises(RecipeError, match="llama_cpp and vllm"):
        export_cluster(Plan(source="m"), "cluster", where=WHERE)
