"""A real browser for the console's tests: Playwright for Python driving Debian's Chromium.

Playwright's own browser download is never used (`playwright install` needs the network):
`executable_path` points at the system's Chromium (`apt-get install chromium`), started with
the flags that keep it from reaching outside hosts (the network here is closed; without them
it stalls on its background requests). Where Playwright or Chromium is missing the tests skip
with one line saying what to install, except where `GPUFED_REQUIRE_BROWSER=1` (CI: .ci/run
sets it): there a missing browser fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

REQUIRE_VARIABLE = "GPUFED_REQUIRE_BROWSER"
PATH_VARIABLE = "GPUFED_CHROMIUM"  # another Chromium than /usr/bin/chromium
SCREENSHOTS_VARIABLE = "GPUFED_SCREENSHOTS"  # where screenshots go (default: the test's tmp)
CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOW_TO_GET_ONE = (
    "no browser for the console tests: `pip install -e '.[test]'` (brings playwright) and "
    "`apt-get install chromium` (never `playwright install`)"
)


def required() -> bool:
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def chromium_path() -> str | None:
    given = os.environ.get(PATH_VARIABLE)
    if given:
        return given if Path(given).exists() else None
    for candidate in CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return shutil.which("chromium")


def missing() -> str | None:
    """What is missing for a browser test, or None."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    if chromium_path() is None:
        where = os.environ.get(PATH_VARIABLE) or " or ".join(CANDIDATES)
        return f"no Chromium at {where}"
    return None


def skip_or_fail_without_browser() -> str:
    """Chromium's path; the test skips (one line) or, where required, fails without it."""
    problem = missing()
    if problem is not None:
        if required():
            pytest.fail(f"{problem}: {HOW_TO_GET_ONE} ({REQUIRE_VARIABLE}=1)", pytrace=False)
        pytest.skip(f"{problem}: {HOW_TO_GET_ONE}")
    path = chromium_path()
    assert path is not None
    return path


def screenshots_dir(tmp_path: Path, test: str) -> Path:
    base = os.environ.get(SCREENSHOTS_VARIABLE)
    folder = Path(base) / test if base else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@asynccontextmanager
async def chromium(executable: str) -> AsyncIterator[Any]:
    """A headless Chromium (a Playwright `Browser`), closed afterwards."""
    from playwright.async_api import async_playwright

    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=executable, args=ARGS)
        try:
            yield browser
        finally:
            await browser.close()
