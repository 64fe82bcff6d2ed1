/* The Flight Recorder entries of a process decoded in C: frmemory.RecorderMemory reads the recorder's slots from
 * /proc/PID/mem and hands them here; this reads what each entry keeps on the heap (its dtype vectors, long names,
 * shapes of many dimensions: addresses near each other in one pread) and builds the entries as the dicts
 * frmemory's Python decoder builds (the keys and values of a fr_trace_json entry), with no Python work per field.
 *
 * decode(fd, data, base, first_id, epoch, from_id, layout, dtype_names) -> (entries, skipped)
 *   data      the bytes of consecutive slots, the first at remote address `base`
 *   first_id  the id the first slot must hold (the next ones +1 each), or -1: any id >= from_id
 *   epoch     the recorder's reset epoch: a slot of another epoch is skipped
 *   layout    the offsets, in LAYOUT_ORDER (frmemory.py builds it from frlayouts/torch-*.json)
 * A slot that holds another id or epoch, a name or shape out of bounds, a heap read that fails (freed: the job
 * wrote over the slot meanwhile) or shapes that do not add up is skipped and counted. The GIL is released
 * while reading.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    L_SIZE, L_ID, L_EPOCH, L_PG_ID, L_PG_NAME, L_PG_DESC, L_COLL, L_P2P, L_OP, L_PNAME, L_CREATED, L_TIMEOUT,
    L_IS_P2P, L_DURATION, L_STARTED, L_COMPLETED, L_IN_DIMS, L_IN_DTYPES, L_OUT_DIMS, L_OUT_DTYPES, L_SIZES,
    L_RETIRED, L_SV4, L_SV8, L_COUNT
};
/* heap fields of an entry */
enum { F_PG_NAME, F_PG_DESC, F_PNAME, F_IN_DIMS, F_OUT_DIMS, F_SIZES, F_IN_DTYPES, F_OUT_DTYPES, F_COUNT };

#define MAX_NAME 4096
#define MAX_DIMS 64
#define CLUSTER_GAP 4096
#define CLUSTER_MAX (1 << 20)

typedef struct { uint64_t addr; uint64_t len; Py_ssize_t slot; int field; const char *at; } Want;
typedef struct { const char *at[F_COUNT]; uint64_t len[F_COUNT]; int ok; } Slot;

static PyObject *K[24];
static PyObject *TEMPLATE;   /* a dict of the keys 0..17, each None */
static const char *KEYS[] = {"record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
                             "profiling_name", "time_created_ns", "input_sizes", "input_dtypes", "output_sizes",
                             "output_dtypes", "state", "time_discovered_started_ns",
                             "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p", "duration_ms",
                             "completed", "started", "scheduled", NULL};

static inline uint64_t u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline PyObject *newref(PyObject *o) { Py_INCREF(o); return o; }
static inline uint32_t u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* an address range a process can hold: below 2^63 (pread's offset is signed), no wrap */
static inline int user_range(uint64_t p, uint64_t len) {
    return p < (1ULL << 63) && p + len >= p && p + len < (1ULL << 63);
}

static int cmp_want(const void *a, const void *b) {
    uint64_t x = ((const Want *)a)->addr, y = ((const Want *)b)->addr;
    return x < y ? -1 : x > y;
}

static int read_all(int fd, char *buf, uint64_t len, uint64_t addr) {
    uint64_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, len - got, (off_t)(addr + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        got += (uint64_t)r;
    }
    return 0;
}

/* a list of shapes: dims[i] sizes each, taken from flat[*pos..] */
static PyObject *shapes(const int64_t *dims, Py_ssize_t nd, const int64_t *flat, Py_ssize_t *pos) {
    PyObject *out = PyList_New(nd);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *s = PyList_New(dims[i]);
        if (!s) {
            Py_DECREF(out);
            return NULL;
        }
        for (int64_t j = 0; j < dims[i]; j++) {
            PyObject *v = PyLong_FromLongLong(flat[(*pos)++]);
            if (!v) {
                Py_DECREF(s);
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(s, j, v);
        }
        PyList_SET_ITEM(out, i, s);
    }
    return out;
}

static PyObject *dtypes(const char *at, uint64_t n, PyObject *names) {   /* names checked by entry() */
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (!out)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(names, (unsigned char)at[i]);   /* checked by entry() */
        Py_INCREF(s);
        PyList_SET_ITEM(out, (Py_ssize_t)i, s);
    }
    return out;
}

