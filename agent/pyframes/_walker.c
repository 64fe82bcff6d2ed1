/* The sampler's inner loop in C: one sample of a CPython process read from outside, the same walk as
 * reader.PythonProcess._sample_once (interpreters -> thread states -> frames, with the /proc scheduler
 * state of each thread), but with no Python work per read or per frame.
 *
 * It is generic over CPython versions: reader.py hands it the offsets of the target's layout
 * (layouts/, the same tables the Python walk uses) and keeps everything that needs Python objects:
 * code objects, line tables, validation of what a frame names, caches of decoded frames. What it
 * returns per thread is the raw frame records (code address, instruction), innermost first, and how
 * many of the bottom records are the same as in that thread's last walk, so the caller decodes only
 * the changed top. Memory is read with pread on the /proc/PID/mem descriptor the caller opened, in
 * 4 KiB blocks read at most once per sample.
 *
 * Consistency: nothing of a sample is kept (last records, last thread-state bytes, scheduler states
 * compared next time) until the whole sample succeeded; a failed read or a structure that does not
 * hold together returns an error tuple and the caller retries, as the Python walk does.
 * The GIL is released during the walk; it is taken back only to map a thread id through the caller's
 * resolver (a target in another PID namespace).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096
#define NBLOCKS 256          /* blocks cached per sample; past that, reads go straight to the fd */
#define MAX_DEPTH 4096
#define MAX_THREADS 20000
#define MAX_INTERPS 64
#define RECSIZE 16           /* a frame record: code address (u64), instruction (i64) */

enum { ERR_READ = 1, ERR_TORN = 2 };

/* ---- u64 -> index map (open addressing; rebuilt, never deleted from) ------------------------- */
typedef struct { uint64_t *keys; int32_t *vals; size_t cap; size_t n; } Map;

static size_t map_slot(const Map *m, uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 17) & (m->cap - 1);
}

static int map_get(const Map *m, uint64_t key) {
    if (!m->cap) return -1;
    for (size_t i = map_slot(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) return m->vals[i];
        if (m->keys[i] == 0) return -1;
    }
}

static int map_put(Map *m, uint64_t key, int32_t val);

static int map_grow(Map *m, size_t cap) {
    Map n = {calloc(cap, sizeof(uint64_t)), calloc(cap, sizeof(int32_t)), cap, 0};
    if (!n.keys || !n.vals) { free(n.keys); free(n.vals); return -1; }
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i]) map_put(&n, m->keys[i], m->vals[i]);
    free(m->keys); free(m->vals);
    *m = n;
    return 0;
}

static int map_put(Map *m, uint64_t key, int32_t val) {   /* key != 0 */
    if ((m->n + 1) * 2 > m->cap && map_grow(m, m->cap ? m->cap * 2 : 64) < 0) return -1;
    for (size_t i = map_slot(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) { m->vals[i] = val; return 0; }
        if (m->keys[i] == 0) { m->keys[i] = key; m->vals[i] = val; m->n++; return 0; }
    }
}

static void map_clear(Map *m) {
    if (m->cap) { memset(m->keys, 0, m->cap * sizeof(uint64_t)); }
    m->n = 0;
}

static void map_free(Map *m) { free(m->keys); free(m->vals); m->keys = NULL; m->vals = NULL; m->cap = m->n = 0; }

/* ---- (code, instruction) -> decoded Frame or None ----------------------------------------------- */
typedef struct { uint64_t *a; int64_t *b; PyObject **v; size_t cap, n; } Memo;

static size_t memo_slot(const Memo *m, uint64_t a, int64_t b) {
    uint64_t h = (a ^ ((uint64_t)b * 0xC2B2AE3D27D4EB4FULL)) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 17) & (m->cap - 1);
}

static PyObject *memo_get(const Memo *m, uint64_t a, int64_t b) {   /* borrowed */
    if (!m->cap) return NULL;
    for (size_t i = memo_slot(m, a, b);; i = (i + 1) & (m->cap - 1)) {
        if (!m->v[i]) return NULL;
        if (m->a[i] == a && m->b[i] == b) return m->v[i];
    }
}

static void memo_clear(Memo *m) {   /* with the GIL */
    for (size_t i = 0; i < m->cap; i++) Py_CLEAR(m->v[i]);
    m->n = 0;
}

