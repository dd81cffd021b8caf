"""TLS between real processes on loopback: a broker serving HTTPS with agent mTLS
(`--tls-cert`, `--tls-key`, `--client-ca`), agents with their own certificates, and the CLI.

Certificates are made in the test (`tests.certificates`): the broker's signed by one CA, the
agents' by another (the client CA), and certificates of a CA nobody trusts. What a user or
an operator would notice: an agent with its cluster's certificate connects (with or without
a token) and runs a job; one whose certificate names another cluster is refused, with or
without a token; a token alone no longer opens a session once mTLS is on; the CLI verifies
the broker's certificate (a wrong CA fails in one line saying what to do, the right one
works); a broker whose certificate is replaced on disk serves the new one to the next
connection, without a restart and without dropping the agent's session.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.helpers import wait_for
from gpufed import client
from gpufed.local import processes
from tests import certificates
from tests.builders import make_job

pytestmark = pytest.mark.e2e

CLUSTERS = processes.config_dir() / "clusters"
ROTATION_BOUND = 20.0  # seconds: two polls of 2 s and the write, with room on a busy machine


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: Path  # the broker's certificate's
    agents_ca: Path  # the agents' client CA (--client-ca)
    other_ca: Path  # signed nothing the broker or agents use
    broker_cert: Path
    broker_key: Path
    authorities: dict[Path, certificates.Authority]

    def agent(self, stem: str, *, cn: str, uri: str | None = None) -> tuple[Path, Path]:
        """An agent's certificate and key, signed by the client CA."""
        return self.leaf(stem, cn=cn, uris=(uri,) if uri else (), ca=self.agents_ca)

    def leaf(
        self, stem: str, *, cn: str, ca: Path, uris: tuple[str, ...] = ()
    ) -> tuple[Path, Path]:
        pair = certificates.make_leaf(cn, ca=self.authorities[ca], server=False, uris=uris)
        return certificates.write_pair(pair, self.folder, stem)


def make_pki(folder: Path) -> Pki:
    names = {"ca.crt": "gpufed broker CA", "agents-ca.crt": "gpufed agents CA"}
    names["other-ca.crt"] = "a CA nobody here trusts"
    authorities = {}
    for filename, common_name in names.items():
        authority = certificates.make_ca(common_name)
        authorities[certificates.write_ca(authority, folder / filename)] = authority
    ca, agents_ca, other_ca = authorities
    server = certificates.make_leaf("gpufed-broker", ca=authorities[ca], server=True)
    cert, key = certificates.write_pair(server, folder, "broker")
    return Pki(folder, ca, agents_ca, other_ca, cert, key, authorities)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
async def tls_fleet(fleet: processes.LocalFleet, pki: Pki) -> processes.LocalFleet:
    """A broker serving HTTPS that takes agents with a certificate of the agents' CA."""
    fleet.ca_file = pki.ca
    fleet.broker_args = [
        *("--tls-cert", str(pki.broker_cert), "--tls-key", str(pki.broker_key)),
        *("--client-ca", str(pki.agents_ca)),
    ]
    fleet.write_tokens(tenants=["team-a"], clusters=["a100", "h100"])
    await fleet.start_broker()
    return fleet


async def clusters(fleet: processes.LocalFleet) -> dict[str, str]:
    async with fleet.client("admin") as api:
        return {c["name"]: c["health"] for c in await api.clusters()}


async def exit_code(service: processes.Service, *, timeout: float = 60.0) -> int:
    return await asyncio.wait_for(service.process.wait(), timeout)


