"""Parsing the bench commands' comma-separated counts (batch sizes, rows, buckets, lengths)."""

from __future__ import annotations

import typer


def parse_counts(text: str, option: str, *, maximum: int | None = None) -> list[int]:
    """The integers of a comma-separated list, in the order given, each in 1..`maximum` (no upper
    bound when None); a `typer.BadParameter` naming `option` otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated integers", param_hint=option) from None
    upper = "" if maximum is None else f"..{maximum}"
    bad = sorted({v for v in values if v < 1 or (maximum is not None and v > maximum)})
    if not values or bad:
        got = f" (got {bad})" if bad else ""
        raise typer.BadParameter(f"{text!r}: expected integers in 1{upper}{got}", param_hint=option)
    return values
