"""fractal-opt export: every plan field x every target is mapped, and the mapping does what it says.

The table test iterates the Plan dataclasses, so a new plan field fails here until each target's
table says where it goes. The behaviour test changes one field at a time (in a plan where it
matters: cb_* fields under continuous batching, kv_bits with a quantized cache...) and checks the
export reflects it: a mapped field changes the command / environment / request / files, a lost
field is listed as not carrying over, with its reason.
"""

from __future__ import annotations

import json

import pytest
import yaml

from fractal_opt.cli import main
from fractal_opt.core.errors import RecipeError
from fractal_opt.export import KINDS, TARGETS, export, plan_fields, table
from fractal_opt.tower.plan import Plan

# A non-default value per field, and the fields it needs set to matter: {field: (value, context)}.
CONTINUOUS = {"scheduling.batching": "continuous"}
QUANT_KV = {"model.kv_cache": "quantized", "model.kv_bits": 4, "model.kv_backend": "quanto"}
SAMPLING = {"application.do_sample": True}
SAMPLES: dict[str, tuple[object, dict[str, object]]] = {
    "source": ("other-model", {}),
    "hardware.runtime": ("vllm", {}),
    "hardware.device": ("cuda", {}),
    "hardware.device_map": ("auto", {}),
    "hardware.max_memory": (("0=20GiB",), {}),
    "hardware.offload_folder": ("/tmp/offload", {}),
    "hardware.dtype": ("bfloat16", {}),
    "hardware.threads": (3, {}),
    "hardware.attention": ("eager", {}),
    "hardware.matmul_precision": ("high", {}),
    "hardware.compile": ("max-autotune", {}),
    "hardware.prepack": (("lm_head",), {}),
    "hardware.flash_attention": ("on", {}),
    "hardware.n_batch": (512, {}),
    "hardware.n_ubatch": (256, {}),
    "hardware.runtime_path": ("/opt/vllm/bin/vllm", {}),
    "hardware.runtime_url": ("http://127.0.0.1:9000", {}),
    "hardware.tensor_parallel": (2, {"hardware.device": "cuda"}),
    "hardware.pipeline_parallel": (2, {"hardware.device": "cuda"}),
    "hardware.rpc_workers": (2, {}),
    "hardware.rpc_endpoints": (("127.0.0.1:1",), {}),  # refused at once (connection refused), never a network wait
    "hardware.rpc_bind": ("0.0.0.0", {"hardware.rpc_workers": 2}),
    "model.weight_bits": (8, {}),
    "model.quant_backend": ("bitsandbytes", {"model.weight_bits": 8}),
    "model.quant_method": ("fp4", {"model.weight_bits": 4, "model.quant_backend": "bitsandbytes"}),  # nf4 is the default
    "model.quant_group_size": (64, {"model.weight_bits": 4, "model.quant_backend": "torchao"}),
    "model.quant_skip": (("lm_head",), {"model.weight_bits": 8}),
    "model.quant_sensitivity_max_kl": (0.01, {"model.weight_bits": 8}),
    "model.kv_cache": ("static", {}),
    "model.kv_bits": (8, {"model.kv_cache": "quantized", "model.kv_backend": "native"}),
    "model.kv_backend": ("hqq", {"model.kv_cache": "quantized", "model.kv_bits": 4}),
    "model.context_cap": (2048, {"model.kv_cache": "static"}),
    "model.trust_remote_code": (True, {}),
    "scheduling.batching": ("continuous", {}),
    "scheduling.batch_size": (8, {"scheduling.batching": "static"}),
    "scheduling.max_wait_ms": (50.0, {"scheduling.batching": "static", "scheduling.batch_size": 4}),
    "scheduling.max_concurrency": (8, CONTINUOUS),
    "scheduling.streaming": (False, {}),
    "scheduling.prefix_cache": (True, {}),
    "scheduling.max_queue": (16, {}),
    "scheduling.timeout_s": (30.0, {}),
    "scheduling.cb_max_batch_tokens": (512, CONTINUOUS),
    "scheduling.cb_num_blocks": (64, CONTINUOUS),
    "scheduling.cb_page_size": (128, CONTINUOUS),
    "scheduling.cb_max_memory_percent": (0.5, CONTINUOUS),
    "scheduling.cb_scheduler": ("prefill_first", CONTINUOUS),
    "scheduling.replicas": (2, {}),
    "scheduling.replica_cores": (1, {"scheduling.replicas": 2}),
    "scheduling.router": ("haproxy", {"scheduling.replicas": 2}),
    "application.max_new_tokens": (24, {}),
    "application.stop": (("\n\n",), {}),
    "application.do_sample": (True, {}),
    "application.temperature": (0.7, SAMPLING),
    "application.top_p": (0.9, SAMPLING),
    "application.top_k": (20, SAMPLING),
    "application.min_p": (0.05, SAMPLING),
    "application.num_beams": (4, {}),
    "application.repetition_penalty": (1.2, {}),
    "application.no_repeat_ngram_size": (3, {}),
    "application.prompt_budget": (512, {}),
    "application.prompt_strategy": ("head_tail", {"application.prompt_budget": 512}),
    "application.head_share": (0.3, {"application.prompt_budget": 512, "application.prompt_strategy": "head_tail"}),
    "application.response_cache": ("exact", {}),
    "application.cache_max_entries": (16, {"application.response_cache": "exact"}),
    "application.cache_ttl_s": (60.0, {"application.response_cache": "exact"}),
    "application.cache_threshold": (0.8, {"application.response_cache": "semantic"}),
    "application.prompt_lookup_tokens": (10, {}),
    "application.draft": ("tiny-draft", {}),
    "application.draft_tokens": (3, {"application.draft": "tiny-draft"}),
    "application.chat_template": ("none", {}),
}


