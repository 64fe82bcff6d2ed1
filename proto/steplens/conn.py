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


def split_addresses(addresses: str) -> list[str]:
    """'HOST:PORT[,HOST:PORT...]': one collector, or several of one cluster (an agent streams to one of them at
    a time). Each is checked as split_host_port checks it; raises SecurityError naming a bad one."""
    out = [a.strip() for a in addresses.split(",")] if addresses else []
    if not out or any(not a for a in out):
        raise SecurityError(f"bad address list {addresses!r}: expected HOST:PORT[,HOST:PORT...]")
    for a in out:
        split_host_port(a)
    if len(set(out)) != len(out):
        raise SecurityError(f"bad address list {addresses!r}: an address is named twice")
    return out


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


def probe_protocol(address: str, timeout_s: float = 2.0) -> str:
    """What the server at HOST:PORT speaks: "plaintext" (HTTP/2 without TLS, as a collector run with --insecure:
    it answers the HTTP/2 client preface with a SETTINGS frame), "tls" (it completes a TLS handshake, or
    refuses it with a TLS alert), or "unknown". Raises OSError (socket.gaierror, ConnectionRefusedError,
    TimeoutError, ...) when no connection can be made. Costs two short connections; for error messages only."""
    import ssl
    host, port = split_host_port(address)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            head = s.recv(9)
        except OSError:
            head = b""
    if len(head) >= 4 and head[3] == 0x04:  # frame header: length(3) type(1); type 4 = SETTINGS
        return "plaintext"
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host):
                return "tls"
        except ssl.SSLError as exc:
            # an alert (certificate required, handshake failure) comes from a TLS server; WRONG_VERSION_NUMBER,
            # RECORD_LAYER_FAILURE or an EOF from something else
            return "tls" if "ALERT" in str(exc.reason or exc).upper() else "unknown"
        except OSError:
            return "unknown"


def explain_unreachable(address: str, insecure: bool, details: str, timeout_s: float = 2.0) -> str:
    """What to tell an operator (or log for an agent) whose call to the collector at `address` failed with
    UNAVAILABLE or DEADLINE_EXCEEDED: which side is wrong and what to do, found by probing the address
    (probe_protocol). `details` (gRPC's own text) is kept where the probe finds nothing better, and always
    when client and collector speak the same protocol: then the status may be the collector's own answer."""
    mode = "plaintext (--insecure)" if insecure else "TLS"
    try:
        host, port = split_host_port(address)
    except SecurityError as exc:
        return str(exc)
    if host.startswith("unix:"):
        return f"{address}: {details}"
    hint = "check --collector (or STEPLENS_COLLECTOR)"
    try:
        server = probe_protocol(address, timeout_s)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror or exc}): {hint}"
    except ConnectionRefusedError:
        return (f"nothing listens on {address} (connection refused): is the collector running "
                f"(`steplens-collector serve`, `make run`)? {hint}")
    except (TimeoutError, socket.timeout):
        return f"cannot reach {address}: no answer to a connection in {timeout_s:g}s (host down, route or firewall?); {hint}"
    except OSError as exc:
        return f"cannot reach {address}: {exc.strerror or exc}; {hint}"
    if server == "plaintext" and not insecure:
        fix = ("pass --insecure (allowed for loopback collectors only)" if is_loopback(address)
               else "plaintext is refused beyond loopback: run the collector with TLS (--tls-cert/--tls-key)")
        return f"the collector at {address} speaks plaintext (it runs with --insecure) and this client tried TLS: {fix}"
    if server == "tls" and insecure:
        return (f"the collector at {address} speaks TLS and this client connected in plaintext (--insecure): drop "
                "--insecure and pass --tls-ca (the CA of the collector's certificate) with --token-file, or "
                "--tls-cert/--tls-key")
    if server == "tls" and any(k in details for k in ("andshake", "SSL", "ertificate", "TSI_")):
        return (f"the TLS handshake with the collector at {address} failed: pass --tls-ca with the CA that signed "
                f"its certificate (which must name {host!r}), and a client certificate (--tls-cert/--tls-key) if it "
                f"asks for one. gRPC said: {details}")
    if server == "unknown":
        return f"{address} accepts connections but does not answer as a gRPC collector would ({mode}); {hint}"
    return f"{address}: {details}"


def hostname() -> str:
    return os.environ.get("STEPLENS_HOSTNAME") or socket.gethostname()
