"""Placement: where one plan's work runs when one process is not enough. Two passes.

- ``split`` (hardware layer) spreads one model over processes or machines: its layers over
  llama.cpp ``rpc-server`` processes (``rpc_workers`` started here, ``rpc_endpoints`` already
  running elsewhere), or each layer's matrices (``tensor``) and the stack of layers (``pipeline``)
  over vLLM's workers. It attacks capacity (a model larger than one process's memory) and pays in
  the traffic between the parts, which the run measures like any other change.
- ``replicas`` (scheduling layer) runs whole copies of the plan, each pinned to its own cores,
  behind a router that exists (HAProxy from the distribution's packages, or vLLM's own
  data-parallel front end). It attacks throughput under load.

A runtime states which placements it offers (``Capabilities.placements``,
:data:`~fractal_opt.engine.capabilities.PLACEMENTS`); a pass asking for one its plan's runtime does
not offer is refused with the ones it does. What needs the model's files (a tensor-parallel degree
that does not divide the attention heads) is the runtime's refusal and the recipe check's
(:mod:`fractal_opt.weights.heads`); what needs the network (an rpc-server that does not answer) is
the runtime's refusal, before any round.

Example:
    >>> from fractal_opt.tower.plan import Plan
    >>> Replicas(count=2, cores=1).apply(Plan(source="m")).scheduling.replicas
    2
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from ..core.errors import RecipeError
from ..core.machine import Machine
from ..engine.capabilities import PLACEMENTS
from ..engine.registry import RUNTIMES
from ..tower.passes import Layer, Pass, register
from ..tower.plan import Plan

__all__ = ["LOOPBACK", "Replicas", "Split", "endpoint_problem", "placement_refused"]

LOOPBACK = "127.0.0.1"
_MAX_PARTS = 64  # rpc-servers, tensor / pipeline ranks or replicas: a bound that keeps a typo from starting hundreds of processes


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a ``host:port`` an rpc-server can listen on, or None."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"got {endpoint!r}, expected 'host:port' with a port in 1-65535, such as '192.168.1.20:50052'"
    return None


def placement_refused(plan: Plan, placement: str) -> str | None:
    """Why the plan's runtime cannot place the plan with ``placement`` (its table's list), or None."""
    caps = RUNTIMES.of(plan)
    if placement in caps.placements:
        return None
    offered = sorted(caps.placements)
    return (f"the {caps.name} runtime does not offer {placement} ({PLACEMENTS[placement]}); "
            + (f"its placements are {offered}" if offered else "it runs one process on one machine"))


@register
@dataclass(frozen=True, kw_only=True)
class Split(Pass):
    """Split one model over processes or machines: llama.cpp rpc-servers, or vLLM's tensor / pipeline parallel.

    ``rpc_workers: 2`` starts two llama.cpp ``rpc-server`` processes here, each on its own cores,
    and ``llama-server --rpc`` spreads the model's layers over them; ``rpc_endpoints`` names
    rpc-servers already running on other machines. llama.cpp's RPC protocol has no
    authentication, so started rpc-servers listen on loopback unless ``rpc_bind`` names another
    address (the run then warns loudly). ``tensor`` / ``pipeline`` are vLLM's degrees (a tensor
    degree must divide the model's attention heads). A layer split serializes the parts, so one
    request decodes no faster; it is how a model larger than one machine's memory runs at all.
    """

    name = "split"
    layer = Layer.HARDWARE

    # None: 2 rpc-servers when nothing else is split (two CPU endpoints are what llama.cpp's RPC is known to run), else none.
    rpc_workers: int | None = field(default=None, metadata={"bounds": (0, _MAX_PARTS)})
    rpc_endpoints: tuple[str, ...] = ()
    rpc_bind: str = LOOPBACK
    tensor: int = field(default=1, metadata={"bounds": (1, _MAX_PARTS)})
    pipeline: int = field(default=1, metadata={"bounds": (1, _MAX_PARTS)})

    def __post_init__(self) -> None:
        object.__setattr__(self, "rpc_endpoints", tuple(str(e) for e in self.rpc_endpoints))
        if self.rpc_workers is None:
            object.__setattr__(self, "rpc_workers", 2 if self.tensor == 1 and self.pipeline == 1 and not self.rpc_endpoints else 0)
        problems = [f"'rpc_endpoints': {why}" for e in self.rpc_endpoints if (why := endpoint_problem(e))]
        try:
            ipaddress.ip_address(self.rpc_bind)
        except ValueError:
            problems.append(f"'rpc_bind': got {self.rpc_bind!r}, expected an IP address such as '127.0.0.1' (loopback) or '0.0.0.0'")
        rpc = bool(self.rpc_workers or self.rpc_endpoints)
        if rpc and (self.tensor > 1 or self.pipeline > 1):
            problems.append("llama.cpp's RPC split (rpc_workers / rpc_endpoints) and vLLM's tensor / pipeline degrees belong to different runtimes; give one")
        if not rpc and self.tensor == 1 and self.pipeline == 1:
            problems.append("nothing to split: give rpc_workers (>= 1) or rpc_endpoints (llama.cpp), or tensor / pipeline > 1 (vLLM)")
        if problems:
            raise RecipeError("; ".join(f"pass 'split': {p}" for p in problems) + ".")

    @property
    def placements(self) -> list[str]:
        """The placements this split asks of the runtime (:data:`PLACEMENTS` names)."""
        if self.rpc_workers or self.rpc_endpoints:
            return ["rpc"]
        return [name for name, degree in (("tensor_parallel", self.tensor), ("pipeline_parallel", self.pipeline)) if degree > 1]

    def check(self, plan: Plan, machine: Machine) -> str | None:
        for placement in self.placements:
            if (why := placement_refused(plan, placement)) is not None:
                return why
        if (self.rpc_workers or 0) > machine.physical_cores:
            return f"rpc_workers={self.rpc_workers}: more rpc-servers than the {machine.physical_cores} physical cores here (each needs a core of its own)"
        ranks = self.tensor * self.pipeline
        if ranks > 1 and plan.hardware.device.startswith("cuda") and ranks > len(machine.cuda_devices):
            return f"tensor x pipeline = {ranks} GPUs, but this machine has {len(machine.cuda_devices)}"
        if ranks > 1 and plan.hardware.device == "cpu" and ranks > machine.physical_cores:
            return f"tensor x pipeline = {ranks} workers, more than the {machine.physical_cores} physical cores here (vLLM's CPU build binds each to its own cores)"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", rpc_workers=self.rpc_workers or 0, rpc_endpoints=self.rpc_endpoints, rpc_bind=self.rpc_bind,
                                    tensor_parallel=self.tensor, pipeline_parallel=self.pipeline)


@register
@dataclass(frozen=True, kw_only=True)
class Replicas(Pass):
    """Serve the plan from several copies, each pinned to its own cores, behind a router (HAProxy, or vLLM's own).

    ``count`` servers of the plan each run on ``cores`` cores of their own (default: this
    machine's physical cores shared out evenly) with that many threads; the router spreads
    requests over them (least connections first). Copies share no memory bandwidth inside one
    process and no scheduler, so under load they can serve more than one server on all the
    cores; the scaling efficiency measured here (N copies against one) is what
    ``fractal-opt fleet`` scales a target load with. More copies than cores is refused.
    """

    name = "replicas"
    layer = Layer.SCHEDULING

    count: int = field(default=2, metadata={"bounds": (1, _MAX_PARTS)})
    cores: int | None = field(default=None, metadata={"bounds": (1, 4096)})
    router: Literal["auto", "haproxy"] = "auto"

    def cores_each(self, machine: Machine) -> int:
        """The cores each replica gets on ``machine``."""
        return self.cores if self.cores is not None else max(1, machine.physical_cores // self.count)

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if (why := placement_refused(plan, "replicas")) is not None:
            return why
        if self.count > machine.physical_cores:
            return f"count={self.count}: more replicas than the {machine.physical_cores} physical cores here (each replica needs a core of its own)"
        need = self.count * self.cores_each(machine)
        if need > machine.physical_cores:
            return f"count={self.count} x cores={self.cores_each(machine)} = {need} cores, more than the {machine.physical_cores} physical cores here"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("scheduling", replicas=self.count, replica_cores=self.cores, router=self.router)
