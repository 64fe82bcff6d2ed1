// steplens `sched` source: per-thread on-CPU, off-CPU and run-queue time of workload threads.
// Rendered by steplens.agent.sources.sched.render_program(); placeholders are double-brace names.
// Kernel struct fields are read at offsets taken from the running kernel's BTF, never from headers.
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf.h>

#define TASK_PID_OFF {{TASK_PID_OFF}}
#define TASK_TGID_OFF {{TASK_TGID_OFF}}
#define TASK_STATE_OFF {{TASK_STATE_OFF}}
#define PREV_STATE_IS_ARG {{PREV_STATE_IS_ARG}}

struct tstat {
    u64 on_cpu_ns;
    u64 off_cpu_ns;
    u64 runq_ns;
    u64 switches;
    u64 involuntary;
    u64 last_in_ns;    // switched in at (0: not on CPU, or not seen yet)
    u64 last_out_ns;   // switched out at (0: not seen yet)
    u64 enqueued_ns;   // runnable since (woken, or preempted); 0: not waiting
    u32 tgid;
    s32 off_stack;     // user stack id taken at switch-out (deep mode), -1 none
};

struct skey {
    u32 tid;
    s32 stack_id;
};

BPF_HASH(watched, u32, u8, {{MAX_PROCESSES}});
BPF_HASH(stats, u32, struct tstat, {{MAX_THREADS}});
BPF_ARRAY(deep, u32, 1);
BPF_PERCPU_ARRAY(overflow, u64, 1);
BPF_STACK_TRACE(stacks, {{STACK_ENTRIES}});
BPF_HASH(offstacks, struct skey, u64, {{MAX_OFFCPU_STACKS}});

static __always_inline void count_overflow(void) {
    int zero = 0;
    u64 *n = overflow.lookup(&zero);
    if (n)
        (*n)++;
}

static __always_inline struct tstat *thread(u32 tid, u32 tgid) {
    struct tstat *s = stats.lookup(&tid);
    if (s)
        return s;
    struct tstat init = {};
    init.tgid = tgid;
    init.off_stack = -1;
    if (stats.insert(&tid, &init) != 0) {
        count_overflow();
        return 0;
    }
    return stats.lookup(&tid);
}

static __always_inline int task_ids(u64 task, u32 *tid, u32 *tgid) {
    if (bpf_probe_read_kernel(tid, sizeof(*tid), (void *)(task + TASK_PID_OFF)) != 0)
        return -1;
    return bpf_probe_read_kernel(tgid, sizeof(*tgid), (void *)(task + TASK_TGID_OFF));
}

// sched_switch: TP_PROTO(bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state)
int steplens_sw(struct bpf_raw_tracepoint_args *ctx) {
    u64 now = bpf_ktime_get_ns();
    u64 preempt = ctx->args[0];
    u64 prev = ctx->args[1];
    u64 next = ctx->args[2];
    u32 prev_state;
#if PREV_STATE_IS_ARG
    prev_state = (u32)ctx->args[3];
#else
    bpf_probe_read_kernel(&prev_state, sizeof(prev_state), (void *)(prev + TASK_STATE_OFF));
#endif
    u32 tid, tgid;

    // prev is the current task: its ids come cheaper from the helper.
    u64 id = bpf_get_current_pid_tgid();
    tid = (u32)id;
    tgid = id >> 32;
    if (tid != 0 && watched.lookup(&tgid)) {
        struct tstat *s = thread(tid, tgid);
        if (s) {
            if (s->last_in_ns)
                s->on_cpu_ns += now - s->last_in_ns;
            s->last_in_ns = 0;
            s->last_out_ns = now;
            s->switches++;
            // The kernel's own nivcsw rule: preempted, or still TASK_RUNNING (stays on the run queue).
            if (preempt || prev_state == 0) {
                s->involuntary++;
                s->enqueued_ns = now;
            }
            s->off_stack = -1;
            int zero = 0;
            u32 *d = deep.lookup(&zero);
            if (d && *d) {
                int sid = stacks.get_stackid(ctx, BPF_F_USER_STACK);
                if (sid == -12 || sid == -17)  // -ENOMEM, -EEXIST: the stack map is full
                    count_overflow();
                s->off_stack = sid;
            }
        }
    }

    if (task_ids(next, &tid, &tgid) != 0 || tid == 0)
        return 0;
    if (!watched.lookup(&tgid))
        return 0;
    struct tstat *n = thread(tid, tgid);
    if (!n)
        return 0;
    if (n->last_out_ns) {
        u64 off = now - n->last_out_ns;
        n->off_cpu_ns += off;
        if (n->off_stack >= 0) {
            struct skey k = {.tid = tid, .stack_id = n->off_stack};
            u64 *v = offstacks.lookup(&k);
            if (v) {
                __sync_fetch_and_add(v, off);
            } else if (offstacks.insert(&k, &off) != 0) {
                count_overflow();
            }
        }
    }
    if (n->enqueued_ns) {
        n->runq_ns += now - n->enqueued_ns;
        n->enqueued_ns = 0;
    }
    n->last_in_ns = now;
    n->last_out_ns = 0;
    n->off_stack = -1;
    return 0;
}

static __always_inline int woken(u64 task) {
    u32 tid, tgid;
    if (task_ids(task, &tid, &tgid) != 0 || tid == 0)
        return 0;
    if (!watched.lookup(&tgid))
        return 0;
    struct tstat *s = thread(tid, tgid);
    if (s && s->enqueued_ns == 0)
        s->enqueued_ns = bpf_ktime_get_ns();
    return 0;
}

// sched_wakeup / sched_wakeup_new: TP_PROTO(struct task_struct *p)
int steplens_wk(struct bpf_raw_tracepoint_args *ctx) {
    return woken(ctx->args[0]);
}

int steplens_wkn(struct bpf_raw_tracepoint_args *ctx) {
    return woken(ctx->args[0]);
}
