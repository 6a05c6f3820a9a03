"""Prompt budgets: each strategy keeps what it promises and reports the tokens saved."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import BadRequest, RecipeError
from fractal_opt.serving.prompting import AtLeast, HFTokens, WordTokens, fit_prompt, split_chunks
from fractal_opt.workloads.workload import Request, Workload


def chat(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i} " + "word " * 10})
        msgs.append({"role": "assistant", "content": f"answer {i} " + "word " * 10})
    msgs.append({"role": "user", "content": "final question"})
    return msgs


def test_under_budget_is_untouched():
    """A prompt already within the budget comes back unchanged, with nothing saved."""
    msgs = chat(1)
    fitted = fit_prompt(msgs, budget=1000, strategy="recent_turns", tokens=WordTokens())
    assert fitted.messages == msgs and fitted.saved == 0 and fitted.fits


def test_recent_turns_keeps_system_and_latest_turns():
    """recent_turns drops the oldest turns first, keeps the system message and the last question,
    and never starts the kept history with an assistant reply."""
    msgs = chat(4)
    tokens = WordTokens()
    fitted = fit_prompt(msgs, budget=40, strategy="recent_turns", tokens=tokens)
    kept = fitted.messages
    assert fitted.fits and fitted.saved == tokens.count(msgs) - tokens.count(kept) > 0
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "final question"
    assert kept[1]["role"] == "user"
    assert "question 3" in kept[1]["content"]  # the most recent earlier turn survived
    assert all("question 0" not in m["content"] for m in kept)


def test_recent_turns_cannot_drop_the_last_question():
    """When even the last turn alone is over budget, the strategy keeps it and says it does not fit."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "word " * 50}]
    fitted = fit_prompt(msgs, budget=10, strategy="recent_turns", tokens=WordTokens())
    assert not fitted.fits and fitted.messages == msgs


def test_head_tail_keeps_head_and_tail_of_the_longest_message():
    """head_tail cuts the middle of the longest message and keeps its start and end."""
    doc = " ".join(f"w{i}" for i in range(200))
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": doc}]
    fitted = fit_prompt(msgs, budget=60, strategy="head_tail", tokens=WordTokens(), head_share=0.5)
    content = fitted.messages[1]["content"]
    assert fitted.fits and fitted.saved > 100
    assert content.startswith("w0 w1") and content.endswith("w198 w199") and "[...]" in content
    assert "w100" not in content
    assert fitted.messages[0] == msgs[0]


def test_head_share_moves_the_cut():
    """head_share 0 keeps only the tail (where a question usually sits)."""
    doc = " ".join(f"w{i}" for i in range(100))
    fitted = fit_prompt([{"role": "user", "content": doc}], budget=30, strategy="head_tail", tokens=WordTokens(), head_share=0.0)
    content = fitted.messages[0]["content"]
    assert "w0" not in content.split() and content.endswith("w99")


def test_drop_chunks_drops_lowest_ranked_passages():
    """drop_chunks removes [n] passages from the last one back, keeping the question and context header."""
    passages = [f"[{i}] " + f"p{i} " * 20 for i in range(1, 5)]
    content = "Context:\n\n" + "\n\n".join(passages) + "\n\nQuestion: what?"
    tokens = WordTokens()
    fitted = fit_prompt([{"role": "user", "content": content}], budget=50, strategy="drop_chunks", tokens=tokens)
    out = fitted.messages[0]["content"]
    assert fitted.fits
    assert "[1]" in out and "[2]" in out and "[3]" not in out and "[4]" not in out
    assert out.startswith("Context:") and out.endswith("Question: what?")


def test_drop_chunks_without_chunks_changes_nothing():
    """A prompt with no [n] passages cannot be trimmed by drop_chunks and is left as it was."""
    msgs = [{"role": "user", "content": "word " * 100}]
    fitted = fit_prompt(msgs, budget=10, strategy="drop_chunks", tokens=WordTokens())
    assert fitted.messages == msgs and not fitted.fits and "no retrieved passages" in fitted.note


def test_split_chunks_flags_passages():
    """Paragraphs that start with [n] are passages; others are not."""
    parts = split_chunks("Context:\n\n[1] a\n\n[2] b\n\nQuestion: c")
    assert [flag for flag, _ in parts] == [False, True, True, False]


def test_unknown_strategy_names_the_closest():
    """An unknown strategy fails with the valid names and the closest match."""
    with pytest.raises(RecipeError, match="recent_turns"):
        fit_prompt([{"role": "user", "content": "x"}], budget=1, strategy="recent_turn", tokens=WordTokens())


def test_request_chunks_render_as_numbered_passages():
    """A request's chunks list becomes [n] paragraphs before the question, which drop_chunks can drop."""
    req = Request.from_data({"prompt": "Question: when?", "chunks": ["first passage", "second\n\npassage"]}, index=0, where="test")
    content = req.messages[-1][1]
    assert content == "Context:\n\n[1] first passage\n\n[2] second passage\n\nQuestion: when?"
    with pytest.raises(RecipeError, match="chunks"):
        Request.from_data({"prompt": "q", "chunks": "not a list"}, index=0, where="test")


def test_hf_tokens_on_a_real_tokenizer(tiny_dir):
    """With a transformers tokenizer the budget counts the rendered chat prompt, and head_tail lands within it."""
    from transformers import AutoTokenizer

    tokens = HFTokens(AutoTokenizer.from_pretrained(tiny_dir))
    request = Workload(suite="long-context").requests()[0]
    msgs = request.as_messages()
    before = tokens.count(msgs)
    fitted = fit_prompt(msgs, budget=before // 3, strategy="head_tail", tokens=tokens)
    assert fitted.fits and fitted.tokens_after <= before // 3 and fitted.saved >= before - before // 3
    assert fitted.messages[-1]["content"].rstrip().endswith("Answer in two sentences.")


def test_a_prompt_certain_to_be_over_a_limit_is_not_tokenized(tiny_dir):
    """With a limit, a prompt whose bytes alone prove it longer is answered AtLeast its floor without
    tokenizing; a prompt near the limit is counted exactly (the floor never passes the true count)."""
    from transformers import AutoTokenizer

    tokens = HFTokens(AutoTokenizer.from_pretrained(tiny_dir))
    huge = [{"role": "user", "content": "hello " * 200_000}]
    floor = tokens.count(huge, limit=4096)
    assert isinstance(floor, AtLeast) and 4096 < floor <= tokens.count(huge)
    near = [{"role": "user", "content": "hello " * 1000}]
    assert not isinstance(tokens.count(near, limit=4096), AtLeast) and tokens.count(near, limit=4096) == tokens.count(near)


def test_a_chat_template_that_refuses_the_messages_is_a_bad_request(tiny_dir):
    """A template's own raise_exception (roles must alternate, say) is a BadRequest on messages, not an engine failure."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}x"
    tokens = HFTokens(tokenizer)
    assert tokens.count([{"role": "user", "content": "hi"}]) >= 1
    with pytest.raises(BadRequest, match="chat template refuses these messages: Conversation roles must start with user") as e:
        tokens.count([{"role": "assistant", "content": "hi"}])
    assert e.value.param == "messages"