static int memo_put(Memo *m, uint64_t a, int64_t b, PyObject *v) {   /* takes a new reference to v */
    if ((m->n + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 256;
        Memo n = {calloc(cap, 8), calloc(cap, 8), calloc(cap, sizeof(PyObject *)), cap, 0};
        if (!n.a || !n.b || !n.v) { free(n.a); free(n.b); free(n.v); return -1; }
        for (size_t i = 0; i < m->cap; i++)
            if (m->v[i]) {
                size_t j = memo_slot(&n, m->a[i], m->b[i]);
                while (n.v[j]) j = (j + 1) & (cap - 1);
                n.a[j] = m->a[i]; n.b[j] = m->b[i]; n.v[j] = m->v[i]; n.n++;
            }
        free(m->a); free(m->b); free(m->v);
        *m = n;
    }
    size_t i = memo_slot(m, a, b);
    while (m->v[i]) i = (i + 1) & (m->cap - 1);
    m->a[i] = a; m->b[i] = b; m->v[i] = Py_NewRef(v); m->n++;
    return 0;
}

/* ---- per thread state and per task (scheduler state) ---------------------------------------- */
typedef struct {
    uint64_t addr;
    int seen;                    /* seen in the sample being taken */
    int has_last;
    unsigned char *raw, *last_raw;   /* this sample's and the last good sample's thread-state bytes */
    unsigned char *rec, *last_rec;   /* frame records, innermost first */
    PyObject **fr, **last_fr;        /* per record its Frame or None (decoded); fr is all NULL between samples */
    Py_ssize_t nrec, nlast, cap, lastcap;
    PyObject *thread, *frames;       /* this sample's ThreadStack and frame list (until commit) */
    PyObject *last_thread, *last_frames, *last_name, *pend_name;
    uint64_t last_tid, pend_tid; int last_gil, pend_gil; char last_state, pend_state;
    /* this sample's result, handed to Python at the end */
    uint64_t tid, pthread;
    int interp_idx, gil, reuse;
    Py_ssize_t same;
    int task;                    /* index into tasks, -1 */
    char state;
    uint64_t span_lo, span_hi;   /* the blocks the last walk read (one pread when they lie close) */
} TState;

typedef struct {
    uint64_t tid;
    int seen;
    int stat_fd, ss_fd;
    char state;                  /* 0 until read; '?' unknown */
    double state_at, name_at;
    PyObject *name;              /* str */
    char comm[64]; Py_ssize_t comm_len; int comm_new;
    unsigned char ss[96]; int ss_len;           /* -1: none */
    unsigned char ss_pend[96]; int ss_pend_len; int ss_pend_set;
    char state_pend; double state_at_pend, name_at_pend; int pend;
    int quiet;
} Task;

typedef struct {
    PyObject_HEAD
    int fd;
    char task_prefix[256];
    uint64_t runtime;
    /* layout */
    long rt_interp_head, gil_mode, gil_last_holder, gil_locked, interp_ceval_gil, interp_next, interp_tstate_head;
    long ts_next, ts_interp, ts_thread_id, ts_native_tid, ts_size, ts_frame, ts_cframe, cf_current;
    long fr_kind, fr_back, fr_code, fr_lasti, fr_instr, fr_owner, fr_size, code_adaptive, lasti_mult;
    uint64_t tag_mask;
    int want_states;
    double refresh, revalidate, fresh_at;   /* a fresh sample every `revalidate` s (code objects re-checked) */
    long tid_off;                /* 3.9/3.10: offset of tid in glibc's struct pthread, -1 unknown */
    PyObject *resolver;          /* target tid -> host tid (other PID namespace), or None */
    PyObject *decode;            /* (code, instruction) -> Frame or None; raises for a torn read */
    PyObject *thread_type;       /* ThreadStack(tid, thread_id, name, gil, state, frames) */
    PyObject *states[128];       /* scheduler state letter -> its name */
    PyObject *empty;             /* "" */
    Memo memo;
    /* per-sample block cache */
    uint64_t blk_addr[NBLOCKS];
    unsigned char *blk_data;
    int nblk;
    Map blk_map;
    unsigned char scratch[3 * BLOCK];
    /* threads and tasks */
    TState *ts; Py_ssize_t nts, capts; Map ts_map;
    Task *tasks; Py_ssize_t ntasks, captasks; Map task_map;
    Map ns_map;                  /* target tid -> host tid + 1 (cached resolver answers) */
    uint64_t *order; Py_ssize_t nord, capord;   /* this sample's threads, in list order */
    uint64_t gil_k[8], gil_v[8]; int ngil;     /* interpreter -> its GIL (3.12+: fixed once created) */
    /* error of the sample being taken */
    int err, err_errno; uint64_t err_addr; const char *why;
    PyThreadState *saved;
    int busy;                    /* a sample is being taken (the GIL is released meanwhile) */
    /* counters */
    unsigned long long reads, samples;
} Walker;

/* ---- memory ---------------------------------------------------------------------------------- */
static int fail_read(Walker *w, uint64_t addr, int e) {
    if (!w->err) { w->err = ERR_READ; w->err_errno = e; w->err_addr = addr; }
    return -1;
}

static int torn(Walker *w, const char *why) {
    if (!w->err) { w->err = ERR_TORN; w->why = why; }
    return -1;
}

static const unsigned char *block(Walker *w, uint64_t b) {
    int i = map_get(&w->blk_map, b);
    if (i >= 0) return w->blk_data + (size_t)i * BLOCK;
    unsigned char *dst = w->nblk < NBLOCKS ? w->blk_data + (size_t)w->nblk * BLOCK : w->scratch + 2 * BLOCK;
    w->reads++;
    ssize_t got = pread(w->fd, dst, BLOCK, (off_t)b);
    if (got != BLOCK) {
        /* a block that ends past the mapping: read what is there (pread stops at the first bad page) */
        fail_read(w, b, got < 0 ? errno : EIO);
        return NULL;
    }
    if (w->nblk < NBLOCKS) {
        if (map_put(&w->blk_map, b, w->nblk) < 0) { fail_read(w, b, ENOMEM); return NULL; }
        w->blk_addr[w->nblk++] = b;
    }
    return dst;
}

/* Read the uncached blocks of [lo, hi) (block addresses) in one pread when there are at most 4 of them
 * and they are all uncached; a failure is not an error (the walk reads what it needs block by block). */
static void prefetch(Walker *w, uint64_t lo, uint64_t hi) {
    if (hi <= lo || hi - lo > 4 * BLOCK || w->nblk + 4 > NBLOCKS) return;
    for (uint64_t b = lo; b < hi; b += BLOCK) if (map_get(&w->blk_map, b) >= 0) return;
    size_t n = (size_t)(hi - lo);
    unsigned char *dst = w->blk_data + (size_t)w->nblk * BLOCK;
    w->reads++;
    if (pread(w->fd, dst, n, (off_t)lo) != (ssize_t)n) return;
    for (uint64_t b = lo; b < hi; b += BLOCK) {
        if (map_put(&w->blk_map, b, w->nblk) < 0) return;
        w->blk_addr[w->nblk++] = b;
    }
}

/* A pointer to `len` (<= 2 * BLOCK) bytes at addr, valid until the next call. */
static const unsigned char *rd(Walker *w, uint64_t addr, size_t len) {
    uint64_t b = addr & ~(uint64_t)(BLOCK - 1);
    size_t o = (size_t)(addr - b);
    if (addr + len < addr) { fail_read(w, addr, EFAULT); return NULL; }
    if (o + len <= BLOCK) {
        const unsigned char *p = block(w, b);
        return p ? p + o : NULL;
    }
    if (len > 2 * BLOCK) { fail_read(w, addr, EINVAL); return NULL; }
    /* crosses into the next block(s): gather into scratch (blocks may be uncached, so copy each) */
    unsigned char tmp[2 * BLOCK];
    size_t done = 0;
    while (done < len) {
        uint64_t a = addr + done, bb = a & ~(uint64_t)(BLOCK - 1);
        size_t oo = (size_t)(a - bb), n = BLOCK - oo;
        if (n > len - done) n = len - done;
        const unsigned char *p = block(w, bb);
        if (!p) return NULL;
        memcpy(tmp + done, p + oo, n);
        done += n;
    }
    memcpy(w->scratch, tmp, len);
    return w->scratch;
}

static inline uint64_t u64at(const unsigned char *p, long off) { uint64_t v; memcpy(&v, p + off, 8); return v; }
static inline int32_t i32at(const unsigned char *p, long off) { int32_t v; memcpy(&v, p + off, 4); return v; }

static int rd_u64(Walker *w, uint64_t addr, uint64_t *out) {
    const unsigned char *p = rd(w, addr, 8);
    if (!p) return -1;
    *out = u64at(p, 0);
    return 0;
}

/* ---- /proc scheduler state (reader.PythonProcess._task) -------------------------------------- */
static ssize_t read_file(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, cap);
    close(fd);
    return n;
}

