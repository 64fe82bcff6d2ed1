/* netflows: per-TCP-connection wire and payload counters and idle-gap bursts (flows).
 *
 * Rendered by netflows.render_program(): every double-braced placeholder is a kernel struct offset read from the
 * running kernel's BTF (OFF_*) or a config value. Kernel structs are never dereferenced through
 * the (possibly older) headers: fields are read with bpf_probe_read_kernel at BTF offsets.
 * Two builds of one file (BTF_TP):
 *   1: BTF raw tracepoints ("tp_btf"). TX packets, send()/recv() and the TX bursts of a socket are kept in
 *      socket-local storage (BPF_MAP_TYPE_SK_STORAGE: found from the typed skb->sk in a few loads, no hash
 *      of the 4-tuple); retransmits and smoothed RTT are the kernel's own tcp_sock counters, read when user
 *      space collects. User space reads the storage with a map iterator and gets each socket's final record
 *      through a ring buffer when it closes. RX packets are counted at netif_receive_skb by their headers in
 *      the hash map, as the device counts them (skb->sk is not known yet there; tcp:tcp_probe, where it is,
 *      sees ACKs the socket backlog has coalesced as one skb: measured 44 of 249 ACKs merged on lo).
 *   0: classic raw tracepoints: a hash map keyed by the 4-tuple, parsed from headers or struct sock, with a
 *      socket cache (kernels without BTF raw tracepoints or socket storage for tracing).
 * Packets whose socket has no storage (request and time-wait socks: SYN-ACKs, RSTs; storage allocation
 * failures) are counted in the hash map in both builds. RX packets go to per-CPU slots first (rx_slot).
 * All programs are named steplens_nf_* (<= 15 chars, the kernel's program-name limit) so `bpftool prog show`
 * can find them.
 */
#include <uapi/linux/ptrace.h>

#define SKB_READ_LEN {{SKB_READ_LEN}}
#define OFF_SKB_LEN {{OFF_SKB_LEN}}
#define OFF_SKB_DATA {{OFF_SKB_DATA}}
#define OFF_SKB_HEAD {{OFF_SKB_HEAD}}
#define OFF_SKB_NETWORK_HEADER {{OFF_SKB_NETWORK_HEADER}}
#define OFF_SKB_MAC_HEADER {{OFF_SKB_MAC_HEADER}}
#define OFF_SKB_SK {{OFF_SKB_SK}}
#define OFF_SKB_DEV {{OFF_SKB_DEV}}
#define OFF_SKB_PROTOCOL {{OFF_SKB_PROTOCOL}}
#define OFF_SKB_TSTAMP {{OFF_SKB_TSTAMP}}
#define OFF_DEV_IFINDEX {{OFF_DEV_IFINDEX}}
#define OFF_SKC_DADDR {{OFF_SKC_DADDR}}
#define OFF_SKC_RCV_SADDR {{OFF_SKC_RCV_SADDR}}
#define OFF_SKC_DPORT {{OFF_SKC_DPORT}}
#define OFF_SKC_NUM {{OFF_SKC_NUM}}
#define OFF_SKC_FAMILY {{OFF_SKC_FAMILY}}
#define OFF_SKC_STATE {{OFF_SKC_STATE}}
#define OFF_SK_PROTOCOL {{OFF_SK_PROTOCOL}}
#define OFF_TCP_SRTT_US {{OFF_TCP_SRTT_US}}
#define OFF_TP_TOTAL_RETRANS {{OFF_TP_TOTAL_RETRANS}}

#define IDLE_GAP_NS {{IDLE_GAP_NS}}ULL
#define MAX_CONNECTIONS {{MAX_CONNECTIONS}}
#define RINGBUF_PAGES {{RINGBUF_PAGES}}
#define FILTER_IFACES {{FILTER_IFACES}}
#define INCLUDE_LOOPBACK {{INCLUDE_LOOPBACK}}
#define FLOW_RX {{FLOW_RX}}
#define RX_SLOTS {{RX_SLOTS}}  /* per CPU, a power of two; 0: no RX slots */
#define RX_SLOT_STALE_JIFFIES {{RX_SLOT_STALE_JIFFIES}}
#define BTF_TP {{BTF_TP}}
#define RDONLY_CAST {{RDONLY_CAST}}  /* 1: headers read through bpf_rdonly_cast (BTF build, kernel has it) */
#define IPHDR_BTF_ID {{IPHDR_BTF_ID}}
#define TCPHDR_BTF_ID {{TCPHDR_BTF_ID}}  /* 1: the packet hooks are BTF raw tracepoints (typed args, plain loads) */
#define SRTT_EVERY_NS 100000000ULL  /* 100 ms */

