"""Saving the package's and the benchmarks' plots small enough to commit."""

from __future__ import annotations

import io
from typing import Any


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Save a matplotlib figure as a PNG of at most 256 colours: the same line and bar plots in about a third of the
    bytes of matplotlib's RGBA PNG (results are committed as small summaries).

    Args:
        fig: the matplotlib figure.
        path: the ``.png`` file to write.
        dpi: the resolution.
    """
    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, format="PNG",
                                                                                       optimize=True)
