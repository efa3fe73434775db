/* The data path of a ring (ipc/ring.py) in one C call per operation.

   From Python every numpy call or memoryview access has a fixed cost that dwarfs copying
   a record, and several times that when the caches went cold between two messages (the
   normal case on the token path); a push or pop here is one call that touches a few cache
   lines.

   Same segment layout and protocol as the Python implementation in ipc/ring.py; the
   memory-ordering argument is docs/architecture.md's "Rings". Counters are loaded with acquire and stored
   with release (__atomic builtins: a plain mov on x86-64, ldar/stlr on aarch64); record,
   bound and arena bytes are plain memcpy's ordered by those. When the segment's barrier
   is "fence", a seq_cst fence separates publishing a counter from reading the peer's
   sleep flag (the Dekker handshake); with "membarrier" the hot side issues nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    Py_buffer segment;  /* holds the mapping exported while the core is open */
    int open;
    uint64_t *hdr;      /* header words */
    uint8_t *slots;     /* [cap * itemsize] */
    uint64_t *bounds;   /* [cap, 2] arena (start, end) per slot; NULL without an arena */
    uint8_t *arena;     /* [arena_size] */
    uint64_t cap, itemsize, arena_size;
    Py_ssize_t w_tail, w_head, w_arena_head, w_consumer_sleeping, w_producer_waiting;
    int fence, peer_fd;
    PyObject *name;     /* layout name, for error messages */
    /* producer: tail authoritative, head and arena_head cached; consumer: head authoritative */
    uint64_t tail, head, arena_tail, arena_head;
} Core;

static inline uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static int check_open(Core *c) {
    if (!c->open) {
        PyErr_SetString(PyExc_ValueError, "channel is closed");
        return -1;
    }
    return 0;
}

