// steplens `gpuprobes` source: uprobes on NCCL API entry points and CUDA kernel-launch functions.
// Rendered by steplens.agent.sources.gpuprobes.render_program(); placeholders are double-brace names.
// x86-64 SysV: arguments 1-6 in registers (PT_REGS_PARM1..6); at function entry SP points at the return
// address, so the 7th integer argument is at SP+8 and the 8th at SP+16 (read from user memory).
#include <uapi/linux/ptrace.h>

struct call {
    u64 ts_ns;        // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 pid;          // tgid
    u32 tid;
    u32 op;           // index into gpuprobes.OPS
    s32 datatype;     // ncclDataType_t, -1 when the op has none
    s32 peer;         // peer (send/recv), root (broadcast/reduce), rank (comm init), -1 otherwise
    s32 redop;        // ncclRedOp_t, -1 when the op has none; nranks for comm init
    u64 count;        // elements
    u64 comm;         // ncclComm_t (for comm init: the ncclComm_t* out-pointer)
    u64 stream;       // cudaStream_t
};

struct okey {
    u32 pid;
    u32 op;
};

struct ocount {
    u64 calls;
    u64 elements;
};

BPF_HASH(watched, u32, u8, {{MAX_PROCESSES}});
BPF_HASH(counts, struct okey, struct ocount, {{MAX_COUNTERS}});
BPF_ARRAY(emit, u32, 1);
BPF_PERCPU_ARRAY(overflow, u64, 2);   // [0] failed counter inserts, [1] ring buffer full
BPF_RINGBUF_OUTPUT(calls, {{RINGBUF_PAGES}});

static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    // n-th integer argument (n >= 7) of a function at its first instruction.
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}

static __always_inline int record(struct pt_regs *ctx, u32 op, u64 count, s32 dtype, s32 peer, s32 redop,
                                  u64 comm, u64 stream) {
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    if (!watched.lookup(&pid))
        return 0;
    struct okey k = {.pid = pid, .op = op};
    struct ocount *c = counts.lookup(&k);
    if (c) {
        __sync_fetch_and_add(&c->calls, 1);
        __sync_fetch_and_add(&c->elements, count);
    } else {
        struct ocount init = {.calls = 1, .elements = count};
        if (counts.insert(&k, &init) != 0) {
            c = counts.lookup(&k);  // another CPU inserted it first
            if (c) {
                __sync_fetch_and_add(&c->calls, 1);
                __sync_fetch_and_add(&c->elements, count);
            } else {
                int i = 0;
                u64 *n = overflow.lookup(&i);
                if (n)
                    (*n)++;
            }
        }
    }
    int zero = 0;
    u32 *on = emit.lookup(&zero);
    if (!on || !*on || op >= {{FIRST_LAUNCH_OP}})  // kernel launches are only counted
        return 0;
    struct call *e = calls.ringbuf_reserve(sizeof(struct call));
    if (!e) {
        int i = 1;
        u64 *n = overflow.lookup(&i);
        if (n)
            (*n)++;
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->pid = pid;
    e->tid = (u32)id;
    e->op = op;
    e->datatype = dtype;
    e->peer = peer;
    e->redop = redop;
    e->count = count;
    e->comm = comm;
    e->stream = stream;
    calls.ringbuf_submit(e, 0);
    return 0;
}

// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
int steplens_nar(struct pt_regs *ctx) {
    return record(ctx, {{OP_ALLREDUCE}}, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1, PT_REGS_PARM5(ctx),
                  PT_REGS_PARM6(ctx), stack_arg(ctx, 7));
}

// ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
int steplens_nbc(struct pt_regs *ctx) {
    return record(ctx, {{OP_BROADCAST}}, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), -1,
                  PT_REGS_PARM6(ctx), stack_arg(ctx, 7));
}

// ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)
int steplens_nrd(struct pt_regs *ctx) {
    return record(ctx, {{OP_REDUCE}}, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM6(ctx),
                  PT_REGS_PARM5(ctx), stack_arg(ctx, 7), stack_arg(ctx, 8));
}

// ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
int steplens_nag(struct pt_regs *ctx) {
    return record(ctx, {{OP_ALLGATHER}}, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1, -1, PT_REGS_PARM5(ctx),
                  PT_REGS_PARM6(ctx));
}

// ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
int steplens_nrs(struct pt_regs *ctx) {
    return record(ctx, {{OP_REDUCESCATTER}}, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1, PT_REGS_PARM5(ctx),
                  PT_REGS_PARM6(ctx), stack_arg(ctx, 7));
}

// ncclSend(sendbuff, count, datatype, peer, comm, stream)
int steplens_nsd(struct pt_regs *ctx) {
    return record(ctx, {{OP_SEND}}, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                  PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

// ncclRecv(recvbuff, count, datatype, peer, comm, stream)
int steplens_nrv(struct pt_regs *ctx) {
    return record(ctx, {{OP_RECV}}, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                  PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

// ncclGroupStart(void), ncclGroupEnd(void): grouped operations are launched at ncclGroupEnd.
int steplens_ngs(struct pt_regs *ctx) {
    return record(ctx, {{OP_GROUPSTART}}, 0, -1, -1, -1, 0, 0);
}

int steplens_nge(struct pt_regs *ctx) {
    return record(ctx, {{OP_GROUPEND}}, 0, -1, -1, -1, 0, 0);
}

// ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank): the 128-byte commId is
// passed in memory, so rank is the third register argument. ncclCommInitRankConfig adds a config pointer after.
int steplens_nci(struct pt_regs *ctx) {
    return record(ctx, {{OP_COMMINITRANK}}, 0, -1, PT_REGS_PARM3(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx), 0);
}

// cudaLaunchKernel(func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream)
int steplens_cdl(struct pt_regs *ctx) {
    return record(ctx, {{OP_CUDALAUNCHKERNEL}}, 0, -1, -1, -1, 0, 0);
}

// cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sharedMem, hStream, params, extra)
int steplens_cul(struct pt_regs *ctx) {
    return record(ctx, {{OP_CULAUNCHKERNEL}}, 0, -1, -1, -1, 0, 0);
}
