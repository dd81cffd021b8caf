"""The agent's side of TLS to the broker: whom it trusts, what certificate it shows.

`gpufed agent --ca-file FILE` (or `GPUFED_CA_FILE`) trusts that CA for the broker's
certificate instead of the system's; `--cert FILE --key FILE` is the agent's client
certificate for a broker with `--client-ca` (agent mTLS): the broker takes the agent's cluster
from it (a URI SAN `spiffe://<trust domain>/cluster/<name>`, else the common name), and the
agent's `--cluster` must be that one. The host name of the broker's URL is checked against its
certificate, as any HTTPS client does.

`ClientTls.context` is asked once per connection attempt: it builds a new context when one of
the files changed (size, modification time or inode: a Kubernetes Secret's volume swaps a
symlink), so a renewed certificate is shown on the next session without a restart. A session
that is open keeps its certificate until it ends (a broker closes it when that certificate
expires, and the agent reconnects with the new one). Files that do not load keep the last
context that did, logged once.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int] | None, ...]


class TlsFilesError(ValueError):
    """A CA, certificate or key file that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class ClientFiles:
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        return tuple(path for path in (self.ca, self.cert, self.key) if path is not None)

    @property
    def given(self) -> bool:
        return bool(self.paths())


def build_context(files: ClientFiles) -> ssl.SSLContext:
    """A client context verifying the broker (with `files.ca`, else the system's CAs), showing
    `files.cert` if given; TlsFilesError naming the flag."""
    if (files.cert is None) != (files.key is None):
        raise TlsFilesError("--cert and --key go together")
    try:
        context = ssl.create_default_context(cafile=files.ca)
    except FileNotFoundError as exc:
        raise TlsFilesError(f"--ca-file: no such file: {files.ca}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise TlsFilesError(f"--ca-file {files.ca}: not PEM CA certificates ({exc})") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.cert is not None and files.key is not None:
        try:
            context.load_cert_chain(files.cert, files.key)
        except FileNotFoundError as exc:
            raise TlsFilesError(f"--cert/--key: no such file: {exc.filename}") from exc
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(
                f"--cert {files.cert}, --key {files.key}: not a PEM certificate chain and its "
                f"private key ({exc})"
            ) from exc
    return context


def _signature(paths: tuple[Path, ...]) -> Signature:
    def one(path: Path) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return (stat.st_size, stat.st_mtime_ns, stat.st_ino)

    return tuple(one(path) for path in paths)


class ClientTls:
    """The context of the agent's next connection, rebuilt when its files change."""

    def __init__(self, files: ClientFiles) -> None:
        self.files = files
        self._applied = _signature(files.paths())
        self._context = build_context(files)  # TlsFilesError: the agent does not start
        self._failed: Signature | None = None
        self.reloads = 0

    def context(self) -> ssl.SSLContext:
        signature = _signature(self.files.paths())
        if signature in (self._applied, self._failed):
            return self._context
        try:
            context = build_context(self.files)
        except TlsFilesError as exc:
            self._failed = signature
            logger.error("%s: the agent keeps the TLS files it had", exc)
            return self._context
        self._context, self._applied, self._failed = context, signature, None
        self.reloads += 1
        logger.info("TLS files reloaded for the next session (%s)", self.files.cert or "CA")
        return context
