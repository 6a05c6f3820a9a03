"""Workload: what is measured — a suite of chat requests, a token budget, seeds and repeats.

Suites are data files: the packaged ones live in ``fractal_opt/data/suites/NAME.yaml``; a recipe can
also point ``suite:`` at its own ``.yaml`` (same shape) or ``.jsonl`` file (one request per line:
``{"id": ..., "messages": [...]}`` or ``{"prompt": "..."}``). A request may add ``"chunks": [...]``
(retrieved passages, best first): they are put before the last user message as ``[1] ...``
paragraphs, which the ``drop_chunks`` prompt budget can drop. docs/workloads.md lists the suites.

Example:
    >>> from fractal_opt.workloads.workload import Workload
    >>> wl = Workload(suite="default", max_new_tokens=32)
    >>> [r.id for r in wl.requests()][:2]
    ['short-1', 'short-2']
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from ..core.errors import RecipeError, closest
from .request import Request

if TYPE_CHECKING:
    from .conversations import Conversation

__all__ = ["LoadProfile", "Request", "Workload", "packaged_suites"]


def packaged_suites() -> list[str]:
    """Names of the suites shipped with fractal_opt."""
    folder = resources.files("fractal_opt") / "data" / "suites"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What each measurement runs.

    Attributes:
        suite: a packaged suite name (``fractal_opt.workloads.workload.packaged_suites()``) or a path to a
            ``.yaml`` / ``.jsonl`` file of requests.
        max_new_tokens: the token budget per request (generation stops earlier at end-of-sequence).
        repeats: timed passes over the suite per measurement (the warm-up is extra).
        max_repeats: budget for adaptive repeats: when a comparison's interval is still too wide
            after ``repeats`` rounds, rounds are added up to this many (None = ``repeats``, no extension).
        warmup: untimed passes over the suite (8 tokens each) after every build; kernels, caches
            and torch.compile warm up here.
        seed: seed for sampling, reset before every request so runs compare like for like.
        limit: use only the first ``limit`` requests of the suite (None = all).
        load: how requests arrive (``{mode: closed|poisson, concurrency, rate, requests,
            output_tokens, ...}``, see :class:`fractal_opt.load.LoadProfile`). With it, every plan is
            measured through a server under that load (aggregate tokens/s, TTFT / ITL percentiles);
            without it, the suite is served synchronously.
        budget_s: the run's time budget in seconds (None = none): searches order their work to fit
            it, and once it is spent the remaining passes are skipped and the best plan found is
            confirmed (``fractal-opt run --budget 6m`` overrides it).
    """

    suite: str = "default"
    max_new_tokens: int = 64
    repeats: int = 3
    max_repeats: int | None = None
    warmup: int = 1
    seed: int = 0
    limit: int | None = None
    load: dict[str, Any] | None = None  # a load profile (fractal_opt.load.LoadProfile): measure through a server under load
    budget_s: float | None = None  # the run's time budget (seconds), baseline and final confirmation included

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            if getattr(self, name) < low:
                raise RecipeError(f"workload, key {name!r}: got {getattr(self, name)}, expected an integer >= {low}.")
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise RecipeError(f"workload, key 'max_repeats': got {self.max_repeats}, expected an integer >= repeats ({self.repeats}) or null.")
        if self.budget_s is not None and not self.budget_s > 0:
            raise RecipeError(f"workload, key 'budget_s': got {self.budget_s}, expected seconds above 0 such as 360 (or null: no budget).")
        if self.limit is not None and self.limit < 1:
            raise RecipeError(f"workload, key 'limit': got {self.limit}, expected an integer >= 1 or null.")
        if self.load is not None:
            self.load_profile()  # validates now, before any model loads

    def load_profile(self):
        """The ``load`` key as a :class:`fractal_opt.load.LoadProfile` (None without one)."""
        from .workload import LoadProfile

        return None if self.load is None else LoadProfile.from_data(self.load)

    def requests(self) -> list[Request]:
        """Load the suite's requests (validated). A conversation suite gives each conversation's
        first turn (its replay turn by turn is the ``conversations`` load: :meth:`conversations`)."""
        data = _load_suite(self.suite)
        where = f"workload suite {self.suite!r}"
        from .conversations import is_conversation_data

        profile = self.load_profile()
        if is_conversation_data(data) or (profile is not None and profile.mode == "conversations"):
            convs = self.conversations(data)
            return [c.first_request() for c in convs]
        raw = data.get("requests") if isinstance(data, dict) else data
        if not isinstance(raw, list) or not raw:
            raise RecipeError(f"{where}: expected a non-empty list of requests.")
        from ..core.validate import parse_each

        requests = parse_each(raw, lambda item, i: Request.from_data(item, index=i, where=where))
        return requests[: self.limit] if self.limit else requests


    def check_wanted(self, metrics: set[str]) -> None:
        """Refuse a recipe that judges on a number this workload never measures: ``capacity`` (as
        objective, guard or target) needs a load profile with ``capacity: true``."""
        profile = self.load_profile()
        if "capacity" in metrics and (profile is None or not profile.capacity):
            msg = ("the recipe judges on 'capacity', which only a load profile with capacity: true measures "
                   "(workload: {load: {mode: conversations, capacity: true, slo_ttft_ms: ...}}); add it, or judge on another metric.")
            raise RecipeError(msg)

    def conversations(self, data: Any = None) -> list[Conversation]:
        """The suite read as conversations (every turn), validated against the load profile:
        ``history: reference`` needs a reference answer for every turn but the last one replayed."""
        from .conversations import load_conversations

        where = f"workload suite {self.suite!r}"
        convs = load_conversations(_load_suite(self.suite) if data is None else data, where=where)
        convs = convs[: self.limit] if self.limit else convs
        profile = self.load_profile()
        if profile is not None and profile.history == "reference":
            for c in convs:
                replayed = c.turns[: profile.turns] if profile.turns else c.turns
                missing = [k for k, (_, answer) in enumerate(replayed[:-1], start=1) if answer is None]
                if missing:
                    msg = (f"{where}: conversation {c.id!r} has no reference answer for turn {missing[0]}, and the load says "
                           "history: reference (replay the suite's own answers). Give every turn an 'assistant' answer, or use history: model.")
                    raise RecipeError(msg)
        return convs


