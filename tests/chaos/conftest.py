"""The chaos suite's `slow_chaos` marker: scenarios too slow for CI's budget. CI (`pytest
tests`) skips them; they run with `LUMEN_SLOW_CHAOS=1` (or `-m slow_chaos`), and
`make chaos` (bench/chaos.py) prints their rows of the fault matrix."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow_chaos: a chaos scenario run by `make chaos` / LUMEN_SLOW_CHAOS=1, "
                   "not by CI")


def wanted(config: pytest.Config) -> bool:
    return (os.environ.get("LUMEN_SLOW_CHAOS", "") not in ("", "0")
            or "slow_chaos" in str(config.getoption("markexpr", "")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if wanted(config):
        return
    skip = pytest.mark.skip(reason="slow chaos scenario: LUMEN_SLOW_CHAOS=1 or `make chaos`")
    for item in items:
        if item.get_closest_marker("slow_chaos") is not None:
            item.add_marker(skip)
