"""The runtimes' registry: one table per runtime, duplicates refused, and every question the house
asks of a runtime (build, refuse, whole device, eviction, availability) answered from it."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.engine.capabilities import Capabilities
from fractal_opt.engine.registry import RUNTIMES, Runtimes
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.plan import Plan


def _caps(name: str, **kw) -> Capabilities:
    return Capabilities(name=name, summary=f"the {name} runtime", engine=FakeEngine, **kw)


def test_the_built_in_runtimes_are_registered_with_their_tables():
    """transformers, llama_cpp and vllm are registered; llama.cpp serves GGUF files and takes a path, vLLM takes a running server's url."""
    assert RUNTIMES.names()[:3] == ["transformers", "llama_cpp", "vllm"]
    assert RUNTIMES.get("llama_cpp").weights == "gguf" and "path" in RUNTIMES.get("llama_cpp").options
    assert "url" in RUNTIMES.get("vllm").options and not RUNTIMES.get("transformers").options
    assert RUNTIMES.get("transformers").default_threads == "torch_threads"


def test_a_duplicate_or_a_bad_name_is_refused_when_registered():
    """Registering a name twice is refused naming the first; a name that cannot be a plan value is refused."""
    mine = Runtimes(_caps("mine"))
    with pytest.raises(RecipeError, match="runtime 'mine' is registered already"):
        mine.register(_caps("mine"))
    with pytest.raises(RecipeError, match="must be an identifier"):
        mine.register(_caps("my runtime"))


def test_an_unknown_runtime_names_the_valid_ones_and_the_closest():
    """A plan naming no registered runtime: RecipeError listing the valid runtimes and a suggestion."""
    with pytest.raises(RecipeError, match=r"unknown runtime 'llama_cp'\. Valid runtimes are: \['transformers', 'llama_cpp', 'vllm'.*Did you mean 'llama_cpp'"):
        RUNTIMES.get("llama_cp")


def test_only_a_runtime_that_reserves_an_accelerator_takes_the_whole_device():
    """vLLM on a GPU cannot be measured beside another model; on the CPU it can; llama.cpp never takes the whole device."""
    vllm = Plan(source="m").replace_section("hardware", runtime="vllm")
    assert RUNTIMES.takes_whole_device(vllm.replace_section("hardware", device="cuda:0"))
    assert not RUNTIMES.takes_whole_device(vllm.replace_section("hardware", device="cpu"))
    assert not RUNTIMES.takes_whole_device(Plan(source="m").replace_section("hardware", runtime="llama_cpp", device="cuda:0"))


def test_eviction_and_clearing_reach_every_registered_runtime():
    """evict_except and clear_cache call each runtime's own hook once (a runtime without one is left alone)."""
    calls: list[tuple[str, object]] = []
    mine = Runtimes(_caps("a", evict=lambda keep: calls.append(("a", keep)), clear=lambda: calls.append(("a", None))), _caps("b"),
                    _caps("c", evict=lambda keep: calls.append(("c", keep))))
    mine.evict_except({("k",)})
    mine.clear_cache()
    assert calls == [("a", {("k",)}), ("c", {("k",)}), ("a", None)]


def test_availability_names_the_missing_package_before_asking_the_runtime():
    """A runtime whose package is missing is unavailable with the pip line; one without packages asks its own check."""
    machine = cpu_machine()
    mine = Runtimes(_caps("needs", packages=("no_such_package_xyz",)), _caps("asks", available=lambda m: "no server found"), _caps("plain"))
    here = mine.availability(machine)
    assert here["needs"] == "needs the no_such_package_xyz package (pip install no_such_package_xyz; make setup installs it)"
    assert here == {"needs": here["needs"], "asks": "no server found", "plain": None}


def test_build_and_refuse_go_to_the_engine_the_table_names():
    """build(plan) returns the registered engine class's build; refuse(plan) its refusal."""
    class Refusing(FakeEngine):
        @classmethod
        def build(cls, plan, **kw):
            return FakeEngine.factory()(plan)

        @classmethod
        def refuse(cls, plan):
            return "never" if plan.hardware.threads == 3 else None

    mine = Runtimes(Capabilities(name="mine", summary="mine", engine=Refusing))
    plan = Plan(source="m").replace_section("hardware", runtime="mine")
    assert isinstance(mine.build(plan), FakeEngine)
    assert mine.refuse(plan) is None and mine.refuse(plan.replace_section("hardware", threads=3)) == "never"


def test_a_runtime_that_formats_prompts_itself_refuses_a_recipes_template():
    """Only a runtime whose table says token_prompts takes a plan with a recipe's chat template;
    the built-in runtimes all take the rendered ids."""
    mine = Runtimes(Capabilities(name="own", summary="own", engine=FakeEngine), Capabilities(name="ids", summary="ids", engine=FakeEngine, token_prompts=True))
    templated = Plan(source="m").replace_section("application", chat_template="none")
    assert "token_prompts: false" in (mine.refuse(templated.replace_section("hardware", runtime="own")) or "")
    assert mine.refuse(templated.replace_section("hardware", runtime="ids")) is None
    assert all(RUNTIMES.get(name).token_prompts for name in ("transformers", "llama_cpp", "vllm"))
