"""Where the server listens, checked before it loads a model: a busy port, an address not
this host's, another server on a unix socket path. Failures are StartupError, which
`python -m service` prints as one line."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat

from service.config import ServeConfig

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start, for the reason its message gives (`python -m service` prints
    it as one line, without a traceback)."""


def check_address(config: ServeConfig) -> None:
    """Raise StartupError if the server cannot listen where `config` says (gRPC and metrics).

    `python -m service` calls it before loading the model, which can take minutes; for TCP it
    is a courtesy (the real bind, later, decides), for a unix socket see claim_unix_socket."""
    if config.unix_socket:
        claim_unix_socket(config.unix_socket)
    elif problem := tcp_bind_problem(config.host, config.port):
        raise StartupError(f"cannot listen on {config.address}: {problem}")
    if config.metrics_port and (problem := tcp_bind_problem(config.host, config.metrics_port)):
        raise StartupError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {problem}")


def claim_unix_socket(path: str) -> None:
    """Make `path` free for a new server's socket, or raise StartupError.

    gRPC unlinks a socket file in its way before it binds: a second server on the path of a
    running one would take it over, the first left running and unreachable. So a socket that
    accepts a connection is refused; one that refuses it (left by a server that died) goes."""
    where = f"cannot listen on unix:{path}"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StartupError(f"{where}: no directory {directory}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{where}: the path exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)  # a listener with a full backlog does not answer at once, but it is there
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            log.info("removed the stale socket %s (nothing listened on it)", path)
            return
        except TimeoutError:
            pass
        except OSError as e:
            raise StartupError(f"{where}: {e.strerror or e}") from e
    raise StartupError(f"another server listens on {path}")


def tcp_bind_problem(host: str, port: int) -> str | None:
    """Why no address of `host` can be bound at `port`, or None if one can (or the host does not
    resolve here: gRPC's resolver and bind say). SO_REUSEADDR on, as gRPC binds: only a listener
    or an address that is not this host's stands in the way."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return None
    problem: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                return None
            except OSError as e:
                problem = problem or e
    return None if problem is None else os_problem(problem)


def os_problem(e: OSError) -> str:
    return "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
