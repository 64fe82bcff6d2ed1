"""tcpinfo: per-TCP-connection traffic, retransmits and RTT (ConnStats, as netflows emits them) and connections
stuck retransmitting (Events), from the kernel's sock_diag netlink interface: no eBPF, no compilation.

Each step is one NETLINK_SOCK_DIAG dump per address family (AF_INET, AF_INET6; what `ss -ti` does: a
SOCK_DIAG_BY_FAMILY request, struct inet_diag_req_v2, with the INET_DIAG_INFO extension) of the TCP sockets in
the agent's network namespace in every state but LISTEN, TIME_WAIT, NEW_SYN_RECV and CLOSE (those carry no
struct tcp_info). Parsed with `struct` alone: nlmsghdr, struct inet_diag_msg (address, ports, cookie, inode),
and the INET_DIAG_INFO attribute, struct tcp_info at the offsets of include/uapi/linux/tcp.h (TCP_INFO_FIELDS;
tests/test_source_tcpinfo.py checks them against the running kernel's BTF and `ss -tin`). A kernel gives the
tcp_info of its own size: fields past that length (bytes_sent on kernels before 4.19, say) read as 0.

Per connection, keyed by (src, sport, dst, dport, socket cookie), the previous reading is kept and
ConnStats(mono_ns = now, start_mono_ns = the previous reading's time) carries the deltas:
  tx_payload_bytes  bytes_sent - bytes_retrans (payload bytes sent once, retransmissions not counted; kernels
                    without bytes_sent: bytes_acked, where the SYN and FIN count one byte each)
  rx_payload_bytes  bytes_received (less the peer's FIN, which the kernel counts as a byte)
  tx_packets / rx_packets   segs_out / segs_in (32-bit counters, deltas taken modulo 2^32)
  retransmits       total_retrans (segments)
  srtt_us           tcpi_rtt, the smoothed RTT (µs) at the reading
  net_limited_us    the interval's time with data to send held back by the network (cwnd, pacing, recovery), not
                    by the peer's window nor the send buffer: tcpi_busy_time - rwnd_limited - sndbuf_limited
                    (Linux 4.10+, jiffy resolution). A slow link keeps a sender network-limited; a slow peer
                    or application does not, even when delayed ACKs inflate its RTT
  tx_bytes / rx_bytes       0: wire bytes at the device are not visible here (netflows has them)
  pid, comm         the workload process holding the socket, else 0 and ""
A connection's first reading is emitted once with start_mono_ns = now and zero deltas (its RTT, its existence)
when it existed before the agent's previous complete dump; a connection absent from that dump was born since,
so its counters are deltas from 0 over [previous dump, now]. A connection whose counters and state did not
change is not emitted (idle connections cost a dictionary update). Closed connections (absent from a complete
dump) are forgotten; the traffic of their last interval is not seen (a poll, not a trace: a connection opened
and closed between two dumps is not seen at all).

Stuck retransmitting: unacked segments and tcpi_retransmits > 0 or tcpi_backoff > 0 (retransmission timeouts
without progress: a dead peer, a link dropping everything; zero-window probing has no unacked data and is not
this). Such a connection is emitted every step even with no delta. Its onset is the later of its last ACK
(tcpi_last_ack_recv) and the previous reading that did not see it stuck; once stuck for stalled_after_seconds,
one Event kind "tcp_stalled", entity "src:sport->dst:dport" (IPv6 addresses in brackets), value = seconds
stuck, message with pid, state, unacked, retransmits, backoff, rto, seconds since the last ACK and bytes queued;
when it is no longer stuck, Event "tcp_recovered" (value = seconds it was stuck); if it closes while stuck, or
its process closes it (an orphan the kernel goes on retransmitting is no workload's), "tcp_stall_closed".

Owning process: socket inode -> pid from the /proc/PID/fd links ("socket:[inode]") of the workload processes
(ctx.workloads, kept by the procs source), rescanned at most once per step, when the dump shows an inode not
seen at the previous scan or the set of workloads changed. workloads_only (default) emits only their
connections. max_connections caps the connections tracked (known ones first); the excess is counted
(`capped_total`) and reported by one Event "tcpinfo_connections_capped" when capping starts. Run-time failures
(a netlink error, ENOBUFS, EPERM, a truncated or malformed message) are counted in `errors` and reported by one
Event "tcpinfo_error" per kind (entity = the kind); step() never raises for them. An incomplete dump forgets
nothing.

Network namespaces: the netlink socket (opened in start()) sees the namespace of the thread that opened it:
an agent in the host namespace does not see the connections of workloads in their own network namespace (run
the agent in it). A kernel that refuses the AF_INET6 dump at start() gets IPv4 dumps only (`ipv6_reason`).
Privileges: the dump needs none; reading other users' /proc/PID/fd needs root (else pid 0, and with
workloads_only those connections are not emitted).

netflows emits ConnStats for the same connections (with wire bytes, and every connection it sees): with both
sources running, each connection is reported twice, once by each; run one of them where the other works.

Dumps and lookups: a dump makes the kernel walk its whole TCP established hash table, whose size follows the
host's memory (262,144 buckets on this 8 GB VM, millions on a GPU host): ~1.1 ms of CPU per family with no
socket at all. So a full dump (both families) runs only when it can find something: at the first step, when
the workloads changed, when the namespace's TCP socket count moved since the last step (/proc/net/sockstat and
sockstat6 "inuse": a connection opened, accepted or closed), and at least every full_dump_seconds (10 s; 0: every
step). Between them the tracked connections are read by exact lookups (SOCK_DIAG_BY_FAMILY with each socket's
inet_diag_sockid, cookie included: a hash lookup, LOOKUP_BATCH requests per datagram); a socket the kernel no
longer has (ENOENT) is closed, and an unanswered lookup forgets nothing. A connection opened and another closed
within one step leave the count unchanged: the new one is found by the next dump, at most full_dump_seconds
later, with its bytes counted from 0 since the last complete dump as above. A connection whose last reading
showed it idle (nothing moved, not stuck) is not parsed when its answer carries the same counters
(SIGNATURE_FIELDS: bytes, segments, retransmits, state, the stuck test's fields, read straight from the answer's
tcp_info): most of a job's connections are idle at any one reading (the 8-rank gloo job of
bench/agent_footprint.py: 72 sockets, about 16 of them moved in a second on average).

Cost (tests/test_source_tcpinfo.py::test_step_cost, 2-core Debian 12 VM, kernel 6.18, CPU time user + system
per step): with no connection ~2.0 ms a dump, 0.04 ms between dumps (the sockstat read); 200 loopback
connections held by a workload (400 sockets, both ends): ~4.4-7.9 ms a dump, ~1.8 ms by lookups with all of
them idle (4.2 ms parsing each: ~10 µs per socket, of which ~3 µs is the kernel's), ~5 ms with every one
moving and emitted; a socket no workload holds ~1.2 µs in a dump (only its header is parsed) and nothing
between dumps. An fd rescan costs ~1.5 µs per open fd of the workloads (409 fds: 0.6 ms), at most once per
step and only when a dump shows an unknown socket.
"""

