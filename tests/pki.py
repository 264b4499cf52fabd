"""Test certificates made with `cryptography`: a CA, a server certificate for localhost and
127.0.0.1, a client certificate (CN alice) it signed, and a rogue client signed by another CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN alice, signed by the CA
    client_key: Path
    rogue_cert: Path  # CN mallory, signed by another CA
    rogue_key: Path
    rogue_ca: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False,
          client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def make_pki(d: Path) -> Pki:
    """Write every certificate and key into the folder d."""
    new_key = lambda: ec.generate_private_key(ec.SECP256R1())
    ca_key, rogue_ca_key, server_key, client_key, rogue_key = (new_key() for _ in range(5))
    ca = _cert("modelexec test CA", ca_key, "modelexec test CA", ca_key, ca=True)
    rogue_ca = _cert("rogue CA", rogue_ca_key, "rogue CA", rogue_ca_key, ca=True)
    return Pki(
        ca=_write(d / "ca.pem", ca),
        server_cert=_write(d / "server.pem", _cert("localhost", server_key, "modelexec test CA", ca_key, server=True)),
        server_key=_write(d / "server.key", key=server_key),
        client_cert=_write(d / "client.pem", _cert("alice", client_key, "modelexec test CA", ca_key, client=True)),
        client_key=_write(d / "client.key", key=client_key),
        rogue_cert=_write(d / "rogue.pem", _cert("mallory", rogue_key, "rogue CA", rogue_ca_key, client=True)),
        rogue_key=_write(d / "rogue.key", key=rogue_key),
        rogue_ca=_write(d / "rogue-ca.pem", rogue_ca),
    )
