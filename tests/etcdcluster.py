"""A real three-member etcd cluster on loopback (`--initial-cluster` on 127.0.0.1 ports).

For the tests of what a broker does when one member of its store goes away: `kill(i)` ends
member i as a crash would, `launch(i)` brings it back on its ports with its data.
"""

from __future__ import annotations

import shutil
import subprocess
import time

from tests import etcdserver


class EtcdCluster:
    def __init__(self, size: int = 3) -> None:
        self.binary = etcdserver.find_etcd_binary()
        self.root = etcdserver.make_data_root()
        ports = etcdserver.pick_free_ports(2 * size)
        self.clients = ports[:size]
        self.peers = ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * size
        self.initial = ",".join(
            f"{name}=http://127.0.0.1:{peer}"
            for name, peer in zip(self.names, self.peers, strict=True)
        )

    @classmethod
    def start(cls, size: int = 3) -> EtcdCluster:
        cluster = cls(size)
        for index in range(size):
            cluster._spawn(index)
        cluster.wait_healthy(range(size))
        return cluster

    def endpoint(self, index: int) -> str:
        return f"127.0.0.1:{self.clients[index]}"

    @property
    def url(self) -> str:
        """The store URL with every member: `etcd://A,B,C`."""
        return "etcd://" + ",".join(self.endpoint(i) for i in range(len(self.names)))

    def _spawn(self, index: int) -> None:
        client = f"http://{self.endpoint(index)}"
        peer = f"http://127.0.0.1:{self.peers[index]}"
        data = self.root / self.names[index]
        log = (self.root / f"{self.names[index]}.log").open("ab")
        self.processes[index] = subprocess.Popen(
            [
                str(self.binary),
                f"--name={self.names[index]}",
                f"--data-dir={data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster={self.initial}",
                "--initial-cluster-state=new",
                "--initial-cluster-token=gpufed-test",
                "--heartbeat-interval=50",
                "--election-timeout=500",
                "--log-level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def running(self, index: int) -> bool:
        process = self.processes[index]
        return process is not None and process.poll() is None

    def wait_healthy(self, members: range | list[int], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(members)
        while pending and time.monotonic() < deadline:
            pending = [i for i in pending if not self._healthy(i)]
            if pending:
                time.sleep(0.1)
        if pending:
            raise etcdserver.EtcdStartError(f"etcd members {pending} not healthy in {timeout}s")

    def _healthy(self, index: int) -> bool:
        server = etcdserver.EtcdServer(
            binary=self.binary, root=self.root, client_port=self.clients[index], peer_port=0
        )
        return self.running(index) and server.check_health()

    def kill(self, index: int) -> None:
        process, self.processes[index] = self.processes[index], None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def launch(self, index: int) -> None:
        if not self.running(index):
            self._spawn(index)
            self.wait_healthy([index])

    def cleanup(self) -> None:
        for index in range(len(self.names)):
            self.kill(index)
        shutil.rmtree(self.root, ignore_errors=True)

    def logs(self) -> dict[str, str]:
        return {
            name: (self.root / f"{name}.log").read_text(errors="replace")[-2000:]
            for name in self.names
            if (self.root / f"{name}.log").exists()
        }