#define DIR_TX 0
#define DIR_RX 1
/* Failure counters only: counting every packet here cost ~20 ns per packet (measured); packet totals come
   from the connections' own counters. */
#define CNT_RINGBUF_OVERFLOW 0
#define CNT_MAP_FULL 1
#define CNT_SK_FALLBACK 2  /* full socket without storage (allocation failed): hash map instead */
#define N_COUNTERS 3

struct conn_key {
    u32 laddr;  /* network order */
    u32 raddr;
    u16 lport;  /* host order */
    u16 rport;
};

/* The open burst per direction (DIR_TX, DIR_RX): its first and last packet times and the direction's byte and
   packet counters before its first packet (the burst's size is the counters now minus these). */
struct bursts {
    u64 start[2], last[2], base_bytes[2], base_packets[2];
};

struct conn_val {
    u64 tx_bytes, rx_bytes, tx_packets, rx_packets;
    u64 tx_payload, rx_payload, retransmits;
    u64 first_ns, last_ns, srtt_read_ns;
    u32 srtt_us, pid;
    u32 closed, _pad;
    char comm[16];
    struct bursts b;
};

struct flow_ev {
    struct conn_key key;
    u32 dir, pid;
    u64 start_ns, end_ns, bytes, packets;
};

BPF_HASH(conns, struct conn_key, struct conn_val, MAX_CONNECTIONS);
BPF_HASH(ifaces, u32, u8, 64);
#if !BTF_TP
/* struct sock * -> its connection key, filled on a socket's first send/recv (or retransmit): the
   per-call hooks and the TX packet hook then skip the 4-tuple reads and the header parse. LRU, so
   sockets that vanish without a TCP_CLOSE we saw cannot fill it; entries are also deleted at close. */
BPF_TABLE("lru_hash", u64, struct conn_key, socks, MAX_CONNECTIONS);
#endif
BPF_PERCPU_ARRAY(counters, u64, N_COUNTERS);

/* RX fast path: per-CPU direct-mapped slots, one connection each (slot = hash of the key). A packet of the
   slot's connection is two plain adds (this CPU only, and the RX hook does not nest on a CPU) instead of a
   hash-map update (measured ~65 ns less per packet). A packet whose slot holds another, active connection
   goes to the hash map. A slot idle for RX_SLOT_STALE_JIFFIES is taken over: its counts are first added to
   the hash map entry of its connection. Slots are cumulative and only BPF writes them; a takeover runs
   between seq_a and seq_b (seq_a odd meanwhile), so user space, which reads the hash map first and then the
   slots, skipping any with seq_a != seq_b, may miss a takeover's counts for one step but never counts them
   twice. Not used with rx_flows (bursts live in the hash map). */
struct rx_slot {
    u64 seq_a;
    struct conn_key key;
    u32 used;
    u64 bytes, packets, last_jiffies;
    u64 seq_b;
};
BPF_PERCPU_ARRAY(rxslots, struct rx_slot, RX_SLOTS);
BPF_RINGBUF_OUTPUT(flows, RINGBUF_PAGES);

static __always_inline void count(u32 idx, u64 n) {
    u64 *c = counters.lookup(&idx);
    if (c) *c += n;  /* per-CPU: no atomics needed */
}

static __always_inline struct conn_val *get_conn(struct conn_key *k, u64 now) {
    struct conn_val *v = conns.lookup(k);
    if (v) return v;
    struct conn_val zero = {};
    zero.first_ns = now;
    int err = conns.update(k, &zero);  /* BPF_ANY */
    if (err) {
        count(CNT_MAP_FULL, 1);
        return 0;
    }
    return conns.lookup(k);
}

static __always_inline int loopback_addr(u32 a) {
    return (a & 0xff) == 127;  /* 127.0.0.0/8, network order */
}

/* One packet of `len` bytes in direction d at `now`, after which the direction's counters are `cbytes` and
   `cpackets`: extend the open burst (one store), or after an idle gap close it (ring buffer) and start a new one. */