/* After publishing a counter: wake the peer if it announced it sleeps on `flag`. */
static int wake_if_flagged(Core *c, Py_ssize_t flag) {
    if (c->fence)
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load_acquire(c->hdr + flag) == 0)
        return 0;
    uint64_t one = 1;
    if (write(c->peer_fd, &one, 8) == 8 || errno == EAGAIN)  /* EAGAIN: already signalled enough */
        return 0;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"buf", "slots_at", "capacity", "itemsize", "bounds_at", "arena_at", "arena_bytes",
                            "words", "fence", "peer_fd", "name", NULL};
    PyObject *buf, *name;
    Py_ssize_t slots_at, bounds_at, arena_at;
    unsigned long long cap, itemsize, arena_size;
    int fence, peer_fd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnKKnnK(nnnnn)piU", names, &buf, &slots_at, &cap, &itemsize,
                                     &bounds_at, &arena_at, &arena_size, &c->w_tail, &c->w_head,
                                     &c->w_arena_head, &c->w_consumer_sleeping, &c->w_producer_waiting,
                                     &fence, &peer_fd, &name))
        return -1;
    if (c->open) {
        PyErr_SetString(PyExc_RuntimeError, "RingCore is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(buf, &c->segment, PyBUF_WRITABLE) < 0)
        return -1;
    if (cap == 0 || itemsize == 0 || (uint64_t)slots_at + cap * itemsize > (uint64_t)c->segment.len
        || (arena_size && (uint64_t)arena_at + arena_size > (uint64_t)c->segment.len)) {
        PyBuffer_Release(&c->segment);
        PyErr_SetString(PyExc_ValueError, "ring layout does not fit the segment");
        return -1;
    }
    uint8_t *base = c->segment.buf;
    c->hdr = (uint64_t *)base;
    c->slots = base + slots_at;
    c->bounds = arena_size ? (uint64_t *)(base + bounds_at) : NULL;
    c->arena = arena_size ? base + arena_at : NULL;
    c->cap = cap, c->itemsize = itemsize, c->arena_size = arena_size;
    c->fence = fence, c->peer_fd = peer_fd;
    Py_XSETREF(c->name, Py_NewRef(name));
    c->tail = load_acquire(c->hdr + c->w_tail);
    c->head = load_acquire(c->hdr + c->w_head);
    c->arena_head = load_acquire(c->hdr + c->w_arena_head);
    c->arena_tail = 0;
    c->open = 1;
    return 0;
}

static PyObject *Core_close(Core *c, PyObject *unused) {
    if (c->open) {
        c->open = 0;
        PyBuffer_Release(&c->segment);
    }
    Py_RETURN_NONE;
}

static void Core_dealloc(Core *c) {
    Core_close(c, NULL);
    Py_XDECREF(c->name);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* push(records, payload) -> records published (0: full), or NotImplemented when `records` or
   `payload` is not C-contiguous (the caller makes contiguous copies). `records` holds whole
   records (the caller checked its dtype), `payload` is None or any buffer. */
static PyObject *Core_push(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "push(records, payload)");
        return NULL;
    }
    if (check_open(c) < 0)
        return NULL;
    Py_buffer rec, blob = {0};
    if (PyObject_GetBuffer(args[0], &rec, PyBUF_STRIDES) < 0)
        return NULL;
    if (args[1] != Py_None && PyObject_GetBuffer(args[1], &blob, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&rec);
        return NULL;
    }
    if (!PyBuffer_IsContiguous(&rec, 'C') || (blob.obj && !PyBuffer_IsContiguous(&blob, 'C'))) {
        PyBuffer_Release(&rec);
        if (blob.obj)
            PyBuffer_Release(&blob);
        Py_RETURN_NOTIMPLEMENTED;
    }
    uint64_t nbytes = (uint64_t)blob.len, isz = c->itemsize, cap = c->cap;
    uint64_t n = (uint64_t)rec.len / isz, k = 0;
    if (nbytes && (!c->arena || nbytes > c->arena_size)) {
        if (!c->arena)
            PyErr_Format(PyExc_ValueError, "payload: the %U channel was created without an arena", c->name);
        else
            PyErr_Format(PyExc_ValueError, "payload of %llu bytes can never fit this channel's %llu-byte arena",
                         (unsigned long long)nbytes, (unsigned long long)c->arena_size);
        goto fail;
    }
    uint64_t tail = c->tail, free_ = cap - (tail - c->head);
    if (free_ < n) {
        c->head = load_acquire(c->hdr + c->w_head);
        free_ = cap - (tail - c->head);
    }
    k = n < free_ ? n : free_;
    if (k == 0)
        goto done;
    uint64_t i = tail % cap, first = k < cap - i ? k : cap - i;  /* records before the wrap */
    if (c->arena) {
        uint64_t start = c->arena_tail, size = c->arena_size;
        if (nbytes) {
            uint64_t index = start % size;
            if (index + nbytes > size)  /* a blob never straddles the end: skip to the next lap */
                start += size - index;
            if (start + nbytes - c->arena_head > size) {
                c->arena_head = load_acquire(c->hdr + c->w_arena_head);
                if (start + nbytes - c->arena_head > size) {
                    k = 0;
                    goto done;
                }
            }
            memcpy(c->arena + start % size, blob.buf, nbytes);
            c->arena_tail = (start + nbytes + 7) & ~(uint64_t)7;
        }
        for (uint64_t j = 0, s = i; j < k; j++, s = s + 1 == cap ? 0 : s + 1) {
            c->bounds[2 * s] = start;
            c->bounds[2 * s + 1] = start + nbytes;
        }
    }
    memcpy(c->slots + i * isz, rec.buf, first * isz);
    if (first < k)
        memcpy(c->slots, (uint8_t *)rec.buf + first * isz, (k - first) * isz);
    c->tail = tail + k;
    store_release(c->hdr + c->w_tail, tail + k);
done:
    PyBuffer_Release(&rec);
    if (blob.obj)
        PyBuffer_Release(&blob);
    if (k && wake_if_flagged(c, c->w_consumer_sleeping) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(k);
fail:
    PyBuffer_Release(&rec);
    if (blob.obj)
        PyBuffer_Release(&blob);
    return NULL;
}

/* pop(max_records) -> None | (records bytearray, payload bytearray | None, starts bytearray | None).
   max_records <= 0: all. `starts` (u64 per record: its blob's arena position; the first is the
   span's) is given when the records reference several pushes' blobs, whose offsets the
   caller rebases onto the span; it is copied before the slots are released. */
static PyObject *Core_pop(Core *c, PyObject *arg) {
    long long max_records = PyLong_AsLongLong(arg);
    if (max_records == -1 && PyErr_Occurred())
        return NULL;
    if (check_open(c) < 0)
        return NULL;
    uint64_t tail = load_acquire(c->hdr + c->w_tail), head = c->head, n = tail - head;
    if (n == 0)
        Py_RETURN_NONE;
    if (max_records > 0 && n > (uint64_t)max_records)
        n = (uint64_t)max_records;
    uint64_t cap = c->cap, isz = c->itemsize, i = head % cap, first = n < cap - i ? n : cap - i;
    PyObject *raw = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * isz));
    if (!raw)
        return NULL;
    uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(raw);
    memcpy(out, c->slots + i * isz, first * isz);
    if (first < n)
        memcpy(out + first * isz, c->slots, (n - first) * isz);
    PyObject *payload = Py_None, *starts = Py_None;
    Py_INCREF(payload);
    Py_INCREF(starts);
    uint64_t new_head = head + n;
    if (c->arena) {
        uint64_t last = (new_head - 1) % cap, start = c->bounds[2 * i], end = c->bounds[2 * last + 1];
        if (end > start) {
            uint64_t len = end - start, size = c->arena_size, index = start % size;
            uint64_t part = len < size - index ? len : size - index;  /* at most one wrap */
            Py_DECREF(payload);
            payload = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)len);
            if (!payload) {
                Py_DECREF(raw);
                return NULL;
            }
            uint8_t *p = (uint8_t *)PyByteArray_AS_STRING(payload);
            memcpy(p, c->arena + index, part);
            if (part < len)
                memcpy(p + part, c->arena, len - part);
            if (c->bounds[2 * last] != start) {
                Py_DECREF(starts);
                starts = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
                if (!starts) {
                    Py_DECREF(raw);
                    Py_DECREF(payload);
                    return NULL;
                }
                uint64_t *s = (uint64_t *)PyByteArray_AS_STRING(starts);
                for (uint64_t j = 0, slot = i; j < n; j++, slot = slot + 1 == cap ? 0 : slot + 1)
                    s[j] = c->bounds[2 * slot];
            }
        }
        /* free up to the first blob still referenced by an unpopped record */
        store_release(c->hdr + c->w_arena_head, new_head == tail ? end : c->bounds[2 * (new_head % cap)]);
    }
    c->head = new_head;
    store_release(c->hdr + c->w_head, new_head);
    if (wake_if_flagged(c, c->w_producer_waiting) < 0) {
        Py_DECREF(raw);
        Py_DECREF(payload);
        Py_DECREF(starts);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(3, raw, payload, starts);
    Py_DECREF(raw);
    Py_DECREF(payload);
    Py_DECREF(starts);
    return result;
}