static void task_close(Task *t) {
    if (t->stat_fd >= 0) close(t->stat_fd);
    if (t->ss_fd >= 0) close(t->ss_fd);
    t->stat_fd = t->ss_fd = -1;
}

static int read_comm(Walker *w, uint64_t tid, Task *t) {
    char path[320];
    snprintf(path, sizeof path, "%s%llu/comm", w->task_prefix, (unsigned long long)tid);
    ssize_t n = read_file(path, t->comm, sizeof t->comm);
    if (n < 0) return -1;
    while (n > 0 && (t->comm[n - 1] == '\n' || t->comm[n - 1] == ' ' || t->comm[n - 1] == '\0')) n--;
    t->comm_len = n;
    t->comm_new = 1;
    return 0;
}

/* The task's state for this sample; fills t->state/quiet. Pending changes are committed at the end. */
static void task_state(Walker *w, Task *t, double now) {
    t->quiet = 0;
    t->pend = 1;
    t->state_pend = t->state;
    t->state_at_pend = t->state_at;
    t->name_at_pend = t->name_at;
    t->ss_pend_set = 0;
    if (now - t->state_at < w->refresh) return;
    char path[320];
    if (t->state != 'R') {
        if (t->ss_fd < 0) {
            snprintf(path, sizeof path, "%s%llu/schedstat", w->task_prefix, (unsigned long long)t->tid);
            t->ss_fd = open(path, O_RDONLY | O_CLOEXEC);
        }
        ssize_t n = t->ss_fd >= 0 ? pread(t->ss_fd, t->ss_pend, sizeof t->ss_pend, 0) : -1;
        if (n <= 0) {
            if (t->ss_fd >= 0) { close(t->ss_fd); t->ss_fd = -1; }
            n = -1;
        }
        if (n > 0 && n == t->ss_len && !memcmp(t->ss_pend, t->ss, (size_t)n)) {
            t->state_at_pend = now;
            t->quiet = 1;
            return;
        }
        t->ss_pend_len = (int)n;
        t->ss_pend_set = 1;
    }
    char stat[512];
    ssize_t n = pread(t->stat_fd, stat, sizeof stat, 0);
    if (n <= 0) goto gone;
    if (now - t->name_at > 5.0) {
        t->name_at_pend = now;
        if (read_comm(w, t->tid, t) < 0) goto gone;
    }
    char *close_paren = NULL;
    for (ssize_t i = n - 1; i >= 0; i--) if (stat[i] == ')') { close_paren = stat + i; break; }
    if (!close_paren || close_paren + 2 >= stat + n) goto gone;
    t->state_pend = close_paren[2];
    t->state_at_pend = now;
    if (t->state_pend == 'R') { t->ss_pend_len = -1; t->ss_pend_set = 1; }
    return;
gone:
    t->state_pend = '?';     /* forgotten at commit: the thread is gone or unreadable */
    t->quiet = 0;
}