static __always_inline void burst(struct conn_key *k, u32 pid, struct bursts *b, u32 d, u64 len, u64 cbytes,
                                  u64 cpackets, u64 now) {
    d &= 1;
    u64 last = b->last[d];
    if (last == 0) {
        b->start[d] = now;
        b->base_bytes[d] = cbytes - len;
        b->base_packets[d] = cpackets - 1;
    } else if (now > last && now - last > IDLE_GAP_NS) {
        /* the burst ended at `last`: hand it to user space and start a new one with this packet */
        struct flow_ev *ev = flows.ringbuf_reserve(sizeof(struct flow_ev));
        if (ev) {
            ev->key = *k;
            ev->dir = d;
            ev->pid = pid;
            ev->start_ns = b->start[d];
            ev->end_ns = last;
            ev->bytes = cbytes - len - b->base_bytes[d];
            ev->packets = cpackets - 1 - b->base_packets[d];
            flows.ringbuf_submit(ev, BPF_RB_NO_WAKEUP);  /* user space polls; no wake-ups */
        } else {
            count(CNT_RINGBUF_OVERFLOW, 1);
        }
        b->start[d] = now;
        b->base_bytes[d] = cbytes - len;
        b->base_packets[d] = cpackets - 1;
    }
    b->last[d] = now;
}

/* One packet of `len` wire bytes in direction dir, counted in the hash map by its 4-tuple: cumulative
   counters and the open burst. Without rx_flows the RX side keeps no burst state and reads no clock (its
   counters are all that is used; last_ns, for idle expiry, is kept by the TX and per-call hooks). */
static __always_inline void account(struct conn_key *k, u32 dir, u64 len, u64 tstamp) {
    struct conn_val *v = conns.lookup(k);
    if (!v) {
        v = get_conn(k, bpf_ktime_get_ns());
        if (!v) return;
    }
    u64 cbytes, cpackets;
    if (dir == DIR_TX) {
        cbytes = __sync_fetch_and_add(&v->tx_bytes, len) + len;
        cpackets = __sync_fetch_and_add(&v->tx_packets, 1) + 1;
    } else {
        cbytes = __sync_fetch_and_add(&v->rx_bytes, len) + len;
        cpackets = __sync_fetch_and_add(&v->rx_packets, 1) + 1;
        if (!FLOW_RX) return;
    }
    u64 now = tstamp ? tstamp : bpf_ktime_get_ns();
    v->last_ns = now;
    burst(k, v->pid, &v->b, dir, len, cbytes, cpackets, now);
}

/* IPv4/TCP 4-tuple of the packet, addresses in network order, ports in host order. */
/* The sk_buff fields a packet hook needs, in one bpf_probe_read_kernel of the struct's head
   (one helper call instead of one per field: this runs for every packet). */
struct skb_fields { unsigned char *head; unsigned char *data; void *sk; void *dev; u64 tstamp; u32 len; u16 nh; u16 mh; u16 proto; };

static __always_inline int read_skb(void *skb, struct skb_fields *f) {
#if BTF_TP
    /* skb is a BTF-typed pointer: plain loads, checked by the verifier against the kernel's struct */
    unsigned char *p = skb;
    f->head = *(unsigned char **)(p + OFF_SKB_HEAD);
    f->data = *(unsigned char **)(p + OFF_SKB_DATA);
    f->sk = *(void **)(p + OFF_SKB_SK);
    f->dev = *(void **)(p + OFF_SKB_DEV);
    f->len = *(u32 *)(p + OFF_SKB_LEN);
    f->nh = *(u16 *)(p + OFF_SKB_NETWORK_HEADER);
    f->mh = *(u16 *)(p + OFF_SKB_MAC_HEADER);
    f->proto = *(u16 *)(p + OFF_SKB_PROTOCOL);
    f->tstamp = *(u64 *)(p + OFF_SKB_TSTAMP);
    return 0;
#else
    u8 b[SKB_READ_LEN];
    /* one read of the struct's head (every field a packet hook uses lies in it) */
    if (bpf_probe_read_kernel(b, sizeof(b), skb)) return -1;
    __builtin_memcpy(&f->head, b + OFF_SKB_HEAD, sizeof(f->head));
    __builtin_memcpy(&f->data, b + OFF_SKB_DATA, sizeof(f->data));
    __builtin_memcpy(&f->sk, b + OFF_SKB_SK, sizeof(f->sk));
    __builtin_memcpy(&f->dev, b + OFF_SKB_DEV, sizeof(f->dev));
    __builtin_memcpy(&f->len, b + OFF_SKB_LEN, sizeof(f->len));
    __builtin_memcpy(&f->nh, b + OFF_SKB_NETWORK_HEADER, sizeof(f->nh));
    __builtin_memcpy(&f->mh, b + OFF_SKB_MAC_HEADER, sizeof(f->mh));
    __builtin_memcpy(&f->proto, b + OFF_SKB_PROTOCOL, sizeof(f->proto));
    __builtin_memcpy(&f->tstamp, b + OFF_SKB_TSTAMP, sizeof(f->tstamp));
    return 0;
#endif
}

#if BTF_TP
/* The 4-tuple of a BTF-typed struct sock * by plain loads. 0: IPv4 TCP; -1: not wanted (another family or
   protocol, or loopback when excluded); -2: a request or time-wait sock, which has only the sock_common part
   (its sk_protocol would be read past the object). */