static PyObject *Core_readable(Core *c, PyObject *unused) {
    if (check_open(c) < 0)
        return NULL;
    return PyBool_FromLong(load_acquire(c->hdr + c->w_tail) != c->head);
}

static PyObject *Core_free_records(Core *c, PyObject *unused) {
    if (check_open(c) < 0)
        return NULL;
    c->head = load_acquire(c->hdr + c->w_head);
    return PyLong_FromUnsignedLongLong(c->cap - (c->tail - c->head));
}

/* room_for(nbytes) -> whether a push of one record with an nbytes payload would succeed now */
static PyObject *Core_room_for(Core *c, PyObject *arg) {
    long long nbytes = PyLong_AsLongLong(arg);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (check_open(c) < 0)
        return NULL;
    c->head = load_acquire(c->hdr + c->w_head);
    if (c->cap == c->tail - c->head)
        Py_RETURN_FALSE;
    if (!c->arena || nbytes <= 0)
        Py_RETURN_TRUE;
    c->arena_head = load_acquire(c->hdr + c->w_arena_head);
    uint64_t size = c->arena_size, start = c->arena_tail, index = start % size;
    if (index + (uint64_t)nbytes > size)
        start += size - index;
    return PyBool_FromLong(start + (uint64_t)nbytes - c->arena_head <= size);
}

static PyMethodDef Core_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Core_push, METH_FASTCALL, NULL},
    {"pop", (PyCFunction)Core_pop, METH_O, NULL},
    {"readable", (PyCFunction)Core_readable, METH_NOARGS, NULL},
    {"free_records", (PyCFunction)Core_free_records, METH_NOARGS, NULL},
    {"room_for", (PyCFunction)Core_room_for, METH_O, NULL},
    {"close", (PyCFunction)Core_close, METH_NOARGS, NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ipc.ring_core.RingCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "ring_core", .m_size = -1};

PyMODINIT_FUNC PyInit_ring_core(void) {
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "RingCore", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