async def test_agents_with_their_certificates_connect_and_run_jobs(
    tls_fleet: processes.LocalFleet, pki: Pki
) -> None:
    """a100 shows only its certificate (a SPIFFE URI SAN, no token); h100 its token and a
    certificate whose common name is h100, and checks the broker's certificate for the name
    localhost (--tls-server-name) though it connects to 127.0.0.1. Both are Ready and run a
    job over wss."""
    cert, key = pki.agent("a100", cn="not-a-cluster name", uri="spiffe://gpufed/cluster/a100")
    await tls_fleet.start_agent(
        "a100", CLUSTERS / "a100.yaml", "--cert", str(cert), "--key", str(key), token=False
    )
    cert, key = pki.agent("h100", cn="h100")
    flags = ("--cert", str(cert), "--key", str(key), "--tls-server-name", "localhost")
    await tls_fleet.start_agent("h100", CLUSTERS / "h100.yaml", *flags)
    await tls_fleet.wait_clusters_ready(["a100", "h100"])
    async with tls_fleet.client("team-a") as api:
        for cluster, model in (
            ("a100", "NVIDIA-A100-SXM4-80GB"),
            ("h100", "NVIDIA-H100-80GB-HBM3"),
        ):
            job = make_job(f"over-tls-{cluster}", gpus=8).duration(0.2)
            document = job.node_selector({"nvidia.com/gpu.product": model}).document()
            submitted = await api.submit(json.dumps(document))
            done = await wait_for(api, submitted["id"], "Succeeded", timeout=30)
            assert done["status"]["cluster"] == cluster


async def test_an_agent_whose_certificate_names_another_cluster_is_refused(
    tls_fleet: processes.LocalFleet, pki: Pki
) -> None:
    """With a100's certificate, an agent saying it is h100 is refused and stops with the
    reason (exit code 3): without a token its hello is refused (4003), with h100's token the
    handshake itself (403). Neither cluster joins."""
    cert, key = pki.agent("a100", cn="a100", uri="spiffe://gpufed/cluster/a100")
    flags = ("--cert", str(cert), "--key", str(key))
    impostor = await tls_fleet.start_agent("h100", CLUSTERS / "h100.yaml", *flags, token=False)
    assert await exit_code(impostor) == 3
    assert "the broker refused cluster h100" in impostor.tail()
    assert "first message must be hello for a100" in impostor.tail()

    with_token = await tls_fleet.start_agent("h100", CLUSTERS / "h100.yaml", *flags)
    assert await exit_code(with_token) == 3
    assert "the client certificate names cluster a100" in with_token.tail()
    assert "agent:h100" in with_token.tail()
    assert await clusters(tls_fleet) == {}


@pytest.mark.parametrize(
    "how", ["a token alone", "a certificate of another CA", "a name the broker's lacks"]
)
async def test_an_agent_without_a_certificate_of_the_client_ca_gets_no_session(
    tls_fleet: processes.LocalFleet, pki: Pki, how: str
) -> None:
    """With mTLS on, a token alone is refused (the agent stops, saying why); a certificate the
    client CA did not sign fails the handshake, as does a broker certificate without the name
    the agent checks (--tls-server-name): no session, the agent keeps trying."""
    if how == "a token alone":
        agent = await tls_fleet.start_agent("h100", CLUSTERS / "h100.yaml")
        assert await exit_code(agent) == 3
        assert "the agent sent none (gpufed agent --cert, --key)" in agent.tail()
    else:
        ca = pki.other_ca if how == "a certificate of another CA" else pki.agents_ca
        cert, key = pki.leaf("h100", cn="h100", ca=ca)
        flags = ["--cert", str(cert), "--key", str(key)]
        if how == "a name the broker's lacks":
            flags += ["--tls-server-name", "broker.example.com"]
        agent = await tls_fleet.start_agent("h100", CLUSTERS / "h100.yaml", *flags)
        deadline = time.monotonic() + 30.0
        while "session with broker" not in agent.tail(50):  # a failed attempt, logged
            assert agent.alive and time.monotonic() < deadline, agent.tail()
            await asyncio.sleep(0.2)
        assert agent.alive
        if how == "a name the broker's lacks":
            assert "Hostname mismatch" in agent.tail(50)
    assert await clusters(tls_fleet) == {}


