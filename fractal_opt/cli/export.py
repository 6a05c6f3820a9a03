"""``fractal-opt export RUN_DIR --to TARGET``: the kept plan as another server's launch settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add(sub) -> None:
    from ..export import TARGETS
    from ..export.cluster import CLUSTER_TARGETS

    p = sub.add_parser("export", help="print the tuned plan as launch settings for transformers serve, vllm, llama-server or generation_config.json, "
                                      "or as a cluster's parts or Kubernetes manifests")
    p.add_argument("run_dir", help="a run's output folder (trace.json, recipe.yaml) or a tuned recipe.yaml")
    p.add_argument("--to", required=True, choices=(*TARGETS, *CLUSTER_TARGETS), dest="target",
                   help="the server to export to; cluster: each part's command (rpc-servers, replicas, router); kubernetes: a Deployment and a Service (+ KServe for vLLM)")
    p.add_argument("--replicas", type=int, default=None, help="kubernetes: pods of the Deployment (default: the plan's replicas; fractal-opt fleet says how many a load needs)")
    p.add_argument("--host", default="127.0.0.1", help="listen address in the launch command (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port in the launch command (default 8000)")
    p.add_argument("--write", metavar="DIR", default=None, help="also write the exported files (generation_config.json) into DIR")
    p.set_defaults(func=export_command)


def export_command(args: argparse.Namespace) -> int:
    from ..core.errors import FractalOptError
    from ..export import Where, export
    from ..export.cluster import CLUSTER_TARGETS, export_cluster
    from ..language.recipe import load_recipe
    from ..runtimes import recipe_source
    from ..weights import models

    source = recipe_source(args.run_dir)
    recipe = load_recipe(source, check_model=False)
    plan = recipe.plan()
    try:
        resolved = models.resolve(plan.source)
        model_path = str(resolved.path) if resolved.path is not None else plan.source
    except FractalOptError:
        model_path = plan.source
    trace = _trace(Path(source).parent)
    threads = _recorded_threads(trace, plan.hardware.runtime)
    if args.target in CLUSTER_TARGETS:
        where = Where(model=model_path, host=args.host, port=args.port, threads=threads)
        out = export_cluster(plan, args.target, where=where, replicas=args.replicas, passes=recipe.passes, measured=_measured(trace))
    else:
        out = export(plan, args.target, passes=recipe.passes, model_path=model_path, measured=_measured(trace), host=args.host, port=args.port, threads=threads)
    print(out.to_text())
    if args.write:
        folder = Path(args.write)
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in out.files.items():
            (folder / name).write_text(text, encoding="utf-8")
            print(f"Wrote {folder / name}")
    return 0


def _trace(run_dir: Path) -> dict:
    """The run's trace.json beside its recipe.yaml ({} without one, or when it does not parse)."""
    try:
        data = json.loads((run_dir / "trace.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _measured(trace: dict) -> str | None:
    """The machine the run measured on, from its trace.json (None without one)."""
    machine = trace.get("machine") or {}
    parts = [machine.get("cpu"), f"{machine['physical_cores']} cores" if machine.get("physical_cores") else None]
    gpus = machine.get("cuda_devices") or []
    if gpus:
        parts.append(", ".join(map(str, gpus)))
    return ", ".join(p for p in parts if p) or None


def _recorded_threads(trace: dict, runtime: str) -> int | None:
    """The thread count the final plan ran with (:meth:`Trace.ran_threads`); None without a
    trace, or when its final plan is on another runtime than the recipe's (a hand-edited recipe)."""
    from ..report.trace import Trace

    try:
        ran = Trace.from_dict(trace) if trace else None
    except (ValueError, TypeError, KeyError):
        return None
    final = ran.final_step() if ran is not None else None
    if final is None or (final.plan.get("hardware") or {}).get("runtime", runtime) != runtime:
        return None
    return ran.ran_threads()
