"""Placeholder: replaced by the issue that builds this command."""

from __future__ import annotations

import typer


def bench_serve_command() -> None:
    typer.secho("not built yet", fg="red", err=True)
    raise typer.Exit(2)