static int task_for(Walker *w, uint64_t tid, double now) {
    int i = map_get(&w->task_map, tid);
    if (i < 0) {
        char path[320];
        snprintf(path, sizeof path, "%s%llu/stat", w->task_prefix, (unsigned long long)tid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return -1;
        if (w->ntasks == w->captasks) {
            Py_ssize_t cap = w->captasks ? w->captasks * 2 : 16;
            Task *n = realloc(w->tasks, (size_t)cap * sizeof(Task));
            if (!n) { close(fd); return -1; }
            w->tasks = n; w->captasks = cap;
        }
        Task *t = &w->tasks[w->ntasks];
        memset(t, 0, sizeof *t);
        t->tid = tid; t->stat_fd = fd; t->ss_fd = -1; t->ss_len = -1; t->state_at = -1e18; t->name_at = now;
        if (read_comm(w, tid, t) < 0) { close(fd); return -1; }
        if (map_put(&w->task_map, tid, (int32_t)w->ntasks) < 0) { close(fd); return -1; }
        i = (int)w->ntasks++;
    }
    Task *t = &w->tasks[i];
    t->seen = 1;
    task_state(w, t, now);
    return i;
}

/* ---- thread states ---------------------------------------------------------------------------- */
static int tstate_for(Walker *w, uint64_t addr) {
    int i = map_get(&w->ts_map, addr);
    if (i >= 0) return i;
    if (w->nts == w->capts) {
        Py_ssize_t cap = w->capts ? w->capts * 2 : 16;
        TState *n = realloc(w->ts, (size_t)cap * sizeof(TState));
        if (!n) return -1;
        w->ts = n; w->capts = cap;
    }
    TState *t = &w->ts[w->nts];
    memset(t, 0, sizeof *t);
    t->addr = addr;
    t->raw = malloc((size_t)w->ts_size);
    t->last_raw = malloc((size_t)w->ts_size);
    if (!t->raw || !t->last_raw) { free(t->raw); free(t->last_raw); return -1; }
    if (map_put(&w->ts_map, addr, (int32_t)w->nts) < 0) { free(t->raw); free(t->last_raw); return -1; }
    return (int)w->nts++;
}

static int push_rec(TState *t, uint64_t code, int64_t value) {
    if (t->nrec == t->cap) {
        Py_ssize_t cap = t->cap ? t->cap * 2 : 32;
        unsigned char *n = realloc(t->rec, (size_t)cap * RECSIZE);
        if (!n) return -1;
        t->rec = n;
        PyObject **f = realloc(t->fr, (size_t)cap * sizeof(PyObject *));
        if (!f) return -1;
        memset(f + t->cap, 0, (size_t)(cap - t->cap) * sizeof(PyObject *));   /* plain memory: no GIL needed */
        t->fr = f; t->cap = cap;
    }
    memcpy(t->rec + t->nrec * RECSIZE, &code, 8);
    memcpy(t->rec + t->nrec * RECSIZE + 8, &value, 8);
    t->nrec++;
    return 0;
}

/* The frame records of one thread from `frame` down, innermost first. */
static int walk(Walker *w, TState *t, uint64_t frame) {
    t->nrec = 0;
    if (t->span_hi) prefetch(w, t->span_lo, t->span_hi);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int depth = 0; frame; depth++) {
        if (depth >= MAX_DEPTH) return torn(w, "frame chain loops or is too deep");
        uint64_t b = frame & ~(uint64_t)(BLOCK - 1);
        if (b < lo) lo = b;
        if (b + BLOCK > hi) hi = b + BLOCK;
        const unsigned char *f = rd(w, frame, (size_t)w->fr_size);
        if (!f) return -1;
        uint64_t back = u64at(f, w->fr_back);
        if (w->fr_kind == 0) {   /* PyFrameObject (3.9/3.10): f_lasti in instructions or bytes */
            uint64_t code = u64at(f, w->fr_code);
            int64_t byte_off = (int64_t)i32at(f, w->fr_lasti) * w->lasti_mult;
            if (push_rec(t, code, byte_off) < 0) return torn(w, "out of memory");
        } else if (f[w->fr_owner] < 3) {   /* _PyInterpreterFrame; owner >= 3: a C-stack shim (3.12+) */
            uint64_t code = u64at(f, w->fr_code) & ~w->tag_mask;
            uint64_t instr = u64at(f, w->fr_instr);
            int64_t units = (int64_t)(instr - code - (uint64_t)w->code_adaptive) >> 1;
            if (push_rec(t, code, units) < 0) return torn(w, "out of memory");
        }
        frame = back;
    }
    t->span_lo = lo;
    t->span_hi = hi > lo && hi - lo <= 4 * BLOCK && hi - lo > BLOCK ? hi : 0;
    return 0;
}

/* The host tid of a target tid (another PID namespace: the resolver's answer, kept). stale: the kept answer
 * names no task of the target any more (that thread ended; its namespace tid may now name a new thread): the
 * resolver is told so and asked again. */
static uint64_t host_tid(Walker *w, uint64_t tid, int stale) {
    if (w->resolver == Py_None || !tid) return tid;
    int v = stale ? 0 : map_get(&w->ns_map, tid);
    if (v > 0) return (uint64_t)v - 1;   /* stored as host tid + 1 */
    PyEval_RestoreThread(w->saved);
    uint64_t host = 0;
    PyObject *r = PyObject_CallFunction(w->resolver, "Ki", (unsigned long long)tid, stale);
    if (r) { host = PyLong_AsUnsignedLongLong(r); Py_DECREF(r); }
    if (PyErr_Occurred()) { PyErr_Clear(); host = 0; }
    w->saved = PyEval_SaveThread();
    map_put(&w->ns_map, tid, host && host < 0x7fffffff ? (int32_t)(host + 1) : 0);   /* 0: ask again */
    return host;
}

