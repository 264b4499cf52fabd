"""Who may call: TLS and mutual TLS credentials, bearer tokens, and the caller's identity.

- TLS: `--tls-cert/--tls-key`; mutual TLS adds `--tls-client-ca` (client certificates are
  required and verified against it).
- Bearer tokens: `--auth-token-file` (lines `IDENTITY TOKEN`, or one bare token meaning
  identity "default"; blank lines and `#` comments ignored) and/or `--auth-token-env VAR`
  (the variable holds one token, identity "default"). Both are read once, at start-up.
  Clients send `authorization: Bearer <token>`; tokens are compared in constant time.
- Identity: the token's identity; under mutual TLS a call without a token is the client
  certificate's subject CN. The check sets `executors.identity.current_identity` in
  the handler's own task, so the executor ties caches to it. No tokens and no mutual TLS
  means no authentication: the identity stays None.

grpc.health.v1 is always open; server reflection is open, closed (not registered) or
authenticated, per `--reflection`.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from executors.identity import current_identity
from service.config import ServeConfig
from service.errors import StatusError

DEFAULT_IDENTITY = "default"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
AUTHORIZATION = "authorization"
BEARER = "bearer "


class CredentialsError(ValueError):
    """A TLS file or token source that cannot be used; the server refuses to start."""


# -- TLS -----------------------------------------------------------------------------------
def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CredentialsError(f"cannot read {what} {path!r}: {e.strerror or e}") from e
    if not data.strip():
        raise CredentialsError(f"{what} {path!r} is empty")
    return data


def server_credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS) server credentials from the config's files; None for plaintext."""
    if not config.tls_cert:
        return None
    assert config.tls_key is not None  # ServeConfig checks they come together
    cert = _read(config.tls_cert, "TLS certificate")
    key = _read(config.tls_key, "TLS key")
    client_ca = _read(config.tls_client_ca, "client CA") if config.tls_client_ca else None
    for data, what, path in ((cert, "TLS certificate", config.tls_cert), (key, "TLS key", config.tls_key)):
        if b"-----BEGIN" not in data:
            raise CredentialsError(f"{what} {path!r} is not PEM")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)


# -- tokens --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenEntry:
    identity: str
    token: bytes


def parse_token_file(text: str, path: str = "<tokens>") -> list[TokenEntry]:
    """`IDENTITY TOKEN` per line, or a single bare token (identity "default")."""
    entries: list[TokenEntry] = []
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    for n, line in lines:
        parts = line.split()
        if len(parts) == 1:
            if len(lines) != 1:
                raise CredentialsError(
                    f"{path}:{n}: a bare token is only allowed as the file's single entry; "
                    "write 'IDENTITY TOKEN' lines")
            entries.append(TokenEntry(DEFAULT_IDENTITY, parts[0].encode()))
        elif len(parts) == 2:
            entries.append(TokenEntry(parts[0], parts[1].encode()))
        else:
            raise CredentialsError(f"{path}:{n}: expected 'IDENTITY TOKEN', got {len(parts)} fields")
    if not entries:
        raise CredentialsError(f"{path}: no tokens (lines are 'IDENTITY TOKEN'; # starts a comment)")
    return entries


def load_tokens(config: ServeConfig, environ: dict[str, str] | None = None) -> list[TokenEntry]:
    """Every token the config names (file and/or environment variable), read now."""
    entries: list[TokenEntry] = []
    if config.auth_token_file:
        entries += parse_token_file(_read(config.auth_token_file, "token file").decode("utf-8"),
                                    config.auth_token_file)
    if config.auth_token_env:
        value = (os.environ if environ is None else environ).get(config.auth_token_env, "").strip()
        if not value:
            raise CredentialsError(f"environment variable {config.auth_token_env} (--auth-token-env) is unset or empty")
        if len(value.split()) != 1:
            raise CredentialsError(f"environment variable {config.auth_token_env} must hold one token, no spaces")
        entries.append(TokenEntry(DEFAULT_IDENTITY, value.encode()))
    seen: dict[bytes, str] = {}
    for e in entries:
        if seen.setdefault(e.token, e.identity) != e.identity:
            raise CredentialsError(f"one token is given to two identities ({seen[e.token]!r} and {e.identity!r})")
    return entries


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    """The token of an `authorization: Bearer <token>` header; b"" when the header is malformed."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            if text[: len(BEARER)].lower() != BEARER:
                return b""
            return text[len(BEARER):].strip().encode()
    return None


# -- the check of every call ---------------------------------------------------------------
class Authenticator:
    """Refuses calls without valid credentials (UNAUTHENTICATED) and sets the caller's identity.

    Applied by the wrapper every method runs in (service.handlers), after the request id is
    given (so refusals are logged and counted) and before the request bytes are parsed: a
    call whose token is missing or wrong is refused with its bytes never read.
    """

    def __init__(self, tokens: Sequence[TokenEntry], mtls: bool, reflection_needs_auth: bool) -> None:
        self.tokens = list(tokens)
        self.mtls = mtls
        self.reflection_needs_auth = reflection_needs_auth

    @classmethod
    def from_config(cls, config: ServeConfig) -> Authenticator | None:
        """The check the config asks for; None when authentication is off."""
        tokens = load_tokens(config)
        mtls = bool(config.tls_client_ca)
        if not tokens and not mtls:
            return None
        return cls(tokens, mtls, config.reflection_mode == "authenticated")

    def guards(self, method: str) -> bool:
        """Whether calls of `method` need credentials: health never, reflection per --reflection."""
        if method.startswith(HEALTH_PREFIX):
            return False
        return self.reflection_needs_auth or not method.startswith(REFLECTION_PREFIXES)

    def identity_for(self, token: bytes) -> str | None:
        """The identity owning `token`; every entry is compared, in constant time."""
        found = None
        for entry in self.tokens:
            if hmac.compare_digest(entry.token, token):
                found = entry.identity
        return found

    def authenticate(self, metadata: Sequence[tuple[str, Any]], context: grpc.aio.ServicerContext) -> None:
        """Set the caller's identity in the handler's own task, or raise the refusal."""
        token = bearer_token(metadata)
        if token is not None:
            if not token:
                raise _refusal("the authorization header must be 'Bearer <token>'", "MALFORMED_TOKEN")
            identity = self.identity_for(token)
            if identity is None:
                raise _refusal("the bearer token is not valid", "INVALID_TOKEN")
            current_identity.set(identity)
        elif self.mtls:
            # The TLS handshake already verified the client certificate against the client CA.
            cn = (context.auth_context().get("x509_common_name") or [b""])[0]
            if not cn:
                raise _refusal("the client certificate has no subject CN and no bearer token was sent", "NO_IDENTITY")
            current_identity.set(cn.decode("utf-8", "replace"))
        else:
            raise _refusal("missing credentials: send the metadata 'authorization: Bearer <token>'", "MISSING_TOKEN")


def _refusal(message: str, reason: str) -> StatusError:
    return StatusError(grpc.StatusCode.UNAUTHENTICATED, message, reason)
