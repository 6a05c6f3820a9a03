"""The same search with screening and without it: what the screen saves, and whether it changes the answer.

Two runs of one recipe on the embedded SmolLM2-135M-Instruct: recipes/quickstart.yaml's workload,
policy and searches (the hardware and model layers), without its scheduling and application steps
and without its time budget, so that both runs try every candidate. The first screens each
candidate (``search: {screen: true}``, the default), the second judges every candidate in full
(``screen: false``). Each run is the pipeline end to end (baseline, searches, final confirmation),
timed by the wall clock.

    python benchmarks/search.py --json     # {"screened": {"wall_s", "steps_s", "final_plan", ...}, "full": {...}, "time_ratio", "same_final_plan"}
    python benchmarks/search.py --out DIR  # the two runs' traces and reports kept under DIR/screened and DIR/full

Targets: the same final plan, and the screened search in at most half the full search's time
(``time_ratio``, the pipelines' wall clocks; ``steps_time_ratio`` beside it, the steps' own time
without the baseline and the final confirmation, which both runs spend alike).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIME_RATIO_TARGET = 0.5  # screened wall time / full wall time


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def recipe(*, screen: bool) -> dict[str, Any]:
    """recipes/quickstart.yaml's searches alone, no budget, screening on or off."""
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text(encoding="utf-8"))
    data["workload"].pop("budget_s", None)
    data["name"] = f"search-{'screened' if screen else 'full'}"
    searches = {}
    for layer in ("hardware", "model"):  # the quickstart's searches as it writes them, screening on or off
        entries = [e for e in data["passes"][layer] if e == "search" or (isinstance(e, dict) and "search" in e)]
        searches[layer] = [{"search": {**(e["search"] if isinstance(e, dict) else {}), "screen": screen}} for e in entries]
    data["passes"] = searches
    return data


def run(*, screen: bool, out: Path) -> dict[str, Any]:
    """One pipeline run; its wall time, final plan and what its searches considered."""
    from fractal_opt.pipeline.runner import Pipeline

    t0 = time.perf_counter()
    result = Pipeline(recipe(screen=screen), out_dir=out, progress=log, force=True).run()
    wall = time.perf_counter() - t0
    steps = result.trace.steps
    return {
        "wall_s": round(wall, 1),
        # The steps' own time (build, warm-up, rounds, quality gate): the search without the baseline
        # and the final confirmation, which are the same work in both runs.
        "steps_s": round(sum(sum(v for k, v in s.timings.items() if k.endswith("_s")) for s in steps), 1),
        "final_plan": result.trace.final.get("kept", []),
        "plan": result.plan.to_dict(),
        "statuses": {s: sum(x.status == s for x in steps) for s in ("kept", "rolled_back", "screened_out", "skipped", "failed")},
        "searches": [f["answer"] for f in result.trace.searches],
        "trace": str(out / "trace.json"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (the log goes to stderr)")
    parser.add_argument("--out", default=None, help="folder for the two runs' outputs (default: a temporary folder)")
    args = parser.parse_args()
    from fractal_opt.core.machine import Machine
    load_start = os.getloadavg()
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fractal-search-"))
    screened = run(screen=True, out=base / "screened")
    full = run(screen=False, out=base / "full")
    machine = Machine.probe()
    out = {
        "screened": screened, "full": full,
        "time_ratio": round(screened["wall_s"] / full["wall_s"], 3) if full["wall_s"] else None,
        "steps_time_ratio": round(screened["steps_s"] / full["steps_s"], 3) if full["steps_s"] else None,
        "same_final_plan": screened["plan"] == full["plan"],
        "machine": f"{machine.cpu}, {machine.physical_cores} physical cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
    out["targets"] = {"same final plan": out["same_final_plan"], "screened time <= half the full time": (out["time_ratio"] or 1.0) <= TIME_RATIO_TARGET}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
