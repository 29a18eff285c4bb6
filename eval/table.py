"""The boxed text tables the evaluation command lines print (upstream's IJB table style)."""
from __future__ import annotations

from collections.abc import Sequence


def boxed_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """``+---+`` rules around the header and the body, every cell centred in its column."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {cell:^{w}} " for cell, w in zip(cells, widths)) + "|"

    return "\n".join([rule, line(header), rule, *map(line, body), rule])