from __future__ import annotations

import errno as errno_mod
import operator
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from steplens.agent.records import ConnStats, Event
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig, host_path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300          # NLM_F_ROOT | NLM_F_MATCH
NLM_F_DUMP_INTR = 0x10      # the dump was inconsistent (the kernel's tables changed under it)
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_INFO = 2
NLA_TYPE_MASK = 0x3FFF      # attribute type without the nested / byte-order flags
INET_DIAG_NOCOOKIE = 0xFFFFFFFFFFFFFFFF

# TCP states (include/net/tcp_states.h)
TCP_ESTABLISHED, TCP_SYN_SENT, TCP_SYN_RECV, TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_TIME_WAIT, TCP_CLOSE, \
    TCP_CLOSE_WAIT, TCP_LAST_ACK, TCP_LISTEN, TCP_CLOSING, TCP_NEW_SYN_RECV = range(1, 13)
STATE_NAMES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
               7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
# full sockets, which carry a tcp_info
DUMP_STATES = (TCP_ESTABLISHED, TCP_SYN_SENT, TCP_SYN_RECV, TCP_FIN_WAIT1, TCP_FIN_WAIT2, TCP_CLOSE_WAIT,
               TCP_LAST_ACK, TCP_CLOSING)
STATES_MASK = sum(1 << s for s in DUMP_STATES)
# states in which the peer's FIN was received (bytes_received counts it as one byte)
FIN_RECEIVED = frozenset((TCP_CLOSE_WAIT, TCP_LAST_ACK, TCP_CLOSING, TCP_TIME_WAIT))

_NLH = struct.Struct("=IHHII")                 # struct nlmsghdr
_REQ = struct.Struct("=BBBxI48x")              # struct inet_diag_req_v2, id (inet_diag_sockid) all zero: any
_REQ_HEAD = struct.Struct("=BBBxI")            # ... without its id, for an exact lookup's request
SOCKID_SIZE = 48                               # struct inet_diag_sockid: ports, src, dst, if, cookie
_MSG = struct.Struct("=BBBB4x16s16sIQIIIII")   # struct inet_diag_msg; ports (big endian) read apart
_PORTS = struct.Struct("!HH")
_RTA = struct.Struct("=HH")                    # struct rtattr / nlattr
_ERR = struct.Struct("=i")
MSG_SIZE = _MSG.size                           # 72
assert MSG_SIZE == 72

# struct tcp_info (include/uapi/linux/tcp.h): field -> (offset, struct format). The kernel fills what its
# version has; each field was appended at the end, so a shorter tcp_info is an older layout's prefix.
TCP_INFO_FIELDS: dict[str, tuple[int, str]] = {
    "state": (0, "B"),
    "ca_state": (1, "B"),
    "retransmits": (2, "B"),        # RTO timeouts without progress (icsk_retransmits)
    "probes": (3, "B"),             # zero-window / keepalive probes unanswered
    "backoff": (4, "B"),            # RTO exponential backoff
    "rto": (8, "I"),                # µs
    "ato": (12, "I"),
    "snd_mss": (16, "I"),
    "rcv_mss": (20, "I"),
    "unacked": (24, "I"),           # segments in flight
    "sacked": (28, "I"),
    "lost": (32, "I"),
    "retrans": (36, "I"),           # segments retransmitted and in flight
    "last_data_sent": (44, "I"),    # ms ago
    "last_data_recv": (52, "I"),
    "last_ack_recv": (56, "I"),
    "pmtu": (60, "I"),
    "rtt": (68, "I"),               # smoothed RTT, µs
    "rttvar": (72, "I"),
    "snd_cwnd": (80, "I"),
    "total_retrans": (100, "I"),    # segments retransmitted over the connection's life
    "bytes_acked": (120, "Q"),      # Linux 4.1
    "bytes_received": (128, "Q"),
    "segs_out": (136, "I"),         # Linux 4.2
    "segs_in": (140, "I"),
    "busy_time": (168, "Q"),        # Linux 4.10, µs (jiffies): time with data to send (TCP chrono), all limits
    "rwnd_limited": (176, "Q"),     # ... of it limited by the peer's receive window
    "sndbuf_limited": (184, "Q"),   # ... of it limited by the send buffer
    "bytes_sent": (200, "Q"),       # Linux 4.19
    "bytes_retrans": (208, "Q"),
}
TCP_INFO_MIN_LEN = 104              # up to total_retrans: every kernel with INET_DIAG_INFO gives at least this


