"""What every export target shares: the kinds of mapping, the :class:`Export` value, the plan
fields, the entries common to every external server, and the decisions two targets make alike
(the weights a server loads, the thread count, the OpenAI request fields).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import ModelSourceError
from ..tower.plan import SECTIONS, Plan

__all__ = ["KINDS", "SHARED", "Export", "Where", "changed", "openai_request", "plan_fields", "served_folder", "stream", "thread_count", "value"]

# Where a plan field goes on a target:
#   arg      a launch flag of the target server
#   env      the server's environment
#   request  a per-request field the client sends (or the server's default for it)
#   config   a generation_config.json key
#   select   names the model / runtime: the target itself is that choice
#   lost     does not carry over; listed, with the reason, when the plan changed it
KINDS = ("arg", "env", "request", "config", "select", "lost")

# fractal_opt's own request server (fractal-opt serve keeps them; the other servers do not).
OWN_SERVER = "fractal_opt's own request server: `fractal-opt serve` keeps it, this server has no such setting"
OWN_APP = "fractal_opt's application layer (prompt trimming / response cache): `fractal-opt serve` keeps it, this server has none"
TORCH_ONLY = "a setting of the transformers runtime in fractal_opt's own process (torch); this server has no such flag"

REPLICAS = "copies of this one server behind a router: `fractal-opt export --to cluster` (each replica and the router) or `--to kubernetes` (a Deployment of N)"

# The entries every external target shares; each target's table adds or overrides the rest.
SHARED: dict[str, tuple[str, str]] = {
    "source": ("select", "the model the server loads"),
    "hardware.runtime": ("select", "the runtime the numbers were measured on (see the note)"),
    "hardware.runtime_path": ("select", "where fractal_opt found vLLM; the server is launched by you"),
    "hardware.runtime_url": ("select", "a running vLLM fractal_opt measured against; the server is launched by you"),
    "scheduling.max_queue": ("lost", OWN_SERVER + " (bounded queue, HTTP 429 when full)"),
    "scheduling.timeout_s": ("lost", OWN_SERVER + " (per-request deadline); put a timeout in the reverse proxy or client"),
    "scheduling.max_wait_ms": ("lost", "static batching's fill wait exists only in fractal_opt's transformers server"),
    "scheduling.batch_size": ("lost", "padded static batches exist only in fractal_opt's transformers server"),
    "application.prompt_budget": ("lost", OWN_APP),
    "application.prompt_strategy": ("lost", OWN_APP),
    "application.head_share": ("lost", OWN_APP),
    "application.response_cache": ("lost", OWN_APP),
    "application.cache_max_entries": ("lost", OWN_APP),
    "application.cache_ttl_s": ("lost", OWN_APP),
    "application.cache_threshold": ("lost", OWN_APP),
    "application.chat_template": ("lost", "fractal_opt renders every prompt itself from the plan's template (fractal_opt/weights/prompts.py): "
                                  "give this server the same template, or send it prompts already rendered (its completions endpoint)"),
    "hardware.rpc_workers": ("lost", "llama.cpp's split over rpc-servers: `fractal-opt export --to cluster` gives each part's command"),
    "hardware.rpc_endpoints": ("lost", "llama.cpp's split over rpc-servers: `fractal-opt export --to cluster` gives each part's command"),
    "hardware.rpc_bind": ("lost", "the rpc-servers' listen address: `fractal-opt export --to cluster` gives their commands"),
    "scheduling.replicas": ("lost", REPLICAS),
    "scheduling.replica_cores": ("lost", REPLICAS),
    "scheduling.router": ("lost", REPLICAS),
}


@dataclass(frozen=True)
class Where:
    """Where the exported server runs and what the run recorded about the plan it measured.

    Attributes:
        model: the model's local path (a GGUF file, a folder) or hub id, as the plan names it.
        host, port: the listen address in the launch command.
        threads: the thread count the measured plan ran with (trace.json), used where the plan
            says ``auto`` or leaves the count to the runtime; None when unknown.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None