async def run_cli(
    fleet: processes.LocalFleet, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """`gpufed ARGS` against the fleet's broker with team-a's token, no GPUFED_CA_FILE unless
    `env` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "GPUFED_CA_FILE"}
    base.update(GPUFED_BROKER=fleet.url, GPUFED_TOKEN=fleet.tokens["team-a"], **(env or {}))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufed.cli", *args, env=base,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_cli_verifies_the_brokers_certificate(
    tls_fleet: processes.LocalFleet, pki: Pki
) -> None:
    code, _, err = await run_cli(tls_fleet, "list", "--ca-file", str(pki.ca))
    assert (code, err) == (0, "")
    code, _, err = await run_cli(tls_fleet, "list", env={"GPUFED_CA_FILE": str(pki.ca)})
    assert (code, err) == (0, "")
    for flags in (["--ca-file", str(pki.other_ca)], []):  # another CA; the system's
        code, out, err = await run_cli(tls_fleet, "list", *flags)
        assert code == 1 and out == ""
        [line] = err.splitlines()
        assert line == (
            f"gpufed list: the broker at {tls_fleet.url} has a certificate this client does not "
            "trust (unable to get local issuer certificate): give the CA that signed it with "
            "--ca-file or GPUFED_CA_FILE"
        )
    code, _, err = await run_cli(tls_fleet, "list", "--ca-file", str(pki.broker_key))
    assert code == 1 and "holds no PEM certificate" in err


async def served_serial(fleet: processes.LocalFleet, ca: Path) -> int:
    """The serial number of the certificate the broker shows a new connection."""
    context = ssl.create_default_context(cafile=str(ca))
    _, writer = await asyncio.open_connection("127.0.0.1", fleet.port, ssl=context)
    try:
        cert = writer.get_extra_info("peercert")
        return int(cert["serialNumber"], 16)
    finally:
        writer.close()
        await writer.wait_closed()


def replace(path: Path, data: bytes) -> None:
    """Write `path` whole at once (a rename), as a Secret volume or cert-manager does."""
    staged = path.with_suffix(".new")
    staged.write_bytes(data)
    staged.chmod(0o600)
    os.replace(staged, path)


async def test_a_rotated_broker_certificate_is_served_without_a_restart(
    tls_fleet: processes.LocalFleet, pki: Pki
) -> None:
    cert, key = pki.agent("a100", cn="a100")
    agent = await tls_fleet.start_agent(
        "a100", CLUSTERS / "a100.yaml", "--cert", str(cert), "--key", str(key)
    )
    await tls_fleet.wait_clusters_ready(["a100"])
    before = await served_serial(tls_fleet, pki.ca)
    assert tls_fleet.broker is not None
    pid = tls_fleet.broker.process.pid

    # a new certificate of the same CA, valid a day: the key first, then the certificate
    renewed = certificates.make_leaf(
        "gpufed-broker", ca=pki.authorities[pki.ca], server=True, valid_for=datetime.timedelta(1)
    )
    staging = pki.folder / "renewed"
    new_cert, new_key = certificates.write_pair(renewed, staging, "broker")
    replace(pki.broker_key, new_key.read_bytes())
    replace(pki.broker_cert, new_cert.read_bytes())
    deadline = time.monotonic() + ROTATION_BOUND
    while (serial := await served_serial(tls_fleet, pki.ca)) == before:
        assert time.monotonic() < deadline, "the broker still serves the old certificate"
        await asyncio.sleep(0.2)
    assert serial == renewed[0].serial_number
    assert tls_fleet.broker.process.pid == pid and tls_fleet.broker.alive
    assert "TLS certificate" in tls_fleet.broker.tail(50)

    # the agent's session went on (one session since it started); the CLI sees the new one
    assert agent.alive and agent.tail(200).count("open: cluster a100") == 1
    assert (await clusters(tls_fleet)) == {"a100": "Ready"}
    async with client.BrokerClient(
        tls_fleet.url, tls_fleet.tokens["team-a"], ca_file=pki.ca
    ) as api:
        assert await api.jobs() == []