/* One sample; 0 or -1 with w->err set. The per-thread results are in w->ts[*] marked seen. */
static int sample(Walker *w, int fresh, double now) {
    w->nblk = 0;
    map_clear(&w->blk_map);
    for (Py_ssize_t i = 0; i < w->nts; i++) w->ts[i].seen = 0;
    w->nord = 0;
    for (Py_ssize_t i = 0; i < w->ntasks; i++) { w->tasks[i].seen = 0; w->tasks[i].pend = 0; }
    uint64_t interp;
    if (rd_u64(w, w->runtime + w->rt_interp_head, &interp) < 0) return -1;
    if (!interp) return torn(w, "no interpreter (starting up or finalizing)");
    uint64_t runtime_holder = 0;
    if (w->gil_mode == 0) {
        const unsigned char *p = rd(w, w->runtime + w->gil_locked, 4);
        if (!p) return -1;
        if (i32at(p, 0) && rd_u64(w, w->runtime + w->gil_last_holder, &runtime_holder) < 0) return -1;
    }
    uint64_t interps[MAX_INTERPS + 1];
    int ninterp = 0;
    Py_ssize_t nthreads = 0;
    while (interp) {
        for (int k = 0; k < ninterp; k++) if (interps[k] == interp) return torn(w, "interpreter list loops");
        if (ninterp > MAX_INTERPS) return torn(w, "interpreter list loops");
        interps[ninterp++] = interp;
        uint64_t next_interp, tstate, holder = 0;
        if (w->gil_mode == 1) {
            uint64_t gil = 0;
            int g = 0;
            while (g < w->ngil && w->gil_k[g] != interp) g++;
            if (g < w->ngil) {
                gil = w->gil_v[g];
            } else {
                if (rd_u64(w, interp + w->interp_ceval_gil, &gil) < 0) return -1;
                if (w->ngil < 8) { w->gil_k[w->ngil] = interp; w->gil_v[w->ngil++] = gil; }
            }
            if (gil > interp && gil + w->gil_locked + 8 - interp <= 3 * BLOCK)
                prefetch(w, interp & ~(uint64_t)(BLOCK - 1),
                         (gil + w->gil_locked + 8 + BLOCK - 1) & ~(uint64_t)(BLOCK - 1));
            if (gil) {
                const unsigned char *p = rd(w, gil + w->gil_locked, 4);
                if (!p) return -1;
                if (i32at(p, 0) && rd_u64(w, gil + w->gil_last_holder, &holder) < 0) return -1;
            }
        }
        if (rd_u64(w, interp + w->interp_next, &next_interp) < 0) return -1;
        if (rd_u64(w, interp + w->interp_tstate_head, &tstate) < 0) return -1;
        if (!holder) holder = runtime_holder;
        while (tstate) {
            if (++nthreads > MAX_THREADS) return torn(w, "thread list loops");
            int ti = tstate_for(w, tstate);
            if (ti < 0) return torn(w, "out of memory");
            TState *t = &w->ts[ti];
            if (t->seen) return torn(w, "thread list loops");
            t->seen = 1;
            if (w->nord == w->capord) {
                Py_ssize_t cap = w->capord ? w->capord * 2 : 16;
                uint64_t *n = realloc(w->order, (size_t)cap * sizeof(uint64_t));
                if (!n) return torn(w, "out of memory");
                w->order = n; w->capord = cap;
            }
            w->order[w->nord++] = tstate;
            const unsigned char *raw = rd(w, tstate, (size_t)w->ts_size);
            if (!raw) return -1;
            if (u64at(raw, w->ts_interp) != interp)
                return torn(w, "thread state does not point back to its interpreter");
            memcpy(t->raw, raw, (size_t)w->ts_size);
            t->interp_idx = ninterp - 1;
            t->gil = tstate == holder;
            t->pthread = u64at(t->raw, w->ts_thread_id);
            t->reuse = 0;
            t->same = 0;
            t->task = -1;
            t->state = '?';
            uint64_t tid = 0;
            if (w->ts_native_tid >= 0) {
                tid = u64at(t->raw, w->ts_native_tid) & 0xFFFFFFFFu;
            } else if (w->tid_off >= 0) {
                const unsigned char *p = rd(w, t->pthread + (uint64_t)w->tid_off, 4);
                if (p) tid = (uint32_t)i32at(p, 0);
                else w->err = 0;    /* as the Python walk: an unreadable pthread gives tid 0 */
            }
            uint64_t ns_tid = tid;
            tid = host_tid(w, tid, 0);
            int quiet = 0;
            if (w->want_states && tid) {
                t->task = task_for(w, tid, now);
                if (t->task < 0 && w->resolver != Py_None) {
                    uint64_t again = host_tid(w, ns_tid, 1);
                    if (again && again != tid) { tid = again; t->task = task_for(w, tid, now); }
                }
                if (t->task >= 0) {
                    Task *k = &w->tasks[t->task];
                    t->state = k->state_pend ? k->state_pend : '?';
                    quiet = k->quiet;
                }
            }
            t->tid = tid;
            if (quiet && !fresh && t->has_last && !memcmp(t->raw, t->last_raw, (size_t)w->ts_size)) {
                t->reuse = 1;
            } else {
                uint64_t frame;
                if (w->ts_cframe >= 0) {
                    /* the _PyCFrame is a local of the C function running the thread's Python code */
                    uint64_t cf = u64at(t->raw, w->ts_cframe);
                    frame = 0;
                    if (cf && rd_u64(w, cf + (uint64_t)w->cf_current, &frame) < 0) return -1;
                } else {
                    frame = u64at(t->raw, w->ts_frame);
                }
                if (walk(w, t, frame) < 0) return -1;
                if (!fresh && t->has_last) {
                    Py_ssize_t k = 0, a = t->nrec, b = t->nlast;
                    while (k < a && k < b && !memcmp(t->rec + (a - 1 - k) * RECSIZE,
                                                     t->last_rec + (b - 1 - k) * RECSIZE, RECSIZE))
                        k++;
                    t->same = k;
                    if (k == a && a == b) t->reuse = 2;   /* the same records as last time */
                }
            }
            tstate = u64at(t->raw, w->ts_next);
        }
        interp = next_interp;
    }
    return 0;
}