static __always_inline int sock_key_btf(void *skp, struct conn_key *k) {
    unsigned char *sk = skp;
    if (*(u16 *)(sk + OFF_SKC_FAMILY) != 2 /* AF_INET */) return -1;
    u8 state = *(u8 *)(sk + OFF_SKC_STATE);
    if (state == 12 /* TCP_NEW_SYN_RECV */ || state == 6 /* TCP_TIME_WAIT */) return -2;
    if (*(u16 *)(sk + OFF_SK_PROTOCOL) != 6 /* IPPROTO_TCP */) return -1;
    k->raddr = *(u32 *)(sk + OFF_SKC_DADDR);
    k->laddr = *(u32 *)(sk + OFF_SKC_RCV_SADDR);
    k->lport = *(u16 *)(sk + OFF_SKC_NUM);
    k->rport = ntohs(*(u16 *)(sk + OFF_SKC_DPORT));
    if (!INCLUDE_LOOPBACK && loopback_addr(k->raddr)) return -1;
    return 0;
}
#endif

/* The packet's time for bursts, CLOCK_MONOTONIC ns. TCP stamps every skb it sends with its departure time
   (skb->tstamp = tcp_wstamp_ns, from the clock it reads once per transmit round), still there at
   net_dev_start_xmit: using it saves a clock read per packet (measured ~60 ns of a ~200 ns TX program here).
   Packets without one (0: not TCP, or cleared on the receive path) read the clock. */
static __always_inline u64 packet_time(struct skb_fields *f) {
    return f->tstamp ? f->tstamp : bpf_ktime_get_ns();
}

#if RDONLY_CAST
/* The kfunc bpf_rdonly_cast(p, btf_id): the verifier turns it into a register move and the loads through the
   result into exception-protected plain loads (no helper call: ~65 ns less per packet than
   bpf_probe_read_kernel, measured). bcc cannot emit kfunc calls: this placeholder helper number is rewritten
   into the kfunc call when the program is loaded (agent/ebpf patch_kfunc_calls). */
static void *(*rdonly_cast)(void *p, u32 btf_id) = (void *)0x7ff0;

/* IPv4 + TCP ports by plain (exception-protected) loads through typed header pointers. */
static __always_inline int parse(struct skb_fields *f, u32 *saddr, u32 *daddr, u16 *sport, u16 *dport) {
    if (f->proto != htons(0x0800) || !f->head || f->nh == 0xffff) return -1;
    unsigned char *ip = rdonly_cast(f->head + f->nh, IPHDR_BTF_ID);
    u8 vihl = *(u8 *)ip;
    if ((vihl >> 4) != 4 || *(u8 *)(ip + 9) != 6 /* IPPROTO_TCP */) return -1;
    u32 ihl = (vihl & 0xf) * 4;
    if (ihl < 20) return -1;
    *saddr = *(u32 *)(ip + 12);
    *daddr = *(u32 *)(ip + 16);
    unsigned char *th = rdonly_cast(f->head + f->nh + ihl, TCPHDR_BTF_ID);
    *sport = ntohs(*(u16 *)th);
    *dport = ntohs(*(u16 *)(th + 2));
    return 0;
}
#else
/* IPv4 + TCP ports, read in one go when the IP header has no options (the common case). */
static __always_inline int parse(struct skb_fields *f, u32 *saddr, u32 *daddr, u16 *sport, u16 *dport) {
    if (f->proto != htons(0x0800) || !f->head || f->nh == 0xffff) return -1;
    u8 h[24];
    if (bpf_probe_read_kernel(h, sizeof(h), f->head + f->nh)) return -1;
    if ((h[0] >> 4) != 4 || h[9] != 6 /* IPPROTO_TCP */) return -1;
    u32 ihl = (h[0] & 0xf) * 4;
    if (ihl < 20) return -1;
    __builtin_memcpy(saddr, &h[12], 4);
    __builtin_memcpy(daddr, &h[16], 4);
    u16 ports[2];
    if (ihl == 20) {
        __builtin_memcpy(ports, &h[20], 4);
    } else if (bpf_probe_read_kernel(ports, sizeof(ports), f->head + f->nh + ihl)) {
        return -1;
    }
    *sport = ntohs(ports[0]);
    *dport = ntohs(ports[1]);
    return 0;
}
#endif

static __always_inline int ifindex_wanted(u32 ifindex) {
    if (!INCLUDE_LOOPBACK && ifindex == 1) return 0;  /* lo is ifindex 1 in every namespace */
    if (FILTER_IFACES && !ifaces.lookup(&ifindex)) return 0;
    return 1;
}

