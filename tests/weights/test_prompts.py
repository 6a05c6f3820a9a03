"""One prompt, every runtime: the model's own chat template, plain completion text for a model
without one, or the recipe's template; tokenized once by the model's own tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from fractal_opt.weights.prompts import NO_TEMPLATE, PromptFormat, prompt_format, prompt_ids

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from fractal_opt.testing import tiny_tokenizer

    return tiny_tokenizer(tmp_path_factory.mktemp("chat-tok"))


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    from fractal_opt.testing import tiny_tokenizer

    return tiny_tokenizer(tmp_path_factory.mktemp("base-tok"), chat_template="")


def test_a_model_with_a_template_renders_through_it_without_adding_special_tokens(chat_tokenizer):
    """The model's own template renders the messages with the generation prompt; the ids are the
    tokenizer's for that text, nothing added (the template writes its own special tokens)."""
    fmt = prompt_format(chat_tokenizer)
    assert fmt.chat and "own chat template" in fmt.origin
    text = fmt.render(CHAT, chat_tokenizer)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert prompt_ids(chat_tokenizer, fmt, CHAT) == chat_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_model_without_a_template_gets_plain_completion_text(base_tokenizer):
    """A base model (no chat template) gets the messages' text joined by newlines, as a completion
    endpoint would, never a ChatML template it never saw."""
    fmt = prompt_format(base_tokenizer)
    assert not fmt.chat and "base model" in fmt.origin
    two = [{"role": "system", "content": "Facts:"}, {"role": "user", "content": "The capital of France is"}]
    assert fmt.render(two) == "Facts:\nThe capital of France is"
    ids = prompt_ids(base_tokenizer, fmt, two)
    assert ids == base_tokenizer("Facts:\nThe capital of France is")["input_ids"]
    assert base_tokenizer.convert_tokens_to_ids("<|im_start|>") not in ids


def test_the_recipe_can_name_plain_text_or_its_own_template(chat_tokenizer):
    """application.chat_template 'none' gives plain text even for a chat model; a Jinja template
    string replaces the model's own."""
    assert not prompt_format(chat_tokenizer, NO_TEMPLATE).chat
    mine = prompt_format(chat_tokenizer, "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    assert mine.origin == "the recipe's chat_template"
    assert mine.render(CHAT, chat_tokenizer) == "Q: What is the capital of France?\nA:"


def test_plain_text_needs_no_tokenizer_and_a_template_does():
    """PromptFormat renders plain text by itself; a template without a tokenizer is refused by name."""
    assert PromptFormat(None, "none").render(CHAT) == "What is the capital of France?"
    with pytest.raises(ValueError, match="tokenizer"):
        PromptFormat("{{ messages }}", "x").render(CHAT)


def test_the_transformers_engine_serves_the_rendered_ids(tiny_dir: Path):
    """The transformers runtime feeds the model exactly prompt_ids(request): its prompt count is their length."""
    from fractal_opt.runtimes import build
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Request

    engine = build(Plan(source=str(tiny_dir)), progress=lambda m: None, max_new_tokens=2)
    request = Request(id="r", messages=(("user", "What is the capital of France?"),))
    [gen] = engine.serve([request], max_new_tokens=2)
    assert gen.prompt_tokens == len(engine.prompt_ids(request)) == len(prompt_ids(engine.tokenizer, prompt_format(engine.tokenizer), CHAT))