static void tstate_free(TState *t) {   /* with the GIL */
    for (Py_ssize_t i = 0; i < t->cap; i++) Py_XDECREF(t->fr[i]);
    for (Py_ssize_t i = 0; i < t->nlast; i++) Py_XDECREF(t->last_fr[i]);
    Py_XDECREF(t->thread); Py_XDECREF(t->frames);
    Py_XDECREF(t->last_thread); Py_XDECREF(t->last_frames); Py_XDECREF(t->last_name); Py_XDECREF(t->pend_name);
    free(t->raw); free(t->last_raw); free(t->rec); free(t->last_rec); free(t->fr); free(t->last_fr);
}

/* Undo what building a sample's objects did (a decode failed): fr back to all NULL. */
static void discard(Walker *w) {
    for (Py_ssize_t i = 0; i < w->nts; i++) {
        TState *t = &w->ts[i];
        for (Py_ssize_t k = 0; k < t->nrec && k < t->cap; k++) Py_CLEAR(t->fr[k]);
        Py_CLEAR(t->thread);
        Py_CLEAR(t->frames);
        Py_CLEAR(t->pend_name);
    }
}

/* Keep what the sample saw (only after a sample that succeeded, objects and all); drop threads and tasks
 * not seen. With the GIL. */
static void commit(Walker *w) {
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < w->ntasks; i++) {
        Task *t = &w->tasks[i];
        if (t->seen && t->pend && t->state_pend == '?') t->seen = 0;   /* gone: forget it */
        if (!t->seen) { task_close(t); Py_CLEAR(t->name); continue; }
        t->state = t->state_pend;
        t->state_at = t->state_at_pend;
        t->name_at = t->name_at_pend;
        if (t->ss_pend_set) {
            t->ss_len = t->ss_pend_len;
            if (t->ss_len > 0) memcpy(t->ss, t->ss_pend, (size_t)t->ss_len);
        }
        if (j != i) w->tasks[j] = *t;
        j++;
    }
    if (j != w->ntasks) {
        w->ntasks = j;
        map_clear(&w->task_map);
        for (Py_ssize_t i = 0; i < j; i++) map_put(&w->task_map, w->tasks[i].tid, (int32_t)i);
    }
    j = 0;
    for (Py_ssize_t i = 0; i < w->nts; i++) {
        TState *t = &w->ts[i];
        if (!t->seen) { tstate_free(t); continue; }
        unsigned char *x = t->raw; t->raw = t->last_raw; t->last_raw = x;
        if (!t->reuse) {   /* new records and their frames become the last ones */
            for (Py_ssize_t k = 0; k < t->nlast; k++) Py_CLEAR(t->last_fr[k]);
            unsigned char *r = t->rec; t->rec = t->last_rec; t->last_rec = r;
            PyObject **f = t->fr; t->fr = t->last_fr; t->last_fr = f;
            Py_ssize_t c = t->cap; t->cap = t->lastcap; t->lastcap = c;
            t->nlast = t->nrec;
        }
        if (t->thread) {
            Py_XSETREF(t->last_thread, t->thread);
            t->thread = NULL;
            Py_XSETREF(t->last_name, t->pend_name);
            t->pend_name = NULL;
            t->last_tid = t->pend_tid; t->last_gil = t->pend_gil; t->last_state = t->pend_state;
        }
        if (t->frames) { Py_XSETREF(t->last_frames, t->frames); t->frames = NULL; }
        t->has_last = 1;
        if (j != i) w->ts[j] = *t;
        j++;
    }
    if (j != w->nts) {
        w->nts = j;
        map_clear(&w->ts_map);
        for (Py_ssize_t i = 0; i < j; i++) map_put(&w->ts_map, w->ts[i].addr, (int32_t)i);
    }
}

/* This sample's ThreadStack of one thread (a new reference), built from the walk's records: a thread whose
 * stack and attributes are all as last time is the same object; records below `same` reuse their frames. */
static PyObject *thread_of(Walker *w, TState *t, double now) {
    PyObject *name = w->empty;
    if (t->task >= 0) {
        Task *k = &w->tasks[t->task];
        if (k->state_pend != '?') {
            if (k->comm_new || !k->name) {
                Py_XSETREF(k->name, PyUnicode_DecodeUTF8(k->comm, k->comm_len, "replace"));
                k->comm_new = 0;
                if (!k->name) return NULL;
            }
            name = k->name;
        }
    }
    if (t->reuse && t->last_thread && t->last_tid == t->tid && t->last_gil == t->gil && t->last_state == t->state
        && t->last_name == name)
        return Py_NewRef(t->last_thread);
    PyObject *frames;
    if (t->reuse) {
        frames = Py_NewRef(t->last_frames);
    } else {
        Py_ssize_t top = t->nrec - t->same, count = 0;
        for (Py_ssize_t i = 0; i < t->nrec; i++) {
            PyObject *f;
            if (i < top) {
                uint64_t code; int64_t value;
                memcpy(&code, t->rec + i * RECSIZE, 8);
                memcpy(&value, t->rec + i * RECSIZE + 8, 8);
                f = memo_get(&w->memo, code, value);
                if (f) {
                    Py_INCREF(f);
                } else {
                    f = PyObject_CallFunction(w->decode, "KLd", (unsigned long long)code, (long long)value, now);
                    if (!f) return NULL;
                    if (memo_put(&w->memo, code, value, f) < 0) { Py_DECREF(f); PyErr_NoMemory(); return NULL; }
                }
            } else {
                f = Py_NewRef(t->last_fr[t->nlast - t->same + (i - top)]);
            }
            t->fr[i] = f;
            count += f != Py_None;
        }
        frames = PyList_New(count);
        if (!frames) return NULL;
        for (Py_ssize_t i = 0, k = 0; i < t->nrec; i++)
            if (t->fr[i] != Py_None) PyList_SET_ITEM(frames, k++, Py_NewRef(t->fr[i]));
    }
    t->frames = frames;
    int c = (unsigned char)t->state < 128 ? t->state : '?';
    PyObject *thread = PyObject_CallFunction(w->thread_type, "KKOOOO", (unsigned long long)t->tid,
                                             (unsigned long long)t->pthread, name, t->gil ? Py_True : Py_False,
                                             w->states[c], frames);
    if (!thread) return NULL;
    t->thread = Py_NewRef(thread);
    Py_XSETREF(t->pend_name, Py_NewRef(name));   /* what last_thread was made of, from commit on */
    t->pend_tid = t->tid; t->pend_gil = t->gil; t->pend_state = t->state;
    return thread;
}

