"""report.html's text sections: the header, every step's table with what one user got, the noise
calibration and the machine (the first screen is :mod:`.html_first_screen`).

Each section is one function ``(trace or steps, policy) -> list of HTML pieces``, so the page
(:func:`.html.render_fragment`) is a list of calls and a new section is one more.
"""

from __future__ import annotations

from typing import Any

from ..language.policy import Policy
from . import one_user
from .html_parts import Step, Trace, cell, figure_html, label, pct, status_text
from .svg import COLOURS, LABEL_W, Svg, data_attrs, esc, fmt_num, is_num, nice_max
from .measurement import resolution
from .reader import wall_time

__all__ = ["CALIBRATED", "calibration", "header", "machine", "steps_table"]

CALIBRATED = ("decode_tokens_per_s", "ttft_ms", "prefill_ms", "e2e_ms", "throughput_tokens_per_s", "peak_memory_mb")


def header(trace: Trace) -> str:
    r = trace.recipe
    wl = r.get("workload") or {}
    run = getattr(trace, "run", {}) or {}
    versions = run.get("versions") or {}
    model = run.get("model") or {}
    out = [f"<h1>fractal_opt report: {esc(r.get('name') or r.get('model'))}</h1>",
           f'<p class="meta">Model <b>{esc(r.get("model"))}</b>; workload: suite <code>{esc(wl.get("suite"))}</code>, '
           f"{esc(wl.get('max_new_tokens'))} new tokens max, {esc(wl.get('repeats'))} repeats after {esc(wl.get('warmup'))} warm-up"
           + (f", load profile {esc((wl.get('load') or {}).get('mode'))}" if wl.get("load") else "") + ".</p>"]
    bits = []
    if run.get("started_at"):
        took = wall_time(run) if trace.finished else None
        bits.append(f"run {esc(run.get('started_at'))} → {esc(run.get('ended_at') or 'not finished')}" + (f" (wall time {esc(took)})" if took else ""))
    if versions:
        bits.append(", ".join(f"{esc(k)} {esc(v)}" for k, v in versions.items() if v))
    if model.get("sha256"):
        bits.append(f"model files sha256 {esc(model['sha256'][:16])}… ({esc(model.get('files'))} files, {fmt_num((model.get('bytes') or 0) / 2**20)} MiB)")
    if bits:
        out.append(f'<p class="meta">{"; ".join(bits)}.</p>')
    if not trace.finished:
        out.append('<p class="banner"><b>This run did not finish</b>: the report shows the steps completed so far.</p>')
    return "\n".join(out)


def steps_table(steps: list[tuple[str, Step]], policy: Policy) -> list[str]:
    cols = (("decode_tokens_per_s", "decode tok/s"), ("ttft_ms", "TTFT ms"), ("e2e_ms", "e2e ms"), ("throughput_tokens_per_s", "throughput tok/s"),
            ("peak_memory_mb", "peak MB"), ("weight_mb", "weights MB"))
    head = "<tr><th>#</th><th>layer</th><th>pass</th><th>verdict</th>" + "".join(f"<th>{esc(h)}</th>" for _, h in cols) + "<th>KL</th><th>reason</th></tr>"
    users = _one_user_cells(steps)
    body = []
    for i, s in steps:
        colour = COLOURS.get(s.status, COLOURS["other"])
        cells = "".join(cell(i, s.metrics, k) for k, _ in cols) + cell(i, s.metrics, "quality.kl_mean", "{:.4f}")
        body.append(f'<tr data-step="{i}"><td>{i}</td><td>{esc(s.layer)}</td><td>{esc(label(s))}</td>'
                    f'<td style="color:{colour};font-weight:600">{esc(status_text(s.status))}</td>{cells}<td>{esc(s.reason)}</td></tr>')
        if i in users:  # the line under its step: what one user got, previous plan -> this step
            body.append(f'<tr class="one-user" data-one-user="{i}"><td></td><td colspan="{len(cols) + 5}">{users[i]}</td></tr>')
    base = next((s for i, s in steps if i == "0"), None)
    return ["<h2>Every step</h2>", ('<p class="note">Medians; the reason is the verdict\'s, in full. trace.json holds every number. '
            f"Under each measured step, what one user got: per request as one user saw it {esc(one_user.under([base, *(s for _, s in steps)]))}; "
            "TTFT and answer are p50 over requests and rounds, streams the median request's decode tokens/s; previous plan → this step, "
            "each % computed from the two numbers next to it (the verdict's paired estimates are in its reason).</p>"),
            f"<table>{head}{''.join(body)}</table>"]