def _load_suite(suite: str) -> Any:
    from ..core.validate import load_data

    path = Path(suite).expanduser()
    if path.suffix in (".yaml", ".yml", ".jsonl", ".json"):
        return load_data(path, what="workload, key 'suite': file")
    names = packaged_suites()
    if suite not in names:
        msg = f"workload, key 'suite': unknown suite {suite!r}. Packaged suites are: {names}, or give a path to a .yaml/.jsonl file.{closest(suite, names)}"
        raise RecipeError(msg)
    text = (resources.files("fractal_opt") / "data" / "suites" / f"{suite}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


@dataclass(frozen=True, kw_only=True)
class LoadProfile:
    """Workload key ``load``: how requests arrive during a measurement.

    Attributes:
        mode: ``closed`` (``concurrency`` requests always in flight), ``poisson`` (``rate`` per s)
            or ``conversations`` (``users`` users, each replaying a conversation of the suite turn
            by turn: every next prompt is the history, the model's answer and the next message).
        concurrency: closed-loop clients. Under a concurrency ramp the clients follow the level.
        rate: Poisson arrivals per second (required for ``poisson``).
        requests: requests per measurement round (None = 2 × concurrency, at least the suite).
        output_tokens: token budgets drawn per request (seeded) for mixed output lengths;
            empty = every request gets the workload's max_new_tokens.
        ignore_eos: generate each request's whole budget (fixed output lengths, as benchmarks do).
        timeout_s: per-request deadline (None = the plan's).
        cancel_fraction: share of requests the client cancels after a random delay in
            ``[0, cancel_after_s]`` (tests the cancel path under load).
        memory_headroom: share of the device's memory that must stay free; a round that leaves
            less fails (and a concurrency ramp stops).
        seed: seeds output lengths, arrival gaps and cancellations.
        slo_ttft_ms / slo_tpot_ms / slo_e2e_ms: latency objectives per request (None = none):
            time to first token, mean time per output token after the first, end to end. With
            any of them set, the summary reports goodput: the requests (and their tokens) per
            second that finished and met every objective.
        slo_percentile: the percentile at which the SLOs must hold for a load to be within
            capacity (90: nine requests in ten meet each objective).
        users / turns / think_s / history: the ``conversations`` mode: the users at once (user
            ``u`` replays conversation ``u`` of the suite, cycling), the turns each replays (None =
            all of its turns), the mean think time between a user's turns (exponential, seeded; 0 =
            none), and what goes into the history: ``model`` (the runtime's own answers) or
            ``reference`` (the suite's recorded answers: every plan sees the same prompts).
        warm_start: the ``conversations`` mode: each round (and capacity probe) starts on a server
            that has already served the shared system prompt, as a deployment's running server
            has: one untimed first turn per user (other users, one token each) before the timed
            turns. False: none; turn 1 finds only what the server kept from before (after a
            start or a reload: nothing, so every user pays the system prompt's prefill).
        capacity: measure the capacity under the SLOs in every round (the ``capacity`` metric):
            the highest offered load (``rate`` for poisson, ``users`` for conversations,
            ``concurrency`` for closed) at which every SLO holds at ``slo_percentile`` and under 1%
            of requests fail, found by growing the load from the profile's own value until an SLO
            breaks, then bisecting to ``capacity_resolution`` (relative), at most ``capacity_max``.
    """

    mode: Literal["closed", "poisson", "conversations"] = "closed"
    concurrency: int = 8
    rate: float | None = None
    requests: int | None = None
    output_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False
    timeout_s: float | None = None
    cancel_fraction: float = 0.0
    cancel_after_s: float = 0.5
    memory_headroom: float = 0.1
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    slo_percentile: float = 90.0
    users: int = 8
    turns: int | None = None
    think_s: float = 0.0
    history: Literal["model", "reference"] = "model"
    warm_start: bool = False
    capacity: bool = False
    capacity_max: float = 256.0
    capacity_resolution: float = 0.1

    def __post_init__(self) -> None:
        problems = self._conversation_problems()
        if self.concurrency < 1:
            problems.append(f"'concurrency': got {self.concurrency}, expected an integer >= 1")
        if self.mode == "poisson" and (self.rate is None or self.rate <= 0):
            problems.append(f"'rate': got {self.rate}, expected requests per second > 0 for mode 'poisson'")
        if self.requests is not None and self.requests < 1:
            problems.append(f"'requests': got {self.requests}, expected an integer >= 1 or null")
        if any(n < 1 for n in self.output_tokens):
            problems.append(f"'output_tokens': got {list(self.output_tokens)}, expected token budgets >= 1")
        if not 0 <= self.cancel_fraction <= 1:
            problems.append(f"'cancel_fraction': got {self.cancel_fraction}, expected a fraction in [0, 1]")
        if not 0 <= self.memory_headroom < 1:
            problems.append(f"'memory_headroom': got {self.memory_headroom}, expected a fraction in [0, 1)")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name!r}: got {value}, expected milliseconds > 0 or null")
        if problems:
            raise RecipeError("workload, key 'load': " + "; ".join(problems) + ".")

    def _conversation_problems(self) -> list[str]:
        """What is wrong with the conversation and capacity keys (each named with its value)."""
        problems = []
        if self.users < 1:
            problems.append(f"'users': got {self.users}, expected an integer >= 1")
        if self.turns is not None and self.turns < 1:
            problems.append(f"'turns': got {self.turns}, expected an integer >= 1 or null (every turn)")
        if not self.think_s >= 0:
            problems.append(f"'think_s': got {self.think_s}, expected seconds >= 0")
        if not 0 < self.slo_percentile < 100:
            problems.append(f"'slo_percentile': got {self.slo_percentile}, expected a percentile in (0, 100)")
        if not 0 < self.capacity_resolution < 1:
            problems.append(f"'capacity_resolution': got {self.capacity_resolution}, expected a relative width in (0, 1) such as 0.1")
        if not self.capacity_max > 0:
            problems.append(f"'capacity_max': got {self.capacity_max}, expected a load > 0")
        if self.capacity and not self.slos():
            problems.append("'capacity': true needs at least one SLO (slo_ttft_ms, slo_tpot_ms or slo_e2e_ms): capacity is the load at which they hold")
        return problems

    def offered(self) -> float:
        """The offered load this profile names: users, arrivals per second, or closed-loop clients."""
        if self.mode == "conversations":
            return float(self.users)
        if self.mode == "poisson":
            return float(self.rate or 0.0)
        return float(self.concurrency)

    def at_load(self, load: float) -> LoadProfile:
        """The same profile at another offered load (the capacity search's probes)."""
        import dataclasses

        if self.mode == "conversations":
            return dataclasses.replace(self, users=max(1, round(load)))
        if self.mode == "poisson":
            return dataclasses.replace(self, rate=load)
        return dataclasses.replace(self, concurrency=max(1, round(load)))

    def slos(self) -> dict[str, float]:
        """The latency objectives that are set, by record attribute."""
        pairs = (("ttft_ms", self.slo_ttft_ms), ("tpot_ms", self.slo_tpot_ms), ("e2e_ms", self.slo_e2e_ms))
        return {name: limit for name, limit in pairs if limit is not None}

    @classmethod
    def from_data(cls, data: Any) -> LoadProfile:
        """Build from the YAML mapping, naming unknown keys and wrong types."""
        from ..core.validate import build

        return build(cls, data, where="workload, key 'load'")