/* the dict of one entry; NULL with an exception set on a memory error, Py_None (borrowed) to skip it */
static PyObject *entry(const char *e, Slot *s, const Py_ssize_t *L, PyObject *names) {
    int64_t din[MAX_DIMS], dout[MAX_DIMS];
    uint64_t nin = s->len[F_IN_DIMS] / 8, nout = s->len[F_OUT_DIMS] / 8, nflat = s->len[F_SIZES] / 8, total = 0;
    if (nin > MAX_DIMS || nout > MAX_DIMS)
        return Py_None;
    memcpy(din, s->at[F_IN_DIMS], nin * 8);
    memcpy(dout, s->at[F_OUT_DIMS], nout * 8);
    for (uint64_t i = 0; i < nin + nout; i++) {
        int64_t d = i < nin ? din[i] : dout[i - nin];
        if (d < 0 || d > MAX_DIMS)
            return Py_None;
        total += (uint64_t)d;
    }
    if (total != nflat)
        return Py_None;
    for (int k = F_IN_DTYPES; k <= F_OUT_DTYPES; k++)
        for (uint64_t i = 0; i < s->len[k]; i++)
            if ((Py_ssize_t)(unsigned char)s->at[k][i] >= PyTuple_GET_SIZE(names))
                return Py_None;   /* not a ScalarType */
    int64_t *flat = malloc(nflat ? nflat * 8 : 8);
    if (!flat)
        return PyErr_NoMemory();
    memcpy(flat, s->at[F_SIZES], nflat * 8);
    int c = *(const unsigned char *)(e + L[L_COMPLETED] + 8), st = *(const unsigned char *)(e + L[L_STARTED] + 8);
    int dur_set = *(const unsigned char *)(e + L[L_DURATION] + 4);
    int64_t t_started, t_completed, created, timeout;
    float dur;
    memcpy(&t_started, e + L[L_STARTED], 8);
    memcpy(&t_completed, e + L[L_COMPLETED], 8);
    memcpy(&created, e + L[L_CREATED], 8);
    memcpy(&timeout, e + L[L_TIMEOUT], 8);
    memcpy(&dur, e + L[L_DURATION], 4);
    Py_ssize_t pos = 0;
    PyObject *v[19] = {NULL};
    v[0] = PyLong_FromUnsignedLongLong(u64(e + L[L_ID]));
    v[1] = PyLong_FromUnsignedLongLong(u64(e + L[L_PG_ID]));
    v[2] = Py_BuildValue("[NN]", PyUnicode_DecodeUTF8(s->at[F_PG_NAME], (Py_ssize_t)s->len[F_PG_NAME], "replace"),
                         PyUnicode_DecodeUTF8(s->at[F_PG_DESC], (Py_ssize_t)s->len[F_PG_DESC], "replace"));
    v[3] = PyLong_FromUnsignedLongLong(u64(e + L[L_COLL]));
    v[4] = PyLong_FromUnsignedLongLong(u64(e + L[L_P2P]));
    v[5] = PyLong_FromUnsignedLongLong(u64(e + L[L_OP]));
    v[6] = PyUnicode_DecodeUTF8(s->at[F_PNAME], (Py_ssize_t)s->len[F_PNAME], "replace");
    v[7] = PyLong_FromLongLong(created);
    v[8] = shapes(din, (Py_ssize_t)nin, flat, &pos);
    v[10] = v[8] ? shapes(dout, (Py_ssize_t)nout, flat, &pos) : NULL;
    v[9] = dtypes(s->at[F_IN_DTYPES], s->len[F_IN_DTYPES], names);
    v[11] = dtypes(s->at[F_OUT_DTYPES], s->len[F_OUT_DTYPES], names);
    v[12] = K[c ? 19 : st ? 20 : 21];
    Py_INCREF(v[12]);
    v[13] = PyLong_FromLongLong(st ? t_started : 0);   /* 0 where not set, as fr_trace_json writes it */
    v[14] = PyLong_FromLongLong(c ? t_completed : 0);
    v[15] = newref(*(const unsigned char *)(e + L[L_RETIRED]) ? Py_True : Py_False);
    v[16] = PyLong_FromLongLong(timeout);
    v[17] = newref(*(const unsigned char *)(e + L[L_IS_P2P]) ? Py_True : Py_False);
    v[18] = dur_set ? PyFloat_FromDouble((double)dur) : NULL;
    free(flat);
    PyObject *d = PyDict_Copy(TEMPLATE);   /* every key but duration_ms already in: no resize per key */
    int bad = !d;
    for (int i = 0; i < 19 && !bad; i++)
        if (v[i] ? PyDict_SetItem(d, K[i], v[i]) : i != 18)
            bad = 1;
    for (int i = 0; i < 19; i++)
        Py_XDECREF(v[i]);
    if (bad) {
        Py_XDECREF(d);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return NULL;
    }
    return d;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer data;
    unsigned long long base;
    long long first_id, from_id;
    unsigned long long epoch;
    PyObject *layout, *names;
    if (!PyArg_ParseTuple(args, "iy*KLKLO!O!", &fd, &data, &base, &first_id, &epoch, &from_id, &PyTuple_Type,
                          &layout, &PyTuple_Type, &names))
        return NULL;
    Py_ssize_t L[L_COUNT];
    if (PyTuple_GET_SIZE(layout) != L_COUNT) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "layout: %d offsets expected", L_COUNT);
    }
    for (int i = 0; i < L_COUNT; i++)
        L[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, i));
    for (int i = 0; i < L_COUNT; i++) {
        /* the bytes each field spans: the entry must hold them */
        Py_ssize_t w = i == L_PG_NAME || i == L_PG_DESC || i == L_PNAME ? 32
                     : i == L_IN_DIMS || i == L_OUT_DIMS ? 16 + 8 * L[L_SV4] : i == L_SIZES ? 16 + 8 * L[L_SV8]
                     : i == L_STARTED || i == L_COMPLETED || i == L_IN_DTYPES || i == L_OUT_DTYPES ? 16
                     : i == L_IS_P2P || i == L_RETIRED ? 1 : 8;
        if (PyErr_Occurred() || L[i] < 0 || (i != L_SIZE && i < L_SV4 && L[i] + w > L[L_SIZE]) ||
                (i >= L_SV4 && L[i] > MAX_DIMS)) {
            PyBuffer_Release(&data);
            return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "layout: offset %d out of range", i);
        }
    }
    Py_ssize_t n = L[L_SIZE] > 0 ? data.len / L[L_SIZE] : 0, skipped = 0;
    const char *buf = data.buf;
    Slot *slots = calloc(n ? (size_t)n : 1, sizeof(Slot));
    Want *wants = malloc(sizeof(Want) * (size_t)(n ? n : 1) * F_COUNT);
    char **heap = NULL;
    size_t nheap = 0, nw = 0;
    PyObject *out = NULL;
    if (!slots || !wants) {
        free(slots);
        free(wants);
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    /* field, its offset's index, the index of its inline element count (0: a string) */
    static const int inl[6][3] = {{F_PG_NAME, L_PG_NAME, 0}, {F_PG_DESC, L_PG_DESC, 0}, {F_PNAME, L_PNAME, 0},
                                  {F_IN_DIMS, L_IN_DIMS, L_SV4}, {F_OUT_DIMS, L_OUT_DIMS, L_SV4},
                                  {F_SIZES, L_SIZES, L_SV8}};
    static const int dts[2][2] = {{F_IN_DTYPES, L_IN_DTYPES}, {F_OUT_DTYPES, L_OUT_DTYPES}};
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *e = buf + i * L[L_SIZE];
        uint64_t addr = base + (uint64_t)(i * L[L_SIZE]), rid = u64(e + L[L_ID]);
        Slot *s = &slots[i];
        size_t w0 = nw;
        if (u64(e + L[L_EPOCH]) != epoch || (first_id >= 0 ? rid != (uint64_t)(first_id + i)
                                                            : (from_id >= 0 && rid < (uint64_t)from_id)))
            continue;
        s->ok = 1;
        for (int k = 0; k < 6 && s->ok; k++) {
            /* a name (libstdc++ string: pointer, u64 length, 16-byte inline buffer) or a shape vector (c10
             * SmallVector: pointer, u32 count, inline elements): inline where the pointer points at the buffer */
            const char *f = e + L[inl[k][1]];
            int vec = inl[k][2] != 0;
            uint64_t p = u64(f), len = vec ? (uint64_t)u32(f + 8) * 8 : u64(f + 8);
            uint64_t cap = vec ? (uint64_t)L[inl[k][2]] * 8 : 15;
            uint64_t most = vec ? 8 * MAX_DIMS * (MAX_DIMS + 2) : MAX_NAME;
            s->len[inl[k][0]] = len;
            if (len > most)
                s->ok = 0;
            else if (len == 0)
                s->at[inl[k][0]] = f + 16;
            else if (p == addr + (uint64_t)L[inl[k][1]] + 16) {
                if (len > cap)
                    s->ok = 0;   /* more than the inline buffer holds, yet pointing at it */
                else
                    s->at[inl[k][0]] = f + 16;
            } else if (!user_range(p, len))
                s->ok = 0;
            else
                wants[nw++] = (Want){p, len, i, inl[k][0], NULL};
        }
        for (int k = 0; k < 2 && s->ok; k++) {
            const char *f = e + L[dts[k][1]];
            uint64_t b = u64(f), end = u64(f + 8);
            if (end < b || end - b > MAX_DIMS || !user_range(b, end - b))
                s->ok = 0;
            else if (end == b) {
                s->at[dts[k][0]] = f;
                s->len[dts[k][0]] = 0;
            } else {
                s->len[dts[k][0]] = end - b;
                wants[nw++] = (Want){b, end - b, i, dts[k][0], NULL};
            }
        }
        if (!s->ok) {
            nw = w0;
            skipped++;
        }
    }
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    qsort(wants, nw, sizeof(Want), cmp_want);
    heap = malloc(sizeof(char *) * (nw ? nw : 1));
    if (!heap)
        nomem = 1;
    for (size_t i = 0; i < nw && !nomem;) {
        uint64_t lo = wants[i].addr, hi = lo + wants[i].len;
        size_t j = i + 1;
        while (j < nw && wants[j].addr <= hi + CLUSTER_GAP &&
               (wants[j].addr + wants[j].len > hi ? wants[j].addr + wants[j].len : hi) - lo <= CLUSTER_MAX) {
            if (wants[j].addr + wants[j].len > hi)
                hi = wants[j].addr + wants[j].len;
            j++;
        }
        char *b = malloc(hi - lo ? hi - lo : 1);
        if (!b) {
            nomem = 1;
            break;
        }
        heap[nheap++] = b;
        if (read_all(fd, b, hi - lo, lo) == 0) {
            for (size_t k = i; k < j; k++)
                wants[k].at = b + (wants[k].addr - lo);
        } else {   /* one by one: those still mapped */
            for (size_t k = i; k < j; k++)
                if (read_all(fd, b + (wants[k].addr - lo), wants[k].len, wants[k].addr) == 0)
                    wants[k].at = b + (wants[k].addr - lo);
        }
        i = j;
    }
    Py_END_ALLOW_THREADS
    if (nomem) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t k = 0; k < nw; k++) {
        Slot *s = &slots[wants[k].slot];
        if (!wants[k].at)
            s->ok = s->ok == 1 ? -1 : s->ok;   /* freed meanwhile: skipped below */
        else
            s->at[wants[k].field] = wants[k].at;
    }
    out = PyList_New(0);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Slot *s = &slots[i];
        if (s->ok != 1) {
            skipped += s->ok == -1;
            continue;
        }
        PyObject *d = entry(buf + i * L[L_SIZE], s, L, names);
        if (!d) {
            Py_CLEAR(out);
            goto done;
        }
        if (d == Py_None) {
            skipped++;
            continue;
        }
        int r = PyList_Append(out, d);
        Py_DECREF(d);
        if (r) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    for (size_t i = 0; i < nheap; i++)
        free(heap[i]);
    free(heap);
    free(slots);
    free(wants);
    PyBuffer_Release(&data);
    if (!out)
        return NULL;
    return Py_BuildValue("(Nn)", out, skipped);
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Flight Recorder slots -> (entries as dicts, slots skipped); see the source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__frread(void) {
    for (int i = 0; KEYS[i]; i++) {
        K[i] = PyUnicode_InternFromString(KEYS[i]);
        if (!K[i])
            return NULL;
    }
    TEMPLATE = PyDict_New();
    for (int i = 0; TEMPLATE && i < 18; i++)
        if (PyDict_SetItem(TEMPLATE, K[i], Py_None))
            return NULL;
    if (!TEMPLATE)
        return NULL;
    return PyModule_Create(&module);
}