def _tcp_info_struct() -> tuple[struct.Struct, int]:
    fmt, pos = "<", 0
    for _name, (off, code) in TCP_INFO_FIELDS.items():
        if off < pos:
            raise ValueError("TCP_INFO_FIELDS must be in offset order")
        fmt += "x" * (off - pos) + code
        pos = off + struct.calcsize(code)
    return struct.Struct(fmt), pos


_TCPI, TCP_INFO_PARSED_LEN = _tcp_info_struct()   # 216 bytes: through bytes_retrans

# What a reading's deltas, state and stuck test depend on: a connection whose tcp_info reads back with these the
# same as at its last reading has nothing to emit (no bytes, segments or retransmits moved, same state, and not
# stuck where it was not), so a lookup need not parse it (SockDiag.lookup's signatures). Left out: the "time
# since" fields (last_data_sent, ...), rtt and the like, which move at every reading.
SIGNATURE_FIELDS = ("state", "retransmits", "backoff", "unacked", "total_retrans", "bytes_acked", "bytes_received",
                    "segs_out", "segs_in", "busy_time", "rwnd_limited", "sndbuf_limited", "bytes_sent",
                    "bytes_retrans")


_SIG_ORDER = tuple(sorted(SIGNATURE_FIELDS, key=lambda n: TCP_INFO_FIELDS[n][0]))


def _signature_struct() -> struct.Struct:
    fmt, pos = "<", 0
    for name in _SIG_ORDER:
        off, code = TCP_INFO_FIELDS[name]
        fmt += "x" * (off - pos) + code
        pos = off + struct.calcsize(code)
    return struct.Struct(fmt)


_SIG = _signature_struct()
signature = operator.attrgetter(*_SIG_ORDER)   # of a TcpInfo: the tuple _SIG reads from its bytes


class TcpInfo(NamedTuple):
    state: int
    ca_state: int
    retransmits: int
    probes: int
    backoff: int
    rto: int
    ato: int
    snd_mss: int
    rcv_mss: int
    unacked: int
    sacked: int
    lost: int
    retrans: int
    last_data_sent: int
    last_data_recv: int
    last_ack_recv: int
    pmtu: int
    rtt: int
    rttvar: int
    snd_cwnd: int
    total_retrans: int
    bytes_acked: int
    bytes_received: int
    segs_out: int
    segs_in: int
    busy_time: int
    rwnd_limited: int
    sndbuf_limited: int
    bytes_sent: int
    bytes_retrans: int
    length: int  # bytes the kernel gave; a field ending past it is absent (0)

    def has(self, name: str) -> bool:
        return _FIELD_END[name] <= self.length


assert TcpInfo._fields[:-1] == tuple(TCP_INFO_FIELDS)
_FIELD_END = {name: off + struct.calcsize(code) for name, (off, code) in TCP_INFO_FIELDS.items()}


def parse_tcp_info(buf, offset: int = 0, length: int | None = None) -> TcpInfo:
    """struct tcp_info from `length` bytes of `buf` at `offset` (default: the rest); fields past it read 0."""
    if length is None:
        length = len(buf) - offset
    length = max(0, min(length, len(buf) - offset))
    if length >= TCP_INFO_PARSED_LEN:
        return TcpInfo(*_TCPI.unpack_from(buf, offset), length)
    padded = bytes(buf[offset:offset + length]) + bytes(TCP_INFO_PARSED_LEN - length)
    return TcpInfo(*_TCPI.unpack(padded), length)


class DiagSock(NamedTuple):
    """One socket of a dump: struct inet_diag_msg, addresses as text, and its tcp_info (None when absent)."""
    family: int
    state: int
    timer: int
    retrans: int
    src: str
    sport: int
    dst: str
    dport: int
    ifindex: int
    cookie: int
    expires: int
    rqueue: int
    wqueue: int
    uid: int
    inode: int
    info: TcpInfo | None
    key: tuple  # (cookie, sport, dport, raw src, raw dst): one socket, whatever its addresses print as
    sockid: bytes = b""  # struct inet_diag_sockid as the kernel gave it: what an exact lookup asks for


@dataclass
class DumpPart:
    """What parse_messages() got from one or more datagrams of a dump."""
    socks: list
    errors: dict          # kind -> count
    done: bool = False    # NLMSG_DONE (or the NLMSG_ERROR that ends a dump) seen
    interrupted: bool = False  # NLM_F_DUMP_INTR: the kernel says the dump may be inconsistent
    skipped: list = field(default_factory=list)  # (key, inode) of sockets whose inode was in `skip_inodes`
    unchanged: list = field(default_factory=list)  # indexes of lookups answered with their signature (lookup)


def _err(errors: dict, kind: str) -> None:
    errors[kind] = errors.get(kind, 0) + 1


