"""The etcd store over TLS and as an etcd user, on real etcd servers: one that takes only
clients with a certificate its CA signed (`--client-cert-auth` on https), and two with etcd's
authentication on (one plain, one with that TLS too) where the broker's user may use the keys
under /gpufed/ only.

A store with the CA and the client certificate reads, commits and watches, also after failing
over to another endpoint; one without the certificate, or trusting another CA, fails at once
with a store error instead of hanging. The right password works, over TLS too (and keeps
working after etcd restarts and forgets its tokens), a wrong one is refused saying so. The
real broker process reaches /readyz with the --etcd-* flags, and a bad flag stops it with one
line, exit code 2.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pydantic
import pytest

from broker.state import errors, etcd, etcd_credentials, opening, store
from gpufed import cli, daemons
from gpufed.local import processes
from tests import certificates, etcdserver, tcpproxy

pytestmark = pytest.mark.etcd

BOUND = 10.0  # seconds a refused connection may take to fail: well under a hang
BROKER_USER, BROKER_PASSWORD = "broker", "s3cret broker password"
# With TLS and no token, etcd takes the client certificate's common name as the user: that
# user exists too, but may not touch /gpufed/, so a broker that did not authenticate fails.
CN_USER, CN_PREFIX = "gpufed-broker", "/cn-only/"
ROOT_PASSWORD = "root-password"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certificates.Pki:
    return certificates.make_pki(tmp_path_factory.mktemp("pki"))


def start_server(tls: etcdserver.ServerTls | None = None) -> etcdserver.EtcdServer:
    try:
        return etcdserver.EtcdServer.start(tls=tls)
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def tls_server(pki: certificates.Pki) -> Iterator[etcdserver.EtcdServer]:
    server = start_server(etcdserver.ServerTls(pki.server_cert, pki.server_key, pki.ca))
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def auth_server_process() -> Iterator[etcdserver.EtcdServer]:
    server = start_server()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def tls_auth_server_process(pki: certificates.Pki) -> Iterator[etcdserver.EtcdServer]:
    server = start_server(etcdserver.ServerTls(pki.server_cert, pki.server_key, pki.ca))
    yield server
    server.cleanup()


async def with_auth(server: etcdserver.EtcdServer) -> etcdserver.EtcdServer:
    """`server` running with authentication on: root, the broker's user on /gpufed/, and the
    client certificate's common name on another prefix."""
    if not server.running:
        server.launch()
    marker = server.root / "auth-enabled"
    if not marker.exists():
        users = {BROKER_USER: (BROKER_PASSWORD, "/gpufed/"), CN_USER: ("unused", CN_PREFIX)}
        await etcdserver.enable_auth(server, root_password=ROOT_PASSWORD, users=users)
        marker.touch()
    return server


@pytest.fixture
async def auth_server(auth_server_process: etcdserver.EtcdServer) -> etcdserver.EtcdServer:
    """A plain etcd with authentication on."""
    return await with_auth(auth_server_process)


@pytest.fixture
async def tls_auth_server(
    tls_auth_server_process: etcdserver.EtcdServer,
) -> etcdserver.EtcdServer:
    """An etcd with mutual TLS and authentication on."""
    return await with_auth(tls_auth_server_process)


@pytest.fixture(params=["plain", "mutual TLS"])
async def auth_target(
    request: pytest.FixtureRequest, pki: certificates.Pki
) -> tuple[etcdserver.EtcdServer, etcd_credentials.EtcdCredentials]:
    """An etcd with authentication on, and the TLS it needs (none for the plain one)."""
    if request.param == "plain":
        server = await with_auth(request.getfixturevalue("auth_server_process"))
        return server, etcd_credentials.NONE
    return await with_auth(request.getfixturevalue("tls_auth_server_process")), mtls(pki)


@pytest.fixture(scope="module")
def password_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "etcd-password"
    path.write_text(BROKER_PASSWORD + "\n")  # as `kubectl create secret --from-file` keeps it
    return path


def mtls(pki: certificates.Pki) -> etcd_credentials.EtcdCredentials:
    return etcd_credentials.load_credentials(
        ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key
    )


