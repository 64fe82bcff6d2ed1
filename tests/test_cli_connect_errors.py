"""The operator CLI says what is wrong when it cannot talk to the collector, and what to do: TLS against a
plaintext collector, plaintext against a TLS one, a TLS handshake without the right CA, nothing listening,
a name that does not resolve. Real collectors on loopback; no raw handshake text, no gRPC core log lines."""

from __future__ import annotations

import subprocess

import pytest

from certs import Pki
from conftest import STEPLENS, CollectorProc, free_port


def _steplens(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STEPLENS, *args], capture_output=True, text=True, timeout=60)


def _one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1 and out.stdout == "", out
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("steplens: "), out.stderr  # no gRPC core log lines
    assert "WRONG_VERSION_NUMBER" not in out.stderr and "certificate verification context" not in out.stderr
    return lines[0]


@pytest.fixture
def tls_collector(tmp_path):
    ca = Pki(str(tmp_path / "pki"))
    cert, key = ca.issue("collector", server=True)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    c = CollectorProc(tmp_path, extra=["--tls-ca", ca.ca_path, "--tls-cert", cert, "--tls-key", key,
                                       "--token-file", str(token), "--control-listen", f"127.0.0.1:{free_port()}"])
    c.control_address = c.extra[-1]
    c.ca, c.token = ca, str(token)
    c.start(insecure=False)
    yield c
    c.stop()


def test_tls_client_against_the_plaintext_collector(collector):
    msg = _one_line(_steplens("--collector", collector.address, "nodes"))
    assert f"the collector at {collector.address} speaks plaintext" in msg and "pass --insecure" in msg, msg
    assert _steplens("--collector", collector.address, "--insecure", "nodes").returncode == 0


def test_plaintext_client_against_a_tls_collector(tls_collector):
    for address in (tls_collector.address, tls_collector.control_address):  # mutual-TLS port and token port
        msg = _one_line(_steplens("--collector", address, "--insecure", "nodes"))
        assert f"the collector at {address} speaks TLS" in msg and "drop --insecure" in msg and "--tls-ca" in msg, msg
    ok = _steplens("--collector", tls_collector.control_address, "--tls-ca", tls_collector.ca.ca_path,
                   "--token-file", tls_collector.token, "nodes")
    assert ok.returncode == 0, ok.stderr


def test_tls_client_without_the_collectors_ca(tls_collector):
    msg = _one_line(_steplens("--collector", tls_collector.control_address, "--token-file", tls_collector.token,
                              "nodes"))
    assert "TLS handshake" in msg and "--tls-ca" in msg, msg


def test_nothing_listening_and_a_name_that_does_not_resolve():
    address = f"127.0.0.1:{free_port()}"
    for extra in ([], ["--insecure"]):
        msg = _one_line(_steplens("--collector", address, *extra, "nodes"))
        assert f"nothing listens on {address}" in msg and "collector running" in msg, msg
    msg = _one_line(_steplens("--collector", "steplens-no-such-host.invalid:7707", "--timeout", "5", "nodes"))
    assert "cannot resolve 'steplens-no-such-host.invalid'" in msg, msg