_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _addr(family: int, raw: bytes) -> str:
    """The address as text; IPv4-mapped IPv6 ones as IPv4 (as the peer, and netflows, see them)."""
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    if raw[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, raw[12:16])
    return socket.inet_ntop(socket.AF_INET6, raw)


def parse_messages(data, seq: int | None = None, part: DumpPart | None = None,
                   skip_inodes: set | frozenset = frozenset()) -> DumpPart:
    """Parse netlink messages (one datagram, or several back to back) of a sock_diag dump into `part`.

    Never raises: a truncated message ends the parse of `data` (what came before is kept), a malformed
    socket is skipped, and each problem is counted in part.errors by kind. Messages of another sequence
    number than `seq` (a stale answer to an earlier request) are skipped. A socket whose inode is in
    `skip_inodes` is only listed in part.skipped (its tcp_info and addresses are not parsed).
    """
    if part is None:
        part = DumpPart([], {})
    n = len(data)
    off = 0
    while off < n:
        if n - off < _NLH.size:
            _err(part.errors, "truncated netlink header")
            break
        length, mtype, flags, mseq, _pid = _NLH.unpack_from(data, off)
        if length < _NLH.size or off + length > n:
            _err(part.errors, "truncated netlink message")
            break
        body, end = off + _NLH.size, off + length
        off += (length + 3) & ~3
        if seq is not None and mseq != seq:
            continue
        if flags & NLM_F_DUMP_INTR:
            part.interrupted = True
        if mtype == NLMSG_DONE:
            part.done = True
            break
        if mtype == NLMSG_ERROR:
            code = -_ERR.unpack_from(data, body)[0] if end - body >= 4 else 0
            if code:
                _err(part.errors, f"netlink error: [Errno {code}] {os.strerror(code)}")
            part.done = True
            break
        if mtype != SOCK_DIAG_BY_FAMILY:
            _err(part.errors, f"unexpected netlink message type {mtype}")
            continue
        if end - body < MSG_SIZE:
            _err(part.errors, "short inet_diag_msg")
            continue
        (family, state, timer, retrans, src, dst, ifindex, cookie, expires, rqueue, wqueue, uid,
         inode) = _MSG.unpack_from(data, body)
        if family not in (socket.AF_INET, socket.AF_INET6):
            _err(part.errors, f"unknown address family {family}")
            continue
        sport, dport = _PORTS.unpack_from(data, body + 4)
        key = (cookie, sport, dport, src, dst)
        if inode in skip_inodes:
            part.skipped.append((key, inode))
            continue
        info = None
        a = body + MSG_SIZE
        while a + _RTA.size <= end:
            alen, atype = _RTA.unpack_from(data, a)
            if alen < _RTA.size or a + alen > end:
                _err(part.errors, "truncated attribute")
                break
            if atype & NLA_TYPE_MASK == INET_DIAG_INFO:
                if alen - _RTA.size < TCP_INFO_MIN_LEN:
                    _err(part.errors, "short tcp_info")
                info = parse_tcp_info(data, a + _RTA.size, alen - _RTA.size)
            a += (alen + 3) & ~3
        part.socks.append(DiagSock(family, state, timer, retrans, _addr(family, src), sport, _addr(family, dst),
                                   dport, ifindex, cookie, expires, rqueue, wqueue, uid, inode, info, key,
                                   bytes(data[body + 4:body + 4 + SOCKID_SIZE])))
    return part


def _answer_signature(buf, end: int) -> tuple | None:
    """The signature (SIGNATURE_FIELDS) of the tcp_info in a one-message lookup answer ending at `end`, or None
    where the message has no full-length one (then it is parsed)."""
    a = _NLH.size + MSG_SIZE
    while a + _RTA.size <= end:
        alen, atype = _RTA.unpack_from(buf, a)
        if alen < _RTA.size or a + alen > end:
            return None
        if atype & NLA_TYPE_MASK == INET_DIAG_INFO:
            return _SIG.unpack_from(buf, a + _RTA.size) if alen - _RTA.size >= TCP_INFO_PARSED_LEN else None
        a += (alen + 3) & ~3
    return None


