"""The budget calculator against hand-computed configurations, its errors, and the CLI."""

from __future__ import annotations

import json

import pytest

from fractal_opt.core.errors import FractalOptError, ModelSourceError
from fractal_opt.measure.budget import budget

SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
# Llama-2-7B: multi-head attention (32 KV heads = 32 attention heads), untied head, no head_dim key.
LLAMA2_7B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
             "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False}
# Llama-3-8B: grouped-query attention with 8 KV heads.
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}


def test_smollm2_by_hand():
    """SmolLM2-135M: 134,515,008 parameters; KV = 2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 bytes/token in bf16."""
    b = budget(SMOLLM2, context=2048, batch=1, dtype="bfloat16")
    # embed 49152*576 + 30 * (q 576*576 + k,v 2*576*192 + o 576*576 + mlp 3*576*1536 + norms 2*576) + final norm 576
    assert b.params == 49152 * 576 + 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576 == 134_515_008
    assert b.kv_bytes_per_token == 23_040
    assert b.kv_bytes == 23_040 * 2048
    assert b.weight_bytes == 134_515_008 * 2
    assert budget(SMOLLM2, dtype="float32").kv_bytes_per_token == 46_080


def test_llama2_7b_by_hand():
    """Llama-2-7B: 6,738,415,616 parameters, 0.5 MiB of fp16 KV per token, 4 sequences of 4k fit next to the weights in 24 GB."""
    b = budget(LLAMA2_7B, context=4096, batch=1, dtype="float16", memory_gb=24, bandwidth_gbs=1000)
    assert b.params == 6_738_415_616
    assert b.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288  # head_dim = 4096 / 32
    assert b.kv_bytes == 2 * 2**30
    # (24e9 - 13,476,831,232 weight bytes) // 2 GiB per 4k sequence = 4
    assert b.weight_bytes == 13_476_831_232 and b.sequences_that_fit == 4
    # One decode step reads every weight but the untied input embedding (one row per token) + the 4k KV.
    step_bytes = (6_738_415_616 - 32000 * 4096) * 2 + 2 * 2**30
    assert b.decode_ceiling_tokens_per_s == pytest.approx(1e12 / step_bytes)
    assert b.decode_ceiling_tokens_per_s == pytest.approx(65.095, rel=1e-4)


def test_gqa_uses_kv_heads_not_attention_heads():
    """Llama-3-8B (8 KV heads of 32): KV is 2 x 32 x 8 x 128 x 2 = 131,072 bytes/token, a quarter of what 32 heads would need."""
    b = budget(LLAMA3_8B, context=8192, batch=4, dtype="bfloat16")
    assert b.params == 8_030_261_248
    assert b.kv_bytes_per_token == 131_072
    assert b.kv_bytes == 131_072 * 8192 * 4
    mha = budget({**LLAMA3_8B, "num_key_value_heads": 32}, dtype="bfloat16")
    assert mha.kv_bytes_per_token == 4 * b.kv_bytes_per_token


def test_quantized_weights_and_kv_bits():
    """int8 linear layers halve the blocks' bf16 bytes but keep embeddings and norms in bf16; 8-bit KV halves the KV."""
    full = budget(LLAMA2_7B, dtype="bfloat16")
    q = budget(LLAMA2_7B, dtype="bfloat16", weights_bits=8, kv_bits=8)
    block_linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert full.weight_bytes - q.weight_bytes == block_linear  # 2 bytes -> 1 byte per block weight
    assert q.kv_bytes_per_token == full.kv_bytes_per_token // 2


def test_batch_raises_aggregate_ceiling_but_not_per_sequence():
    """A batch shares one weight read per step: aggregate decode ceiling grows, per-sequence falls as KV grows."""
    one = budget(LLAMA3_8B, context=1024, batch=1, bandwidth_gbs=100)
    many = budget(LLAMA3_8B, context=1024, batch=16, bandwidth_gbs=100)
    assert many.decode_ceiling_tokens_per_s > 10 * one.decode_ceiling_tokens_per_s
    assert many.decode_ceiling_per_sequence < one.decode_ceiling_per_sequence


