"""The TLS contexts of the broker's listener (`broker.http.tls.ServerTls`) and of the agent's
connections (`member_agent.session.tls.ClientTls`), with real handshakes on loopback.

What rotation must get right beyond "the new file is read" (e2e/test_tls.py has the real
processes): a certificate and key written one after the other are applied together, not half;
files that do not load keep the old context serving; a client CA replaced on disk changes which
agents get in; the agent shows its renewed certificate on its next connection. And bad flags
stop a broker or an agent at start, naming the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic
import pytest

from broker import app
from broker.http import tls
from gpufed import cli, daemons
from member_agent import app as agent_app
from member_agent.session import tls as agent_tls
from tests import certificates

Listener = tuple[tls.ServerTls, int, list[object]]


@pytest.fixture
def ca() -> certificates.Authority:
    return certificates.make_ca("gpufed test CA")


def server_files(
    folder: Path, ca: certificates.Authority, *, client_ca: Path | None
) -> tls.ServerFiles:
    cert, key = certificates.write_pair(
        certificates.make_leaf("broker", ca=ca, server=True), folder, "server"
    )
    return tls.ServerFiles(cert, key, client_ca)


@pytest.fixture
async def listener(tmp_path: Path, ca: certificates.Authority) -> AsyncIterator[Listener]:
    """A TLS server on loopback with a ServerTls (client CA: the same CA) that answers each
    connection with nothing and records the peer certificate it verified."""
    client_ca = certificates.write_ca(ca, tmp_path / "client-ca.crt")
    server = tls.ServerTls(server_files(tmp_path, ca, client_ca=client_ca), poll_seconds=0.05)
    seen: list[object] = []

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("peercert"))
        writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server.context)
    port = listening.sockets[0].getsockname()[1]
    yield server, port, seen
    listening.close()
    await listening.wait_closed()


async def handshake(port: int, context: ssl.SSLContext) -> int:
    """The serial number of the server's certificate, over a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        await reader.read()  # until the server closed: it has seen the client's certificate
        return int(writer.get_extra_info("peercert")["serialNumber"], 16)
    finally:
        writer.close()
        await writer.wait_closed()


def trusting(ca_file: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_file))