static __always_inline int dev_wanted(void *dev) {
    if (INCLUDE_LOOPBACK && !FILTER_IFACES) return 1;  /* every device counts: skip the read */
    u32 ifindex = 0;
#if BTF_TP
    ifindex = *(u32 *)((unsigned char *)dev + OFF_DEV_IFINDEX);  /* typed: a plain load */
#else
    bpf_probe_read_kernel(&ifindex, sizeof(ifindex), dev + OFF_DEV_IFINDEX);
#endif
    return ifindex_wanted(ifindex);
}

/* A packet whose socket is unknown or has no storage: key it by its IPv4/TCP headers (TX: source is local). */
static __always_inline void account_parsed(struct skb_fields *f, u32 dir, u64 len) {
    u32 saddr, daddr; u16 sport, dport;
    if (parse(f, &saddr, &daddr, &sport, &dport)) return;
    struct conn_key k = {};
    if (dir == DIR_TX) {
        k.laddr = saddr; k.raddr = daddr; k.lport = sport; k.rport = dport;
    } else {
        k.laddr = daddr; k.raddr = saddr; k.lport = dport; k.rport = sport;
    }
    account(&k, dir, len, dir == DIR_TX ? f->tstamp : 0);  /* RX stamps, if any, are CLOCK_REALTIME */
}

static __always_inline int same_key(struct conn_key *a, struct conn_key *b) {
    return a->laddr == b->laddr && a->raddr == b->raddr && a->lport == b->lport && a->rport == b->rport;
}

static __always_inline void rx_slot_account(struct conn_key *k, u64 wire) {
    u32 h = k->laddr ^ (k->raddr * 0x9E3779B1u) ^ ((((u32)k->lport << 16) | k->rport) * 0x85EBCA6Bu);
    u32 idx = (h ^ (h >> 15)) & (RX_SLOTS - 1);
    struct rx_slot *s = rxslots.lookup(&idx);
    if (!s) {
        account(k, DIR_RX, wire, 0);
        return;
    }
    u64 now = bpf_jiffies64();
    if (s->used && same_key(&s->key, k)) {
        s->bytes += wire;
        s->packets += 1;
        s->last_jiffies = now;
        return;
    }
    if (s->used && now - s->last_jiffies < RX_SLOT_STALE_JIFFIES) {
        account(k, DIR_RX, wire, 0);  /* another connection is using this slot */
        return;
    }
    s->seq_a += 1;  /* odd: user space skips the slot until seq_b matches */
    asm volatile("" ::: "memory");
    if (s->used && (s->bytes || s->packets)) {  /* hand the idle connection's counts to the hash map */
        struct conn_key old = s->key;
        struct conn_val *v = conns.lookup(&old);
        if (!v) v = get_conn(&old, bpf_ktime_get_ns());
        if (v) {
            __sync_fetch_and_add(&v->rx_bytes, s->bytes);
            __sync_fetch_and_add(&v->rx_packets, s->packets);
        }  /* (map full: counted as such, and these counts are lost) */
    }
    s->key = *k;
    s->bytes = wire;
    s->packets = 1;
    s->last_jiffies = now;
    s->used = 1;
    s->seq_a += 1;
    asm volatile("" ::: "memory");
    s->seq_b = s->seq_a;
}

/* netif_receive_skb(skb), both builds: the MAC header is already pulled; add it back so bytes match the
   device's rx_bytes. Keyed by the packet's headers (skb->sk is not set yet). */
static __always_inline int rx_packet(void *skb) {
    struct skb_fields f = {};
    if (read_skb(skb, &f)) return 0;
    if (!f.dev || !dev_wanted(f.dev)) return 0;
    u64 wire = f.len;
    unsigned char *mac = f.head + f.mh;
    if (f.mh != 0xffff && f.data >= mac && f.data - mac <= 64) wire += f.data - mac;
    if (FLOW_RX || RX_SLOTS == 0) {
        account_parsed(&f, DIR_RX, wire);
        return 0;
    }
    u32 saddr, daddr; u16 sport, dport;
    if (parse(&f, &saddr, &daddr, &sport, &dport)) return 0;
    struct conn_key k = {.laddr = daddr, .raddr = saddr, .lport = dport, .rport = sport};
    rx_slot_account(&k, wire);
    return 0;
}

#if BTF_TP
/* ---- BTF build: per-socket state in socket-local storage ----------------------------------------------- */

