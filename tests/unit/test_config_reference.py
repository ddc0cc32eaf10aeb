"""docs/config-reference.md is what scripts/config_reference.py makes of the configs and command lines now."""

from __future__ import annotations

from scripts.config_reference import PAGE, render


def test_the_config_reference_is_current() -> None:
    assert PAGE.read_text() == render(), (
        "docs/config-reference.md is stale: run python scripts/config_reference.py"
    )
