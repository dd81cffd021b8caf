"""Start and stop gpufed processes (broker, agents) on loopback: for the demo and the e2e tests.

Each service is a real child process (`python -m gpufed.cli ...`) with its own log file;
`LocalFleet` waits until the broker answers and every agent's cluster is Ready, and stops
everything (SIGTERM, then SIGKILL) on the way out. Not the broker's `Fleet` (every cluster
the broker has heard of): this one is a set of local processes.

Several brokers on one etcd (`start_brokers(n)`): each its own port and `--advertise-url`,
one leads; agents get every broker's URL (`--broker URL1,URL2,...`) and the fleet's client
fails over between them. `leader()` asks each broker's `GET /v1/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpufed import client
from gpufed.local import allocator

REPO = Path(__file__).resolve().parents[2]


def config_dir() -> Path:
    """The example configs: the checkout's config/ or the copy shipped in the package."""
    for candidate in (REPO / "config", Path(__file__).resolve().parents[1] / "config"):
        if (candidate / "clusters").is_dir():
            return candidate
    raise FileNotFoundError("gpufed: no config/clusters directory found")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Service:
    name: str
    process: asyncio.subprocess.Process
    log: Path
    url: str = ""  # a broker's

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def stop(self, *, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        try:
            await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()

    def tail(self, lines: int = 20) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def spawn(
    name: str, args: list[str], *, workdir: Path, env: dict[str, str] | None = None
) -> Service:
    log = workdir / f"{name}.log"
    handle = log.open("ab")
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpufed.cli",
            *args,
            stdout=handle,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=workdir,
        )
    finally:
        handle.close()
    return Service(name, process, log)


