"""How steplens peers connect: the address policy, TLS credentials and operator auth, shared by
the agent, the collector and the operator CLI so all three enforce the same rules.

Plaintext (`--insecure`) is allowed only when every address involved is loopback or a Unix
socket; anything else needs TLS (agents: mutual TLS; operators: a bearer token or a client cert).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import grpc

# Message-size limits on every channel and server. Batches are bounded by the agent (1 MiB by
# default); anything larger than this is refused by gRPC with RESOURCE_EXHAUSTED before decoding.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
TOKEN_METADATA_KEY = "authorization"


class SecurityError(ValueError):
    """A connection setting that would be unsafe or cannot work; raised before connecting."""


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port', '[v6]:port'. Raises SecurityError with the address on bad input."""
    if address.startswith("unix:"):
        return address, 0
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
    else:
        host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise SecurityError(f"bad address {address!r}: expected HOST:PORT or unix:PATH")
    return host, int(port)


def is_loopback(address: str) -> bool:
    """True for unix: sockets and for hosts whose every resolved address is loopback."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host, _ = split_host_port(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def require_insecure_allowed(*addresses: str) -> None:
    bad = [a for a in addresses if a and not is_loopback(a)]
    if bad:
        raise SecurityError(
            f"--insecure is refused for non-loopback address(es) {', '.join(bad)}: "
            "use TLS (--tls-ca/--tls-cert/--tls-key), or listen on 127.0.0.1 / a unix: socket")


@dataclass
class TlsFiles:
    ca: str = ""
    cert: str = ""
    key: str = ""

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def load(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as fh:
                    return fh.read()
            except OSError as exc:
                raise SecurityError(f"cannot read TLS {what} {path!r}: {exc.strerror}") from None
        return load(self.ca, "CA"), load(self.cert, "certificate"), load(self.key, "key")


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def client_channel(address: str, insecure: bool, tls: TlsFiles | None = None,
                   token: str = "", extra_options: list | None = None) -> grpc.Channel:
    """A channel to the collector; plaintext only for loopback, else TLS (+ client cert / token)."""
    options = CHANNEL_OPTIONS + (extra_options or [])
    if insecure:
        require_insecure_allowed(address)
        return grpc.insecure_channel(address, options=options)
    tls = tls or TlsFiles()
    ca, cert, key = tls.read()
    if bool(cert) != bool(key):
        raise SecurityError("a client certificate needs its key, and a key its certificate")
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, creds, options=options)


def server_credentials(tls: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials:
    ca, cert, key = tls.read()
    if not cert or not key:
        raise SecurityError("the collector needs --tls-cert and --tls-key unless it runs --insecure on loopback")
    if require_client_cert and not ca:
        raise SecurityError("mutual TLS for agents needs --tls-ca (the CA that signs agent certificates)")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=require_client_cert)


def read_token(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise SecurityError(f"cannot read token file {path!r}: {exc.strerror}") from None
    if not token:
        raise SecurityError(f"token file {path!r} is empty")
    return token


def hostname() -> str:
    return os.environ.get("STEPLENS_HOSTNAME") or socket.gethostname()