def serial_of(path: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def settle(server: tls.ServerTls, polls: int = 2) -> bool:
    """`polls` looks at the files (a change applies once still for one look)."""
    return any([server.poll() for _ in range(polls)])


async def test_a_certificate_and_key_written_one_after_the_other_apply_together(
    listener: Listener, tmp_path: Path, ca: certificates.Authority
) -> None:
    server, port, _ = listener
    ca_file = certificates.write_ca(ca, tmp_path / "ca.crt")
    first = serial_of(server.files.cert)
    assert await handshake(port, trusting(ca_file)) == first

    cert, key = certificates.write_pair(
        certificates.make_leaf("broker", ca=ca, server=True), tmp_path / "next", "server"
    )
    server.files.cert.write_bytes(cert.read_bytes())  # the certificate first: the old key
    assert not settle(server)  # does not load: the old pair keeps serving
    assert await handshake(port, trusting(ca_file)) == first
    server.files.key.write_bytes(key.read_bytes())
    assert settle(server)
    assert await handshake(port, trusting(ca_file)) == serial_of(cert) != first
    assert server.reloads == 1


async def test_a_replaced_client_ca_changes_which_agents_get_in(
    listener: Listener, tmp_path: Path, ca: certificates.Authority
) -> None:
    server, port, seen = listener
    ca_file = certificates.write_ca(ca, tmp_path / "ca.crt")
    new_ca = certificates.make_ca("the agents' next CA")
    old_agent = certificates.write_pair(
        certificates.make_leaf("a100", ca=ca, server=False), tmp_path, "old-agent"
    )
    new_agent = certificates.write_pair(
        certificates.make_leaf("h100", ca=new_ca, server=False), tmp_path, "new-agent"
    )

    def agent(pair: tuple[Path, Path]) -> ssl.SSLContext:
        return agent_tls.build_context(agent_tls.ClientFiles(ca_file, *pair))

    async def admitted(*pairs: tuple[Path, Path]) -> list[str]:
        """The agents whose connection the server took (TLS 1.3: a refused client learns
        it after its own handshake, when the server closes)."""
        seen.clear()
        for pair in pairs:
            with contextlib.suppress(ssl.SSLError, ConnectionError):
                await handshake(port, agent(pair))
        return [dict(rdn[0] for rdn in peer["subject"])["commonName"] for peer in seen]  # type: ignore[index]

    assert await admitted(old_agent, new_agent) == ["a100"]
    assert server.files.client_ca is not None
    certificates.write_ca(new_ca, server.files.client_ca)
    assert settle(server)
    assert await admitted(old_agent, new_agent) == ["h100"]
    seen.clear()
    await handshake(port, trusting(ca_file))  # a user API client still needs none
    assert seen == [None]


async def test_the_agent_shows_its_renewed_certificate_on_its_next_connection(
    listener: Listener, tmp_path: Path, ca: certificates.Authority
) -> None:
    _, port, seen = listener
    ca_file = certificates.write_ca(ca, tmp_path / "ca.crt")
    cert, key = certificates.write_pair(
        certificates.make_leaf("a100", ca=ca, server=False), tmp_path, "agent"
    )
    client = agent_tls.ClientTls(agent_tls.ClientFiles(ca_file, cert, key))
    await handshake(port, client.context())
    assert client.context() is client.context()  # unchanged files: the same context

    key.write_text("not a key\n")  # half-way through a rotation: the agent keeps what it had
    await handshake(port, client.context())
    renewed = certificates.make_leaf("a100", ca=ca, server=False)
    certificates.write_pair(renewed, tmp_path, "agent")
    await handshake(port, client.context())
    serials = [int(str(peer["serialNumber"]), 16) for peer in seen]  # type: ignore[index]
    assert serials == [serials[0], serials[0], renewed[0].serial_number] and client.reloads == 1


# -- bad flags stop the start, naming the flag ---------------------------------------------


def broker_settings(tmp_path: Path, **files: Path) -> app.BrokerSettings:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens: []\n")
    return app.BrokerSettings(store="sqlite:///:memory:", tokens_file=tokens, **files)


def test_a_broker_certificate_needs_its_key_and_mtls_needs_https(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="--tls-cert and --tls-key go together"):
        broker_settings(tmp_path, tls_cert_file=tmp_path / "x.crt")
    with pytest.raises(pydantic.ValidationError, match="--client-ca needs --tls-cert"):
        broker_settings(tmp_path, client_ca_file=tmp_path / "ca.crt")
    assert broker_settings(tmp_path).advertised.startswith("http://")


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("missing key", "--tls-cert/--tls-key: no such file"),
        ("another certificate's key", "not a PEM certificate chain and its private key"),
        ("a key as client CA", "--client-ca {client_ca}: not PEM CA certificates"),
    ],
)
def test_broker_tls_files_that_do_not_load_stop_the_start(
    tmp_path: Path, ca: certificates.Authority, which: str, message: str
) -> None:
    files = server_files(tmp_path, ca, client_ca=None)
    cert, key, client_ca = files.cert, files.key, None
    if which == "missing key":
        key = tmp_path / "missing.key"
    elif which == "another certificate's key":
        _, key = certificates.write_pair(
            certificates.make_leaf("other", ca=ca, server=True), tmp_path, "other"
        )
    else:
        client_ca = files.key
    settings = broker_settings(tmp_path, tls_cert_file=cert, tls_key_file=key)
    settings = settings.model_copy(update={"client_ca_file": client_ca})
    assert settings.advertised.startswith("https://")
    with pytest.raises(tls.TlsFilesError, match=message.format(client_ca=client_ca)):
        app.create_app(settings)


def test_an_agent_needs_a_token_or_a_certificate_that_loads(
    tmp_path: Path, ca: certificates.Authority
) -> None:
    base = ["agent", "--broker", "https://broker:8443", "--cluster", "a100"]
    base += ["--nodes", str(tmp_path / "nodes.yaml")]

    def settings(*flags: str) -> agent_app.AgentSettings:
        args = cli.build_parser().parse_args([*base, *flags])
        result: agent_app.AgentSettings = daemons.agent_settings(args)
        return result

    with pytest.raises(ValueError, match="--token-file, or its --cert and --key"):
        settings()
    cert, key = certificates.write_pair(
        certificates.make_leaf("a100", ca=ca, server=False), tmp_path, "agent"
    )
    with pytest.raises(pydantic.ValidationError, match="--cert and --key go together"):
        settings("--cert", str(cert))
    with pytest.raises(pydantic.ValidationError, match="--ca-file: no such file"):
        settings("--cert", str(cert), "--key", str(key), "--ca-file", str(tmp_path / "no.crt"))
    made = settings("--cert", str(cert), "--key", str(key), "--tls-server-name", "localhost")
    assert made.connect_settings().tls_files.cert == cert
    assert made.connect_settings().tls_server_name == "localhost"