#define SK_INIT 1     /* key (and, for sockets older than the agent, baselines) set */
#define SK_SKIP 2     /* not an IPv4 TCP socket we watch (or loopback, excluded): ignored */
#define SK_BORN 4     /* seen from its first state change (SYN_SENT / SYN_RECV): its TCP counters started at 0 */
#define SK_CLOSED 32  /* its final record went to user space at TCP_CLOSE: the iterator skips it */

struct sk_val {
    u64 id;                      /* the struct sock address: with first_ns, names the socket to user space */
    u64 first_ns;
    struct conn_key key;
    u32 flags;
    u64 tx_bytes, tx_packets;    /* every skb at net_dev_start_xmit (skb->len, what the device counts) */
    u64 tx_payload, rx_payload;  /* send() / recv() return values */
    u32 base_retrans, pid;       /* total_retrans when first seen (sockets older than the agent); last PID */
    char comm[16];
    struct bursts b;
};

/* The kernel's live TCP counters of a socket, read when user space collects it. */
struct sk_live {
    u32 retrans_now, srtt_us;
};

/* What user space gets per socket: by the iterator while it lives, through `closes` when it closes. */
struct sk_rec {
    struct sk_val v;
    struct sk_live l;
};

BPF_SK_STORAGE(sks, struct sk_val);
BPF_RINGBUF_OUTPUT(closes, RINGBUF_PAGES);
BPF_ARRAY(rec_layout, struct sk_rec, 1);  /* never used by the programs: gives user space the record layout */

static __always_inline void read_live(void *sk, struct sk_live *l) {
    bpf_probe_read_kernel(&l->retrans_now, sizeof(l->retrans_now), sk + OFF_TP_TOTAL_RETRANS);
    u32 srtt = 0;
    bpf_probe_read_kernel(&srtt, sizeof(srtt), sk + OFF_TCP_SRTT_US);
    l->srtt_us = srtt >> 3;  /* stored << 3 by the kernel */
}

/* Key a socket's storage on first use. Sockets older than the agent start from their counters now. */
static __always_inline int sk_init(void *sk, struct sk_val *v) {
    struct conn_key k = {};
    if (sock_key_btf(sk, &k)) {
        v->flags |= SK_SKIP;
        return -1;
    }
    v->key = k;
    v->id = (u64)sk;
    v->first_ns = bpf_ktime_get_ns();
    if (!(v->flags & SK_BORN))  /* older than the agent: its retransmits count from now */
        bpf_probe_read_kernel(&v->base_retrans, sizeof(v->base_retrans), sk + OFF_TP_TOTAL_RETRANS);
    v->flags |= SK_INIT;
    return 0;
}

/* The socket's storage, created on first sight; 0 when the socket is not watched (*slow = 1: it should be
   counted in the hash map instead: storage could not be had for a full TCP socket). */
static __always_inline struct sk_val *sk_get(void *sk, int *slow) {
    struct sk_val *v = sks.sk_storage_get(sk, 0, 0);
    if (!v) {
        struct conn_key k = {};
        if (sock_key_btf(sk, &k)) return 0;  /* not watched, or a request / time-wait sock (callers check) */
        v = sks.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
        if (!v) {
            count(CNT_SK_FALLBACK, 1);
            *slow = 1;
            return 0;
        }
    }
    if (v->flags & SK_SKIP) return 0;
    if (!(v->flags & SK_INIT) && sk_init(sk, v)) return 0;
    return v;
}

/* net_dev_start_xmit(skb, dev): skb->len is what the device counts. Only skbs with a socket are this host's
   TCP (forwarded or bridged packets carry none). */
int steplens_nf_tx(u64 *ctx) {
    struct skb_fields f = {};
    read_skb((void *)ctx[0], &f);
    if (!f.sk || !dev_wanted((void *)ctx[1])) return 0;
    int slow = 0;
    struct sk_val *v = sk_get(f.sk, &slow);
    if (!v) {
        /* request and time-wait socks (SYN-ACK, RST, last ACKs) and storage failures: by the headers */
        struct conn_key k = {};
        if (slow || sock_key_btf(f.sk, &k) == -2) account_parsed(&f, DIR_TX, f.len);
        return 0;
    }
    u64 cbytes = __sync_fetch_and_add(&v->tx_bytes, f.len) + f.len;
    u64 cpackets = __sync_fetch_and_add(&v->tx_packets, 1) + 1;
    burst(&v->key, v->pid, &v->b, DIR_TX, f.len, cbytes, cpackets, packet_time(&f));
    return 0;
}

int steplens_nf_rx(u64 *ctx) { return rx_packet((void *)ctx[0]); }