@dataclass
class LocalFleet:
    """A broker and its agents, each a process, sharing one work directory."""

    workdir: Path
    store: str = ""
    heartbeat: float = 1.0
    lost_after: float = 10.0
    port: int = 0
    broker: Service | None = None
    agents: dict[str, Service] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    queues: Path | None = None  # the broker's queues file (--queues)
    cycle_interval: float | None = None  # the broker's --cycle-interval
    offer_timeout: float | None = None  # the broker's --offer-timeout
    lease_seconds: int | None = None  # the brokers' --leader-lease-seconds
    brokers: list[Service] = field(default_factory=list)  # start_brokers: one per replica
    broker_args: list[str] = field(default_factory=list)  # more flags for every broker
    # the brokers serve HTTPS (broker_args has --tls-cert, --tls-key): the CA of their
    # certificate, which the fleet's clients and agents (--ca-file) trust
    ca_file: Path | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ca_file is not None else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def urls(self) -> list[str]:
        """Every broker's URL (one: `url`)."""
        return [b.url for b in self.brokers] if self.brokers else [self.url]

    def _broker_args(self, port: int) -> list[str]:
        store = self.store or f"sqlite:///{self.workdir / 'broker.db'}"
        return [
            "broker",
            "--store",
            store,
            "--tokens",
            str(self.workdir / "tokens.yaml"),
            "--port",
            str(port),
            "--advertise-url",
            f"{self.scheme}://127.0.0.1:{port}",
            "--heartbeat",
            str(self.heartbeat),
            "--lost-after",
            str(self.lost_after),
            *(["--queues", str(self.queues)] if self.queues else []),
            *(
                ["--cycle-interval", str(self.cycle_interval)]
                if self.cycle_interval is not None
                else []
            ),
            *(
                ["--offer-timeout", str(self.offer_timeout)]
                if self.offer_timeout is not None
                else []
            ),
            *(
                ["--leader-lease-seconds", str(self.lease_seconds)]
                if self.lease_seconds is not None
                else []
            ),
            *self.broker_args,
        ]

    async def start_brokers(self, count: int) -> list[Service]:
        """`count` brokers on the fleet's etcd `store`, each ready (one of them leads)."""
        if not self.store.startswith("etcd://"):
            raise ValueError("several brokers share an etcd store: set `store` to etcd://...")
        ports = [free_port() for _ in range(count)]
        self.port = self.port or ports[0]
        started = []
        for index, port in enumerate(ports):
            started.append(await self._spawn_broker(f"broker-{index}", port))
        self.brokers.extend(started)
        for service in started:
            await self.wait_http("/readyz", service)
        return started

    async def _spawn_broker(self, name: str, port: int) -> Service:
        # the C allocator, jemalloc where the system has it (`allocator`)
        env = {**allocator.service_env(os.environ), **(self.env or {})}
        service = await spawn(name, self._broker_args(port), workdir=self.workdir, env=env)
        service.url = f"{self.scheme}://127.0.0.1:{port}"
        return service

    async def restart_broker(self, index: int) -> Service:
        """Broker `index` of `start_brokers` again, on its port (after it was stopped)."""
        old = self.brokers[index]
        await old.stop()
        port = int(old.url.rsplit(":", 1)[1])
        service = await self._spawn_broker(old.name, port)
        self.brokers[index] = service
        await self.wait_http("/readyz", service)
        return service

    async def statuses(self) -> list[dict[str, object] | None]:
        """Each broker's `GET /v1/status` (None: it does not answer)."""
        answers = await asyncio.gather(
            *(client.replica_status(url, ca_file=self.ca_file) for url in self.urls)
        )
        return [a if isinstance(a, dict) else None for a in answers]

    async def leader(self, *, timeout: float = 30.0, not_: str | None = None) -> Service:
        """The broker whose leader work runs and whom every live broker names (other than
        the URL `not_`, e.g. the leader just killed), once there is one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answers = await self.statuses()
            live = [(b, a) for b, a in zip(self.brokers, answers, strict=True) if a is not None]
            named = {a.get("leader") for _, a in live}
            for service, answer in live:
                if (
                    answer.get("active")
                    and service.url != not_
                    and named == {service.url}
                    and all(a.get("synced") for _, a in live)
                ):
                    return service
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no broker leads after {timeout}s: {await self.statuses()}")

    def write_tokens(self, *, tenants: list[str], clusters: list[str]) -> Path:
        entries: list[dict[str, object]] = []
        for tenant in tenants:
            self.tokens[tenant] = secrets.token_urlsafe(24)
            entries.append({"token": self.tokens[tenant], "tenant": tenant})
        for cluster in clusters:
            token = secrets.token_urlsafe(24)
            self.tokens[f"agent:{cluster}"] = token
            (self.workdir / f"{cluster}.token").write_text(token + "\n")
            entries.append({"token": token, "agent": cluster})
        self.tokens["admin"] = secrets.token_urlsafe(24)
        entries.append({"token": self.tokens["admin"], "admin": True})
        self.tokens["metrics"] = secrets.token_urlsafe(24)  # what a scraper sends to /metrics
        entries.append({"token": self.tokens["metrics"], "role": "metrics"})
        path = self.workdir / "tokens.yaml"
        path.write_text(yaml.safe_dump({"tokens": entries}))
        return path

    async def start_broker(self) -> Service:
        if not self.port:
            self.port = free_port()
        self.broker = await self._spawn_broker("broker", self.port)
        await self.wait_http("/readyz", self.broker)
        return self.broker

    async def start_agent(
        self,
        cluster: str,
        nodes: Path | None,
        *extra: str,
        backend: str = "simulated",
        token: bool = True,
    ) -> Service:
        """An agent process; `nodes` for the simulated backend, `extra` flags for others;
        without `token`, no --token-file (an agent with a client certificate, --cert)."""
        where = ["--nodes", str(nodes)] if nodes is not None else []
        if token:
            where += ["--token-file", str(self.workdir / f"{cluster}.token")]
        if self.ca_file is not None:
            where += ["--ca-file", str(self.ca_file)]
        service = await spawn(
            f"agent-{cluster}",
            [
                "agent",
                "--broker",
                ",".join(self.urls),
                "--cluster",
                cluster,
                "--backend",
                backend,
                *where,
                *extra,
            ],
            workdir=self.workdir,
            env={**allocator.service_env(os.environ), **(self.env or {})},  # as the broker's
        )
        self.agents[cluster] = service
        return service

    async def start_simulated(
        self, clusters: list[str], *, tenants: list[str] | None = None
    ) -> None:
        """Tokens, a broker, and one agent per cluster on its shipped description
        (`config/clusters/NAME.yaml`), all Ready."""
        self.write_tokens(tenants=tenants or ["team-a"], clusters=clusters)
        await self.start_broker()
        for cluster in clusters:
            await self.start_agent(cluster, config_dir() / "clusters" / f"{cluster}.yaml")
        await self.wait_clusters_ready(clusters)

    async def wait_http(self, path: str, service: Service, *, timeout: float = 30.0) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout
        url = service.url or self.url
        connector = aiohttp.TCPConnector(ssl=client.trust(self.ca_file))
        async with aiohttp.ClientSession(connector=connector) as session:
            while time.monotonic() < deadline:
                if not service.alive:
                    raise RuntimeError(f"{service.name} exited:\n{service.tail()}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}{path}") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise TimeoutError(f"{service.name} not ready after {timeout}s:\n{service.tail()}")

    def client(self, tenant: str, *, url: str | None = None) -> client.BrokerClient:
        """A client of `url`, else of every broker (failing over between them)."""
        return client.BrokerClient(
            url or ",".join(self.urls), self.tokens[tenant], ca_file=self.ca_file
        )

    async def wait_clusters_ready(self, names: list[str], *, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        async with self.client("admin") as api:
            while time.monotonic() < deadline:
                items = {c["name"]: c for c in await api.clusters()}
                if all(items.get(n, {}).get("health") == "Ready" for n in names):
                    return
                for name in names:
                    agent = self.agents.get(name)
                    if agent is not None and not agent.alive:
                        raise RuntimeError(f"{agent.name} exited:\n{agent.tail()}")
                await asyncio.sleep(0.05)
        raise TimeoutError(f"clusters {names} not Ready after {timeout}s")

    async def stop(self) -> None:
        for agent in self.agents.values():
            await agent.stop()
        for broker in self.brokers:
            await broker.stop()
        if self.broker is not None:
            await self.broker.stop()
