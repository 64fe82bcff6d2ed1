"""netflows: per-TCP-connection traffic (wire bytes, payload bytes, packets, retransmits, RTT, owning
PID) and LLMPrism-style flows (bursts of one connection in one direction split by an idle gap), from
eBPF raw tracepoints.

Probes (all raw tracepoints, attached explicitly; programs named `steplens_nf_*` so `bpftool prog
show` finds them; nothing is pinned, so the programs die with the agent's file descriptors):
  net:net_dev_start_xmit (skb, dev)     TX wire bytes = skb->len (what the device counts), packets.
                                        Only skbs that carry a socket (skb->sk): forwarded/bridged
                                        packets are not this host's TCP and are not counted.
  net:netif_receive_skb (skb)           RX wire bytes = skb->len + the already-pulled MAC header
                                        (data - (head + mac_header), 14 on Ethernet/veth/lo).
  sock:sock_send_length / sock_recv_length (sk, ret, flags)
                                        payload bytes (ret > 0; MSG_PEEK reads skipped) and the PID
                                        (tgid) and comm of the process that last moved bytes.
  tcp:tcp_retransmit_skb (sk, ...)      retransmits.   srtt_us >> 3 (µs) read on the send path (per send(), not per segment).
  sock:inet_sock_set_state (sk, old, new)  TCP_CLOSE marks the connection closed.
Headers are parsed at skb->head + skb->network_header (valid at both hooks; at xmit skb->data
points at the Ethernet header, at netif_receive_skb at the IP header — both checked on veth and lo).

Connection key: (local addr, local port, remote addr, remote port), IPv4 only. At xmit the source
is local, at receive the destination is local. Loopback (and two namespaces on one host) thus
yields one entry per socket end: a packet from A:p to B:q is TX of (A:p -> B:q) when sent and RX
of (B:q -> A:p) when received, i.e. counted once per direction per socket, never twice in one
entry. Caveats: the key has no network-namespace id (identical tuples in two namespaces merge);
on hosts where a packet crosses several devices on the receive path (a bridge in a namespace,
VLAN, tunnels) RX is counted at each receiving device: set `interfaces` to the NICs to avoid it
(ifindexes are resolved in the agent's namespace).

Counters are cumulative in the BPF hash map and never cleared from user space (FACTS: updates
between read and clear would be lost); step() keeps the previous values and emits ConnStats deltas.
A connection's map entry is deleted only when it is closed and did not change since the previous
step, or idle longer than conn_idle_timeout_seconds. Flow bursts close in BPF when a packet
arrives more than idle_gap after the previous one (ring buffer, no wake-ups, polled each step);
bursts still open whose last packet is older than the gap are closed from user space by reading
the map (remembered, so the later ring-buffer copy of the same burst is dropped).
Ring-buffer reserve failures and map-insert failures are counted in a per-CPU array and reported
as Events `netflows_ringbuf_overflow` / `netflows_map_full` (value = new failures) when they grow.

Idle gap default 5 ms: gaps between DP buckets or PP micro-batches are ~10 ms to 100s of ms (the
CPU testbed's PP sends come every ~15-30 ms), while inside one message a sender on a loaded host
stalls for a few ms: with a 2 ms gap, 4 MB messages between two namespaces on the 2-core dev VM
split into two flows in about one test run in three (stalls of 2-3 ms); 5 ms did not split them.
LLMPrism-style analysis needs phase boundaries, not sub-ms structure, so the larger gap is safer.

Flows are emitted for the TX direction only by default: the receiver's view of a burst is the
sender's TX flow again (on one host, over lo or between namespaces, both ends are local and every
burst would appear twice with the same src/dst, as Flow has no direction field). `rx_flows = true`
adds receive-direction bursts, for peers that run no agent.

The per-packet and per-call programs (tx, rx, send, recv) are loaded as BTF raw tracepoints ("tp_btf",
agent/ebpf BtfRawTracepoint) when the kernel has BTF for the tracepoint: sk_buff and sock fields are then
plain loads (the sending socket's 4-tuple too, so TX packets need no header parse) instead of
bpf_probe_read_kernel() calls. Otherwise (or with btf_tracepoints = false) they are classic raw tracepoints,
and a socket cache (LRU hash, struct sock * -> key, filled at a socket's first send/recv, deleted at close)
lets the per-call hooks and TX packets of known sockets skip the struct sock reads and the header parse.
RX packets are parsed either way (skb->sk is not set yet at netif_receive_skb). A fallback's reason is kept
in `btf_reason`.

Cost (bench/ebpf.py, 2-core VM, loopback at ~36-38 Gbit/s with 64 KiB skbs, both programs of every packet on
the sender's CPU): 4.6 % lower throughput with the probes over 8 pairs (5.7-9.3 % in other runs of the same
code: the VM's spread is about +-2 %; 6.7 % with classic raw tracepoints and the socket cache, 14.8 % before
it); BPF time per run tx ~210 ns, rx ~190 ns, send() ~340 ns, recv() ~180 ns; 1.3 ms of BPF CPU per Gbit
counted at both ends (between two hosts each end pays about half). An empty program on the same tracepoints
costs ~80 ns per run here (with the kernel's run-time statistics on): what remains is the hash-map update, the
clock read for bursts and, on RX, the IP header read, paid per skb.

Needs root (or CAP_BPF+CAP_PERFMON), BTF, kernel headers for bcc, tracefs.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass, field

from steplens.agent import ebpf
from steplens.agent.records import ConnStats, Event, Flow
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig

BPF_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netflows.bpf.c")

# placeholder -> (struct, member path) in the running kernel's BTF
OFFSETS: dict[str, tuple[str, str]] = {
    "OFF_SKB_LEN": ("sk_buff", "len"),
    "OFF_SKB_DATA": ("sk_buff", "data"),
    "OFF_SKB_HEAD": ("sk_buff", "head"),
    "OFF_SKB_NETWORK_HEADER": ("sk_buff", "network_header"),
    "OFF_SKB_MAC_HEADER": ("sk_buff", "mac_header"),
    "OFF_SKB_SK": ("sk_buff", "sk"),
    "OFF_SKB_DEV": ("sk_buff", "dev"),
    "OFF_SKB_PROTOCOL": ("sk_buff", "protocol"),
    "OFF_DEV_IFINDEX": ("net_device", "ifindex"),
    "OFF_SKC_DADDR": ("sock_common", "skc_daddr"),
    "OFF_SKC_RCV_SADDR": ("sock_common", "skc_rcv_saddr"),
    "OFF_SKC_DPORT": ("sock_common", "skc_dport"),
    "OFF_SKC_NUM": ("sock_common", "skc_num"),
    "OFF_SKC_FAMILY": ("sock_common", "skc_family"),
    "OFF_SKC_STATE": ("sock_common", "skc_state"),
    "OFF_SK_PROTOCOL": ("sock", "sk_protocol"),
    "OFF_TCP_SRTT_US": ("tcp_sock", "srtt_us"),
}

# function -> raw tracepoint
ATTACH: dict[str, str] = {
    "steplens_nf_tx": "net_dev_start_xmit",
    "steplens_nf_rx": "netif_receive_skb",
    "steplens_nf_snd": "sock_send_length",
    "steplens_nf_rcv": "sock_recv_length",
    "steplens_nf_rtx": "tcp_retransmit_skb",
    "steplens_nf_st": "inet_sock_set_state",
}

CNT_RINGBUF_OVERFLOW, CNT_MAP_FULL, CNT_PACKETS, CNT_SOCK_EVENTS = range(4)
DIR_TX, DIR_RX = 0, 1
_FLOW_EV = struct.Struct("<IIHHII4xQQQQ")  # struct flow_ev (4 bytes of padding before start_ns)


@dataclass
class NetflowsConfig(SourceConfig):
    idle_gap_seconds: float = 0.005          # a burst ends after this much silence in one direction
    max_connections: int = 16384             # BPF hash map entries; inserts beyond are counted, not kept
    ringbuf_pages: int = 64                  # flow ring buffer size in 4 KiB pages (power of two)
    conn_idle_timeout_seconds: float = 300.0 # forget a connection (map entry + state) idle this long
    interfaces: list[str] = field(default_factory=list)  # interface names to watch; empty = all
    include_loopback: bool = False           # count `lo` traffic and 127.0.0.0/8 sockets
    rx_flows: bool = False                   # also emit receive-direction bursts (the peer's TX flows)
    btf_tracepoints: bool = True             # packet hooks as BTF raw tracepoints when the kernel allows

    def validate(self) -> None:
        super().validate()
        if not (0.00001 <= self.idle_gap_seconds <= 10):
            raise ConfigError(f"idle_gap_seconds must be within 0.00001..10, got {self.idle_gap_seconds}")
        if not (16 <= self.max_connections <= 1 << 22):
            raise ConfigError(f"max_connections must be within 16..4194304, got {self.max_connections}")
        p = self.ringbuf_pages
        if p < 1 or p & (p - 1) or p > 1 << 16:
            raise ConfigError(f"ringbuf_pages must be a power of two within 1..65536, got {p}")
        if self.conn_idle_timeout_seconds <= self.idle_gap_seconds:
            raise ConfigError("conn_idle_timeout_seconds must be larger than idle_gap_seconds")
        for name in self.interfaces:
            if not name or "/" in name or len(name) > 15:
                raise ConfigError(f"interfaces: {name!r} is not an interface name")


TABLES = ("conns", "ifaces", "socks", "counters", "flows")  # resolved at compile time (see ebpf.BCC_LOCK)

# the per-packet and per-call programs, loaded as BTF raw tracepoints (rtx, st are rare: classic)
BTF_HOOKS = ("steplens_nf_tx", "steplens_nf_rx", "steplens_nf_snd", "steplens_nf_rcv")


def render_program(offsets: dict[str, int], config: NetflowsConfig, btf_tp: bool = False) -> str:
    """The BPF C text for these BTF offsets (keys of OFFSETS) and config; pure."""
    with open(BPF_FILE) as fh:
        template = fh.read()
    from steplens.agent.ebpf import render

    values = {name: int(offsets[name]) for name in OFFSETS}
    # one read covers every sk_buff field a packet hook uses (see read_skb in the C)
    skb_fields = [v for k, v in values.items() if k.startswith("OFF_SKB_")]
    values["SKB_READ_LEN"] = (max(skb_fields) + 8 + 7) // 8 * 8
    values.update(
        IDLE_GAP_NS=int(round(config.idle_gap_seconds * 1e9)),
        MAX_CONNECTIONS=int(config.max_connections),
        RINGBUF_PAGES=int(config.ringbuf_pages),
        FILTER_IFACES=1 if config.interfaces else 0,
        INCLUDE_LOOPBACK=1 if config.include_loopback else 0,
        FLOW_RX=1 if config.rx_flows else 0,
        BTF_TP=1 if btf_tp else 0,
    )
    return render(template, **values)


def kernel_offsets() -> dict[str, int]:
    from steplens.agent.ebpf import btf_offset

    return {name: btf_offset(s, path) for name, (s, path) in OFFSETS.items()}


def _ip(addr: int) -> str:
    return socket.inet_ntoa(struct.pack("<I", addr))  # stored in network order, read as host int


class NetflowsSource(Source):
    name = "netflows"
    config_class = NetflowsConfig
    description = "per-TCP-connection bytes/packets/retransmits/RTT/PID and idle-gap flows (eBPF raw tracepoints)"

    def __init__(self, ctx: HostContext, config: NetflowsConfig) -> None:
        super().__init__(ctx, config)
        self._bpf = None
        self._reset_state()

    def _reset_state(self) -> None:
        self._prev: dict[tuple, tuple] = {}       # key -> (totals tuple, mono_ns of that read, changed flag)
        self._early: dict[tuple, int] = {}        # (key, dir, start_ns) closed from user space -> steps gone
        self._pending: list = []                  # Flow records from ring-buffer callbacks
        self._counters = [0, 0, 0, 0]
        self._steps = 0
        self.packets_total = 0                    # packets counted by the programs (bench: events/s)

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        from steplens.agent.ebpf import unavailable_reason

        reason = unavailable_reason(ctx.proc_root)
        return Availability.no(reason) if reason else Availability.yes()

    def start(self) -> None:
        if self._bpf is not None:
            return
        from steplens.agent.ebpf import load_bcc

        load_bcc()
        ifindexes = self._resolve_interfaces()
        self._btf_links = []
        self.btf_reason = "disabled by config" if not self.config.btf_tracepoints else ""
        b = None
        if self.config.btf_tracepoints:
            b = ebpf.compile_program(render_program(kernel_offsets(), self.config, btf_tp=True), tables=TABLES)
            try:
                with ebpf.BCC_LOCK:
                    for fn in BTF_HOOKS:
                        self._btf_links.append(ebpf.BtfRawTracepoint(b, fn, ATTACH[fn], fn))
            except ebpf.EbpfUnavailable as exc:  # an older kernel or verifier: the probe-read programs
                self.btf_reason = str(exc)
                for link in self._btf_links:
                    link.close()
                self._btf_links = []
                ebpf.cleanup(b)
                b = None
        if b is None:
            b = ebpf.compile_program(render_program(kernel_offsets(), self.config), tables=TABLES)
        try:
            with ebpf.BCC_LOCK:
                for fn, tp in ATTACH.items():
                    if fn in BTF_HOOKS and self._btf_links:
                        continue
                    b.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            if ifindexes:
                ifaces = b[b"ifaces"]
                for idx in ifindexes:
                    ifaces[ctypes.c_uint32(idx)] = ctypes.c_uint8(1)
            b[b"flows"].open_ring_buffer(self._on_flow)
        except Exception:
            for link in self._btf_links:
                link.close()
            ebpf.cleanup(b)
            raise
        self._bpf = b
        self._conns = b[b"conns"]
        self._reset_state()
        self._start_ns = self.ctx.mono_ns()

    def _resolve_interfaces(self) -> list[int]:
        out = []
        for name in self.config.interfaces:
            path = os.path.join(self.ctx.sys_root, "class", "net", name, "ifindex")
            try:
                with open(path) as fh:
                    out.append(int(fh.read()))
            except (OSError, ValueError):
                raise ConfigError(f"netflows: interface {name!r} not found ({path})") from None
        return out

    def stop(self) -> None:
        b, self._bpf = self._bpf, None
        for link in getattr(self, "_btf_links", []):
            link.close()
        self._btf_links = []
        if b is not None:
            ebpf.cleanup(b)

    # -- step ------------------------------------------------------------------------------------

    def _on_flow(self, _cpu, data, size) -> None:
        laddr, raddr, lport, rport, d, pid, start, end, nbytes, packets = _FLOW_EV.unpack(
            ctypes.string_at(data, _FLOW_EV.size))
        key = (laddr, raddr, lport, rport)
        if self._early.pop((key, d, start), None) is not None:
            return  # already emitted from user space when the connection went quiet
        self._pending.append(self._flow(key, d, start, end, nbytes, packets, pid))

    @staticmethod
    def _flow(key, d, start, end, nbytes, packets, pid) -> Flow:
        laddr, raddr, lport, rport = key
        if d == DIR_TX:
            return Flow(end, start, _ip(laddr), lport, _ip(raddr), rport, nbytes, packets, pid)
        return Flow(end, start, _ip(raddr), rport, _ip(laddr), lport, nbytes, packets, pid)

    def step(self) -> list:
        b = self._bpf
        if b is None:
            return []
        self._steps += 1
        b.ring_buffer_consume()
        out: list = self._pending
        self._pending = []
        now = self.ctx.mono_ns()
        self._check_counters(b, now, out)
        gap_ns = int(round(self.config.idle_gap_seconds * 1e9))
        idle_ns = int(self.config.conn_idle_timeout_seconds * 1e9)
        seen = set()
        pids: dict[tuple, int] = {}  # (src, sport, dst, dport) of TX flows -> PID (RX flows stay 0)
        starts: dict[tuple, int] = {}  # (key, dir) -> start of the burst open in the map
        to_delete = []
        for k, v in self._read_conns():
            key = (k.laddr, k.raddr, k.lport, k.rport)
            seen.add(key)
            if v.pid:
                pids[(_ip(k.laddr), k.lport, _ip(k.raddr), k.rport)] = v.pid
            totals = (v.tx_bytes, v.rx_bytes, v.tx_packets, v.rx_packets, v.tx_payload, v.rx_payload,
                      v.retransmits)
            prev = self._prev.get(key)
            if prev is None:
                base, since = (0,) * 7, max(v.first_ns, self._start_ns)
            else:
                base, since = prev[0], prev[1]
            changed = totals != base
            if changed:
                d = [a - b_ for a, b_ in zip(totals, base)]
                out.append(ConnStats(now, since, _ip(k.laddr), k.lport, _ip(k.raddr), k.rport,
                                     tx_bytes=d[0], rx_bytes=d[1], tx_packets=d[2], rx_packets=d[3],
                                     tx_payload_bytes=d[4], rx_payload_bytes=d[5], retransmits=d[6],
                                     srtt_us=v.srtt_us, pid=v.pid,
                                     comm=bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace")))
            self._prev[key] = (totals, now if changed or prev is None else prev[1])
            # bursts that went quiet: close them here so a flow ends even if no packet follows
            for d_ in ((DIR_TX, DIR_RX) if self.config.rx_flows else (DIR_TX,)):
                last, nbytes = v.b_last[d_], v.b_bytes[d_]
                start = v.b_start[d_]
                starts[(key, d_)] = start
                if last and nbytes and now - last > gap_ns and (key, d_, start) not in self._early:
                    self._early[(key, d_, start)] = 0
                    out.append(self._flow(key, d_, start, last, nbytes, v.b_packets[d_], v.pid))
            if (v.closed and not changed and prev is not None) or (now - v.last_ns > idle_ns):
                to_delete.append(k)
        for k in to_delete:
            try:
                del self._conns[k]
            except KeyError:
                pass
            key = (k.laddr, k.raddr, k.lport, k.rport)
            self._prev.pop(key, None)
            seen.discard(key)
        for key in [key for key in self._prev if key not in seen]:
            del self._prev[key]
        # a burst closed in BPF before the first send() returned carries no PID yet: take the connection's
        for f in out:
            if isinstance(f, Flow) and f.pid == 0:
                f.pid = pids.get((f.src, f.sport, f.dst, f.dport), 0)
        # Forget an early-closed burst once BPF has moved on from it (its ring-buffer copy, if any, was
        # submitted before the new burst started, so it is consumed by the next step or two), or when
        # the connection is gone. While the map still shows that burst open, keep it: the copy comes
        # whenever the connection next sends, however long it stays quiet.
        early = {}
        for (key, d_, start), misses in self._early.items():
            if key not in seen:
                continue
            if starts.get((key, d_)) != start:
                misses += 1
            if misses < 3:
                early[(key, d_, start)] = misses
        self._early = early
        return out

    def _read_conns(self):
        t = self._conns
        try:
            return list(t.items_lookup_batch())
        except Exception:  # kernels without batch ops
            return list(t.items())

    def _check_counters(self, b, now: int, out: list) -> None:
        table = b[b"counters"]
        vals = []
        for i in range(4):
            per_cpu = table[ctypes.c_int(i)]
            vals.append(sum(int(x) for x in per_cpu))
        for idx, kind in ((CNT_RINGBUF_OVERFLOW, "netflows_ringbuf_overflow"), (CNT_MAP_FULL, "netflows_map_full")):
            grown = vals[idx] - self._counters[idx]
            if grown > 0:
                what = "flow ring buffer full" if idx == CNT_RINGBUF_OVERFLOW else "connection map full"
                out.append(Event(now, kind, "", f"{grown} new ({vals[idx]} total): {what}", float(grown)))
        self._counters = vals
        self.packets_total = vals[CNT_PACKETS]