@dataclass
class Export:
    """What a target needs to run the plan, and what does not carry over."""

    target: str
    command: list[str] | None = None  # the launch command (None for generation-config)
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name -> text (generation_config.json)
    request: dict[str, Any] = field(default_factory=dict)  # per-request fields a client sends
    lost: list[tuple[str, Any, str]] = field(default_factory=list)  # (field, value, why) for changed fields that do not carry
    lost_passes: list[tuple[str, list[str]]] = field(default_factory=list)  # (kept pass, its fields that do not carry)
    remarks: list[str] = field(default_factory=list)  # where a value in the command comes from (the converted folder, the thread count)
    note: str = ""
    parts: list[tuple[str, list[str], dict[str, str]]] = field(default_factory=list)  # a cluster's parts: (where it runs, command, environment), in start order

    def to_text(self) -> str:
        lines = [f"# fractal-opt export --to {self.target}", ""]
        if self.command:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
            lines += ["Launch:", "  " + (env + " " if env else "") + shlex.join(self.command), ""]
        if self.parts:
            lines.append("Parts, started in this order:")
            for where, command, env in self.parts:
                prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                lines += [f"  # {where}", "  " + (prefix + " " if prefix else "") + shlex.join(command)]
            lines.append("")
        lines += [*(f"  ({r})" for r in self.remarks), *([""] if self.remarks else [])]
        if self.request:
            lines += ["Per-request fields (send them, or the server's defaults apply):", "  " + json.dumps(self.request, sort_keys=True), ""]
        for name, text in self.files.items():
            lines += [f"{name}:", *("  " + line for line in text.splitlines()), ""]
        if self.lost:
            lines.append("Does not carry over to this target:")
            lines += [f"  - {name}={value!r}: {why}" for name, value, why in self.lost]
            if self.lost_passes:
                lines.append("  kept passes affected: " + "; ".join(f"{p} ({', '.join(f)})" for p, f in self.lost_passes))
            lines.append("")
        else:
            lines += ["Every field the kept passes changed carries over to this target.", ""]
        lines.append(self.note)
        return "\n".join(lines)


def plan_fields() -> list[str]:
    """Every plan field as ``"section.field"`` (plus ``"source"``), in dataclass order."""
    out = [f.name for f in dataclasses.fields(Plan) if f.name not in SECTIONS and f.name != "applied"]
    for section, cls in SECTIONS.items():
        out.extend(f"{section}.{f.name}" for f in dataclasses.fields(cls))
    return out


# Fields only padded static batches read (fractal_opt's server, :func:`~fractal_opt.serving.server.in_flight_limit`):
# the batching pass sets them for continuous batching too, where no server uses them.
STATIC_BATCH_ONLY = ("scheduling.batch_size", "scheduling.max_wait_ms")


def in_use(plan: Plan, name: str) -> bool:
    """False for a field the plan's own scheduling never reads (a static batch's size under continuous batching)."""
    return name not in STATIC_BATCH_ONLY or plan.scheduling.batching == "static"


def value(plan: Plan, name: str) -> Any:
    """The plan's value of ``name`` ("source" or "section.field")."""
    if "." not in name:
        return getattr(plan, name)
    section, key = name.split(".")
    return getattr(getattr(plan, section), key)


def changed(before: Plan, after: Plan) -> list[str]:
    """The plan fields (not the source) whose values differ between ``before`` and ``after``."""
    return [n for n in plan_fields() if n != "source" and value(before, n) != value(after, n)]


def served_folder(model: str) -> tuple[str, bool]:
    """``(what a transformers-based server loads, whether it is a converted GGUF)``.

    transformers serve 5.x and vLLM take a model folder (or hub id); given a GGUF file they fail or
    load it differently from what was measured. The transformers and vLLM runtimes measure the GGUF
    dequantized once to safetensors with its tokenizer (:func:`fractal_opt.weights.models.materialize`,
    cached; made now, ~30 s, if it is not there yet), so that folder is what the export names.
    """
    from ..weights.models import materialize, resolve

    try:
        source = resolve(model)
    except ModelSourceError:
        return model, False
    if source.kind not in ("gguf", "embedded"):
        return model, False
    return materialize(source, progress=lambda m: print(m, file=sys.stderr)), True


def thread_count(plan: Plan, where: Where, *, flag: str) -> tuple[int | None, str | None, str | None]:
    """``(count to launch with, why the plan's value does not carry, a remark on where the count comes from)``.

    A count the plan pins carries as it is. ``auto`` (the physical cores) and a plan that leaves the
    count to the runtime ran, on the measuring machine, with the count the run recorded
    (``where.threads``): the export passes that count, so the server runs what was measured, and
    says to give the target's own physical cores on another machine.
    """
    threads = plan.hardware.threads
    if isinstance(threads, int):
        return threads, None, None
    if where.threads is not None:
        what = "'auto'" if threads == "auto" else "the runtime's default"
        return where.threads, None, (f"{where.threads} threads ({flag}): the count the measured plan ran with ({what} on the measuring machine); "
                                     "on another machine give its physical cores")
    if threads == "auto":
        return None, f"'auto' (physical cores) is resolved on the target: pass {flag} with its physical cores", None
    return None, None, None


def stream(plan: Plan) -> dict[str, Any]:
    """``stream: false`` when the plan measured unstreamed answers (clients stream by choice)."""
    return {} if plan.scheduling.streaming else {"stream": False}


def openai_request(plan: Plan) -> dict[str, Any]:
    """The OpenAI request fields that give the plan's decoding on a server that reads them."""
    a = plan.application
    body: dict[str, Any] = stream(plan)
    if a.max_new_tokens:
        body["max_tokens"] = a.max_new_tokens
    body["temperature"] = a.temperature if a.do_sample else 0.0
    if a.do_sample:
        body["top_p"] = a.top_p
    if a.stop:
        body["stop"] = list(a.stop)
    return body
