"""NCCL topology from real published NCCL_DEBUG=INFO lines (tests/fixtures/nccl/README.md says where each
came from) and from NCCL RAS: JSON parsing, the client's line protocol, and a clean failure when RAS is
not there."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from conftest import REPO
from steplens.agent import nccltopo as nt

FIX = os.path.join(REPO, "tests", "fixtures", "nccl")


def _lines(name):
    with open(os.path.join(FIX, name)) as fh:
        return fh.readlines()


def test_init_complete_with_comm_hash():
    comms = nt.parse_log(_lines("init_2x_commid.log"))
    assert list(comms) == ["5ae77eb5ea4ec1ee"]
    c = comms["5ae77eb5ea4ec1ee"]
    assert c.nranks == 64 and c.complete
    assert sorted(c.ranks) == [32, 34, 35, 36]  # rank 33's line is cut short in the source post: skipped
    r = c.ranks[36]
    assert (r.host, r.pid, r.cuda_dev, r.nvml_dev, r.bus_id, r.comm_ptr) == \
        ("hostname-test", 984, 4, 4, "9b000", "0x557fe785f7a0")
    assert nt.norm_bus_id(r.bus_id) == "00000000:9B:00.0"


def test_init_start_with_launcher_prefix():
    comms = nt.parse_log(_lines("init_start_prefixed.log"))
    c = comms["9ad9b5e4ab2566da"]
    assert not c.complete and c.nranks == 16 and sorted(c.ranks) == [0, 1, 4, 7]
    assert c.ranks[7].host == "rdma-gpu-train-worker-0" and c.ranks[7].pid == 19491 and c.ranks[7].bus_id == "d6000"


def test_old_format_without_comm_hash_is_keyed_by_process_and_pointer():
    comms = nt.parse_log(_lines("init_old_nohash.log"))
    assert len(comms) == 8 and all(k.startswith("ptr:") for k in comms)
    (key,) = [k for k, c in comms.items() if 15 in c.ranks]
    assert key == "ptr:A03-R28-I49-3-9000018:193027:0x7fdf08000d00"
    c = comms[key]
    assert c.ranks[15].nvml_dev == -1 and c.ranks[15].bus_id == "e7000"


def test_files_and_non_init_lines():
    assert nt.parse_init_line("host:1:2 [0] NCCL INFO Connected all trees") is None
    comms = nt.parse_log_files([os.path.join(FIX, n) for n in ("init_2x_commid.log", "init_start_prefixed.log")]
                               + ["/nonexistent/nccl.x.1.log"])
    assert set(comms) == {"5ae77eb5ea4ec1ee", "9ad9b5e4ab2566da"}
    assert nt.norm_hash("0x00AB") == "ab"


def test_ras_json_and_merge_with_logs():
    with open(os.path.join(FIX, "ras_status.json")) as fh:
        ras = nt.parse_ras_json(fh.read())
    c = ras["5ae77eb5ea4ec1ee"]
    assert c.nranks == 64 and sorted(c.ranks) == [32, 40, 41]
    assert (c.ranks[40].host, c.ranks[40].pid, c.ranks[40].cuda_dev) == ("10.0.0.5", 1211, 0)
    merged = nt.merge(nt.parse_log(_lines("init_2x_commid.log")), ras)
    m = merged["5ae77eb5ea4ec1ee"]
    assert sorted(m.ranks) == [32, 34, 35, 36, 40, 41]
    assert m.ranks[32].host == "hostname-test" and m.ranks[32].bus_id == "18000"  # the log's view kept
    with pytest.raises(nt.RasUnavailable):
        nt.parse_ras_json("Job summary\n===========\n")  # text output of an older NCCL


def _free_tcp_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_ras_unreachable_degrades_cleanly():
    port = _free_tcp_port()
    with pytest.raises(nt.RasUnavailable) as err:
        nt.ras_topology("127.0.0.1", port, timeout_s=1.0)
    assert f"127.0.0.1:{port}" in str(err.value)


def _serve_once(handler):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        c, _ = srv.accept()
        with c, c.makefile("rwb") as f:
            handler(f)
        srv.close()
    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def test_ras_client_line_protocol():
    """A peer speaking RAS's line protocol as in NCCL src/ras/client_support.cc (a protocol double, not NCCL)."""
    with open(os.path.join(FIX, "ras_status.json"), "rb") as fh:
        body = fh.read()
    seen = []

    def ras(f):
        for answer in (b"SERVER PROTOCOL 2\n", b"OK\n"):
            seen.append(f.readline().strip())
            f.write(answer)
            f.flush()
        seen.append(f.readline().strip())
        f.write(body)
        f.flush()
    port = _serve_once(ras)
    comms = nt.ras_topology("127.0.0.1", port)
    assert seen == [b"CLIENT PROTOCOL 2", b"SET FORMAT json", b"VERBOSE STATUS"]
    assert "5ae77eb5ea4ec1ee" in comms

    def not_ras(f):
        f.readline()
        f.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        f.flush()
    with pytest.raises(nt.RasUnavailable) as err:
        nt.ras_topology("127.0.0.1", _serve_once(not_ras))
    assert "not NCCL RAS" in str(err.value)

    def old_nccl(f):
        f.readline()
        f.write(b"SERVER PROTOCOL 2\n")
        f.flush()
        f.readline()
        f.write(b"ERROR: Unknown command\n")
        f.flush()
    with pytest.raises(nt.RasUnavailable) as err:
        nt.ras_topology("127.0.0.1", _serve_once(old_nccl))
    assert "2.28.7" in str(err.value)
