"""Shared fixtures. Plugins with more fixtures are registered here."""

import asyncio

import pytest

pytest_plugins = ["tests.conftest_etcd", "tests.conftest_kube", "tests.conftest_postgres"]


def pytest_configure(config: pytest.Config) -> None:
    """No event loop until a test makes one. looptime's plugin asks the policy for the current
    loop before every test, and on Python 3.11 asking makes one when none was ever set: a loop
    nobody closes, whose socket a later test's garbage collection finds unclosed (an error)."""
    asyncio.set_event_loop(None)
