"""The cost of a round: CPU-seconds per 1,000 output tokens, dollars per million, joules per token.

What a deployment is judged by is what each token costs, so every measured round reports it:

- ``cpu_s_per_1k_tokens``: user + system CPU time of this process and the engine's server
  processes (``os.times`` / psutil, the same window as ``cpu_utilization``) per 1,000 output tokens.
  It counts the work the plan made the CPUs do, whatever the wall clock; on a GPU the host's share.
- ``usd_per_m_tokens``: the machine's price for the round's wall time per million output tokens,
  when the recipe states the price (``machine: {price_per_hour: ...}``): the machine is rented by
  the hour whether its cores are busy or not, so a plan that serves more tokens an hour costs less.
- ``joules_per_token``: energy counters over the round per output token: the GPU board's (NVML) on
  a GPU, else the CPU packages' RAPL counters through Linux powercap
  (``/sys/class/powercap/intel-rapl:N/energy_uj``, AMD's too). RAPL counts the whole package, other
  processes included. Where no counter is readable, :func:`energy_status` says why in one line.

Example:
    >>> cost_readings(output_tokens=500, wall_s=10.0, cpu_s=20.0, energy_j=None, price_per_hour=3.6)["usd_per_m_tokens"]
    20.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["RaplWindow", "cost_readings", "energy_status"]

POWERCAP = Path("/sys/class/powercap")


def cost_readings(*, output_tokens: int, wall_s: float, cpu_s: float, energy_j: float | None, price_per_hour: float | None) -> dict[str, Any]:
    """The round's cost per token (each None where its inputs are missing or no token came out)."""
    if output_tokens <= 0:
        return {"cpu_s_per_1k_tokens": None, "usd_per_m_tokens": None, "joules_per_token": None}
    return {
        "cpu_s_per_1k_tokens": cpu_s * 1000 / output_tokens,
        "usd_per_m_tokens": price_per_hour * wall_s / 3600 * 1e6 / output_tokens if price_per_hour is not None and wall_s > 0 else None,
        "joules_per_token": energy_j / output_tokens if energy_j is not None else None,
    }


def _packages() -> list[Path]:
    """The top-level RAPL domains (one per CPU package; their sub-zones are parts of them)."""
    return sorted(p for p in POWERCAP.glob("intel-rapl:*") if p.name.count(":") == 1)


def energy_status() -> str:
    """``ok``, or one line saying why the CPU's energy counters cannot be read here."""
    if not POWERCAP.is_dir():
        return f"unavailable: {POWERCAP} does not exist (no RAPL powercap driver: a VM or container usually hides it)"
    zones = _packages()
    if not zones:
        return f"unavailable: no RAPL package zone under {POWERCAP} (intel-rapl:N)"
    try:
        int((zones[0] / "energy_uj").read_text())
    except PermissionError:
        return f"unavailable: {zones[0] / 'energy_uj'} is readable by root only (Linux 5.10 and later, CVE-2020-8694)"
    except (OSError, ValueError) as e:
        return f"unavailable: {zones[0] / 'energy_uj'} cannot be read ({type(e).__name__}: {e})"
    return "ok"


class RaplWindow:
    """The CPU packages' energy (J) between ``__enter__`` and ``__exit__``; ``energy_j`` None when
    unreadable (``status`` says why). Counters wrap at ``max_energy_range_uj``; one wrap per round
    is corrected (a package wraps after tens of minutes at full power)."""

    def __init__(self) -> None:
        self.status = energy_status()
        self.energy_j: float | None = None
        self._start: list[tuple[Path, int, int]] = []

    def __enter__(self) -> RaplWindow:
        if self.status == "ok":
            self._start = [(z, _read(z / "energy_uj"), _read(z / "max_energy_range_uj")) for z in _packages()]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status != "ok":
            return
        total = 0
        for zone, start, span in self._start:
            now = _read(zone / "energy_uj")
            total += now - start if now >= start else now + span - start
        self.energy_j = total / 1e6


def _read(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0