def _plan(values: dict[str, object]) -> Plan:
    plan = Plan(source=str(values.get("source", "my-model")))
    for name, value in values.items():
        if name != "source":
            section, key = name.split(".")
            plan = plan.replace_section(section, **{key: value})
    return plan


@pytest.mark.parametrize("target", TARGETS)
def test_every_plan_field_is_mapped_for_every_target(target):
    """A new Plan field fails here until this target's table names where it goes."""
    mapped = table(target)
    missing = [f for f in plan_fields() if f not in mapped]
    assert not missing, f"{target}: plan fields with no export mapping: {missing} (add them to fractal_opt/export.py)"
    assert not set(mapped) - set(plan_fields()), f"{target}: mapped fields that are not plan fields: {sorted(set(mapped) - set(plan_fields()))}"
    bad = {f: kind for f, (kind, why) in mapped.items() if kind not in KINDS or not why}
    assert not bad, f"{target}: entries without a valid kind and a reason: {bad}"


def test_the_samples_cover_every_plan_field():
    assert sorted(SAMPLES) == sorted(plan_fields())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_changing_a_field_shows_in_the_export_or_in_what_does_not_carry(target, name):
    value, context = SAMPLES[name]
    base = export(_plan(context), target)
    changed = export(_plan({**context, name: value}), target)
    kind, _ = table(target)[name]
    lost = {f for f, _, _ in changed.lost}
    if kind == "select":
        return  # the model / runtime choice: the command names the model, the note the runtime
    if kind == "lost":
        assert name in lost, f"{target}: {name}={value!r} is mapped 'lost' but not listed as not carrying over"
        return
    settings = (changed.command, changed.env, changed.request, changed.files)
    assert settings != (base.command, base.env, base.request, base.files) or name in lost, (
        f"{target}: {name}={value!r} is mapped {kind!r} but the export did not change and does not list it as lost")


def test_lost_fields_say_why_and_name_the_kept_pass():
    from fractal_opt.layers import get_pass

    passes = [get_pass("quantize").from_params({"bits": 8}), get_pass("queue").from_params({"max_queue": 16})]
    plan = Plan(source="m")
    for p in passes:
        plan = p.apply(plan).with_applied(p.name)
    out = export(plan, "llama-server", passes=passes)
    reasons = {f: why for f, _, why in out.lost}
    assert "model.weight_bits" in reasons and "GGUF" in reasons["model.weight_bits"]
    assert "scheduling.max_queue" in reasons and "fractal-opt serve" in reasons["scheduling.max_queue"]
    assert [name for name, _ in out.lost_passes] == ["model/quantize", "scheduling/queue"]
    assert "re-measure" in out.note and "transformers runtime" in out.note and "another runtime" in out.note


@pytest.mark.parametrize("target", ["llama-server", "vllm"])
def test_continuous_batching_carries_over_without_a_static_batch_note(target):
    """A kept continuous-batching pass exports whole: the static batch's size it also sets is read by no server, so it is not listed as lost."""
    from fractal_opt.layers import get_pass

    batching = get_pass("batching").from_params({"mode": "continuous"})
    plan = batching.apply(Plan(source="m").replace_section("hardware", runtime="llama_cpp")).with_applied(batching.name)
    out = export(plan, target, passes=[batching])
    assert not any(name.startswith("scheduling.batch_size") or name == "scheduling.max_wait_ms" for name, _, _ in out.lost), out.lost
    static = get_pass("batching").from_params({"mode": "static"})
    assert "scheduling.batch_size" in {name for name, _, _ in export(static.apply(Plan(source="m")), "llama-server").lost}


def test_vllm_export_is_the_runtimes_own_engine_args():
    from fractal_opt.runtimes.vllm.engine_args import engine_args

    plan = Plan(source="m").replace_section("scheduling", batching="continuous", max_concurrency=8).replace_section("model", context_cap=2048)
    out = export(plan, "vllm", host="0.0.0.0", port=9000)
    assert out.command == ["vllm", "serve", "m", "--host", "0.0.0.0", "--port", "9000", *engine_args(plan)]
    assert "--max-num-seqs" in out.command and out.command[out.command.index("--max-num-seqs") + 1] == "8"


def test_generation_config_holds_the_plans_decoding():
    plan = Plan(source="m").replace_section("application", do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=32, stop=("###",))
    cfg = json.loads(export(plan, "generation-config").files["generation_config.json"])
    assert cfg == {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0, "max_new_tokens": 32, "stop_strings": ["###"]}