@pytest.fixture
async def tls_store(
    tls_server: etcdserver.EtcdServer, pki: certificates.Pki
) -> AsyncIterator[store.DurableStore]:
    if not tls_server.running:
        tls_server.launch()
    backing = await opening.open_store(tls_server.url, credentials=mtls(pki))
    try:
        yield backing
    finally:
        await backing.close()


async def next_events(
    events: AsyncIterator[store.WatchEvent], count: int
) -> list[tuple[str, bytes]]:
    """The next `count` events' keys and values (failing after BOUND seconds)."""
    seen: list[tuple[str, bytes]] = []
    async with asyncio.timeout(BOUND):
        while len(seen) < count:
            event = await anext(events)
            seen.append((event.key, event.value))
    return seen


async def stop_watching(events: AsyncIterator[store.WatchEvent] | None) -> None:
    if events is not None:
        await events.aclose()  # type: ignore[attr-defined]  # the store's is a generator


# -- TLS with a client certificate ---------------------------------------------------------


async def test_with_the_ca_and_a_client_certificate_the_store_reads_commits_and_watches(
    tls_store: store.DurableStore,
) -> None:
    start = await tls_store.put("/tls/a", b"1")
    entry = await tls_store.get("/tls/a")
    assert entry is not None and (entry.value, entry.mod_revision) == (b"1", start)
    revision = await tls_store.commit(
        store.Txn(compares=[store.Compare("/tls/a", start)], puts=[("/tls/b", b"2")])
    )
    with pytest.raises(errors.ConflictError):  # compare-and-swap holds over TLS too
        await tls_store.commit(
            store.Txn(compares=[store.Compare("/tls/a", 0)], puts=[("/tls/a", b"again")])
        )
    entries, _ = await tls_store.list("/tls/")
    assert [(e.key, e.value) for e in entries] == [("/tls/a", b"1"), ("/tls/b", b"2")]
    events = tls_store.watch("/tls/", start_revision=start)
    try:
        assert await next_events(events, 2) == [("/tls/a", b"1"), ("/tls/b", b"2")]
    finally:
        await stop_watching(events)
    assert revision > start
    lease = await tls_store.grant_lease(5)
    assert await tls_store.keep_alive(lease) > 0


@pytest.mark.parametrize(
    ("make", "says"),
    [
        pytest.param(
            lambda pki: etcd_credentials.load_credentials(ca_file=pki.ca),
            "no etcd endpoint answers",
            id="no client certificate",
        ),
        pytest.param(
            lambda pki: etcd_credentials.load_credentials(
                ca_file=pki.other_ca, cert_file=pki.client_cert, key_file=pki.client_key
            ),
            "CERTIFICATE_VERIFY_FAILED",
            id="trusting another CA",
        ),
        pytest.param(
            lambda pki: etcd_credentials.NONE, "no etcd endpoint answers", id="no TLS at all"
        ),
    ],
)
async def test_a_store_etcd_does_not_accept_fails_at_once_with_a_store_error(
    tls_server: etcdserver.EtcdServer,
    pki: certificates.Pki,
    make: Callable[[certificates.Pki], etcd_credentials.EtcdCredentials],
    says: str,
) -> None:
    if not tls_server.running:
        tls_server.launch()
    credentials = make(pki)
    began = time.monotonic()
    with pytest.raises(errors.TemporaryStoreError, match=says) as refused:
        async with asyncio.timeout(BOUND):
            await opening.open_store(tls_server.url, credentials=credentials)
    assert time.monotonic() - began < etcd.PROBE_TIMEOUT + 1.0
    assert tls_server.endpoint in str(refused.value)  # which endpoint, in the one line