/* sock_send_length / sock_recv_length(sk, ret, flags): payload bytes and the owning process. */
static __always_inline void payload(void *sk, int ret, int flags, u32 dir) {
    if (ret <= 0 || (dir == DIR_RX && (flags & 2 /* MSG_PEEK */))) return;
    int slow = 0;
    struct sk_val *v = sk_get(sk, &slow);
    if (!v) {
        struct conn_key k = {};
        if (!slow || sock_key_btf(sk, &k)) return;
        struct conn_val *c = get_conn(&k, bpf_ktime_get_ns());
        if (!c) return;
        if (dir == DIR_TX) __sync_fetch_and_add(&c->tx_payload, (u64)ret);
        else __sync_fetch_and_add(&c->rx_payload, (u64)ret);
        return;
    }
    /* after the call returned: no socket lock, another thread may be in the same socket */
    if (dir == DIR_TX) __sync_fetch_and_add(&v->tx_payload, (u64)ret);
    else __sync_fetch_and_add(&v->rx_payload, (u64)ret);
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (v->pid != pid) {
        v->pid = pid;
        bpf_get_current_comm(&v->comm, sizeof(v->comm));
    }
}

int steplens_nf_snd(u64 *ctx) { payload((void *)ctx[0], (int)ctx[1], (int)ctx[2], DIR_TX); return 0; }
int steplens_nf_rcv(u64 *ctx) { payload((void *)ctx[0], (int)ctx[1], (int)ctx[2], DIR_RX); return 0; }

/* inet_sock_set_state(sk, oldstate, newstate): a socket's birth (fresh storage: its counters start at 0) and
   TCP_CLOSE (its final record to user space). */
int steplens_nf_st(u64 *ctx) {
    void *sk = (void *)ctx[0];
    int newstate = (int)ctx[2];
    if (newstate == 2 /* TCP_SYN_SENT */ || newstate == 3 /* TCP_SYN_RECV */) {
        struct conn_key k = {};
        if (sock_key_btf(sk, &k) == -1) return 0;  /* (a SYN_SENT socket may have no local port yet) */
        struct sk_val *v = sks.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
        if (!v) {
            count(CNT_SK_FALLBACK, 1);
            return 0;
        }
        __builtin_memset(v, 0, sizeof(*v));  /* a socket connect()ed again after a close starts over */
        v->flags = SK_BORN;  /* keyed at its first packet, when the local port is set */
        return 0;
    }
    if (newstate != 7 /* TCP_CLOSE */) return 0;
    struct conn_key k = {};
    if (sock_key_btf(sk, &k) == 0) {  /* its RX (and slow-path) entry in the hash map: deleted once quiet */
        struct conn_val *c = conns.lookup(&k);
        if (c) c->closed = 1;
    }
    struct sk_val *v = sks.sk_storage_get(sk, 0, 0);
    if (!v || (v->flags & (SK_INIT | SK_SKIP | SK_CLOSED)) != SK_INIT) return 0;
    struct sk_rec *r = closes.ringbuf_reserve(sizeof(struct sk_rec));
    if (!r) {
        count(CNT_RINGBUF_OVERFLOW, 1);  /* the iterator still shows it until the socket is freed */
        return 0;
    }
    __builtin_memcpy(&r->v, v, sizeof(*v));
    read_live(sk, &r->l);
    closes.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    v->flags |= SK_CLOSED;
    return 0;
}

/* Iterator over the socket storage map: one sk_rec per watched, open socket. */
int steplens_nf_it(u64 *ctx) {
    void *meta = (void *)ctx[0];
    void *sk = (void *)ctx[2];
    struct sk_val *v = (struct sk_val *)ctx[3];
    if (!sk || !v || (v->flags & (SK_INIT | SK_SKIP | SK_CLOSED)) != SK_INIT) return 0;
    struct sk_live l = {};
    read_live(sk, &l);
    void *seq = *(void **)meta;
    bpf_seq_write(seq, v, sizeof(*v));
    bpf_seq_write(seq, &l, sizeof(l));
    return 0;
}

#else
/* ---- classic build: raw tracepoints, hash map by 4-tuple, socket cache ----------------------------------- */

/* net_dev_start_xmit(skb, dev): skb->data is at the MAC header, skb->len is what the device counts. */
int steplens_nf_tx(struct bpf_raw_tracepoint_args *ctx) {
    struct skb_fields f = {};
    if (read_skb((void *)ctx->args[0], &f)) return 0;
    /* forwarded or bridged packets carry no socket: only packets this host's TCP sent are TX */
    if (!f.sk || !dev_wanted((void *)ctx->args[1])) return 0;
    u64 skp = (u64)f.sk;
    struct conn_key *known = socks.lookup(&skp);
    if (known) {  /* a socket that sent or received before: no header parse */
        struct conn_key k = *known;
        account(&k, DIR_TX, f.len, f.tstamp);
        return 0;
    }
    /* SYNs, SYN-ACKs (skb->sk is then a request sock), RSTs, and sockets older than the agent that have not
       sent since: parse the headers */
    account_parsed(&f, DIR_TX, f.len);
    return 0;
}