def test_param_count_matches_a_real_model(tiny_dir):
    """The config arithmetic counts exactly the parameters transformers builds (tiny model: GQA, tied embeddings)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    real = sum(p.numel() for p in model.parameters())  # tied weights are yielded once
    assert budget(tiny_dir).params == real
    assert budget(tiny_dir / "config.json").params == real


def test_errors_name_the_problem(tmp_path):
    """Bad inputs fail with the value and what is allowed: unknown dtype (with the closest), bad numbers, configs without a shape."""
    with pytest.raises(FractalOptError, match="bfloat16"):
        budget(SMOLLM2, dtype="bfloat61")
    with pytest.raises(FractalOptError, match="context got 0, expected an integer from 1 to 100,000,000 tokens"):
        budget(SMOLLM2, context=0)
    with pytest.raises(FractalOptError, match="weights_bits must be one of"):
        budget(SMOLLM2, weights_bits=7)
    with pytest.raises(ModelSourceError, match="encoder-decoder"):
        budget({"model_type": "t5"})
    with pytest.raises(ModelSourceError, match="num_hidden_layers"):
        budget({"model_type": "not-an-architecture", "hidden_size": 64})
    with pytest.raises(ModelSourceError, match="smollm2-135m-instruct"):
        budget("smollm2-135m")


def test_cli_budget_json(tmp_path, capsys):
    """`fractal-opt budget CONFIG --json` prints the same numbers as the Python function."""
    from fractal_opt.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    assert main(["budget", str(path), "--context", "4096", "--dtype", "float16", "--memory-gb", "24", "--bandwidth-gbs", "1000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 6_738_415_616 and data["sequences_that_fit"] == 4 and data["shape"]["kv_heads"] == 32
    assert main(["budget", str(path), "--batch", "2"]) == 0
    assert "KV cache" in capsys.readouterr().out
    assert main(["budget", str(path), "--dtype", "fp9"]) == 2


GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}  # no tie_word_embeddings


def test_gpt2_counts_124m_with_its_own_defaults(tmp_path):
    """A GPT-2 config that does not say tie_word_embeddings is tied (GPT2Config's default, read
    through AutoConfig): 124,439,808 parameters, as GPT2LMHeadModel holds, not 163 M."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    b = budget(path, context=1024)
    # wte 50257x768 + wpe 1024x768 + 12 x (c_attn 768x2304+2304, c_proj 768x768+768, c_fc 768x3072+3072, c_proj 3072x768+768, 2 LayerNorms 2x1536) + ln_f 1536
    by_hand = 50257 * 768 + 1024 * 768 + 12 * (768 * 2304 + 2304 + 768 * 768 + 768 + 768 * 3072 + 3072 + 3072 * 768 + 768 + 2 * 1536) + 1536
    assert b.params == by_hand == 124_439_808 and b.shape.tied_embeddings and not b.notes
    with torch.device("meta"):  # no memory, no weights: the parameter shapes transformers builds
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**GPT2))
    assert b.params == sum(p.numel() for p in model.parameters())
    assert b.weight_bytes == by_hand * 2
    assert budget({**GPT2, "tie_word_embeddings": False}).params == by_hand + 50257 * 768  # an untied head is counted when the config says so


def test_sliding_window_layers_hold_at_most_their_window():
    """Gemma-3-style layer_types: sliding layers cache at most the window, full layers the whole context."""
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000, "sliding_window": 512,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    b = budget(gemma, context=8192, dtype="bfloat16")
    per_layer_token = 2 * 1 * 64 * 2
    assert (b.sliding_layers, b.sliding_window) == (5, 512)
    assert b.kv_bytes == per_layer_token * (1 * 8192 + 5 * 512)
    assert "5 of 6 layers hold at most their 512-token window" in b.to_text()
    short = budget(gemma, context=256)  # shorter than the window: every layer holds the context
    assert short.kv_bytes == per_layer_token * 6 * 256
    # Mistral-style: a window and no layer_types means every layer; an explicit null means none.
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 256, "vocab_size": 100}
    assert budget({**mistral, "sliding_window": 1024}, context=4096).kv_bytes == budget({**mistral, "sliding_window": None}, context=1024).kv_bytes
    assert budget({**mistral, "sliding_window": None}, context=4096).sliding_layers == 0


def test_architectures_the_arithmetic_does_not_model_are_named():
    """Multi-head latent attention and hybrid stacks come with a warning that says what is off."""
    mla = budget({"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000,
                  "kv_lora_rank": 64, "qk_rope_head_dim": 16, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 4,
                  "first_k_dense_replace": 1})
    assert any("multi-head latent attention" in n and "320 values per token" in n for n in mla.notes), mla.notes
    assert "warning          multi-head latent attention" in mla.to_text()
    hybrid = budget({"model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000,
                     "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]})
    assert any(n.startswith("hybrid layers: 3 of 4 are linear_attention") for n in hybrid.notes), hybrid.notes
    unknown = budget({"model_type": "my_own_lm", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100})
    assert any("not a transformers architecture" in n for n in unknown.notes)


@pytest.mark.parametrize(("name", "value"), [("context", 10**20), ("context", -1), ("batch", 0), ("bandwidth_gbs", float("inf")),
                                             ("memory_gb", float("nan")), ("memory_gb", -4.0), ("context", 2.5)])
def test_numbers_without_a_sane_bound_are_refused(name, value):
    """The calculator refuses what no machine has: the message names the number, the value and the range."""
    with pytest.raises(FractalOptError, match=rf"budget: {name} got .*, expected (an integer|a number) from"):
        budget(SMOLLM2, **{name: value})


@pytest.mark.parametrize(("args", "flag"), [(["--context", "1e20"], "--context"), (["--bandwidth-gbs", "inf"], "--bandwidth-gbs"),
                                            (["--batch", "0"], "--batch"), (["--memory-gb", "-1"], "--memory-gb"),
                                            (["--context", "-5"], "--context"), (["--kv-bits", "7"], "--kv-bits")])
def test_cli_refuses_unbounded_numbers_with_exit_2(tmp_path, capsys, args, flag):
    """`fractal-opt budget` exits 2 before reading the model, naming the flag, the value and what is allowed."""
    from fractal_opt.cli import main

    assert main(["budget", "no-such-model-is-read", *args]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: got {args[1]!r}, expected " in err and "Traceback" not in err
