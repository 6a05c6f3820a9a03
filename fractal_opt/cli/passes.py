"""``fractal-opt passes``: every pass by layer, its parameters, and whether it can run here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any


def add(sub) -> None:
    p = sub.add_parser("passes", help="list every pass by layer, and whether it can run on this machine")
    p.add_argument("--json", action="store_true", help="print [{name, layer, summary, params, available, unavailable, runtimes, capabilities}] instead of text")
    p.set_defaults(func=passes)


def describe_passes() -> list[dict[str, Any]]:
    """Every registered pass, bottom up: its parameters and why this machine cannot run it (or None)."""
    from ..core.machine import Machine
    from ..core.validate import plain, type_name
    from ..layers import passes_by_layer

    machine = Machine.probe()
    out = []
    for layer, classes in passes_by_layer().items():
        for cls in classes:
            hints = typing.get_type_hints(cls)
            params = [{"name": f.name, "type": type_name(hints[f.name]), "default": plain(_default(f))} for f in dataclasses.fields(cls)]
            why = cls().unavailable(machine)
            entry: dict[str, Any] = {"name": cls.name, "layer": layer.section, "summary": cls.summary(), "params": params,
                                     "available": why is None, "unavailable": why}
            if cls.name == "runtime":
                from ..runtimes import RUNTIMES

                entry["runtimes"] = RUNTIMES.availability(machine)  # runtime -> None (runs here) or why not
                entry["capabilities"] = {caps.name: _capabilities(caps) for caps in RUNTIMES}
            out.append(entry)
    return out


def _capabilities(caps: Any) -> dict[str, Any]:
    """What a runtime's capabilities table says, as plain data (the registry's, fractal_opt.runtimes)."""
    return {"summary": caps.summary, "weights": caps.weights, "refuses": caps.refused_fields(), "whole_device": caps.whole_device,
            "batch_invariant": caps.batch_invariant, "token_prompts": caps.token_prompts, "default_threads": caps.default_threads, "idle": dataclasses.asdict(caps.idle),
            "telemetry": list(caps.telemetry), "export_targets": list(caps.export_targets), "options": sorted(caps.options)}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def passes(args: argparse.Namespace) -> int:
    from ..tower.passes import Layer

    entries = describe_passes()
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    layer = None
    for e in entries:
        if e["layer"] != layer:
            layer = e["layer"]
            print(f"{Layer.from_name(layer).value}. {layer}")
        params = ", ".join(f"{p['name']}: {p['type']} = {p['default']!r}" for p in e["params"])
        print(f"   {e['name']:<16} {e['summary']}")
        print(f"   {'':<16} params: {params or '-'}")
        print(f"   {'':<16} {'available on this machine' if e['available'] else 'not available here: ' + e['unavailable']}")
        for runtime, reason in (e.get("runtimes") or {}).items():
            print(f"   {'':<16}   {runtime:<13} {'runs here' if reason is None else 'not here: ' + reason}")
            caps = e["capabilities"][runtime]
            device = "takes a whole GPU" if caps["whole_device"] == "accelerator" else "shares its device"
            print(f"   {'':<16}   {'':<13} serves {caps['weights']} weights; {device}; refuses {len(caps['refuses'])} plan fields at some "
                  f"value; exports to {', '.join(caps['export_targets']) or 'no target'}")
    return 0

