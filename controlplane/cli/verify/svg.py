"""Two small SVG pictures for the report, written by hand (no plotting dependency): lines over time
(utilization per card) and a histogram (latency distribution)."""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

from controlplane.cli.verify.model import Series
from kunlun_common.i18n import _, translate

W, H = 720, 320
LEFT, RIGHT, TOP, BOTTOM = 60, 170, 36, 44
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _frame(title: str, x_label: str, y_label: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{H - 8}" text-anchor="middle">{escape(x_label)}</text>',
        f'<text x="14" y="{TOP + (H - TOP - BOTTOM) / 2}" text-anchor="middle" transform="rotate(-90 14 {TOP + (H - TOP - BOTTOM) / 2})">{escape(y_label)}</text>',
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
    ]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / n if hi > lo else 1.0
    return [lo + i * step for i in range(n + 1)]


def lines(
    title: str, series: Sequence[Series], y_max: float = 100.0, marks: Sequence[tuple[float, str]] = ()
) -> str:
    """Each series as a polyline over its (seconds, value) points; vertical lines at `marks`."""
    out = _frame(title, _("seconds"), _("utilization %"))
    t_max = max((t for s in series for t, _ in s.points), default=1.0) or 1.0
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + pw * t / t_max

    def y(v: float) -> float:
        return H - BOTTOM - ph * min(v, y_max) / y_max

    for v in _ticks(0, y_max):
        out.append(f'<line x1="{LEFT - 4}" y1="{y(v):.1f}" x2="{W - RIGHT}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for t in _ticks(0, t_max):
        out.append(f'<text x="{x(t):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{t:.0f}</text>')
    for t, what in marks:
        out.append(
            f'<line x1="{x(t):.1f}" y1="{TOP}" x2="{x(t):.1f}" y2="{H - BOTTOM}" stroke="#999" stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{x(t) + 3:.1f}" y="{TOP + 10}" fill="#666">{escape(translate(what))}</text>')
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        pts = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in s.points)
        if pts:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        ly = TOP + 14 * i + 6
        out.append(f'<rect x="{W - RIGHT + 10}" y="{ly - 8}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{W - RIGHT + 24}" y="{ly + 1}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def histogram(title: str, values_ms: Sequence[float], bins: int = 30) -> str:
    """Latency distribution: counts per equal-width bin from 0 to the maximum."""
    out = _frame(title, _("latency (ms)"), _("requests"))
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    hi = max(values_ms, default=1.0) or 1.0
    counts = [0] * bins
    for v in values_ms:
        counts[min(bins - 1, int(v / hi * bins))] += 1
    top = max(counts, default=1) or 1
    bw = pw / bins
    for i, c in enumerate(counts):
        h = ph * c / top
        out.append(
            f'<rect x="{LEFT + i * bw + 1:.1f}" y="{H - BOTTOM - h:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" fill="{COLORS[0]}"/>'
        )
    for v in _ticks(0, top):
        yy = H - BOTTOM - ph * v / top
        out.append(f'<text x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for t in _ticks(0, hi):
        out.append(
            f'<text x="{LEFT + pw * t / hi:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{t:.0f}</text>'
        )
    out.append(f'<text x="{W - RIGHT + 10}" y="{TOP + 6}">{len(values_ms)} requests</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
