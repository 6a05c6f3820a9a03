"""A placed plan for a cluster: the launch settings of each part (``--to cluster``) and Kubernetes manifests (``--to kubernetes``).

``--to cluster`` starts from the single-server export of the plan's runtime (the same flags the
run measured with) and adds the parts around it:

- a split over llama.cpp rpc-servers: one ``rpc-server`` per machine (``RPC_HOST_N``, port 50052,
  listening on all interfaces of that machine, with the threads each measured part ran), then the
  ``llama-server --rpc RPC_HOST_1:50052,...`` that drives them; the plan's own endpoints as given;
- replicas on llama.cpp: each replica's ``llama-server`` pinned to its cores (``taskset``), on
  ports from ``port + 1`` up, and HAProxy in front on ``port`` with its configuration file (the
  same configuration the run measured through: :func:`fractal_opt.runtimes.router.haproxy_config`);
- vLLM: ``vllm serve`` with ``--tensor-parallel-size / --pipeline-parallel-size /
  --data-parallel-size``, and Ray's start commands when the layers are split over nodes.

``--to kubernetes`` writes ``kubernetes.yaml``: a Deployment of ``replicas`` pods (each the plan's
server: llama.cpp's ``ghcr.io/ggml-org/llama.cpp:server`` image or ``vllm/vllm-openai``, the model
read from a PersistentVolumeClaim, CPU requests = the cores per replica, the API key from an
optional Secret) and a Service in front; for a vLLM plan also ``llminferenceservice.yaml``,
KServe's LLMInferenceService (``serving.kserve.io/v1alpha2``) with the plan's parallelism. The
tests validate both against the Kubernetes schemas (kubernetes-validate) and KServe's CRD schema.
A split over rpc-servers has no Kubernetes form here (its parts are machines, not pod replicas):
it is refused with that reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import RecipeError, closest
from ..tower.plan import Plan
from .common import Export, Where

__all__ = ["CLUSTER_TARGETS", "LLAMA_IMAGE", "RPC_PORT", "VLLM_IMAGE", "export_cluster"]

CLUSTER_TARGETS = ("cluster", "kubernetes")
RPC_PORT = 50052  # rpc-server's own default port
LLAMA_IMAGE = "ghcr.io/ggml-org/llama.cpp:server"  # llama.cpp's published server image (CPU)
VLLM_IMAGE = "vllm/vllm-openai:latest"  # vLLM's published OpenAI-server image (CUDA)
_CONTAINER_PORT = 8080
_MODELS = "/models"  # where the pods find the model: the PersistentVolumeClaim below


def export_cluster(plan: Plan, target: str, *, where: Where, replicas: int | None = None, name: str = "fractal-opt", **single: Any) -> Export:
    """The plan as a cluster's parts (``cluster``) or Kubernetes manifests (``kubernetes``).

    Args:
        single: passed to :func:`fractal_opt.export.export` for the runtime's own single-server export.
        replicas: pods of the Deployment (default: the plan's replicas).

    Raises:
        RecipeError: an unknown target, a runtime with no cluster form, or a split over rpc-servers for Kubernetes.
    """
    from . import export

    if target not in CLUSTER_TARGETS:
        raise RecipeError(f"export --to: unknown cluster target {target!r}. Valid: {list(CLUSTER_TARGETS)}.{closest(target, CLUSTER_TARGETS)}")
    runtime = plan.hardware.runtime
    if runtime not in ("llama_cpp", "vllm"):
        raise RecipeError(f"export --to {target}: the plan runs on {runtime!r}; a cluster export is written for the llama_cpp and vllm runtimes, whose servers run as processes")
    base = export(plan, "llama-server" if runtime == "llama_cpp" else "vllm", host=where.host, port=where.port, model_path=where.model, threads=where.threads, **single)
    out = dataclasses.replace(base, target=target, command=None, parts=[], files={}, remarks=list(base.remarks))
    out.lost = [entry for entry in out.lost if not entry[0].startswith(("scheduling.replica", "scheduling.router", "hardware.rpc_"))]
    if target == "cluster":
        _parts(plan, base, out, where)
    else:
        if plan.hardware.rpc_workers or plan.hardware.rpc_endpoints:
            raise RecipeError("export --to kubernetes: a plan split over rpc-servers spreads one model over machines, not pod replicas; "
                              "export it with --to cluster (each machine's command)")
        count = replicas if replicas is not None else plan.scheduling.replicas
        out.files["kubernetes.yaml"] = yaml.safe_dump_all(manifests(plan, base, name=name, replicas=count, model=where.model), sort_keys=False)
        if runtime == "vllm":
            out.files["llminferenceservice.yaml"] = yaml.safe_dump(llm_inference_service(plan, base, name=name, replicas=count, model=where.model), sort_keys=False)
        out.remarks.append(f"copy the model into the PersistentVolumeClaim {name}-models (mounted at {_MODELS}); the pods read it from there")
    return out


def _parts(plan: Plan, base: Export, out: Export, where: Where) -> None:
    from ..runtimes.router import haproxy_config

    assert base.command is not None
    hw, s = plan.hardware, plan.scheduling
    if hw.runtime == "vllm":
        out.parts.append(("every node (vLLM starts its ranks itself)", base.command, dict(base.env)))
        if hw.pipeline_parallel > 1:
            out.remarks.append("layers split over nodes: start Ray first (`ray start --head` on the first node, `ray start --address=HEAD:6379` on the "
                               "others) and add --distributed-executor-backend ray to the command, on the first node only")
        return
    threads = where.threads or _threads(base.command)  # the machine's count the run measured with, shared out over the rpc-servers
    for i in range(hw.rpc_workers):
        out.parts.append((f"machine RPC_HOST_{i + 1}: an rpc-server (no authentication: reachable from the front machine only)",
                          ["rpc-server", "--host", "0.0.0.0", "--port", str(RPC_PORT), "--threads", str(max(1, (threads or 1) // hw.rpc_workers))], {}))
    if s.replicas > 1:
        cores = s.replica_cores or where.threads or 1  # the recorded count is a replica's: its threads = its cores
        ports = [where.port + 1 + i for i in range(s.replicas)]
        for i, port in enumerate(ports):
            command = _with(base.command, {"--port": str(port), "--host": "127.0.0.1", "--threads": str(cores), "--threads-batch": str(cores)})
            out.parts.append((f"replica {i + 1} of {s.replicas}, cores {i * cores}-{(i + 1) * cores - 1}",
                              ["taskset", "--cpu-list", f"{i * cores}-{(i + 1) * cores - 1}", *command], {}))
        out.files["haproxy.cfg"] = haproxy_config([("127.0.0.1", p) for p in ports], port=where.port, maxconn=_slots(base.command), host=where.host)
        out.parts.append(("the router, in front of the replicas", ["haproxy", "-db", "-f", "haproxy.cfg"], {}))
        out.remarks.append("export one LLAMA_API_KEY for every replica before starting them: each then demands that key, and HAProxy passes "
                           "each client's Authorization header through")
        return
    where_front = "the front machine (holds the token embeddings, drives the rpc-servers)" if hw.rpc_workers or hw.rpc_endpoints else "the server"
    out.parts.append((where_front, base.command, dict(base.env)))


def _with(command: list[str], flags: dict[str, str]) -> list[str]:
    """``command`` with each flag's value replaced (or the flag added)."""
    out = list(command)
    for flag, value in flags.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _threads(command: list[str]) -> int | None:
    value = _flag(command, "--threads")
    return int(value) if value else None


def _slots(command: list[str]) -> int:
    return int(_flag(command, "--parallel") or 1)


def _container(plan: Plan, base: Export, model: str) -> dict[str, Any]:
    """The pod's one container: the plan's server on port 8080, the model from the volume."""
    assert base.command is not None
    path = f"{_MODELS}/{Path(model).name}"
    if plan.hardware.runtime == "llama_cpp":
        args = _with(base.command[1:], {"--model": path, "--host": "0.0.0.0", "--port": str(_CONTAINER_PORT)})
        image, key_var = LLAMA_IMAGE, "LLAMA_API_KEY"
    else:
        rest = [a for a in base.command[3:]]  # after "vllm serve MODEL"
        rest = _drop(rest, "--data-parallel-size")  # each pod is one replica; the Deployment makes the copies
        args = ["--model", path, *_with(rest, {"--host": "0.0.0.0", "--port": str(_CONTAINER_PORT)})]
        image, key_var = VLLM_IMAGE, "VLLM_API_KEY"
    env = [{"name": k, "value": v} for k, v in base.env.items()]
    env.append({"name": key_var, "valueFrom": {"secretKeyRef": {"name": "fractal-opt-api-key", "key": "key", "optional": True}}})
    cores = plan.scheduling.replica_cores or _threads(base.command) or 1
    return {"name": "server", "image": image, "args": args, "env": env, "ports": [{"containerPort": _CONTAINER_PORT, "name": "http"}],
            "resources": {"requests": {"cpu": str(cores)}, "limits": {"cpu": str(cores)}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": _CONTAINER_PORT}, "periodSeconds": 5},
            "volumeMounts": [{"name": "models", "mountPath": _MODELS, "readOnly": True}]}


def _drop(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def manifests(plan: Plan, base: Export, *, name: str, replicas: int, model: str) -> list[dict[str, Any]]:
    """A Deployment of ``replicas`` pods of the plan's server and a Service in front of them."""
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "fractal-opt"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                 "template": {"metadata": {"labels": dict(labels)},
                              "spec": {"containers": [_container(plan, base, model)],
                                       "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": f"{name}-models", "readOnly": True}}]}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": dict(labels)},
               "spec": {"selector": {"app.kubernetes.io/name": name}, "ports": [{"name": "http", "port": 80, "targetPort": _CONTAINER_PORT}]}}
    return [deployment, service]


def llm_inference_service(plan: Plan, base: Export, *, name: str, replicas: int, model: str) -> dict[str, Any]:
    """KServe's LLMInferenceService for a vLLM plan: the model, ``replicas``, the plan's tensor / pipeline degrees, the container."""
    hw = plan.hardware
    parallelism = {k: v for k, v in (("tensor", hw.tensor_parallel), ("pipeline", hw.pipeline_parallel)) if v > 1}
    container = _container(plan, base, model)
    container.pop("volumeMounts")  # KServe's storage initializer puts the model at /mnt/models itself
    container["name"] = "main"
    container["args"] = ["--model", "/mnt/models", *container["args"][2:]]
    spec: dict[str, Any] = {"model": {"uri": f"pvc://{name}-models/{Path(model).name}", "name": Path(model).name}, "replicas": replicas,
                            "template": {"containers": [container]}}
    if parallelism:
        spec["parallelism"] = parallelism
    return {"apiVersion": "serving.kserve.io/v1alpha2", "kind": "LLMInferenceService", "metadata": {"name": name}, "spec": spec}