async def test_tls_applies_to_every_endpoint_and_survives_a_fail_over(
    tls_server: etcdserver.EtcdServer, pki: certificates.Pki
) -> None:
    """Two endpoints (proxies to the one server, so they hold the same data): the store
    loses the one it uses and goes on over TLS on the other, its watch too."""
    if not tls_server.running:
        tls_server.launch()
    proxies = [await tcpproxy.TcpProxy(tls_server.client_port).start() for _ in range(2)]
    by_endpoint = {f"127.0.0.1:{proxy.port}": proxy for proxy in proxies}
    backing = await opening.open_store(f"etcd://{','.join(by_endpoint)}", credentials=mtls(pki))
    events = None
    try:
        assert isinstance(backing, etcd.EtcdStore)
        using = backing.endpoint
        start = await backing.put("/tls-failover/a", b"1")
        events = backing.watch("/tls-failover/", start_revision=start)
        assert await next_events(events, 1) == [("/tls-failover/a", b"1")]
        by_endpoint[using].cut(mode="reset")
        entry = await backing.get("/tls-failover/a")  # fails over, then answered there
        assert entry is not None and entry.value == b"1"
        assert backing.endpoint in by_endpoint and backing.endpoint != using
        await backing.put("/tls-failover/b", b"2")
        assert await next_events(events, 1) == [("/tls-failover/b", b"2")]
    finally:
        await stop_watching(events)
        await backing.close()
        for proxy in proxies:
            await proxy.close()


