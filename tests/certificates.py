"""Throwaway X.509 certificates for TLS tests: a CA, a server certificate for loopback and
client certificates, written as PEM files into a test's directory (with `cryptography`, one of
the test extras).

`make_pki(folder)` writes `ca.crt`, `server.crt`/`server.key` (SAN IP 127.0.0.1, DNS
localhost; server and client usage, as an etcd member's certificate that also talks to its
peers), `client.crt`/`client.key` (the broker's), and `other-ca.crt`, a CA that signed
nothing here: a client that trusts only it cannot verify the server. Others, such as an
agent's with a URI SAN `spiffe://gpufed/cluster/<name>`: `make_ca`, `make_leaf(uris=...)`,
`write_pair`, `write_ca`.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=2)
Authority = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]  # a CA: what it signs with


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_leaf(
    common_name: str,
    *,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    server: bool,
    uris: tuple[str, ...] = (),
    valid_for: datetime.timedelta = VALIDITY,
    dns: tuple[str, ...] = (),
    loopback: bool = True,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by `ca`: client usage; with `server` also server usage and the
    loopback names (unless not `loopback`); `uris` as URI SANs (an agent's
    spiffe://gpufed/cluster/<name>), `dns` as DNS names."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
    names += [x509.DNSName(name) for name in dns]
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if server and loopback:
        names += [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(folder: Path) -> Pki:
    """A CA, a loopback server certificate and a client certificate in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca("gpufed test CA")
    server = make_leaf("etcd", ca=ca, server=True)
    client = make_leaf("gpufed-broker", ca=ca, server=False)
    other_ca, _ = make_ca("a CA that signed nothing here")
    pki = Pki(
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
        other_ca=folder / "other-ca.crt",
    )
    _write_cert(ca[0], pki.ca)
    _write_cert(server[0], pki.server_cert)
    _write_key(server[1], pki.server_key)
    _write_cert(client[0], pki.client_cert)
    _write_key(client[1], pki.client_key)
    _write_cert(other_ca, pki.other_ca)
    return pki


def write_pair(
    pair: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], folder: Path, stem: str
) -> tuple[Path, Path]:
    """`pair` as `folder/stem.crt` and `folder/stem.key`; the two paths."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{stem}.crt", folder / f"{stem}.key"
    _write_cert(pair[0], cert)
    _write_key(pair[1], key)
    return cert, key


def write_ca(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], path: Path) -> Path:
    """The CA's certificate (not its key) as PEM at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_cert(ca[0], path)
    return path
