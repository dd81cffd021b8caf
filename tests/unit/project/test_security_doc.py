"""docs/security.md names, for every boundary of the trust model, the test that tries to cross
it: each `path::name` it names exists (a renamed or deleted test would leave a boundary
claimed and untested)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "security.md"
NAMED = re.compile(r"`((?:tests|e2e)/[\w/]+\.py)(?:::(\w+))?`")
CONTINUED = re.compile(r"`::(\w+)`")


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file, test) pairs; a bare `::name` continues the file named before it."""
    found: list[tuple[str, str | None]] = []
    last = ""
    for match in re.finditer(rf"{NAMED.pattern}|{CONTINUED.pattern}", text):
        if match.group(1):
            last = match.group(1)
            found.append((last, match.group(2)))
        else:
            found.append((last, match.group(3)))
    return found


def test_every_test_the_trust_model_names_exists() -> None:
    named = named_tests(DOC.read_text())
    assert len(named) >= 20  # the trust model names a test per boundary
    missing = []
    for path, name in named:
        source = REPO / path
        if not source.exists():
            missing.append(path)
        elif name is not None and not re.search(rf"def {name}\b", source.read_text()):
            missing.append(f"{path}::{name}")
    assert missing == []