def _one_user_cells(steps: list[tuple[str, Step]]) -> dict[str, str]:
    """Per step index, the one-user cell (:mod:`.one_user`): the baseline's own numbers, each
    measured step's next to the plan it was judged against; none for a skipped or failed step."""
    base = next((s for i, s in steps if i == "0"), None)
    rest = [(i, s) for i, s in steps if i != "0"]
    out: dict[str, str] = {}
    if base is not None and base.metrics:
        figs = [figure_html(f, ("0", ""), ("0", f"metrics.{f.metric}")) for f in one_user.figures(None, base.metrics) if f.after is not None]
        if figs:
            out["0"] = "<b>one user</b>: " + ", ".join(figs)
    for (i, s), prev in zip(rest, one_user.previous_plans(base, [s for _, s in rest])):
        if prev is None:
            continue
        figs = [figure_html(f, (prev.step, f"{prev.path}.{f.metric}"), (i, f"metrics.{f.metric}")) for f in one_user.figures(prev.metrics, s.metrics)
                if f.after is not None]
        if figs:
            out[i] = "<b>one user</b>: " + ", ".join(figs) + f' <small>({esc(prev.source())})</small>'
    return out


def calibration(trace: Trace, policy: Policy) -> list[str]:
    cal = trace.calibration or {}
    intervals = cal.get("intervals") or {}
    metrics = [m for m in CALIBRATED if is_num(cal.get(m))]
    if not metrics:
        return []
    spans = [abs(x) for m in metrics for x in (intervals.get(m) or [cal[m]]) if is_num(x)] + [policy.min_effect]
    half = nice_max(max(spans) * 1.05)
    row_h, width = 24, 900
    svg = Svg(width, 10 + len(metrics) * row_h + 40, title="noise calibration: A/A change with 95% intervals")
    x0, x1 = LABEL_W, width - 170
    xc = (x0 + x1) / 2
    sc = (x1 - x0) / 2 / half
    bottom = 10 + len(metrics) * row_h
    svg.rect(xc - policy.min_effect * sc, 4, 2 * policy.min_effect * sc, bottom - 4, fill="#2e9e4f", opacity=0.12,
             tip=f"±min_effect {policy.min_effect:.0%}: the smallest change that counts even on a quiet machine")
    for k in range(-2, 3):
        x = xc + k * (x1 - x0) / 4
        svg.line(x, 4, x, bottom, stroke="#e3e3e3" if k else "#888")
        svg.text(x, bottom + 14, f"{k * half / 2:+.0%}" if k else "0", anchor="middle", size=10, fill="#555")
    for n, m in enumerate(metrics):
        y = 10 + n * row_h + row_h / 2
        svg.text(x0 - 8, y + 4, m, anchor="end")
        iv = intervals.get(m)
        if iv and all(is_num(x) for x in iv):
            lo, hi = (max(-half, min(half, x)) for x in iv)
            svg.line(xc + lo * sc, y, xc + hi * sc, y, stroke="#4c78a8", width=2)
        svg.circle(xc + max(-half, min(half, cal[m])) * sc, y, 4.5, fill="#4c78a8", extra=data_attrs("calibration", m, cal[m]),
                   tip=f"{m}: A/A {cal[m]:+.1%}" + (f", resolves ±{resolution(iv)}" if iv else ""))
        svg.text(x1 + 8, y + 4, f"±{resolution(iv)} (A/A {cal[m]:+.1%})" if iv else f"{cal[m]:+.1%}", size=11)
    rounds = cal.get("rounds")
    return ["<h2>Noise calibration</h2>",
            (f'<p class="note">The baseline measured against itself{f", interleaved, {esc(rounds)} rounds" if rounds else ""}: how much a change of nothing moves '
            "each number here (dot: A/A change, line: 95% interval, clipped to the axis). Green: the minimum effect the policy asks for.</p>"), svg.render()]


def machine(trace: Trace) -> list[str]:
    m = trace.machine or {}
    if not m:
        return []
    limits = m.get("limits") or {}
    rows = [("CPU", f"{m.get('cpu')}, {m.get('logical_cores')} logical / {m.get('physical_cores')} physical cores"),
            ("memory", f"{(m.get('memory_bytes') or 0) / 2**30:.1f} GiB"),
            ("GPUs", ", ".join(m.get("cuda_devices") or []) or "none"),
            ("platform", m.get("platform"))]
    if limits:
        flops = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in (limits.get("peak_flops") or {}).items() if is_num(v))
        rows += [("memory bandwidth", (f"{(limits.get('bandwidth_bytes_per_s') or 0) / 1e9:.1f} GB/s read, {(limits.get('copy_bandwidth_bytes_per_s') or 0) / 1e9:.1f} GB/s copy "
                  f"({limits.get('device')}, {limits.get('threads')} threads, probed in {limits.get('probe_s')} s{', cached' if limits.get('cached') else ''}, "
                  f"load average {limits.get('load_average')})")),
                 ("matmul peak", flops or "–")]
    packages = m.get("packages") or {}
    rows.append(("packages", ", ".join(f"{k} {v}" for k, v in packages.items() if v)))
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows)
    return ["<h2>The machine</h2>", f"<dl>{dl}</dl>"]
