"""Authentication: mutual TLS for agents (agent_id = certificate CN), bearer token or operator
certificate for Control, and plaintext refused anywhere but loopback."""

import json
import subprocess

import grpc
import pytest

from certs import Pki
from conftest import AGENT, COLLECTOR, STEPLENS, AgentProc, CollectorProc, free_port, wait_for
from wire import RawAgent, metrics

from steplens import conn
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc


@pytest.fixture
def pki(tmp_path):
    ca = Pki(str(tmp_path / "pki"))
    server = ca.issue("collector", server=True)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    return ca, server, str(token)


@pytest.fixture
def tls_collector(tmp_path, pki):
    ca, (cert, key), token = pki
    c = CollectorProc(tmp_path, extra=["--tls-ca", ca.ca_path, "--tls-cert", cert, "--tls-key", key,
                                       "--token-file", token, "--control-listen", f"127.0.0.1:{free_port()}"])
    c.control_address = c.extra[-1]
    c.start(insecure=False)
    yield c
    c.stop()


def _channel(address, ca, client=None):
    cert, key = client or (None, None)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        open(ca.ca_path, "rb").read(), open(key, "rb").read() if key else None,
        open(cert, "rb").read() if cert else None))


def test_agent_with_its_certificate_streams(tls_collector, pki):
    ca = pki[0]
    a = RawAgent(tls_collector.address, "node-a", channel=_channel(tls_collector.address, ca, ca.issue("node-a")))
    assert a.hello() is not None
    a.batch(1, metrics(4))
    assert a.wait_ack(1).rejected_records == 0
    a.close()


def test_agent_without_a_certificate_is_refused(tls_collector, pki):
    a = RawAgent(tls_collector.address, "node-a", channel=_channel(tls_collector.address, pki[0]))
    a.hello(timeout=5, expect=False)
    assert a.wait_error().code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails


def test_certificate_from_another_ca_is_refused(tls_collector, pki, tmp_path):
    other = Pki(str(tmp_path / "other"), "evil")
    a = RawAgent(tls_collector.address, "node-a",
                 channel=_channel(tls_collector.address, pki[0], other.issue("node-a")))
    a.hello(timeout=5, expect=False)
    assert a.wait_error().code() == grpc.StatusCode.UNAVAILABLE


def test_agent_id_must_match_certificate(tls_collector, pki):
    ca = pki[0]
    a = RawAgent(tls_collector.address, "node-b", channel=_channel(tls_collector.address, ca, ca.issue("node-a")))
    a.hello(timeout=5, expect=False)
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "node-a" in err.details()


def test_ingest_on_the_token_port_is_refused(tls_collector, pki):
    # the operators' port asks for no client certificate, so no agent can stream there
    a = RawAgent(tls_collector.control_address, "node-a", channel=_channel(tls_collector.control_address, pki[0]))
    a.hello(timeout=5, expect=False)
    assert a.wait_error().code() == grpc.StatusCode.PERMISSION_DENIED


def test_control_needs_token_or_operator_cert(tls_collector, pki):
    ca, _, token = pki
    ok = subprocess.run([STEPLENS, "--collector", tls_collector.control_address, "--tls-ca", ca.ca_path,
                         "--token-file", token, "nodes", "--json"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    wrong = tls_collector.control_address
    stub = cgrpc.ControlStub(_channel(wrong, ca))
    with pytest.raises(grpc.RpcError) as exc:
        stub.ListNodes(cpb.ListRequest(), metadata=[("authorization", "Bearer nope")], timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # an operator certificate works on the main (mutual TLS) port; an agent's certificate does not
    op = cgrpc.ControlStub(_channel(tls_collector.address, ca, ca.issue("steplens-operator")))
    op.ListNodes(cpb.ListRequest(), timeout=10)
    agent = cgrpc.ControlStub(_channel(tls_collector.address, ca, ca.issue("node-a")))
    with pytest.raises(grpc.RpcError) as exc:
        agent.ListNodes(cpb.ListRequest(), timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_real_agent_over_mutual_tls(tmp_path, tls_collector, pki, agents):
    ca, _, token = pki
    cert, key = ca.issue("tls-node")
    a = AgentProc(tmp_path, "tls-node", tls_collector.address)
    a.proc = subprocess.Popen([AGENT, "run", "--config", a.config, "--collector", tls_collector.address,
                               "--node-id", "tls-node", "--state-dir", a.state_dir, "--metrics-listen", "",
                               "--tls-ca", ca.ca_path, "--tls-cert", cert, "--tls-key", key],
                              stdout=open(a.log_path, "ab"), stderr=subprocess.STDOUT)
    agents.append(a)

    def stored():
        out = subprocess.run([STEPLENS, "--collector", tls_collector.control_address, "--tls-ca", ca.ca_path,
                              "--token-file", token, "nodes", "--json"], capture_output=True, text=True, timeout=30)
        nodes = json.loads(out.stdout or "[]")
        return nodes and nodes[0]["records_stored"] > 0
    wait_for(stored, 30, what="records over mutual TLS")
    assert a.stop() == 0


@pytest.mark.parametrize("argv", [
    [COLLECTOR, "serve", "--db", "/tmp/x.db", "--listen", "0.0.0.0:7777", "--insecure"],
    [COLLECTOR, "serve", "--db", "/tmp/x.db", "--listen", "10.1.2.3:7777", "--insecure"],
    [AGENT, "run", "--collector", "10.1.2.3:7707", "--insecure", "--state-dir", "/tmp/never"],
    [STEPLENS, "--collector", "192.168.1.1:7707", "--insecure", "nodes"],
    [COLLECTOR, "serve", "--db", "/tmp/x.db", "--listen", "127.0.0.1:7777"],  # TLS without certificates
])
def test_insecure_only_on_loopback(argv):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "insecure" in out.stderr or "TLS" in out.stderr or "tls" in out.stderr


def test_loopback_policy():
    assert conn.is_loopback("127.0.0.1:1") and conn.is_loopback("[::1]:1") and conn.is_loopback("localhost:1")
    assert conn.is_loopback("unix:/run/steplens.sock")
    assert not conn.is_loopback("0.0.0.0:1") and not conn.is_loopback("10.0.0.1:1")
    with pytest.raises(conn.SecurityError):
        conn.split_host_port("nohost")
