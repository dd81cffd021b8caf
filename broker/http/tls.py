"""The broker's listener over TLS: its certificate, the agents' client CA, and rotation.

`gpufed broker --tls-cert FILE --tls-key FILE` serves HTTPS (the agents' sessions are then
wss); `--client-ca FILE` also asks every client for a certificate that CA signed, without
requiring one (`ssl.CERT_OPTIONAL`): people and scripts on the user API send none, and an
agent's is what `broker.http.peers` reads its cluster from. A client that sends a
certificate the CA did not sign fails the handshake.

`ServerTls` builds the context from the files and rebuilds it when they change: their size,
modification time or inode (a Kubernetes Secret's volume swaps a symlink; cert-manager renews
the Secret), polled every `poll_seconds` (2 s) and applied once the files have been still
for one poll, so a certificate and its key written one after the other are read together.
The listener keeps the context it was started with; its `sni_callback` hands every new
handshake the newest one (`SSLObject.context`), so a rotated certificate (or client CA) is
served to the next connection, without a restart, and open connections keep theirs. Files
that do not load (a key that does not match its certificate) are logged once and the
broker keeps the context it had.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from broker.http import tokens
from kits import tasks

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0
Signature = tuple[tokens.Signature, ...]


class TlsFilesError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class ServerFiles:
    """The listener's files: its certificate chain and key, and the agents' client CA."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) + ((self.client_ca,) if self.client_ca else ())


def build_context(files: ServerFiles) -> ssl.SSLContext:
    """A server context from `files` (TLS 1.2 at least); TlsFilesError naming the flag."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except FileNotFoundError as exc:
        raise TlsFilesError(f"--tls-cert/--tls-key: no such file: {exc.filename}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise TlsFilesError(
            f"--tls-cert {files.cert}, --tls-key {files.key}: not a PEM certificate chain and "
            f"its private key ({_reason(exc)})"
        ) from exc
    if files.client_ca is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except FileNotFoundError as exc:
            raise TlsFilesError(f"--client-ca: no such file: {files.client_ca}") from exc
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(
                f"--client-ca {files.client_ca}: not PEM CA certificates ({_reason(exc)})"
            ) from exc
        # asked for, verified when sent, never required: the user API takes none
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def _reason(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    return str(exc) or type(exc).__name__


def _signature(paths: tuple[Path, ...]) -> Signature:
    return tuple(tokens.file_signature(path) for path in paths)


class ServerTls:
    """The listener's context (`context`, given to the server once) and the newest one built
    from the files (`current`), which every new handshake switches to."""

    def __init__(self, files: ServerFiles, *, poll_seconds: float = POLL_SECONDS) -> None:
        self.files = files
        self.poll_seconds = poll_seconds
        self.reloads = 0  # contexts built after the first
        self._seen = _signature(files.paths())
        self.context = build_context(files)  # TlsFilesError: the broker does not start
        self.current = self.context
        self._applied = self._seen
        self._failed: Signature | None = None  # the files as they were when they did not load
        self.context.sni_callback = self._handshake

    @property
    def client_certificates(self) -> bool:
        """Whether clients are asked for a certificate (--client-ca)."""
        return self.files.client_ca is not None

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, _: object) -> None:
        if self.current is not self.context:
            connection.context = self.current

    def poll(self) -> bool:
        """One look at the files; True if a new context now applies."""
        signature = _signature(self.files.paths())
        if signature in (self._applied, self._failed) or signature != self._seen:
            self._seen = signature  # unchanged, known bad, or still being written
            return False
        try:
            context = build_context(self.files)
        except TlsFilesError as exc:
            self._failed = signature
            logger.error("%s: new connections keep the certificate they had", exc)
            return False
        self.current, self._applied, self._failed = context, signature, None
        self.reloads += 1
        logger.info("TLS certificate %s reloaded for new connections", self.files.cert)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await asyncio.to_thread(self.poll)
            except Exception:  # the next change may load
                logger.exception("following the TLS files %s failed", self.files.cert)


SERVER_TLS = web.AppKey("server_tls", ServerTls)


def install(
    app: web.Application, files: ServerFiles, *, poll_seconds: float = POLL_SECONDS
) -> ServerTls:
    """The listener's TLS for `app` (TlsFilesError if the files do not load), followed while
    the app runs. The caller gives `ServerTls.context` to the server (`web.run_app`)."""
    server = ServerTls(files, poll_seconds=poll_seconds)
    app[SERVER_TLS] = server

    async def following(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(server.run(), name="tls-follow")
        yield
        await tasks.stop_task(task)

    app.cleanup_ctx.append(following)
    return server