/* ---- Python type -------------------------------------------------------------------------------- */
static void Walker_dealloc(Walker *w) {
    for (Py_ssize_t i = 0; i < w->ntasks; i++) { task_close(&w->tasks[i]); Py_CLEAR(w->tasks[i].name); }
    for (Py_ssize_t i = 0; i < w->nts; i++) tstate_free(&w->ts[i]);
    memo_clear(&w->memo);
    free(w->memo.a); free(w->memo.b); free(w->memo.v);
    Py_XDECREF(w->decode); Py_XDECREF(w->thread_type); Py_XDECREF(w->empty);
    for (int i = 0; i < 128; i++) Py_XDECREF(w->states[i]);
    free(w->tasks); free(w->ts); free(w->blk_data); free(w->order);
    map_free(&w->blk_map); map_free(&w->ts_map); map_free(&w->task_map); map_free(&w->ns_map);
    Py_XDECREF(w->resolver);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Walker_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Walker *w = (Walker *)type->tp_alloc(type, 0);
    if (w) { w->fd = -1; w->tid_off = -1; }
    return (PyObject *)w;
}

static int Walker_init(Walker *w, PyObject *args, PyObject *kw) {
    const char *prefix;
    PyObject *layout, *resolver, *decode, *thread_type, *states;
    unsigned long long runtime;
    int want_states;
    double refresh, revalidate;
    if (w->blk_data) { PyErr_SetString(PyExc_RuntimeError, "Walker initialized twice"); return -1; }
    if (!PyArg_ParseTuple(args, "isKO!pddOOOO!", &w->fd, &prefix, &runtime, &PyTuple_Type, &layout, &want_states,
                          &refresh, &revalidate, &resolver, &decode, &thread_type, &PyDict_Type, &states))
        return -1;
    w->revalidate = revalidate;
    w->fresh_at = -1e18;
    if (!PyCallable_Check(decode) || !PyCallable_Check(thread_type)) {
        PyErr_SetString(PyExc_TypeError, "decode and thread_type must be callable");
        return -1;
    }
    PyObject *unknown = PyDict_GetItemString(states, "?");
    if (!unknown) { PyErr_SetString(PyExc_ValueError, "states: needs '?' (unknown)"); return -1; }
    for (int i = 0; i < 128; i++) {
        char c = (char)i;
        PyObject *key = PyUnicode_FromStringAndSize(&c, 1);
        if (!key) return -1;
        PyObject *v = PyDict_GetItemWithError(states, key);
        Py_DECREF(key);
        if (!v && PyErr_Occurred()) return -1;
        Py_XSETREF(w->states[i], Py_NewRef(v ? v : unknown));
    }
    if (!(w->empty = PyUnicode_FromStringAndSize("", 0))) return -1;
    w->decode = Py_NewRef(decode);
    w->thread_type = Py_NewRef(thread_type);
    long v[24];
    if (PyTuple_GET_SIZE(layout) != 24) { PyErr_SetString(PyExc_ValueError, "layout: 24 integers"); return -1; }
    for (int i = 0; i < 24; i++) {
        PyObject *o = PyTuple_GET_ITEM(layout, i);
        v[i] = o == Py_None ? -1 : PyLong_AsLong(o);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    if (strlen(prefix) >= sizeof w->task_prefix - 40) { PyErr_SetString(PyExc_ValueError, "path too long"); return -1; }
    strcpy(w->task_prefix, prefix);
    w->runtime = runtime;
    long *f[] = {&w->rt_interp_head, &w->gil_mode, &w->gil_last_holder, &w->gil_locked, &w->interp_ceval_gil,
                 &w->interp_next, &w->interp_tstate_head, &w->ts_next, &w->ts_interp, &w->ts_thread_id,
                 &w->ts_native_tid, &w->ts_size, &w->ts_frame, &w->ts_cframe, &w->cf_current, &w->fr_kind,
                 &w->fr_back, &w->fr_code, &w->fr_lasti, &w->fr_instr, &w->fr_owner, &w->fr_size,
                 &w->code_adaptive, &w->lasti_mult};
    for (int i = 0; i < 24; i++) *f[i] = v[i];
    w->tag_mask = 0;
    /* every field read out of a thread state or a frame must lie inside the bytes read of it (the offsets of
     * 3.13+ come from the target's own memory) */
#define IN(off, width, size) ((off) >= 0 && (off) + (width) <= (size))
#define OPT(off, width, size) ((off) < 0 || IN(off, width, size))
    if (w->ts_size <= 0 || w->ts_size > BLOCK || w->fr_size <= 0 || w->fr_size > BLOCK
        || !IN(w->ts_next, 8, w->ts_size) || !IN(w->ts_interp, 8, w->ts_size) || !IN(w->ts_thread_id, 8, w->ts_size)
        || !OPT(w->ts_native_tid, 8, w->ts_size) || !OPT(w->ts_frame, 8, w->ts_size)
        || !OPT(w->ts_cframe, 8, w->ts_size) || (w->ts_frame < 0 && w->ts_cframe < 0)
        || (w->ts_cframe >= 0 && w->cf_current < 0) || !IN(w->fr_back, 8, w->fr_size) || !IN(w->fr_code, 8, w->fr_size)
        || (w->fr_kind == 0 && (!IN(w->fr_lasti, 4, w->fr_size) || (w->lasti_mult != 1 && w->lasti_mult != 2)))
        || (w->fr_kind == 1 && (!IN(w->fr_instr, 8, w->fr_size) || !IN(w->fr_owner, 1, w->fr_size)
                                || w->code_adaptive < 0))
        || (w->fr_kind != 0 && w->fr_kind != 1) || (w->gil_mode != 0 && w->gil_mode != 1)
        || w->gil_locked < 0 || w->gil_last_holder < 0 || (w->gil_mode == 1 && w->interp_ceval_gil < 0)
        || w->rt_interp_head < 0 || w->interp_next < 0 || w->interp_tstate_head < 0) {
        PyErr_SetString(PyExc_ValueError, "layout: an offset outside what is read, or missing");
        return -1;
    }
    w->want_states = want_states;
    w->refresh = refresh;
    w->tid_off = -1;
    Py_INCREF(resolver);
    Py_XSETREF(w->resolver, resolver);
    if (!(w->blk_data = malloc((size_t)NBLOCKS * BLOCK))) { PyErr_NoMemory(); return -1; }
    return 0;
}

/* sample(fresh=False) -> (mono_ns, [ThreadStack, ...], threads of the first interpreter)
 *                or (1, errno, address) for a failed read, (2, why) for a torn structure.
 * fresh: forget the decoded frames and the last walks (then decode re-checks code objects); so is every
 * sample `revalidate` seconds after the last fresh one. decode gets (code, instruction, now). */
static PyObject *Walker_sample(Walker *w, PyObject *args) {
    int fresh = 0;
    if (!PyArg_ParseTuple(args, "|p", &fresh)) return NULL;
    if (w->busy || !w->blk_data || !w->decode) {
        PyErr_SetString(PyExc_RuntimeError, w->busy ? "Walker.sample called from two threads at once"
                                                    : "Walker not initialized");
        return NULL;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    long long mono = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now - w->fresh_at >= w->revalidate) fresh = 1;
    if (fresh || w->memo.n > 50000) memo_clear(&w->memo);
    w->busy = 1;
    w->err = 0;
    w->saved = PyEval_SaveThread();
    int rc = sample(w, fresh, now);
    PyEval_RestoreThread(w->saved);
    w->saved = NULL;
    if (rc < 0) {
        w->busy = 0;
        if (w->err == ERR_READ)
            return Py_BuildValue("(iiK)", ERR_READ, w->err_errno, (unsigned long long)w->err_addr);
        return Py_BuildValue("(is)", ERR_TORN, w->why ? w->why : "torn read");
    }
    PyObject *out = PyList_New(w->nord);
    Py_ssize_t first = 0;
    for (Py_ssize_t i = 0; out && i < w->nord; i++) {   /* in list order (ts[] keeps them by first sight) */
        TState *t = &w->ts[map_get(&w->ts_map, w->order[i])];
        first += t->interp_idx == 0;
        PyObject *thread = thread_of(w, t, now);   /* may call back into Python (decode) */
        if (!thread) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, thread);
    }
    if (!out) {
        discard(w);
        w->busy = 0;
        return NULL;
    }
    commit(w);
    if (fresh) w->fresh_at = now;
    w->busy = 0;
    w->samples++;
    return Py_BuildValue("(LNn)", mono, out, first);
}

