"""Does every family reach llama.cpp and compute there what transformers computes? The family x
runtime matrix of docs/models.md, measured.

For each family of fractal_opt.testing_families (tiny random-weight models built from configs:
llama, mistral, qwen2, qwen3, gemma3, phi3), the folder is converted to an F32 GGUF with llama.cpp's
own converter, loaded by llama.cpp (the xllamacpp wheel, in this process) and scored against
transformers in float32 on the shipped reference text: ``kl_f32`` is the exact KL (the baseline's
top-256 tokens at each of the first ``--positions`` positions, docs/quality.md) and
``top1_agreement`` the share of positions whose most likely next token both runtimes agree on. At
F32 the two compute the same numbers up to float32 rounding, so a conversion bug (a rotary layout,
a norm offset, a fused projection split the wrong way) shows as a KL orders of magnitude above the
1e-3 the issue asks for. With ``--vllm`` (needs make setup-vllm) each family is also served by vLLM
(its start takes a minute or more a family).

    python benchmarks/models.py            # about 1.5 minutes on 2 cores
    python benchmarks/models.py --json     # one JSON object on stdout: {"families": {name: {...}}, ...}
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_family(family: str, root: Path, *, positions: int, vllm: bool) -> dict[str, Any]:
    """Build, convert, load and score one family; every stage's outcome, the first failure named."""
    from fractal_opt.quality.probes import QualityConfig, build_reference, model_probes
    from fractal_opt.runtimes import build, clear_cache
    from fractal_opt.testing_families import tiny_family
    from fractal_opt.tower.plan import HardwarePlan, Plan
    from fractal_opt.weights.convert import architecture, converted_path, folder_to_gguf

    row: dict[str, Any] = {"converted": False, "llama_cpp_loads": False}
    folder = tiny_family(root / ("phi4-style" if family == "phi3" else family), family)  # the folder name: see testing_families
    row["architecture"] = architecture(folder)
    config = QualityConfig(reference_tokens=max(positions + 1, 64), top_k_positions=positions)
    reference = build_reference(build(Plan(source=str(folder)), progress=lambda m: None), {}, config)
    clear_cache()
    converted_path(folder, "f32").unlink(missing_ok=True)  # the same seed gives the same folder: convert it again, timed
    t0 = time.perf_counter()
    gguf = folder_to_gguf(folder, "f32", progress=lambda m: None)
    row.update(converted=True, convert_s=round(time.perf_counter() - t0, 1), gguf_mb=round(gguf.stat().st_size / 2**20, 1))
    llama = build(Plan(source=str(folder), hardware=HardwarePlan(runtime="llama_cpp")), progress=lambda m: None)
    row["llama_cpp_loads"] = True
    probes = model_probes(reference, llama)
    llama.close()
    clear_cache()
    row.update(kl_f32=probes["kl_mean"], kl_max=probes["kl_max"], top1_agreement=round(1.0 - probes["top1_flip"], 4),
               ppl_ratio=probes["ppl_ratio"], kl_method=probes["kl_method"])
    gguf.unlink(missing_ok=True)  # a benchmark's model leaves nothing in the cache
    if vllm:
        row["vllm"] = _vllm(folder, reference)
    return row


def _vllm(folder: Path, reference: Any) -> dict[str, Any]:
    """vLLM on the folder: its top-k KL lower bound (vLLM gives top-k rows only), or why it did not serve."""
    from fractal_opt.quality.probes import model_probes
    from fractal_opt.runtimes import build, clear_cache
    from fractal_opt.tower.plan import HardwarePlan, Plan

    try:
        engine = build(Plan(source=str(folder), hardware=HardwarePlan(runtime="vllm")), progress=lambda m: None)
        probes = model_probes(reference, engine)
        engine.close()
        return {"serves": True, "kl_lower_bound": probes["kl_mean"], "kl_method": probes["kl_method"]}
    except Exception as e:  # noqa: BLE001 (a family vLLM cannot serve is a row of the matrix, not the end of the run)
        return {"serves": False, "why": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        clear_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=128, help="reference positions the exact KL scores (two llama.cpp requests each)")
    parser.add_argument("--vllm", action="store_true", help="also serve each family with vLLM (needs make setup-vllm)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    from fractal_opt.core.machine import Machine
    from fractal_opt.testing_families import FAMILIES

    load_start = os.getloadavg()
    families: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fractal-families-") as tmp:
        for family in FAMILIES:
            log(f"{family}: building, converting, loading, scoring")
            try:
                families[family] = measure_family(family, Path(tmp), positions=args.positions, vllm=args.vllm)
            except Exception as e:  # noqa: BLE001 (one family's failure is its row; the others are still measured)
                families[family] = {"converted": False, "llama_cpp_loads": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            log(f"{family}: {families[family]}")
    machine = Machine.probe()
    out = {"families": families, "positions": args.positions, "machine": f"{machine.cpu}, {machine.physical_cores} physical cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"# {out['machine']}, {out['date']}, load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| family | architecture | converted | llama.cpp loads | kl_f32 | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for name, r in families.items():
        print(f"| {name} | {r.get('architecture', '–')} | {r['converted']} | {r['llama_cpp_loads']} | {r.get('kl_f32', r.get('error', '–'))} | {r.get('top1_agreement', '–')} |")
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