def test_an_unknown_target_names_the_valid_ones():
    with pytest.raises(RecipeError, match="llama-server"):
        export(Plan(source="m"), "llama-srv")


def test_the_cli_exports_a_run_folder(tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": "some-org/some-model", "passes": {"scheduling": [{"batching": {"mode": "continuous"}}]}}), encoding="utf-8")
    out_dir = tmp_path / "gen"
    assert main(["export", str(tmp_path), "--to", "transformers-serve", "--write", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "transformers serve some-org/some-model" in text and "--continuous-batching" in text
    assert json.loads((out_dir / "generation_config.json").read_text()) == {"do_sample": False}
    assert main(["export", str(tmp_path / "gen"), "--to", "vllm"]) == 2  # a folder without recipe.yaml: exit 2, a message
    assert "recipe.yaml" in capsys.readouterr().err


def test_a_run_folder_stands_for_its_tuned_recipe(tmp_path):
    """Engine.from_recipe, serve and export take the --out folder of `fractal-opt run` (its recipe.yaml)."""
    from fractal_opt.runtimes import from_recipe, recipe_source

    (tmp_path / "trace.json").write_text("{}", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"without recipe.yaml .*trace.json"):
        from_recipe(tmp_path)
    (tmp_path / "recipe.yaml").write_text("model: some-org/some-model\n", encoding="utf-8")
    assert recipe_source(tmp_path) == tmp_path / "recipe.yaml"
    assert recipe_source(str(tmp_path / "recipe.yaml")) == str(tmp_path / "recipe.yaml")  # a file stays itself
    assert recipe_source({"model": "x"}) == {"model": "x"}


def test_servers_that_cannot_read_a_gguf_get_the_converted_folder_and_its_tokenizer(monkeypatch, tmp_path):
    """A GGUF source exports as the safetensors folder the transformers / vLLM runtimes measured (vLLM also gets --tokenizer); llama-server keeps the GGUF."""
    import fractal_opt.weights.models as models

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "converted"
    monkeypatch.setattr(models, "materialize", lambda source, progress=print: str(folder) if source.path == gguf.resolve() else "unexpected")
    plan = Plan(source=str(gguf))
    ts = export(plan, "transformers-serve")
    assert ts.command[:3] == ["transformers", "serve", str(folder)] and any(str(folder) in r for r in ts.remarks)
    vl = export(plan, "vllm")
    assert vl.command[:5] == ["vllm", "serve", str(folder), "--tokenizer", str(folder)]
    assert export(plan.replace_section("hardware", runtime="llama_cpp"), "llama-server").command[:3] == ["llama-server", "--model", str(gguf)]


def test_a_plan_without_a_pinned_count_exports_the_count_it_ran_with():
    """threads auto or unset: llama-server gets --threads / --threads-batch with the recorded count, said to be the measuring machine's."""
    plan = Plan(source="m.gguf").replace_section("hardware", runtime="llama_cpp")
    for threads in (None, "auto"):
        out = export(plan.replace_section("hardware", threads=threads), "llama-server", threads=2)
        flags = dict(zip(out.command, out.command[1:]))
        assert flags["--threads"] == "2" and flags["--threads-batch"] == "2"
        assert any("measured plan ran with" in r for r in out.remarks) and "hardware.threads" not in {f for f, _, _ in out.lost}
    pinned = export(plan.replace_section("hardware", threads=1), "llama-server", threads=2)
    assert dict(zip(pinned.command, pinned.command[1:]))["--threads"] == "1" and not pinned.remarks
    unknown = export(plan.replace_section("hardware", threads="auto"), "llama-server")
    assert "--threads" not in unknown.command and "hardware.threads" in {f for f, _, _ in unknown.lost}
    ts = export(Plan(source="m").replace_section("hardware", threads="auto"), "transformers-serve", threads=2)
    assert ts.env["OMP_NUM_THREADS"] == "2"


def test_the_cli_passes_the_thread_count_the_run_recorded(tmp_path, capsys):
    """A run folder whose final plan's census says 2 threads exports --threads 2 for a plan with threads auto."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": "some-org/some-model", "passes": {"hardware": [{"threads": {"count": "auto"}}]}}), encoding="utf-8")
    plan = Plan(source="some-org/some-model").replace_section("hardware", threads="auto").to_dict()
    step = {"pass": "threads", "layer": "hardware", "params": {"count": "auto"}, "status": "kept", "reason": "", "plan": plan, "census": {"threads": 2}}
    trace = {"schema_version": 2, "run": {}, "recipe": {"model": "some-org/some-model"}, "machine": {"cpu": "X", "physical_cores": 2},
             "baseline": {**step, "pass": "baseline", "status": "baseline", "census": {"threads": 4}}, "steps": [step]}
    (tmp_path / "trace.json").write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(tmp_path), "--to", "transformers-serve"]) == 0
    text = capsys.readouterr().out
    assert "OMP_NUM_THREADS=2 transformers serve" in text and "the count the measured plan ran with" in text
