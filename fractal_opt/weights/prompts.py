"""One prompt, every runtime: a request rendered once, by fractal_opt, into the token ids every
runtime receives.

Runtimes format prompts their own way when they are given text or chat messages: llama.cpp's
chat endpoint falls back to a ChatML template the model never saw when a GGUF has none, and
transformers joins the messages as plain text, so the same request reached two runtimes as two
different prompts and the quality gate judged the formatting, not the kernels. Here the prompt is
rendered once, from the model's own chat template (its tokenizer's, which transformers renders in
Jinja's sandbox) or, for a model without one (a base model), as plain completion text, and
tokenized by the model's own tokenizer; every runtime then receives those ids (transformers as
``input_ids``, llama.cpp and vLLM as a token-id prompt of their completion endpoints).

- A chat template is applied with the generation prompt and tokenized without adding special
  tokens: the template writes its own (``{{ bos_token }}``), as transformers' ``apply_chat_template``
  does.
- Plain text is the messages' contents joined by newlines, tokenized with the tokenizer's special
  tokens (a BOS where the model's tokenizer adds one), as a completion endpoint would.
- ``template``: the plan's ``application.chat_template``: None (the model's own, or plain text when
  it has none), ``"none"`` (plain text even when it has one), or a Jinja template of the recipe's.

Example:
    >>> fmt = PromptFormat(template=None, origin="none")
    >>> fmt.render([{"role": "user", "content": "The capital of France is"}])
    'The capital of France is'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_TEMPLATE", "PromptFormat", "has_chat_template", "prompt_format", "prompt_ids", "tokenize"]

NO_TEMPLATE = "none"  # application.chat_template: plain completion text even for a model with a template


@dataclass(frozen=True)
class PromptFormat:
    """How a request becomes the prompt text: a chat template, or plain text."""

    template: str | None  # the Jinja chat template; None: plain completion text
    origin: str  # where it came from, for the trace and errors: "the model's tokenizer", "the recipe", "none: ..."

    @property
    def chat(self) -> bool:
        """True when requests are rendered through a chat template."""
        return self.template is not None

    def render(self, messages: Sequence[dict[str, str]], tokenizer: Any = None) -> str:
        """The prompt text of ``messages`` (the tokenizer supplies the template's special tokens)."""
        if self.template is None:
            return "\n".join(m["content"] for m in messages)
        if tokenizer is None:
            raise ValueError("rendering a chat template needs the model's tokenizer (its special tokens)")
        return tokenizer.apply_chat_template(list(messages), chat_template=self.template, add_generation_prompt=True, tokenize=False)


def prompt_format(tokenizer: Any, template: str | None = None) -> PromptFormat:
    """The prompt format of a model whose transformers tokenizer is ``tokenizer``, under the plan's
    ``application.chat_template`` value ``template``."""
    if template == NO_TEMPLATE:
        return PromptFormat(None, "none: the recipe asks for plain completion text")
    if template is not None:
        return PromptFormat(template, "the recipe's chat_template")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates (tokenizer_config.json may hold a list): the default one
        own = own.get("default")
    if isinstance(own, str) and own.strip():
        return PromptFormat(own, "the model's own chat template")
    return PromptFormat(None, "none: the model has no chat template (a base model), so prompts are plain completion text")


def prompt_ids(tokenizer: Any, fmt: PromptFormat, messages: Sequence[dict[str, str]]) -> list[int]:
    """The token ids the model receives for ``messages``: rendered by ``fmt``, tokenized by ``tokenizer``."""
    return tokenize(tokenizer, fmt, fmt.render(messages, tokenizer))


def tokenize(tokenizer: Any, fmt: PromptFormat, text: str) -> list[int]:
    """The token ids of prompt ``text`` rendered by ``fmt`` (special tokens added to plain text only)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=not fmt.chat)["input_ids"]]


def has_chat_template(source: Any) -> bool:
    """Whether a model's files carry a chat template, read without loading it: a folder's
    chat_template.jinja or tokenizer_config.json, a GGUF's ``tokenizer.chat_template``."""
    from .checks import model_templates
    from .models import gguf_metadata

    if getattr(source, "folder", None) is not None:
        return bool(model_templates(source.folder))
    if getattr(source, "path", None) is not None and source.kind in ("gguf", "embedded"):
        return bool(str(gguf_metadata(str(source.path)).get("tokenizer.chat_template") or "").strip())
    return True  # a hub id not cached here: nothing to read; the chat form is the common one
