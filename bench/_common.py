"""Helpers shared by the bench/ scripts: summary statistics, the key=value result line, and synthetic
desktop-like screenshots.

Every benchmark prints its figures last as one line of ``key=value`` pairs (`result_line`), so a script or CI
job can read the final line alone.
"""

from __future__ import annotations

import io
import math
import random
import statistics
from typing import Iterable

from arpo_async.stage_timings import percentile as stage_percentile


def median(values: Iterable[float]) -> float:
    """Median of ``values`` (NaN when empty)."""
    data = list(values)
    return statistics.median(data) if data else math.nan


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` (arpo_async.stage_timings.percentile: numpy's); NaN when
    empty."""
    data = list(values)
    return stage_percentile(data, q) if data else math.nan


def p95(values: Iterable[float]) -> float:
    """95th percentile of ``values`` (see `percentile`)."""
    return percentile(values, 95.0)


def fmt(value: float, digits: int = 3) -> str:
    """A number for a key=value line: ``digits`` significant digits, no exponent for ordinary magnitudes."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}g}" if abs(value) < 1e6 else f"{value:.0f}"


def result_line(figures: dict[str, float | int | str]) -> str:
    """``key=value key=value ...`` in the given order (the last line every bench script prints)."""
    return " ".join(f"{k}={v if isinstance(v, str) else fmt(v)}" for k, v in figures.items())


def desktop_png(seed: int, size: tuple[int, int] = (1280, 720)) -> bytes:
    """A PNG that compresses like a real desktop screenshot (about 100-300 KB at 1280x720).

    Drawn with PIL: a gradient wallpaper, a task bar, overlapping windows with title bars, buttons, text lines
    and a photo-like noisy thumbnail per window. Deterministic for a given ``seed``.
    """
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    w, h = size
    # Gradient wallpaper: smooth areas compress well, as in real screenshots.
    row = bytes(b for x in range(w) for b in (20 + 60 * x // w, 40 + 30 * x // w, 90 + 80 * x // w))
    img = Image.frombytes("RGB", (w, h), row * h)
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, h - 32, w, h], fill=(30, 30, 36))
    for i in range(8):
        draw.rectangle([8 + 44 * i, h - 28, 40 + 44 * i, h - 4], fill=(70 + 20 * i, 90, 140))
    draw.text((w - 80, h - 24), f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", fill=(230, 230, 230))
    words = ("file edit view open save close submit cancel name email terminal settings red green blue "
             "yellow button label form field options help window desktop task click type").split()
    for _ in range(rng.randint(3, 5)):
        x0, y0 = rng.randint(0, w // 2), rng.randint(0, h // 2)
        x1, y1 = min(w - 1, x0 + rng.randint(300, 640)), min(h - 40, y0 + rng.randint(200, 420))
        draw.rectangle([x0, y0, x1, y1], fill=(245, 245, 245), outline=(90, 90, 90))
        draw.rectangle([x0, y0, x1, y0 + 22], fill=(60, 90, 150))
        draw.text((x0 + 6, y0 + 5), " ".join(rng.choices(words, k=4)).title(), fill=(255, 255, 255))
        y = y0 + 30
        while y < y1 - 16:
            draw.text((x0 + 8, y), " ".join(rng.choices(words, k=rng.randint(3, 9))), fill=(20, 20, 20))
            y += 14
        for b in range(rng.randint(2, 4)):
            bx = x0 + 10 + 90 * b
            if bx + 80 < x1 and y1 - 30 > y0 + 30:
                draw.rectangle([bx, y1 - 30, bx + 80, y1 - 8], fill=rng.choice(
                    [(200, 60, 60), (60, 160, 60), (60, 60, 200), (220, 200, 40)]), outline=(0, 0, 0))
                draw.text((bx + 10, y1 - 25), rng.choice(words), fill=(255, 255, 255))
        tw, th = min(160, x1 - x0 - 20), min(90, y1 - y0 - 40)
        if tw > 0 and th > 0:  # photo-like content: high entropy, like icons, images and anti-aliased text
            noise = Image.frombytes("RGB", (tw, th), rng.randbytes(tw * th * 3))
            img.paste(noise, (x1 - tw - 10, y0 + 30))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()

