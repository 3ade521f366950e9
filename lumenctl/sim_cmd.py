"""`lumenctl sim`: the cluster simulator (being built; see the simulator issue)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the `sim` command to `app`."""