def lookup_request(family: int, sockid: bytes, seq: int) -> bytes:
    """The netlink request for one socket (exact lookup by its inet_diag_sockid, cookie included) with
    INET_DIAG_INFO: a hash lookup in the kernel, where a dump walks the whole established table."""
    body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0) + sockid
    return _NLH.pack(_NLH.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def dump_request(family: int, seq: int, states: int = STATES_MASK) -> bytes:
    """The netlink request for a dump of `family` TCP sockets in `states` with INET_DIAG_INFO."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), states)
    return _NLH.pack(_NLH.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


class SockDiag:
    """A NETLINK_SOCK_DIAG socket and its dumps. The socket sees the network namespace it was opened in."""

    BUFFER_BYTES = 1 << 16   # a dump datagram is at most 32 KiB (netlink_dump); a larger one is truncated, counted
    TIMEOUT_SECONDS = 2.0

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        try:
            self._sock.bind((0, 0))
            self._sock.settimeout(self.TIMEOUT_SECONDS)
        except OSError:
            self._sock.close()
            raise
        self._buf = bytearray(self.BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._seq = 0
        self._dirty = False  # an earlier dump ended early: its remaining answer may still be queued

    def close(self) -> None:
        self._sock.close()

    def _drain(self) -> None:
        self._sock.settimeout(0.0)
        try:
            while True:
                self._sock.recv_into(self._buf)
        except OSError:  # BlockingIOError: nothing left
            pass
        finally:
            self._sock.settimeout(self.TIMEOUT_SECONDS)
        self._dirty = False

    LOOKUP_BATCH = 128       # requests per send: their answers (~350 bytes each) stay far under the receive buffer

    def lookup(self, socks: list[tuple[int, bytes]], part: DumpPart | None = None,
               signatures: list | None = None) -> tuple[DumpPart, int]:
        """Exact lookups of (family, sockid) sockets, LOOKUP_BATCH requests per datagram (the kernel answers each
        message of a datagram in turn: the socket, or an error). Returns (part with the sockets found, how many
        the kernel said do not exist any more: ENOENT, which is also its answer to a reused address with another
        cookie). part.done: every request was answered, each by its socket or ENOENT, so a socket absent from
        part is closed. Never raises OSError: errors are counted in part.errors.
        signatures: per request, the signature (SIGNATURE_FIELDS) of its socket's last reading, or None; a socket
        answered with the same one is not parsed, its index goes to part.unchanged (~4.5 of ~6.3 µs of Python per
        socket saved, warm: most of a job's connections are idle at any one reading)."""
        if part is None:
            part = DumpPart([], {})
        gone = answered = 0
        try:
            if self._dirty:
                self._drain()
            for i in range(0, len(socks), self.LOOKUP_BATCH):
                batch = socks[i:i + self.LOOKUP_BATCH]
                self._seq = (self._seq + 1) & 0xFFFFFFFF
                self._dirty = True
                self._sock.send(b"".join(lookup_request(f, sid, self._seq) for f, sid in batch))
                waiting = len(batch)
                while waiting:
                    n = self._sock.recv_into(self._buf, 0, socket.MSG_TRUNC)
                    if n > len(self._buf):
                        _err(part.errors, "truncated datagram")
                        n = len(self._buf)
                    if n < _NLH.size:
                        _err(part.errors, "short datagram")
                        continue
                    length, mtype, _flags, mseq, _pid = _NLH.unpack_from(self._buf, 0)
                    if mseq != self._seq:
                        continue   # a stale answer to an earlier request
                    index = i + len(batch) - waiting   # answers come in the order of the requests
                    waiting -= 1
                    if mtype == NLMSG_ERROR:
                        code = -_ERR.unpack_from(self._buf, _NLH.size)[0] if n >= _NLH.size + 4 else 0
                        if code == errno_mod.ENOENT:
                            gone += 1
                            answered += 1
                        elif code:
                            _err(part.errors, f"netlink error: [Errno {code}] {os.strerror(code)}")
                        continue
                    if signatures is not None and mtype == SOCK_DIAG_BY_FAMILY and \
                            signatures[index] is not None and \
                            _answer_signature(self._buf, min(n, length)) == signatures[index]:
                        part.unchanged.append(index)
                        answered += 1
                        continue
                    before = len(part.socks)
                    parse_messages(self._view[:n], self._seq, part)
                    answered += len(part.socks) > before
                self._dirty = False
        except socket.timeout:
            _err(part.errors, "timeout waiting for a lookup")
        except OSError as exc:
            code = exc.errno or 0
            _err(part.errors, f"{errno_mod.errorcode.get(code, str(code))}: {exc.strerror or exc}")
        part.done = answered == len(socks) and not part.errors
        return part, gone

    def dump(self, family: int, part: DumpPart | None = None, skip_inodes: set | frozenset = frozenset()) -> DumpPart:
        """One dump of `family` into `part` (see parse_messages for `skip_inodes`); a socket error or a datagram
        that does not end it leaves done False. Never raises OSError: errors are counted in part.errors."""
        if part is None:
            part = DumpPart([], {})
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        part.done = False
        try:
            if self._dirty:
                self._drain()
            self._sock.send(dump_request(family, self._seq))
            while not part.done:
                n = self._sock.recv_into(self._buf, 0, socket.MSG_TRUNC)
                if n > len(self._buf):
                    _err(part.errors, "truncated datagram")
                    n = len(self._buf)
                if n == 0:
                    _err(part.errors, "empty datagram")
                    break
                # a malformed message loses the rest of its datagram; the dump's later datagrams still parse
                parse_messages(self._view[:n], self._seq, part, skip_inodes)
        except socket.timeout:
            _err(part.errors, "timeout waiting for the dump")
        except OSError as exc:
            code = exc.errno or 0
            name = errno_mod.errorcode.get(code, str(code))
            _err(part.errors, f"{name}: {exc.strerror or exc}")
        if not part.done:
            self._dirty = True
        return part


@dataclass
class TcpinfoConfig(SourceConfig):
    workloads_only: bool = True          # emit only connections whose socket a workload process holds
    max_connections: int = 4096          # connections tracked per step at most; the excess is counted
    stalled_after_seconds: float = 2.0   # stuck retransmitting this long -> Event tcp_stalled
    full_dump_seconds: float = 10.0      # a full dump at least this often; between them the tracked connections
                                         # are looked up one by one unless the namespace's TCP socket count moved
                                         # (0: a full dump every step)

    def validate(self) -> None:
        super().validate()
        if not (1 <= self.max_connections <= 1 << 20):
            raise ConfigError(f"max_connections must be within 1..1048576, got {self.max_connections}")
        if not (0.0 <= self.stalled_after_seconds <= 3600):
            raise ConfigError(f"stalled_after_seconds must be within 0..3600, got {self.stalled_after_seconds}")
        if not (0.0 <= self.full_dump_seconds <= 3600):
            raise ConfigError(f"full_dump_seconds must be within 0..3600, got {self.full_dump_seconds}")


class _Conn:
    """What is kept of a connection between readings."""
    __slots__ = ("mono_ns", "totals", "state", "stuck", "stuck_since_ns", "stall_reported", "entity", "family",
                 "sockid", "sig")

    def __init__(self, mono_ns: int, totals: tuple, state: int, entity: str, family: int = 0,
                 sockid: bytes = b"") -> None:
        self.mono_ns = mono_ns
        self.totals = totals
        self.state = state
        self.family, self.sockid = family, sockid
        self.stuck = False
        self.stuck_since_ns = 0    # onset of the current stuck episode
        self.stall_reported = False
        self.entity = entity
        self.sig: tuple | None = None   # signature() of the last reading (None: parse the next one whole)


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def conn_entity(s: DiagSock) -> str:
    """"src:sport->dst:dport", IPv6 addresses in brackets (what collector/analysis/hang.py parses)."""
    return f"{_endpoint(s.src, s.sport)}->{_endpoint(s.dst, s.dport)}"


def totals_of(info: TcpInfo) -> tuple[int, int, int, int, int, int]:
    """Cumulative (tx payload, rx payload, segments out, segments in, retransmitted segments, µs network-limited)
    of a reading. Network-limited: time with data to send held back by neither the peer's window nor the send
    buffer (TCP chrono "busy": cwnd, pacing, loss recovery), 0 before Linux 4.10."""
    if info.length >= _BYTES_SENT_END:
        tx = info.bytes_sent - info.bytes_retrans
    else:
        tx = info.bytes_acked
    rx = info.bytes_received - (1 if info.state in FIN_RECEIVED and info.bytes_received else 0)
    net = max(0, info.busy_time - info.rwnd_limited - info.sndbuf_limited) if info.length >= _SNDBUF_END else 0
    return (tx, rx, info.segs_out, info.segs_in, info.total_retrans, net)


_BYTES_SENT_END, _SNDBUF_END = _FIELD_END["bytes_sent"], _FIELD_END["sndbuf_limited"]


def is_stuck(info: TcpInfo) -> bool:
    """Unacked data and retransmission timeouts without progress (or RTO backoff)."""
    return info.unacked > 0 and (info.retransmits > 0 or info.backoff > 0)


def _deltas(now: tuple, before: tuple) -> tuple:
    """now - before per counter: 64-bit byte counts never go back; 32-bit segment counts wrap."""
    return (max(0, now[0] - before[0]), max(0, now[1] - before[1]), (now[2] - before[2]) & 0xFFFFFFFF,
            (now[3] - before[3]) & 0xFFFFFFFF, (now[4] - before[4]) & 0xFFFFFFFF, max(0, now[5] - before[5]))


class TcpinfoSource(Source):
    name = "tcpinfo"
    config_class = TcpinfoConfig
    description = "per-connection TCP bytes, retransmits, RTT and stuck connections from sock_diag (no eBPF)"

    def __init__(self, ctx: HostContext, config: TcpinfoConfig) -> None:
        super().__init__(ctx, config)
        self._diag: SockDiag | None = None
        self.families = [socket.AF_INET, socket.AF_INET6]
        self.ipv6_reason = ""  # why AF_INET6 sockets are not dumped, if they are not
        self._reset()

    def _reset(self) -> None:
        self._conns: dict[tuple, _Conn] = {}
        self._seen_prev: set = set()          # keys in the dumps since the last complete one (all sockets)
        self._complete_ns: int | None = None  # time of the last complete dump
        self._owners: dict[int, int] = {}     # socket inode -> workload pid, at the last fd scan
        self._comms: dict[int, str] = {}
        self._foreign: set[int] = set()       # inodes in the dump at the last scan that no workload held
        self._scanned_workloads: frozenset = frozenset()
        self._error_kinds: set[str] = set()
        self._capping = False
        self.capped_total = 0    # connections not tracked because of max_connections, summed over steps
        self.fd_scans = 0
        self.dumps = 0
        self.lookups = 0         # steps that read the tracked connections by exact lookups instead of a dump
        self.unchanged = 0       # lookups answered with the last reading's signature (not parsed)
        self._sockstat_sig = None
        self._last_dump_complete = False  # the last full dump ended complete (none yet: False)

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        try:
            diag = SockDiag()
        except OSError as exc:
            return Availability.no(f"sock_diag unavailable: {exc}")
        try:
            part = diag.dump(socket.AF_INET)
        finally:
            diag.close()
        if not part.done or part.errors:
            return Availability.no(f"sock_diag TCP dump failed: {'; '.join(sorted(part.errors)) or 'no answer'}")
        if os.geteuid() != 0:
            return Availability.yes("not root: sockets of other users' workloads get no pid")
        return Availability.yes()

    def start(self) -> None:
        self.stop()
        self._diag = SockDiag()
        self._reset()
        # a kernel without IPv6 may refuse the AF_INET6 dump: then every step would count it as an error and
        # no dump would ever be complete
        self.families = [socket.AF_INET]
        v6 = self._diag.dump(socket.AF_INET6)
        if v6.done and not v6.errors:
            self.families.append(socket.AF_INET6)
        else:
            self.ipv6_reason = "; ".join(sorted(v6.errors)) or "no answer"

    def stop(self) -> None:
        diag, self._diag = self._diag, None
        if diag is not None:
            diag.close()

    def idle(self) -> bool:
        """With workloads_only, nothing is emitted while there is no workload: idle once the last step saw none.
        The connection state is dropped then, so the first dump after a workload appears is a first reading
        (zero deltas) rather than the whole idle time's traffic counted as new."""
        if not self.config.workloads_only or self._scanned_workloads or self.ctx.workloads.snapshot():
            return False
        self._conns, self._seen_prev, self._complete_ns = {}, set(), None
        return True

    # -- step ------------------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Connections tracked now."""
        return len(self._conns)

    def read(self, skip_inodes: set | frozenset = frozenset()) -> DumpPart:
        """Both families' dumps in one DumpPart, `done` when both are complete: ended by NLMSG_DONE, not
        interrupted, nothing malformed or lost (only then can an absent socket be taken as closed)."""
        part = DumpPart([], {})
        complete = True
        for family in self.families:
            self._diag.dump(family, part, skip_inodes)
            self.dumps += 1
            complete = complete and part.done and not part.interrupted
        part.done = complete and not part.errors
        return part

    @staticmethod
    def sockstat() -> tuple | None:
        """The TCP and TCP6 "inuse" counts of this thread's network namespace (/proc/net/sockstat, sockstat6):
        a socket hashed or unhashed (connected, accepted, closed) moves them. None where they cannot be read."""
        base = "/proc/thread-self/net" if os.path.exists("/proc/thread-self/net") else "/proc/self/net"
        sig = []
        for name, tag in (("sockstat", b"TCP:"), ("sockstat6", b"TCP6:")):
            try:
                with open(f"{base}/{name}", "rb") as fh:
                    data = fh.read()
            except OSError:
                if name == "sockstat6":
                    continue   # a kernel without IPv6
                return None
            for line in data.split(b"\n"):
                if line.startswith(tag):
                    f = line.split()
                    sig.append(f[2] if len(f) > 2 and f[1] == b"inuse" else line)
        return tuple(sig)

    def _full_dump_due(self, now: int, workloads: frozenset) -> bool:
        """A full dump (every socket: new connections are found) rather than lookups of the tracked ones: when the
        last dump was incomplete, full_dump_seconds have passed since the last complete one, the workloads
        changed, or the namespace's TCP socket count moved since the last step (a socket opened or closed).
        Between them, a dump of a 262,144-bucket table costs ~1.1 ms per family here with no socket at all; a
        tracked socket ~10 µs in a dump, ~4.5 µs by lookup when idle (see the module docstring)."""
        sig, self._sockstat_sig = self._sockstat_sig, self.sockstat()
        return (self.config.full_dump_seconds <= 0 or self._complete_ns is None or not self._last_dump_complete
                or sig is None or self._sockstat_sig != sig or workloads != self._scanned_workloads
                or now - self._complete_ns >= self.config.full_dump_seconds * 1e9)

    def step(self) -> list:
        if self._diag is None:
            return []
        now = self.ctx.mono_ns()
        out: list = []
        workloads = frozenset(self.ctx.workloads.snapshot())
        dumped = self._full_dump_due(now, workloads)
        if dumped:
            # sockets no workload held at the last fd scan are not parsed (while the workloads are the same)
            skip = self._foreign if self.config.workloads_only and workloads == self._scanned_workloads \
                else frozenset()
            part = self.read(skip)
        else:
            asked = [(key, c) for key, c in self._conns.items() if c.sockid]
            # a stuck connection is parsed whole at every reading: its stall is timed from its tcp_info
            part, _gone = self._diag.lookup([(c.family, c.sockid) for _, c in asked],
                                            signatures=[None if c.stuck else c.sig for _, c in asked])
            self.lookups += 1
            self.unchanged += len(part.unchanged)
        complete = part.done
        self._report_errors(part.errors, now, out)

        by_key: dict[tuple, DiagSock] = {s.key: s for s in part.socks}  # a socket seen twice in a dump: once
        present = set(by_key)
        present.update(k for k, _ in part.skipped)
        if dumped:  # a lookup reads only connections whose owner is known
            self._resolve_owners({s.inode for s in part.socks if s.inode} | {i for _, i in part.skipped if i},
                                 workloads)

        known, new = [], []
        for key, s in by_key.items():
            if s.info is None:
                continue
            pid = self._owners.get(s.inode, 0) if s.inode else 0
            if self.config.workloads_only and not pid:
                continue
            (known if key in self._conns else new).append((key, s, pid))
        room = max(0, self.config.max_connections - len(known))
        excess = max(0, len(new) - room)
        if excess:
            new = new[:room]
            self.capped_total += excess
            if not self._capping:
                out.append(Event(now, "tcpinfo_connections_capped", "",
                                 f"{excess} connections over max_connections={self.config.max_connections} "
                                 f"not tracked", float(excess)))
        self._capping = bool(excess)

        stalled_ns = int(self.config.stalled_after_seconds * 1e9)
        processed = set()
        for index in part.unchanged:   # read back as at their last reading: nothing moved, nothing to emit
            key, conn = asked[index]
            conn.mono_ns = now
            processed.add(key)
            present.add(key)
        for key, s, pid in known + new:
            processed.add(key)
            info = s.info
            totals = totals_of(info)
            prev = self._conns.get(key)
            if prev is None:
                conn = _Conn(now, totals, info.state, conn_entity(s), s.family, s.sockid)
                if self._complete_ns is not None and key not in self._seen_prev:
                    base, since = (0, 0, 0, 0, 0, 0), self._complete_ns   # born since the last complete dump
                    floor_ns = since
                else:
                    base, since = totals, now
                    floor_ns = 0
                stuck_prev = False
                changed = True
            else:
                conn = prev
                base, since = prev.totals, prev.mono_ns
                stuck_prev, floor_ns = prev.stuck, prev.mono_ns
                changed = info.state != prev.state
            d = _deltas(totals, base)
            # byte totals never go back (a retransmission that failed before reaching the device counts in
            # bytes_retrans but not in bytes_sent): keep the high-water mark, so nothing is counted twice
            totals = (max(totals[0], base[0]), max(totals[1], base[1])) + totals[2:]
            stuck = is_stuck(info)
            emit = changed or stuck or any(d)
            if emit:
                out.append(ConnStats(now, since, s.src, s.sport, s.dst, s.dport,
                                     tx_payload_bytes=d[0], rx_payload_bytes=d[1], tx_packets=d[2],
                                     rx_packets=d[3], retransmits=d[4], srtt_us=info.rtt, pid=pid,
                                     comm=self._comms.get(pid, "") if pid else "", net_limited_us=d[5]))
            conn.mono_ns, conn.totals, conn.state = now, totals, info.state
            # a connection that moved now will likely move at the next reading: not worth a signature check then
            conn.sig = None if emit or info.length < TCP_INFO_PARSED_LEN else signature(info)
            if stuck:
                if not stuck_prev:
                    # the later of its last ACK and the last reading that saw it unstuck (or did not see it)
                    conn.stuck = True
                    conn.stuck_since_ns = min(now, max(now - info.last_ack_recv * 1_000_000, floor_ns))
                if not conn.stall_reported and now - conn.stuck_since_ns >= stalled_ns:
                    conn.stall_reported = True
                    out.append(Event(now, "tcp_stalled", conn.entity, self._stall_message(s, pid),
                                     round((now - conn.stuck_since_ns) / 1e9, 3)))
            elif stuck_prev:
                if conn.stall_reported:
                    out.append(Event(now, "tcp_recovered", conn.entity,
                                     f"acked again after {(now - conn.stuck_since_ns) / 1e9:.1f} s stuck "
                                     f"({info.total_retrans} retransmits in total)",
                                     round((now - conn.stuck_since_ns) / 1e9, 3)))
                conn.stuck = conn.stall_reported = False
            self._conns[key] = conn

        # forget closed connections (absent from a complete dump) and those no longer selected (present, but
        # no workload's any more); an incomplete dump cannot tell a closed connection from a missed one
        for key in [k for k in self._conns if k not in processed and (complete or k in present)]:
            conn = self._conns.pop(key)
            if conn.stall_reported:
                how = "no workload holds it any more (closed by its process: the kernel may go on retransmitting)" \
                    if key in present else "closed"
                out.append(Event(now, "tcp_stall_closed", conn.entity,
                                 f"{how}, after {(now - conn.stuck_since_ns) / 1e9:.1f} s stuck retransmitting",
                                 round((now - conn.stuck_since_ns) / 1e9, 3)))
        if dumped:  # (a lookup says nothing about the sockets it did not ask for)
            self._last_dump_complete = complete
            if complete:
                self._seen_prev = present
                self._complete_ns = now
            else:
                self._seen_prev.update(present)
        return out

    def _stall_message(self, s: DiagSock, pid: int) -> str:
        i = s.info
        who = f"pid {pid} ({self._comms.get(pid, '')})" if pid else "no workload's socket"
        return (f"{who} {STATE_NAMES.get(i.state, i.state)}: {i.unacked} segments unacked, {i.retransmits} "
                f"retransmission timeouts without progress, backoff {i.backoff}, rto {i.rto // 1000} ms, last ACK "
                f"{i.last_ack_recv / 1000:.1f} s ago, {s.wqueue} bytes queued, {i.total_retrans} retransmits "
                f"in total")

    def _report_errors(self, errors: dict, now: int, out: list) -> None:
        for kind, count in errors.items():
            self.errors += count
            if kind not in self._error_kinds:
                self._error_kinds.add(kind)
                out.append(Event(now, "tcpinfo_error", kind, f"sock_diag dump: {kind} ({count}x this step; "
                                 f"later ones are only counted)", float(count)))

    # -- owners ----------------------------------------------------------------------------------

    def _resolve_owners(self, inodes: set[int], workloads: frozenset) -> None:
        """Rescan the workloads' fds when the dump shows an inode the last scan did not, or the workloads
        changed (at most once per step)."""
        owners = self._owners
        if workloads == self._scanned_workloads and all(i in owners or i in self._foreign for i in inodes):
            self._foreign &= inodes
            return
        self.fd_scans += 1
        owners, comms = {}, {}
        root = self.ctx.proc_root
        for pid, _ticks in workloads:
            fd_dir = host_path(root, str(pid), "fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            mine = False
            for fd in fds:
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    try:
                        owners.setdefault(int(target[8:-1]), pid)
                        mine = True
                    except ValueError:
                        continue
            if mine:
                try:
                    with open(host_path(root, str(pid), "comm")) as fh:
                        comms[pid] = fh.read().strip()
                except OSError:
                    comms[pid] = ""
        self._owners, self._comms = owners, comms
        self._foreign = inodes - owners.keys()
        self._scanned_workloads = workloads
