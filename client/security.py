"""Credentials for a server started with TLS, mutual TLS or bearer tokens (no torch here).

    from . import ExecutorClient
    from .security import tls_credentials

    creds = tls_credentials(ca="ca.pem", cert="client.pem", key="client.key")  # cert/key: mTLS only
    with ExecutorClient("localhost:50051", credentials=creds, token="s3cret") as ex:
        ex.info()

`token=` on either client sends `authorization: Bearer <token>` with every call;
`bearer_metadata(token)` gives the same pair for raw stubs.
"""

from __future__ import annotations

import os

import grpc

__all__ = ["bearer_metadata", "tls_credentials"]

PemSource = str | os.PathLike[str] | bytes


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    with open(source, "rb") as f:
        return f.read()


def tls_credentials(
    ca: PemSource | None = None,
    cert: PemSource | None = None,
    key: PemSource | None = None,
) -> grpc.ChannelCredentials:
    """Channel credentials: `ca` verifies the server (None: the system roots); `cert` and
    `key`, the client's certificate and key, are for servers that require mutual TLS.
    Each is a PEM file path or PEM bytes."""
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together: give both (mutual TLS) or neither")
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca), private_key=_pem(key),
                                        certificate_chain=_pem(cert))


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata pair that carries a bearer token."""
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError("a bearer token is one non-empty word")
    return ("authorization", f"Bearer {token}")
