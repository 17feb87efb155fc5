"""Server-side SVG line chart of the eval loss: axes, "nice" ticks, labels, title, per-point tooltips.

Pure functions of their inputs (no I/O), so the chart is tested offline and identical for every viewer. Every string
placed in the SVG goes through ``markupsafe.escape``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from decimal import Decimal

from markupsafe import Markup, escape

from hivetrain.coordinator.web.snapshot import LossPoint

MAX_DRAWN_POINTS = 1000
_MAX_MARKERS = 80


def nice_ticks(lo: float, hi: float, max_ticks: int = 6, integer: bool = False, cover: bool = True) -> list[float]:
    """Round tick values with a 1/2/2.5/5 × 10^k step (Heckbert's "nice numbers", Graphics Gems 1990).

    Args:
        lo, hi: the data range (hi >= lo; equal values are widened).
        max_ticks: about this many ticks at most (>= 2).
        integer: steps of at least 1 (for epochs).
        cover: True = the first/last ticks enclose [lo, hi] (use them as the axis bounds); False = only ticks
            inside [lo, hi].

    Raises:
        ValueError: non-finite bounds, hi < lo, or max_ticks < 2.
    """
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo or max_ticks < 2:
        raise ValueError(f"bad tick range [{lo}, {hi}] / max_ticks {max_ticks}")
    if hi == lo:
        pad = 1.0 if integer or lo == 0 else abs(lo) * 0.05
        lo, hi = lo - pad, hi + pad
    raw_step = (hi - lo) / (max_ticks - 1)
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw_step * (1 - 1e-9))
    if integer:
        step = float(max(1, math.ceil(step)))
    first = math.floor(lo / step + 1e-9) if cover else math.ceil(lo / step - 1e-9)
    last = math.ceil(hi / step - 1e-9) if cover else math.floor(hi / step + 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _format_tick(value: float, step: float) -> str:
    decimals = max(0, -Decimal(f"{step:.6g}").normalize().as_tuple().exponent)
    return f"{value:.{decimals}f}"


def render_loss_svg(points: Sequence[LossPoint], width: int = 880, height: int = 320) -> Markup:
    """The eval-loss curve as an inline ``<svg>`` element (responsive: scales to its container's width).

    x = epoch (outer steps), y = eval loss in nats/token. Non-finite losses are left out and counted in a note.
    More than ``MAX_DRAWN_POINTS`` points are thinned to an even stride (the newest point is always drawn).

    Args:
        points: evaluations, oldest first.
        width, height: the viewBox size in px.
    """
    left, right, top, bottom = 70, 24, 46, 56
    plot_w, plot_h = width - left - right, height - top - bottom
    finite = [p for p in points if math.isfinite(p.eval_loss)]
    skipped = len(points) - len(finite)
    if len(finite) > MAX_DRAWN_POINTS:
        stride = math.ceil(len(finite) / MAX_DRAWN_POINTS)
        finite = finite[::stride] + ([finite[-1]] if (len(finite) - 1) % stride else [])

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-labelledby="chart-title" '
        f'xmlns="http://www.w3.org/2000/svg" font-family="system-ui, -apple-system, Segoe UI, sans-serif">',
        f'<title id="chart-title">Eval loss (nats/token) per epoch, {len(finite)} evaluations</title>',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="24" font-size="16" font-weight="600" fill="#111827">Eval loss'
        '<tspan dx="10" font-size="13" font-weight="400" fill="#6b7280">nats/token on the shared held-out windows'
        "</tspan></text>",
    ]
    if finite:
        latest = finite[-1]
        parts.append(
            f'<text x="{width - right}" y="24" font-size="13" text-anchor="end" fill="#111827">latest '
            f'<tspan font-weight="600">{latest.eval_loss:.4f}</tspan> at epoch {latest.epoch}</text>'
        )

    epochs = [p.epoch for p in finite] or [0, 1]
    losses = [p.eval_loss for p in finite] or [0.0, 1.0]
    x0, x1 = min(epochs), max(max(epochs), min(epochs) + 1)
    x_ticks = nice_ticks(x0, x1, max_ticks=9, integer=True, cover=False)
    y_lo, y_hi = min(losses), max(losses)
    pad = (y_hi - y_lo) * 0.06
    y_ticks = nice_ticks(y_lo - pad, y_hi + pad, max_ticks=6)
    y0, y1 = y_ticks[0], y_ticks[-1]

    def sx(epoch: float) -> float:
        return left + (epoch - x0) / (x1 - x0) * plot_w

    def sy(loss: float) -> float:
        return top + (1 - (loss - y0) / (y1 - y0)) * plot_h

    y_step = y_ticks[1] - y_ticks[0]
    for tick in y_ticks:
        y = sy(tick)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(
            f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="12" text-anchor="end" fill="#374151">'
            f"{_format_tick(tick, y_step)}</text>"
        )
    for tick in x_ticks:
        x = sx(tick)
        parts.append(f'<line x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" y2="{top + plot_h + 5}" stroke="#6b7280"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{top + plot_h + 20}" font-size="12" text-anchor="middle" fill="#374151">'
            f"{int(tick)}</text>"
        )
    parts += [
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#6b7280"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#6b7280"/>',
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 12}" font-size="13" text-anchor="middle" fill="#111827">'
        "epoch (outer steps)</text>",
        f'<text transform="translate(18 {top + plot_h / 2:.1f}) rotate(-90)" font-size="13" text-anchor="middle" '
        'fill="#111827">eval loss (nats/token)</text>',
    ]

    if not finite:
        parts.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" font-size="14" text-anchor="middle" '
            'fill="#6b7280">No evaluations yet: the curve appears after the first eval.</text>'
        )
    else:
        coords = " ".join(f"{sx(p.epoch):.1f},{sy(p.eval_loss):.1f}" for p in finite)
        parts.append(
            f'<polyline points="{coords}" fill="none" stroke="#2563eb" stroke-width="2.5" '
            'stroke-linejoin="round" stroke-linecap="round"/>'
        )
        markers = finite if len(finite) <= _MAX_MARKERS else finite[-1:]
        for p in markers:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(p.wall_time_s))
            tip = escape(f"epoch {p.epoch}: loss {p.eval_loss:.4f} nats/token ({when})")
            parts.append(
                f'<circle cx="{sx(p.epoch):.1f}" cy="{sy(p.eval_loss):.1f}" r="3.5" fill="#2563eb" '
                f'stroke="#ffffff" stroke-width="1.5"><title>{tip}</title></circle>'
            )
    if skipped:
        parts.append(
            f'<text x="{left + plot_w}" y="{top + 14}" font-size="12" text-anchor="end" fill="#b91c1c">'
            f"{skipped} non-finite evaluation{'s' if skipped != 1 else ''} (NaN/Inf) not drawn</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