def test_quarantine_reads_an_etcd_store_over_tls_with_the_brokers_flags(
    tls_server: etcdserver.EtcdServer, pki: certificates.Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    if not tls_server.running:
        tls_server.launch()
    tls = ["--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert)]
    tls += ["--etcd-key", str(pki.client_key)]
    code = cli.main(["broker", "quarantine", "--store", tls_server.url, *tls])
    assert (code, capsys.readouterr().out.strip().splitlines()[-1]) == (
        0,
        "no record is in quarantine",
    )
    # the flags may come before the command too, as the broker's own
    assert cli.main(["broker", "--store", tls_server.url, *tls, "quarantine"]) == 0
    without_key = ["--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert)]
    assert cli.main(["broker", "quarantine", "--store", tls_server.url, *without_key]) == 1
    assert "--etcd-cert needs --etcd-key" in capsys.readouterr().err


# -- etcd's authentication -----------------------------------------------------------------


def as_broker(
    password_file: Path, tls: etcd_credentials.EtcdCredentials = etcd_credentials.NONE
) -> etcd_credentials.EtcdCredentials:
    """The broker's user and password (from its file), over `tls`'s files if any."""
    return etcd_credentials.load_credentials(
        ca_file=tls.ca_file,
        cert_file=tls.cert_file,
        key_file=tls.key_file,
        user=BROKER_USER,
        password_file=password_file,
    )


async def test_the_right_user_and_password_read_commit_and_watch_under_its_prefix(
    auth_target: tuple[etcdserver.EtcdServer, etcd_credentials.EtcdCredentials],
    password_file: Path,
) -> None:
    server, tls = auth_target
    backing = await opening.open_store(server.url, credentials=as_broker(password_file, tls))
    events = None
    try:
        start = await backing.put("/gpufed/auth/a", b"1")
        assert (await backing.get("/gpufed/auth/a")).value == b"1"  # type: ignore[union-attr]
        events = backing.watch("/gpufed/auth/", start_revision=start)
        await backing.put("/gpufed/auth/b", b"2")
        assert await next_events(events, 2) == [("/gpufed/auth/a", b"1"), ("/gpufed/auth/b", b"2")]
        # the role is the broker's keys only: etcd enforces it on this user's token
        with pytest.raises(errors.StoreError, match="permission denied"):
            await backing.put("/elsewhere", b"x")
    finally:
        await stop_watching(events)
        await backing.close()


async def test_a_wrong_password_is_refused_at_once_saying_so(
    auth_target: tuple[etcdserver.EtcdServer, etcd_credentials.EtcdCredentials],
) -> None:
    server, tls = auth_target
    credentials = dataclasses.replace(tls, user=BROKER_USER, password="wrong")
    says = f"as user '{BROKER_USER}': etcdserver: authentication failed, invalid user ID or"
    with pytest.raises(errors.StoreError, match=says) as refused:
        async with asyncio.timeout(BOUND):
            await opening.open_store(server.url, credentials=credentials)
    # not worth retrying: the same password fails the same way
    assert not isinstance(refused.value, errors.TemporaryStoreError)


@pytest.mark.parametrize(
    ("credentials", "says"),
    [
        pytest.param(
            etcd_credentials.EtcdCredentials(user="nobody", password=BROKER_PASSWORD),
            "authentication failed",
            id="an unknown user",
        ),
        pytest.param(etcd_credentials.NONE, "user name is empty", id="no user"),
    ],
)
async def test_an_unknown_user_or_none_is_refused_at_once(
    auth_server: etcdserver.EtcdServer, credentials: etcd_credentials.EtcdCredentials, says: str
) -> None:
    with pytest.raises(errors.StoreError, match=says) as refused:
        async with asyncio.timeout(BOUND):
            await opening.open_store(auth_server.url, credentials=credentials)
    assert not isinstance(refused.value, errors.TemporaryStoreError)


async def test_over_mutual_tls_without_a_user_etcd_takes_the_certificates_name(
    tls_auth_server: etcdserver.EtcdServer, pki: certificates.Pki
) -> None:
    """No --etcd-user: the certificate's common name is the user, with that user's role
    (here: not the broker's keys, so such a broker could not even connect)."""
    with pytest.raises(errors.StoreError, match="permission denied"):
        await opening.open_store(tls_auth_server.url, credentials=mtls(pki))
    client = etcd_credentials.make_client(
        "127.0.0.1", tls_auth_server.client_port, mtls(pki), timeout=5.0, options={}
    )
    try:
        await client.put(f"{CN_PREFIX}x".encode(), b"by certificate")
        assert (await client.get(f"{CN_PREFIX}x".encode())).value == b"by certificate"
    finally:
        await client.close()


async def test_after_etcd_restarts_and_forgets_its_tokens_the_store_authenticates_again(
    auth_server: etcdserver.EtcdServer, password_file: Path
) -> None:
    backing = await opening.open_store(auth_server.url, credentials=as_broker(password_file))
    events = None
    try:
        start = await backing.put("/gpufed/restart/a", b"1")
        events = backing.watch("/gpufed/restart/", start_revision=start)
        assert await next_events(events, 1) == [("/gpufed/restart/a", b"1")]
        await asyncio.to_thread(auth_server.restart)  # simple tokens live in memory only
        # a read with the forgotten token authenticates again and is answered
        assert (await backing.get("/gpufed/restart/a")).value == b"1"  # type: ignore[union-attr]
        # a commit too: refused for its token, it did not land, and is sent again
        await backing.put("/gpufed/restart/b", b"2")
        assert await next_events(events, 1) == [("/gpufed/restart/b", b"2")]
    finally:
        await stop_watching(events)
        await backing.close()


# -- the broker process --------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["mutual TLS", "mutual TLS and an etcd user"])
async def test_the_broker_process_gets_ready_with_the_etcd_flags(
    mode: str,
    *,
    tmp_path: Path,
    pki: certificates.Pki,
    tls_server: etcdserver.EtcdServer,
    tls_auth_server: etcdserver.EtcdServer,
    password_file: Path,
) -> None:
    if not tls_server.running:
        tls_server.launch()
    fleet = processes.LocalFleet(workdir=tmp_path)
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    fleet.port = processes.free_port()
    flags = ["--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert)]
    flags += ["--etcd-key", str(pki.client_key)]
    url = tls_server.url
    if mode == "mutual TLS and an etcd user":
        url = tls_auth_server.url  # where the certificate's own name may not use /gpufed/
        flags += ["--etcd-user", BROKER_USER, "--etcd-password-file", str(password_file)]
    broker = await processes.spawn(
        "broker",
        [
            "broker",
            "--store",
            url,
            "--tokens",
            str(tmp_path / "tokens.yaml"),
            "--port",
            str(fleet.port),
            "--advertise-url",
            fleet.url,
            "--leader-lease-seconds",
            "2",
            *flags,
        ],
        workdir=tmp_path,
    )
    fleet.broker = broker
    try:
        await fleet.wait_http("/readyz", broker)  # store open, cache synced, elected, scheduling
        async with fleet.client("team-a") as api:
            assert await api.jobs() == []
    finally:
        await fleet.stop()
    assert broker.process.returncode == 0, broker.tail()


BAD_FLAGS = [
    pytest.param(
        ["--etcd-ca", "{tmp}/missing-ca.crt"],
        "--etcd-ca {tmp}/missing-ca.crt: cannot read it (No such file or directory)",
        id="a missing CA file",
    ),
    pytest.param(
        ["--etcd-ca", "{ca}", "--etcd-cert", "{cert}"],
        "--etcd-cert needs --etcd-key",
        id="a certificate without its key",
    ),
    pytest.param(
        ["--etcd-cert", "{cert}", "--etcd-key", "{other_key}"],
        "--etcd-key {other_key}: not the private key of --etcd-cert {cert}",
        id="the key of another certificate",
    ),
    pytest.param(["--etcd-ca", "{key}"], "--etcd-ca {key}: not a PEM certificate", id="key as CA"),
    pytest.param(
        ["--etcd-user", "gpufed-broker"],
        "--etcd-user gpufed-broker needs a password: --etcd-password-file FILE",
        id="a user without a password",
    ),
    pytest.param(
        ["--etcd-user", "gpufed-broker", "--etcd-password-file", "{tmp}/nope"],
        "--etcd-password-file {tmp}/nope: cannot read it",
        id="a missing password file",
    ),
    pytest.param(
        ["--store", "sqlite:///{tmp}/b.db", "--etcd-ca", "{ca}"],
        "--etcd-ca: only for an etcd store",
        id="TLS flags with SQLite",
    ),
]


def broker_args(
    flags: list[str], tmp_path: Path, pki: certificates.Pki
) -> tuple[list[str], dict[str, str]]:
    names = {
        "tmp": str(tmp_path),
        "ca": str(pki.ca),
        "cert": str(pki.client_cert),
        "key": str(pki.client_key),
        "other_key": str(pki.server_key),
    }
    args = [flag.format(**names) for flag in flags]
    if "--store" not in args:
        args = ["--store", "etcd://127.0.0.1:9", *args]  # never reached: the flags stop it
    return [*args, "--tokens", str(tmp_path / "tokens.yaml")], names


@pytest.mark.parametrize(("flags", "says"), BAD_FLAGS)
def test_a_bad_etcd_flag_is_one_line_naming_it(
    flags: list[str],
    says: str,
    tmp_path: Path,
    pki: certificates.Pki,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(daemons.ETCD_PASSWORD_ENV, raising=False)
    args, names = broker_args(flags, tmp_path, pki)
    with pytest.raises(pydantic.ValidationError) as refused:
        daemons.broker_settings(cli.build_parser().parse_args(["broker", *args]))
    problem = daemons.settings_problem(refused.value)
    assert problem.startswith(says.format(**names)) and "\n" not in problem, problem


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("flags", "says"), [p for p in BAD_FLAGS if p.id in ("a missing CA file", "key as CA")]
)
def test_a_bad_etcd_flag_stops_the_broker_process_with_exit_code_2_and_no_traceback(
    flags: list[str], says: str, tmp_path: Path, pki: certificates.Pki
) -> None:
    args, names = broker_args(flags, tmp_path, pki)
    done = subprocess.run(
        [sys.executable, "-m", "gpufed.cli", "broker", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"gpufed broker: {says.format(**names)}"), lines[0]


def test_the_password_may_come_from_the_environment_and_the_file_wins(
    password_file: Path,
) -> None:
    given = etcd_credentials.load_credentials(user="u", password="from env")
    assert given.password == "from env"
    filed = etcd_credentials.load_credentials(
        user="u", password_file=password_file, password="from env"
    )
    assert filed.password == BROKER_PASSWORD  # the trailing newline dropped
    assert BROKER_PASSWORD not in repr(filed)
    with pytest.raises(ValueError, match="--etcd-password-file needs --etcd-user"):
        etcd_credentials.load_credentials(password_file=password_file)
    # without a user, a password in the environment is not used (nor an error)
    assert etcd_credentials.load_credentials(password="from env") == etcd_credentials.NONE