static PyObject *Walker_set_tid_off(Walker *w, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    w->tid_off = v;
    Py_RETURN_NONE;
}

static PyObject *Walker_set_tag_mask(Walker *w, PyObject *arg) {
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    w->tag_mask = v;
    Py_RETURN_NONE;
}

static PyObject *Walker_stats(Walker *w, PyObject *Py_UNUSED(arg)) {
    PyObject *blocks = PyList_New(w->nblk);
    if (!blocks) return NULL;
    for (int i = 0; i < w->nblk; i++) PyList_SET_ITEM(blocks, i, PyLong_FromUnsignedLongLong(w->blk_addr[i]));
    return Py_BuildValue("{sKsKsnsnsN}", "reads", w->reads, "samples", w->samples, "threads", w->nts,
                         "tasks", w->ntasks, "blocks", blocks);
}

static PyMethodDef Walker_methods[] = {
    {"sample", (PyCFunction)Walker_sample, METH_VARARGS, "One sample (see the module's source)."},
    {"set_tid_off", (PyCFunction)Walker_set_tid_off, METH_O, "Where glibc's struct pthread keeps the tid."},
    {"set_tag_mask", (PyCFunction)Walker_set_tag_mask, METH_O, "Tag bits of a frame's code pointer (3.14)."},
    {"stats", (PyCFunction)Walker_stats, METH_NOARGS, "Counters: reads, samples, threads, tasks."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steplens.agent.pyframes._walker.Walker",
    .tp_basicsize = sizeof(Walker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Walker_new,
    .tp_init = (initproc)Walker_init,
    .tp_dealloc = (destructor)Walker_dealloc,
    .tp_methods = Walker_methods,
    .tp_doc = "The sampler's walk of one CPython process, in C (see reader.py).",
};

static struct PyModuleDef walker_module = {
    PyModuleDef_HEAD_INIT, "_walker", "The sampler's inner loop in C (see reader.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__walker(void) {
    if (PyType_Ready(&WalkerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&walker_module);
    if (!m) return NULL;
    Py_INCREF(&WalkerType);
    if (PyModule_AddObject(m, "Walker", (PyObject *)&WalkerType) < 0) {
        Py_DECREF(&WalkerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
