"""netflows: per-TCP-connection traffic (wire bytes, payload bytes, packets, retransmits, RTT, owning
PID) and LLMPrism-style flows (bursts of one connection in one direction split by an idle gap), from
eBPF raw tracepoints.

Two builds of netflows.bpf.c; the first is used when the kernel allows it, else the second (reason kept in
`btf_reason`, the build in `mode`; `planned_mode()` says beforehand which one a host gets, for
`steplens-agent check`; STEPLENS_EBPF_REFUSE=tp_btf,iter forces the second, see agent/ebpf):

"socket-storage" (BTF raw tracepoints, "tp_btf", agent/ebpf BtfRawTracepoint + MapIterator):
  net:net_dev_start_xmit (skb, dev)     TX wire bytes = skb->len (what the device counts), packets and the
                                        TX burst, kept in the sending socket's own storage
                                        (BPF_MAP_TYPE_SK_STORAGE, reached from the typed skb->sk: no 4-tuple
                                        hash). Burst times are the skb's departure stamp (TCP sets
                                        skb->tstamp to its CLOCK_MONOTONIC send time), not a clock read.
  net:netif_receive_skb (skb)           RX wire bytes = skb->len + the already-pulled MAC header, keyed by
                                        the parsed IPv4/TCP headers (per-CPU slots, else the hash map:
                                        see "RX fast path" below; skb->sk is not known
                                        yet; tcp:tcp_probe, where it is, sees ACKs the socket backlog merged
                                        into one skb: 44 of 249 ACKs on lo in one check, so not exact).
  sock:sock_send_length / sock_recv_length (sk, ret, flags)
                                        payload bytes (ret > 0; MSG_PEEK reads skipped) and the PID (tgid)
                                        and comm of the process that last moved bytes.
  sock:inet_sock_set_state (sk, old, new)  SYN_SENT / SYN_RECV: a new socket's storage (so its kernel counters
                                        start at 0 for us); TCP_CLOSE: the socket's final record to a ring
                                        buffer (`closes`).
  iterator bpf_sk_storage_map           each step, one record per open watched socket, with the kernel's
                                        own tcp_sock total_retrans and srtt_us read at that moment (so
                                        retransmits and RTT cost nothing per packet).
  Packets whose socket has no storage (request and time-wait socks: SYN-ACKs, RSTs, last ACKs; and an
  allocation failure, counted as Event netflows_sk_storage_fallback) are counted in the hash map by their
  headers. Sockets older than the agent get their storage at their first packet or call after the start.

"raw-tracepoints" (classic raw tracepoints, probe reads at BTF offsets): every TX and RX packet in the hash
  map by 4-tuple, with a socket cache (LRU hash, struct sock * -> key, filled at a socket's first send/recv,
  deleted at close) so per-call hooks and TX packets of known sockets skip the header parse;
  tcp:tcp_retransmit_skb counts retransmits; srtt is read on send() at most every 100 ms per connection.

Headers are parsed at skb->head + skb->network_header (valid at both packet hooks; at xmit skb->data
points at the Ethernet header, at netif_receive_skb at the IP header — both checked on veth and lo).

Connection key: (local addr, local port, remote addr, remote port), IPv4 only. At xmit the source
is local, at receive the destination is local. Loopback (and two namespaces on one host) thus
yields one entry per socket end: a packet from A:p to B:q is TX of (A:p -> B:q) when sent and RX
of (B:q -> A:p) when received, i.e. counted once per direction per socket, never twice in one
entry. Caveats: the key has no network-namespace id (identical tuples in two namespaces merge);
on hosts where a packet crosses several devices on the receive path (a bridge in a namespace,
VLAN, tunnels) RX is counted at each receiving device: set `interfaces` to the NICs to avoid it
(ifindexes are resolved in the agent's namespace).

Counters are cumulative in BPF (hash map values, socket storage) and never cleared from user space (FACTS:
updates between read and clear would be lost); step() keeps the previous values per hash key and per socket
(address + first-seen time) and emits ConnStats deltas per 4-tuple, summing a connection's sources. A hash
entry is deleted only when it is closed and did not change since the previous step, or idle longer than
conn_idle_timeout_seconds (`max_connections` bounds the hash map: RX keys and the packets above); socket
storage dies with its socket. Flow bursts close in BPF when a packet arrives more than idle_gap after the
previous one (ring buffer, no wake-ups, polled each step); bursts still open whose last packet is older than
the gap, or whose socket closed, are closed from user space (remembered, so the later ring-buffer copy of the
same burst is dropped). Ring-buffer reserve failures, map-insert failures and storage fallbacks are counted in
a per-CPU array and reported as Events `netflows_ringbuf_overflow` / `netflows_map_full` /
`netflows_sk_storage_fallback` (value = new failures) when they grow. Packets themselves are not counted
there (~20 ns per packet, measured): `packets_total` sums the connections' packet deltas.

Idle gap default 5 ms: gaps between DP buckets or PP micro-batches are ~10 ms to 100s of ms (the
CPU testbed's PP sends come every ~15-30 ms), while inside one message a sender on a loaded host
stalls for a few ms: with a 2 ms gap, 4 MB messages between two namespaces on the 2-core dev VM
split into two flows in about one test run in three (stalls of 2-3 ms); 5 ms did not split them.
LLMPrism-style analysis needs phase boundaries, not sub-ms structure, so the larger gap is safer.

Flows are emitted for the TX direction only by default: the receiver's view of a burst is the
sender's TX flow again (on one host, over lo or between namespaces, both ends are local and every
burst would appear twice with the same src/dst, as Flow has no direction field). `rx_flows = true`
adds receive-direction bursts (from the hash map), for peers that run no agent.

RX fast path (both builds, without rx_flows): per-CPU direct-mapped slots, one connection each, two plain
adds per packet instead of a hash-map update (~65 ns less per packet, measured); a packet whose slot holds
another connection active in the last 2 s goes to the hash map; an idler slot is taken over after its counts
are added to the hash map (seqlock-style, so user space, reading the map first and the slots second, can miss
a move for one step but never counts it twice; tests/test_source_netflows.py checks RX = the peer's TX
exactly through constant takeovers). A key's totals are its hash entry plus its slots.

In the BTF build headers are read through the kfunc bpf_rdonly_cast (exception-protected plain loads; bcc
cannot emit kfunc calls, so agent/ebpf rewrites a placeholder call when it loads the program), not with
bpf_probe_read_kernel calls (kernels without the kfunc: probe reads).

Cost (bench/ebpf.py, 2-core VM, loopback at ~20-30 Gbit/s with 64 KiB skbs, where both programs of every
packet run on this host). BPF time per run, from the kernel's statistics:
  tx ~120-130 ns: socket storage and the skb stamp (250-320 ns with the hash map and a clock read)
  rx ~110-120 ns: typed header loads and a per-CPU slot (240-285 ns with a probe read and the hash map)
  ~65-75 ns of either is what the statistics themselves add to a run (an empty program, statistics on)
The tracepoint dispatch around each run, measured apart (an empty program toggled under a C recv() loop), is
64-92 ns on this VM (retpolines). runs x (body + dispatch) against the CPU per Gbit without probes gives an
estimated slowdown of 1.2 % with both ends of the transfer on one core and 2.0 % with them on two (more ACKs
and recv() calls per Gbit). Measured directly, toggling the programs every 0.25 s inside 6 transfers of 60 s:
0.44 +- 0.48 % (one core) and 1.32 +- 0.98 % (two cores); see bench/README.md.

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
    "OFF_SKB_TSTAMP": ("sk_buff", "tstamp"),
    "OFF_DEV_IFINDEX": ("net_device", "ifindex"),
    "OFF_SKC_DADDR": ("sock_common", "skc_daddr"),
    "OFF_SKC_RCV_SADDR": ("sock_common", "skc_rcv_saddr"),
    "OFF_SKC_DPORT": ("sock_common", "skc_dport"),
    "OFF_SKC_NUM": ("sock_common", "skc_num"),
    "OFF_SKC_FAMILY": ("sock_common", "skc_family"),
    "OFF_SKC_STATE": ("sock_common", "skc_state"),
    "OFF_SK_PROTOCOL": ("sock", "sk_protocol"),
    "OFF_TCP_SRTT_US": ("tcp_sock", "srtt_us"),
    "OFF_TP_TOTAL_RETRANS": ("tcp_sock", "total_retrans"),
}

# function -> raw tracepoint (classic build)
ATTACH: dict[str, str] = {
    "steplens_nf_tx": "net_dev_start_xmit",
    "steplens_nf_rx": "netif_receive_skb",
    "steplens_nf_snd": "sock_send_length",
    "steplens_nf_rcv": "sock_recv_length",
    "steplens_nf_rtx": "tcp_retransmit_skb",
    "steplens_nf_st": "inet_sock_set_state",
}

# function -> BTF raw tracepoint (BTF build; plus the iterator steplens_nf_it over the socket storage map)
BTF_ATTACH: dict[str, str] = {
    "steplens_nf_tx": "net_dev_start_xmit",
    "steplens_nf_rx": "netif_receive_skb",
    "steplens_nf_snd": "sock_send_length",
    "steplens_nf_rcv": "sock_recv_length",
    "steplens_nf_st": "inet_sock_set_state",
}
ITERATOR = ("steplens_nf_it", "bpf_sk_storage_map")

CNT_RINGBUF_OVERFLOW, CNT_MAP_FULL, CNT_SK_FALLBACK = range(3)
N_COUNTERS = 3
# struct sk_val flags (netflows.bpf.c)
SK_INIT, SK_SKIP, SK_BORN, SK_CLOSED = 1, 2, 4, 32
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


# maps each build must have (checked once compiled); the socket storage map `sks` is reached by fd only
TABLES = ("conns", "ifaces", "socks", "counters", "flows", "rxslots")
BTF_TABLES = ("conns", "ifaces", "counters", "flows", "closes", "rec_layout", "rxslots")


def render_program(offsets: dict[str, int], config: NetflowsConfig, btf_tp: bool = False, hz: int = 250,
                   header_btf_ids: tuple[int, int] | None = None) -> str:
    """The BPF C text for these BTF offsets (keys of OFFSETS), config and kernel HZ; with `header_btf_ids`
    (struct iphdr and tcphdr type ids, BTF build only) headers are read through bpf_rdonly_cast; pure."""
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
        RDONLY_CAST=1 if btf_tp and header_btf_ids else 0,
        IPHDR_BTF_ID=header_btf_ids[0] if btf_tp and header_btf_ids else 0,
        TCPHDR_BTF_ID=header_btf_ids[1] if btf_tp and header_btf_ids else 0,
        RX_SLOTS=RX_SLOTS,
        RX_SLOT_STALE_JIFFIES=max(1, int(RX_SLOT_STALE_SECONDS * hz)),
    )
    return render(template, **values)


RX_SLOTS = 256              # per-CPU RX slots (see netflows.bpf.c)
RX_SLOT_STALE_SECONDS = 2.0  # a slot idle this long may be taken over by another connection


def _jiffies_hz() -> int:
    """The kernel's HZ (jiffies per second): /proc/timer_list's jiffies rate is not exported, so take it from
    the kernel config when readable, else 250 (a stale threshold only needs the order of magnitude)."""
    import gzip
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as fh:
                for line in fh:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except (OSError, ValueError):
            continue
    return 250


def header_btf_ids() -> tuple[int, int] | None:
    """(struct iphdr, struct tcphdr) type ids in the kernel's BTF when it also has the kfunc bpf_rdonly_cast
    (Linux 6.2+), else None (headers are then read with bpf_probe_read_kernel)."""
    from steplens.agent.ebpf import btf_func_id, btf_struct_id
    ip, tcp = btf_struct_id("iphdr"), btf_struct_id("tcphdr")
    if ip is None or tcp is None or btf_func_id("bpf_rdonly_cast") is None:
        return None
    return ip, tcp


def kernel_offsets() -> dict[str, int]:
    from steplens.agent.ebpf import btf_offset

    return {name: btf_offset(s, path) for name, (s, path) in OFFSETS.items()}


def _ip(addr: int) -> str:
    return socket.inet_ntoa(struct.pack("<I", addr))  # stored in network order, read as host int


class NetflowsSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "netflows"
    config_class = NetflowsConfig
    description = "per-TCP-connection bytes/packets/retransmits/RTT/PID and idle-gap flows (eBPF raw tracepoints)"

    def __init__(self, ctx: HostContext, config: NetflowsConfig) -> None:
        super().__init__(ctx, config)
        self._bpf = None
        self._reset_state()

    def _reset_state(self) -> None:
        self._prev: dict[tuple, tuple] = {}       # hash-map key -> (totals tuple, mono_ns of that read)
        self._sprev: dict[tuple, tuple] = {}      # socket (id, first_ns) -> (totals tuple, mono_ns of that read)
        self._early: dict[tuple, int] = {}        # (key, dir, start_ns) closed from user space -> steps gone
        self._pending: list = []                  # Flow records from ring-buffer callbacks
        self._closed: list = []                   # final socket records from the `closes` ring buffer
        self._counters = [0] * N_COUNTERS
        self._last_step_ns = 0
        self._steps = 0
        self.packets_total = 0                    # packets counted by the programs (bench: events/s)

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        from steplens.agent.ebpf import unavailable_reason

        reason = unavailable_reason(ctx.proc_root)
        return Availability.no(reason) if reason else Availability.yes()

    @classmethod
    def planned_mode(cls, ctx: HostContext, config: NetflowsConfig) -> tuple[str, str]:
        """(mode, why): the build start() will get here, from minimal programs of the BTF build's types loaded
        now (ebpf.tracing_support). Call only where probe() said yes."""
        if not config.btf_tracepoints:
            return "raw-tracepoints", "btf_tracepoints = false in the config"
        tried = ebpf.tracing_support(tuple(BTF_ATTACH.values()), (ITERATOR[1],))
        refused = [why for why in tried.values() if why]
        if refused:
            return "raw-tracepoints", f"the kernel refuses the socket-storage build: {refused[0]}"
        how = "typed header loads (bpf_rdonly_cast)" if header_btf_ids() else "header probe reads (no bpf_rdonly_cast)"
        return "socket-storage", (f"the kernel accepts BTF raw tracepoints on {', '.join(BTF_ATTACH.values())} and "
                                  f"{ITERATOR[1]} iterators; {how}")

    def start(self) -> None:
        if self._bpf is not None:
            return
        ifindexes = self._resolve_interfaces()
        self._links: list = []
        self._iter = None
        self.btf_reason = "disabled by config" if not self.config.btf_tracepoints else ""
        b = None
        if self.config.btf_tracepoints:
            b = ebpf.compile_program(render_program(kernel_offsets(), self.config, btf_tp=True, hz=_jiffies_hz(),
                                                     header_btf_ids=header_btf_ids()), tables=BTF_TABLES)
            try:
                for fn, tp in BTF_ATTACH.items():
                    self._links.append(ebpf.BtfRawTracepoint(b, fn, tp, fn))
                self._iter = ebpf.MapIterator(b, ITERATOR[0], ITERATOR[1], ebpf.table_fd(b, "sks"), ITERATOR[0])
                self._links.append(self._iter)
            except ebpf.EbpfUnavailable as exc:  # an older kernel or verifier: the classic build
                self.btf_reason = str(exc)
                self._close_links()
                ebpf.cleanup(b)
                b = None
        try:
            if b is None:
                b = ebpf.compile_program(render_program(kernel_offsets(), self.config, hz=_jiffies_hz()), tables=TABLES)
                for fn, tp in ATTACH.items():
                    b.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            if ifindexes:
                ifaces = b[b"ifaces"]
                for idx in ifindexes:
                    ifaces[ctypes.c_uint32(idx)] = ctypes.c_uint8(1)
            b[b"flows"].open_ring_buffer(self._on_flow)
            if self._iter is not None:
                self._rec_type = b[b"rec_layout"].Leaf
                b[b"closes"].open_ring_buffer(self._on_close)
        except Exception:
            self._close_links()
            if b is not None:
                ebpf.cleanup(b)
            raise
        self._bpf = b
        self._conns = b[b"conns"]
        self._reset_state()
        self._start_ns = self.ctx.mono_ns()

    @property
    def mode(self) -> str:
        """"socket-storage" (BTF build) or "raw-tracepoints" (classic build); "" when stopped."""
        if self._bpf is None:
            return ""
        return "socket-storage" if self._iter is not None else "raw-tracepoints"

    def pause(self) -> None:
        """Detach the packet and per-call programs, keeping maps and state (nothing is counted meanwhile). Used
        by bench/ebpf.py to measure the probes' cost inside one transfer."""
        if self._bpf is None:
            return
        if self._iter is not None:
            for link in self._links:
                if isinstance(link, ebpf.BtfRawTracepoint) and link.prog_fd >= 0:
                    link.detach()
        else:
            for fn, tp in ATTACH.items():
                self._bpf.detach_raw_tracepoint(tp=tp.encode())

    def resume(self) -> None:
        """Re-attach what pause() detached."""
        if self._bpf is None:
            return
        if self._iter is not None:
            for link in self._links:
                if isinstance(link, ebpf.BtfRawTracepoint):
                    link.attach()
        else:
            for fn, tp in ATTACH.items():
                self._bpf.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())

    def _close_links(self) -> None:
        for link in getattr(self, "_links", []):
            link.close()
        self._links = []
        self._iter = None

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
        self._close_links()
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

    def _on_close(self, _cpu, data, size) -> None:
        self._closed.append(self._rec_type.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(self._rec_type))))

    @staticmethod
    def _flow(key, d, start, end, nbytes, packets, pid) -> Flow:
        laddr, raddr, lport, rport = key
        if d == DIR_TX:
            return Flow(end, start, _ip(laddr), lport, _ip(raddr), rport, nbytes, packets, pid)
        return Flow(end, start, _ip(raddr), rport, _ip(laddr), lport, nbytes, packets, pid)

    @staticmethod
    def sock_totals(r) -> tuple:
        """Cumulative (tx_bytes, rx_bytes, tx_packets, rx_packets, tx_payload, rx_payload, retransmits) of one
        socket record (struct sk_rec): RX packets are in the hash map (by headers), never here."""
        v = r.v
        retrans = (r.l.retrans_now - v.base_retrans) & 0xFFFFFFFF
        return (v.tx_bytes, 0, v.tx_packets, 0, v.tx_payload, v.rx_payload, retrans)

    def _read_socks(self) -> list:
        """Open sockets' records, by the map iterator."""
        raw = self._iter.read()
        size = ctypes.sizeof(self._rec_type)
        return [self._rec_type.from_buffer_copy(raw, i) for i in range(0, len(raw) - size + 1, size)]

    def step(self) -> list:
        b = self._bpf
        if b is None:
            return []
        self._steps += 1
        last_step, self._last_step_ns = self._last_step_ns, self.ctx.mono_ns()
        b.ring_buffer_consume()  # flows, and (socket storage) the final records of sockets that closed
        out: list = self._pending
        self._pending = []
        now = self.ctx.mono_ns()
        self._check_counters(b, now, out)
        gap_ns = int(round(self.config.idle_gap_seconds * 1e9))
        idle_ns = int(self.config.conn_idle_timeout_seconds * 1e9)
        dirs = (DIR_TX, DIR_RX) if self.config.rx_flows else (DIR_TX,)
        acc: dict[tuple, list] = {}  # key -> [deltas, since, srtt_us, pid, comm] summed over its sources
        seen = set()
        pids: dict[tuple, int] = {}  # (src, sport, dst, dport) of TX flows -> PID (RX flows stay 0)
        starts: dict[tuple, int] = {}  # (key, dir) -> start of the burst open in BPF
        quiet: list = []  # (key, dir, start, last, bytes, packets, pid) of open bursts

        def add(key, totals, prev, first_ns, srtt, pid, comm) -> tuple:
            if prev is None:
                base, since = (0,) * 7, max(first_ns, self._start_ns)
            else:
                base, since = prev
            d = [max(0, a - b_) for a, b_ in zip(totals, base)]
            totals = tuple(max(a, b_) for a, b_ in zip(totals, base))  # never backwards
            slot = acc.get(key)
            if slot is None:
                acc[key] = [d, since, srtt, pid, comm]
            else:
                slot[0] = [x + y for x, y in zip(slot[0], d)]
                slot[1] = min(slot[1], since)
                slot[2] = srtt or slot[2]
                if pid:
                    slot[3], slot[4] = pid, comm
            changed = any(d)
            return totals, (now if changed or prev is None else since), changed

        if self._iter is not None:
            closed, self._closed = self._closed, []
            live = self._read_socks()
            alive = set()
            for r, is_closed in [(r, True) for r in closed] + [(r, False) for r in live]:
                v = r.v
                sid = (v.id, v.first_ns)
                k = v.key
                key = (k.laddr, k.raddr, k.lport, k.rport)
                comm = bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
                totals, since, _ = add(key, self.sock_totals(r), self._sprev.get(sid), v.first_ns, r.l.srtt_us,
                                       v.pid, comm)
                if v.pid:
                    pids[(_ip(k.laddr), k.lport, _ip(k.raddr), k.rport)] = v.pid
                for d_ in dirs:  # (sockets keep TX bursts only)
                    if d_ == DIR_TX:
                        starts[(key, d_)] = v.b.start[d_]
                        quiet.append((key, d_, v.b.start[d_], v.b.last[d_], v.tx_bytes - v.b.base_bytes[d_],
                                      v.tx_packets - v.b.base_packets[d_], v.pid, is_closed))
                seen.add(key)
                if is_closed:
                    self._sprev.pop(sid, None)
                else:
                    self._sprev[sid] = (totals, since)
                    alive.add(sid)
            for sid in [sid for sid in self._sprev if sid not in alive]:
                del self._sprev[sid]  # freed without a final record we got (counted as ring-buffer overflow)

        # hash map first, then the RX slots (see rx_slot in netflows.bpf.c: a count moving from a slot to the
        # hash map between the two reads is missed for one step, never counted twice); a key's totals are
        # its hash entry plus its slots, so a move between them is no change
        entries = {(k.laddr, k.raddr, k.lport, k.rport): (k, v) for k, v in self._read_conns()}
        slots = self._read_rx_slots()
        to_delete = []
        for key in set(entries) | set(slots):
            k, v = entries.get(key, (None, None))
            sb, sp = slots.get(key, (0, 0))
            seen.add(key)
            prev = self._prev.get(key)
            if v is None:
                totals = (0, sb, 0, sp, 0, 0, 0)
                totals, since, changed = add(key, totals, prev, last_step, 0, 0, "")
                self._prev[key] = (totals, since)
                continue
            if v.pid:
                pids.setdefault((_ip(k.laddr), k.lport, _ip(k.raddr), k.rport), v.pid)
            totals = (v.tx_bytes, v.rx_bytes + sb, v.tx_packets, v.rx_packets + sp, v.tx_payload, v.rx_payload,
                      v.retransmits)
            comm = bytes(v.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
            totals, since, changed = add(key, totals, prev, v.first_ns, v.srtt_us, v.pid, comm)
            self._prev[key] = (totals, since)
            for d_ in dirs:
                starts.setdefault((key, d_), v.b.start[d_])
                cb, cp = (v.tx_bytes, v.tx_packets) if d_ == DIR_TX else (v.rx_bytes, v.rx_packets)
                quiet.append((key, d_, v.b.start[d_], v.b.last[d_], cb - v.b.base_bytes[d_],
                              cp - v.b.base_packets[d_], v.pid, False))
            # closed and quiet since the last step, or unchanged for the idle timeout (judged here: RX packets
            # keep no time in BPF)
            quiet_for = now - since if not changed else 0
            if prev is not None and not changed and not sb and (v.closed or quiet_for > idle_ns):
                to_delete.append((k, v))
        for k, v in to_delete:
            try:
                del self._conns[k]
            except KeyError:
                pass
            key = (k.laddr, k.raddr, k.lport, k.rport)
            sb, sp = slots.get(key, (0, 0))
            if sb or sp:  # slots still hold part of it: keep that part as the baseline
                (tot, since) = self._prev[key]
                self._prev[key] = ((0, sb, 0, sp, 0, 0, 0), since)
            else:
                self._prev.pop(key, None)
        for key in [key for key in self._prev if key not in seen]:
            del self._prev[key]

        for key, (d, since, srtt, pid, comm) in acc.items():
            self.packets_total += d[2] + d[3]
            if any(d):
                laddr, raddr, lport, rport = key
                out.append(ConnStats(now, since, _ip(laddr), lport, _ip(raddr), rport,
                                     tx_bytes=d[0], rx_bytes=d[1], tx_packets=d[2], rx_packets=d[3],
                                     tx_payload_bytes=d[4], rx_payload_bytes=d[5], retransmits=d[6],
                                     srtt_us=srtt, pid=pid, comm=comm))
        # bursts that went quiet (or whose socket closed): close them here so a flow ends even if no packet
        # follows; remembered, so the ring-buffer copy BPF submits on the next packet is dropped
        for key, d_, start, last, nbytes, packets, pid, final in quiet:
            if last and nbytes and (final or now - last > gap_ns) and (key, d_, start) not in self._early:
                if not final:
                    self._early[(key, d_, start)] = 0
                out.append(self._flow(key, d_, start, last, nbytes, packets, pid))
        # a burst closed in BPF before the first send() returned carries no PID yet: take the connection's
        for f in out:
            if isinstance(f, Flow) and f.pid == 0:
                f.pid = pids.get((f.src, f.sport, f.dst, f.dport), 0)
        # Forget an early-closed burst once BPF has moved on from it (its ring-buffer copy, if any, was
        # submitted before the new burst started, so it is consumed by the next step or two), or when
        # the connection is gone. While BPF still shows that burst open, keep it: the copy comes
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

    def _read_rx_slots(self) -> dict[tuple, tuple[int, int]]:
        """key -> (RX bytes, RX packets) held in the per-CPU RX slots, summed over CPUs; a slot being taken over
        (seq_a odd or != seq_b) is skipped this step."""
        out: dict[tuple, tuple[int, int]] = {}
        items = self._bpf[b"rxslots"].items(skip_zero=True)  # slots never taken are all zero: not decoded
        for _idx, per_cpu in items:
            for sl in per_cpu:
                if not sl.used or sl.seq_a != sl.seq_b or sl.seq_a & 1:
                    continue
                key = (sl.key.laddr, sl.key.raddr, sl.key.lport, sl.key.rport)
                b0, p0 = out.get(key, (0, 0))
                out[key] = (b0 + sl.bytes, p0 + sl.packets)
        return out

    def _read_conns(self):
        return self._conns.items()  # batched where the kernel can (agent/ebpf/maps.py)

    def _check_counters(self, b, now: int, out: list) -> None:
        table = b[b"counters"]
        vals = []
        for i in range(N_COUNTERS):
            per_cpu = table[ctypes.c_int(i)]
            vals.append(sum(int(x) for x in per_cpu))
        whats = {CNT_RINGBUF_OVERFLOW: ("netflows_ringbuf_overflow", "flow or close ring buffer full"),
                 CNT_MAP_FULL: ("netflows_map_full", "connection map full"),
                 CNT_SK_FALLBACK: ("netflows_sk_storage_fallback",
                                   "no socket storage for a socket: counted in the connection map instead")}
        for idx, (kind, what) in whats.items():
            grown = vals[idx] - self._counters[idx]
            if grown > 0:
                out.append(Event(now, kind, "", f"{grown} new ({vals[idx]} total): {what}", float(grown)))
        self._counters = vals