int steplens_nf_rx(struct bpf_raw_tracepoint_args *ctx) { return rx_packet((void *)ctx->args[0]); }

/* The socket's key: from the socks map, else read from struct sock (and remembered). */
static __always_inline int sock_key(void *sk, struct conn_key *k) {
    u64 skp = (u64)sk;
    struct conn_key *known = socks.lookup(&skp);
    if (known) {
        *k = *known;
        return 0;
    }
    u16 family = 0, proto = 0;
    bpf_probe_read_kernel(&family, sizeof(family), sk + OFF_SKC_FAMILY);
    if (family != 2 /* AF_INET */) return -1;
    bpf_probe_read_kernel(&proto, sizeof(proto), sk + OFF_SK_PROTOCOL);
    if (proto != 6) return -1;
    u16 dport = 0;
    bpf_probe_read_kernel(&k->laddr, sizeof(k->laddr), sk + OFF_SKC_RCV_SADDR);
    bpf_probe_read_kernel(&k->raddr, sizeof(k->raddr), sk + OFF_SKC_DADDR);
    bpf_probe_read_kernel(&k->lport, sizeof(k->lport), sk + OFF_SKC_NUM);
    bpf_probe_read_kernel(&dport, sizeof(dport), sk + OFF_SKC_DPORT);
    k->rport = ntohs(dport);
    if (!INCLUDE_LOOPBACK && loopback_addr(k->raddr)) return -1;
    if (k->lport && k->rport) socks.update(&skp, k);  /* connected: the 4-tuple is final */
    return 0;
}

/* sock_send_length / sock_recv_length(sk, ret, flags): payload bytes and the owning process. */
static __always_inline void payload(void *sk, int ret, int flags, u32 dir) {
    if (ret <= 0 || (dir == DIR_RX && (flags & 2 /* MSG_PEEK */))) return;
    struct conn_key k = {};
    if (sock_key(sk, &k)) return;
    u64 now = bpf_ktime_get_ns();
    struct conn_val *v = get_conn(&k, now);
    if (!v) return;
    v->last_ns = now;
    if (dir == DIR_TX) {
        __sync_fetch_and_add(&v->tx_payload, (u64)ret);
        /* smoothed RTT (stored << 3 by the kernel), read at most every SRTT_EVERY_NS per connection: the
           field sits in a line the ACK path on another CPU keeps writing, so each read is a cache miss */
        if (now - v->srtt_read_ns > SRTT_EVERY_NS) {
            u32 srtt = 0;
            bpf_probe_read_kernel(&srtt, sizeof(srtt), sk + OFF_TCP_SRTT_US);
            if (srtt) v->srtt_us = srtt >> 3;
            v->srtt_read_ns = now;
        }
    }
    else __sync_fetch_and_add(&v->rx_payload, (u64)ret);
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (v->pid != pid) {
        v->pid = pid;
        bpf_get_current_comm(&v->comm, sizeof(v->comm));
    }
}

int steplens_nf_snd(struct bpf_raw_tracepoint_args *ctx) {
    payload((void *)ctx->args[0], (int)ctx->args[1], (int)ctx->args[2], DIR_TX);
    return 0;
}
int steplens_nf_rcv(struct bpf_raw_tracepoint_args *ctx) {
    payload((void *)ctx->args[0], (int)ctx->args[1], (int)ctx->args[2], DIR_RX);
    return 0;
}

/* tcp_retransmit_skb(sk, skb, ...) */
int steplens_nf_rtx(struct bpf_raw_tracepoint_args *ctx) {
    struct conn_key k = {};
    if (sock_key((void *)ctx->args[0], &k)) return 0;
    struct conn_val *v = get_conn(&k, bpf_ktime_get_ns());
    if (v) __sync_fetch_and_add(&v->retransmits, 1);
    return 0;
}

/* inet_sock_set_state(sk, oldstate, newstate): mark closed; user space deletes it once quiet. */
int steplens_nf_st(struct bpf_raw_tracepoint_args *ctx) {
    if ((int)ctx->args[2] != 7 /* TCP_CLOSE */) return 0;
    struct conn_key k = {};
    if (sock_key((void *)ctx->args[0], &k)) return 0;
    u64 skp = (u64)ctx->args[0];
    socks.delete(&skp);
    struct conn_val *v = conns.lookup(&k);
    if (v) v->closed = 1;
    return 0;
}
#endif
