/* netflows: per-TCP-connection wire and payload counters and idle-gap bursts (flows).
 *
 * Rendered by netflows.render_program(): every double-braced placeholder is a kernel struct offset read from the
 * running kernel's BTF (OFF_*) or a config value. Kernel structs are never dereferenced through
 * the (possibly older) headers: fields are read with bpf_probe_read_kernel at BTF offsets.
 * All programs are attached explicitly as raw tracepoints and named steplens_nf_* (<= 15 chars,
 * the kernel's program-name limit) so `bpftool prog show` can find them.
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
#define OFF_DEV_IFINDEX {{OFF_DEV_IFINDEX}}
#define OFF_SKC_DADDR {{OFF_SKC_DADDR}}
#define OFF_SKC_RCV_SADDR {{OFF_SKC_RCV_SADDR}}
#define OFF_SKC_DPORT {{OFF_SKC_DPORT}}
#define OFF_SKC_NUM {{OFF_SKC_NUM}}
#define OFF_SKC_FAMILY {{OFF_SKC_FAMILY}}
#define OFF_SKC_STATE {{OFF_SKC_STATE}}
#define OFF_SK_PROTOCOL {{OFF_SK_PROTOCOL}}
#define OFF_TCP_SRTT_US {{OFF_TCP_SRTT_US}}

#define IDLE_GAP_NS {{IDLE_GAP_NS}}ULL
#define MAX_CONNECTIONS {{MAX_CONNECTIONS}}
#define RINGBUF_PAGES {{RINGBUF_PAGES}}
#define FILTER_IFACES {{FILTER_IFACES}}
#define INCLUDE_LOOPBACK {{INCLUDE_LOOPBACK}}
#define FLOW_RX {{FLOW_RX}}
#define BTF_TP {{BTF_TP}}  /* 1: the packet hooks are BTF raw tracepoints (typed args, plain loads) */
#define SRTT_EVERY_NS 100000000ULL  /* 100 ms */

#define DIR_TX 0
#define DIR_RX 1
#define CNT_RINGBUF_OVERFLOW 0
#define CNT_MAP_FULL 1
#define CNT_PACKETS 2
#define CNT_SOCK_EVENTS 3
#define N_COUNTERS 4

struct conn_key {
    u32 laddr;  /* network order */
    u32 raddr;
    u16 lport;  /* host order */
    u16 rport;
};

struct conn_val {
    u64 tx_bytes, rx_bytes, tx_packets, rx_packets;
    u64 tx_payload, rx_payload, retransmits;
    u64 first_ns, last_ns, srtt_read_ns;
    u32 srtt_us, pid;
    u32 closed, _pad;
    char comm[16];
    /* open burst per direction (DIR_TX, DIR_RX) */
    u64 b_start[2], b_last[2], b_bytes[2], b_packets[2];
};

struct flow_ev {
    struct conn_key key;
    u32 dir, pid;
    u64 start_ns, end_ns, bytes, packets;
};

BPF_HASH(conns, struct conn_key, struct conn_val, MAX_CONNECTIONS);
BPF_HASH(ifaces, u32, u8, 64);
/* struct sock * -> its connection key, filled on a socket's first send/recv (or retransmit): the
   per-call hooks and the TX packet hook then skip the 4-tuple reads and the header parse. LRU, so
   sockets that vanish without a TCP_CLOSE we saw cannot fill it; entries are also deleted at close. */
BPF_TABLE("lru_hash", u64, struct conn_key, socks, MAX_CONNECTIONS);
BPF_PERCPU_ARRAY(counters, u64, N_COUNTERS);
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

/* One packet of `len` wire bytes in direction dir: cumulative counters and the open burst.
   Without rx_flows the RX side keeps no burst state and reads no clock (its counters are all that is
   used; last_ns, for idle expiry, is kept by the TX and per-call hooks, which see every live socket). */
static __always_inline void account(struct conn_key *k, u32 dir, u64 len) {
    struct conn_val *v = conns.lookup(k);
    if (!v) {
        v = get_conn(k, bpf_ktime_get_ns());
        if (!v) return;
    }
    count(CNT_PACKETS, 1);
    if (dir == DIR_TX) {
        __sync_fetch_and_add(&v->tx_bytes, len);
        __sync_fetch_and_add(&v->tx_packets, 1);
    } else {
        __sync_fetch_and_add(&v->rx_bytes, len);
        __sync_fetch_and_add(&v->rx_packets, 1);
        if (!FLOW_RX) return;
    }
    u64 now = bpf_ktime_get_ns();
    v->last_ns = now;
    u32 d = dir & 1;
    u64 last = v->b_last[d];
    if (last != 0 && now > last && now - last > IDLE_GAP_NS) {
        /* the burst ended at `last`: hand it to user space and start a new one with this packet */
        struct flow_ev *ev = flows.ringbuf_reserve(sizeof(struct flow_ev));
        if (ev) {
            ev->key = *k;
            ev->dir = d;
            ev->pid = v->pid;
            ev->start_ns = v->b_start[d];
            ev->end_ns = last;
            ev->bytes = v->b_bytes[d];
            ev->packets = v->b_packets[d];
            flows.ringbuf_submit(ev, BPF_RB_NO_WAKEUP);  /* user space polls; no wake-ups */
        } else {
            count(CNT_RINGBUF_OVERFLOW, 1);
        }
        v->b_start[d] = now;
        v->b_bytes[d] = len;
        v->b_packets[d] = 1;
    } else {
        if (last == 0 || v->b_bytes[d] == 0) v->b_start[d] = now;
        __sync_fetch_and_add(&v->b_bytes[d], len);
        __sync_fetch_and_add(&v->b_packets[d], 1);
    }
    v->b_last[d] = now;
}

