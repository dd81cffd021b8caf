"""What the broker shows etcd: TLS (the CA that signed etcd's certificate, and a client
certificate with its key for mutual TLS) and etcd's own authentication (a user, a password).

The broker's flags `--etcd-ca`, `--etcd-cert`, `--etcd-key`, `--etcd-user` and
`--etcd-password-file` (or GPUFED_ETCD_PASSWORD) become `EtcdCredentials` through
`load_credentials`, which reads and checks every file at start: a missing or unreadable file,
a certificate without its key, a key that is not the certificate's, a user without a password
is a ValueError of one line naming the flag, before anything connects.

`make_client` is the aetcd client of one member with them. The same credentials serve every
endpoint of `etcd://A,B,C`; the files are read again for each new connection (a fail-over, a
new authentication), so a certificate renewed on disk is used from the next one on. aetcd
1.0.0 opens plaintext channels only: `_Client` is its client on a TLS channel.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd import watcher as aetcd_watcher

from broker.state import errors

CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
PASSWORD_ENV = "GPUFED_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdCredentials:
    """Paths of the PEM files (read at each connection) and the user and password."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def describe(self) -> str:
        """For log lines: `TLS, client certificate, user NAME`, or `plaintext`."""
        parts = ["TLS" if self.tls else "plaintext"]
        if self.cert_file is not None:
            parts.append("client certificate")
        if self.user is not None:
            parts.append(f"user {self.user}")
        return ", ".join(parts)


NONE = EtcdCredentials()


def load_credentials(
    *,
    ca_file: Path | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    user: str | None = None,
    password_file: Path | None = None,
    password: str | None = None,
) -> EtcdCredentials:
    """The credentials the flags name, every file read and checked; ValueError naming the flag.

    `password_file` wins over `password` (GPUFED_ETCD_PASSWORD), which without a `user` is
    not used.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError(
            "--etcd-cert needs --etcd-key (the client certificate's private key)"
            if key_file is None
            else "--etcd-key needs --etcd-cert (the client certificate it is the key of)"
        )
    if ca_file is not None:
        _check_certificate("--etcd-ca", ca_file)
        try:
            ssl.create_default_context(cafile=str(ca_file))
        except ssl.SSLError as exc:
            raise ValueError(f"--etcd-ca {ca_file}: cannot load it ({exc.reason})") from exc
    if cert_file is not None and key_file is not None:
        _check_certificate("--etcd-cert", cert_file)
        _read("--etcd-key", key_file)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                str(cert_file), str(key_file), password=b""
            )
        except ssl.SSLError as exc:
            raise ValueError(
                f"--etcd-key {key_file}: not the private key of --etcd-cert {cert_file}, or "
                f"encrypted ({exc.reason}; give the key without a passphrase)"
            ) from exc
    if user is not None and not user:
        raise ValueError("--etcd-user is empty")
    if password_file is not None:
        if user is None:
            raise ValueError("--etcd-password-file needs --etcd-user (whose password it is)")
        password = _read("--etcd-password-file", password_file).decode().rstrip("\r\n")
        if not password:
            raise ValueError(f"--etcd-password-file {password_file} is empty")
    if user is None:
        password = None
    elif not password:
        raise ValueError(
            f"--etcd-user {user} needs a password: --etcd-password-file FILE (or {PASSWORD_ENV})"
        )
    return EtcdCredentials(
        ca_file=ca_file, cert_file=cert_file, key_file=key_file, user=user, password=password
    )


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


def _check_certificate(flag: str, path: Path) -> None:
    if CERTIFICATE not in _read(flag, path):
        raise ValueError(f"{flag} {path}: not a PEM certificate (no {CERTIFICATE.decode()})")


def make_client(
    host: str,
    port: int,
    credentials: EtcdCredentials,
    *,
    timeout: float,
    options: dict[str, int],
) -> aetcd.Client:
    """An aetcd client of the member at host:port, not connected yet; StoreError if a file
    cannot be read now."""
    channel_credentials = None
    if credentials.tls:
        try:
            channel_credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_now(credentials.ca_file),
                private_key=_read_now(credentials.key_file),
                certificate_chain=_read_now(credentials.cert_file),
            )
        except OSError as exc:
            problem = f"etcd TLS: cannot read {exc.filename}: {exc.strerror}"
            raise errors.StoreError(problem) from exc
    return _Client(
        host=host,
        port=port,
        username=credentials.user,
        password=credentials.password,
        timeout=timeout,
        options=options,
        channel_credentials=channel_credentials,
    )


def _read_now(path: Path | None) -> bytes | None:
    """The file's bytes; None without a path (no CA: gRPC's default roots)."""
    return None if path is None else path.read_bytes()


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's Client, on a TLS channel when given channel credentials.

    aetcd 1.0.0's `connect` opens `grpc.aio.insecure_channel` and has no TLS option; with
    credentials this `connect` does what aetcd's does on a secure channel (authenticate when
    a user is set, the stubs, the watcher). Without, it is aetcd's own.
    """

    def __init__(self, *, channel_credentials: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._channel_credentials = channel_credentials

    async def connect(self) -> None:
        if self._channel_credentials is None:
            await super().connect()
            return
        if self._connected.is_set():
            return
        self.channel = rpc.secure_channel(
            f"{self._host}:{self._port}",
            self._channel_credentials,
            options=list(self._options.items()),
        )
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
            self.metadata = (("token", reply.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd_watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()