/* IPv4/TCP 4-tuple of the packet, addresses in network order, ports in host order. */
/* The sk_buff fields a packet hook needs, in one bpf_probe_read_kernel of the struct's head
   (one helper call instead of one per field: this runs for every packet). */
struct skb_fields { unsigned char *head; unsigned char *data; void *sk; void *dev; u32 len; u16 nh; u16 mh; u16 proto; };

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
    return 0;
#endif
}

#if BTF_TP
#define PKT_ARGS u64 *ctx
#define PKT_ARG(i) ((void *)ctx[i])
#else
#define PKT_ARGS struct bpf_raw_tracepoint_args *ctx
#define PKT_ARG(i) ((void *)ctx->args[i])
#endif

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

static __always_inline int dev_wanted(void *dev) {
    if (INCLUDE_LOOPBACK && !FILTER_IFACES) return 1;  /* every device counts: skip the read */
    u32 ifindex = 0;
    bpf_probe_read_kernel(&ifindex, sizeof(ifindex), dev + OFF_DEV_IFINDEX);
    if (!INCLUDE_LOOPBACK && ifindex == 1) return 0;  /* lo is ifindex 1 in every namespace */
    if (FILTER_IFACES && !ifaces.lookup(&ifindex)) return 0;
    return 1;
}

/* net_dev_start_xmit(skb, dev): skb->data is at the MAC header, skb->len is what the device counts. */
int steplens_nf_tx(PKT_ARGS) {
    void *dev = PKT_ARG(1);
    struct skb_fields f = {};
    if (read_skb(PKT_ARG(0), &f)) return 0;
    /* forwarded or bridged packets carry no socket: only packets this host's TCP sent are TX */
    if (!f.sk || !dev_wanted(dev)) return 0;
#if BTF_TP
    {  /* the sending socket is a BTF-typed pointer: its 4-tuple is four plain loads */
        struct conn_key k = {};
        int r = sock_key_btf(f.sk, &k);
        if (r == 0) {
            account(&k, DIR_TX, f.len);
            return 0;
        }
        if (r == -1) return 0;  /* not IPv4 TCP (or loopback, excluded) */
    }   /* -2: a request or time-wait sock (SYN-ACK, RST): no struct sock behind it, parse the headers */
#endif
    u64 skp = (u64)f.sk;
    struct conn_key *known = socks.lookup(&skp);
    if (known) {  /* a socket that sent or received before: no header parse */
        struct conn_key k = *known;
        account(&k, DIR_TX, f.len);
        return 0;
    }
    /* SYNs, SYN-ACKs (skb->sk is then a request sock), RSTs, and sockets older than the agent that have not
       sent since: parse the headers */
    u32 saddr, daddr; u16 sport, dport;
    if (parse(&f, &saddr, &daddr, &sport, &dport)) return 0;
    struct conn_key k = {.laddr = saddr, .raddr = daddr, .lport = sport, .rport = dport};
    account(&k, DIR_TX, f.len);
    return 0;
}

/* netif_receive_skb(skb): MAC header already pulled; add it back so bytes match rx_bytes. */
int steplens_nf_rx(PKT_ARGS) {
    struct skb_fields f = {};
    if (read_skb(PKT_ARG(0), &f)) return 0;
    if (!f.dev || !dev_wanted(f.dev)) return 0;
    u32 saddr, daddr; u16 sport, dport;
    if (parse(&f, &saddr, &daddr, &sport, &dport)) return 0;
    u64 wire = f.len;
    unsigned char *mac = f.head + f.mh;
    if (f.mh != 0xffff && f.data >= mac && f.data - mac <= 64) wire += f.data - mac;
    struct conn_key k = {.laddr = daddr, .raddr = saddr, .lport = dport, .rport = sport};
    account(&k, DIR_RX, wire);
    return 0;
}

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
#if BTF_TP
    if (sock_key_btf(sk, &k)) return;
#else
    if (sock_key(sk, &k)) return;
#endif
    u64 now = bpf_ktime_get_ns();
    struct conn_val *v = get_conn(&k, now);
    if (!v) return;
    count(CNT_SOCK_EVENTS, 1);
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

int steplens_nf_snd(PKT_ARGS) { payload(PKT_ARG(0), (int)(u64)PKT_ARG(1), (int)(u64)PKT_ARG(2), DIR_TX); return 0; }
int steplens_nf_rcv(PKT_ARGS) { payload(PKT_ARG(0), (int)(u64)PKT_ARG(1), (int)(u64)PKT_ARG(2), DIR_RX); return 0; }

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
