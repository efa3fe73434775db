/* GPT-2's pre-tokenizer split of ASCII text, in C (runtime/http_worker/prompt_encoder.py builds this on
 * first use): the same pieces as prompt_encoder.ASCII_SPLIT.findall, the regex
 *     's|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\s A-Za-z0-9]+|\s+(?!\S)|\s+
 * with \s = [\t\n\v\f\r ], where every piece costs Python's re a match object and a call,
 * a fixed cost that dwarfs the piece's work. Alternatives are tried in that order at each
 * position, so:
 *   - a contraction wins at an apostrophe;
 *   - a space followed by a letter, digit or other character joins that run;
 *   - a run of whitespace followed by a non-space leaves its last character to the next
 *     piece (\s+(?!\S) backtracks one), unless the run is that one character.
 *
 * Each piece's ids come from a PieceTable (filled by the tokenizer's BPE, which the caller
 * runs), looked up here too, so a prompt whose pieces are all cached is encoded in one call
 * with no Python per piece. The table is C rather than a dict[str, list[int]]: with the
 * ~15k pieces of real traffic a dict lookup misses the CPU caches several times a piece (a
 * str made for the key, its hash, the table, the key it compares, the list and each int of
 * the value: much slower than the same lookups with a few hot pieces); an entry
 * here is one 32-byte slot holding a short piece's bytes and a one-token piece's id.
 *
 * encode(text: str, start: int, end: int, pieces: PieceTable, ids: list[int])
 *     -> None, or (i, j): appends the cached ids of text[start:end]'s pieces to `ids` up to the
 *     first piece text[i:j] not in `pieces`; text must be ASCII.
 * PieceTable(): table[piece] = ids (ASCII piece, ids < 2**32), table[piece], piece in table,
 *     len(table), table.clear().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- PieceTable */

#define INLINE_KEY 16

typedef struct {
    uint64_t hash;     /* 0: an empty slot (a piece hashing to 0 is stored as 1) */
    uint32_t ids;      /* the id when n_ids == 1, else the offset of the ids in the ids arena */
    uint16_t n_ids;
    uint16_t key_len;
    union {
        char bytes[INLINE_KEY];  /* key_len <= INLINE_KEY */
        uint32_t off;            /* else: the offset of the key in the keys arena */
    } key;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *slots;
    Py_ssize_t mask, count;  /* capacity - 1 (a power of two), entries */
    char *keys;
    Py_ssize_t keys_used, keys_cap;
    uint32_t *ids;
    Py_ssize_t ids_used, ids_cap;
} PieceTable;

static PyTypeObject PieceTableType;

static inline uint64_t fnv1a(const unsigned char *s, Py_ssize_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ULL;
    return h ? h : 1;
}

static inline const char *key_of(const PieceTable *t, const Entry *e) {
    return e->key_len <= INLINE_KEY ? e->key.bytes : t->keys + e->key.off;
}

/* the slot holding the piece, or the empty slot where it would go */
static Entry *find(const PieceTable *t, const unsigned char *s, Py_ssize_t n, uint64_t h) {
    for (Py_ssize_t i = (Py_ssize_t)h & t->mask;; i = (i + 1) & t->mask) {
        Entry *e = &t->slots[i];
        if (e->hash == 0 || (e->hash == h && e->key_len == n && memcmp(key_of(t, e), s, n) == 0)) return e;
    }
}

static int reserve(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 4096;
    while (c < need) c *= 2;
    void *p = PyMem_Realloc(*buf, (size_t)c * item);
    if (p == NULL) { PyErr_NoMemory(); return -1; }
    *buf = p, *cap = c;
    return 0;
}

static int alloc_slots(PieceTable *t, Py_ssize_t capacity) {
    Entry *slots = PyMem_Calloc((size_t)capacity, sizeof(Entry));
    if (slots == NULL) { PyErr_NoMemory(); return -1; }
    PyMem_Free(t->slots);
    t->slots = slots, t->mask = capacity - 1;
    return 0;
}

static int grow(PieceTable *t) {
    Entry *old = t->slots;
    const Py_ssize_t old_cap = t->mask + 1;
    t->slots = NULL;  /* kept in `old` for the rehash */
    if (alloc_slots(t, old_cap * 2) < 0) { t->slots = old; return -1; }
    for (Py_ssize_t i = 0; i < old_cap; i++) {
        if (old[i].hash == 0) continue;
        Py_ssize_t j = (Py_ssize_t)old[i].hash & t->mask;
        while (t->slots[j].hash) j = (j + 1) & t->mask;
        t->slots[j] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

static const unsigned char *ascii_piece(PyObject *piece, Py_ssize_t *n) {
    if (!PyUnicode_Check(piece) || !PyUnicode_IS_ASCII(piece) || PyUnicode_GET_LENGTH(piece) == 0
            || PyUnicode_GET_LENGTH(piece) > UINT16_MAX) {
        PyErr_SetString(PyExc_KeyError, "a PieceTable key is a non-empty ASCII str");
        return NULL;
    }
    *n = PyUnicode_GET_LENGTH(piece);
    return PyUnicode_1BYTE_DATA(piece);
}

static int table_set(PieceTable *t, PyObject *piece, PyObject *value) {
    Py_ssize_t n;
    const unsigned char *s = ascii_piece(piece, &n);
    if (s == NULL) return -1;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "PieceTable entries cannot be deleted (clear() empties it)");
        return -1;
    }
    PyObject *seq = PySequence_Fast(value, "PieceTable values are lists of token ids");
    if (seq == NULL) return -1;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k > UINT16_MAX) {  /* none is possible: BPE drops bytes its vocabulary lacks */
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a piece has at most 65535 token ids");
        return -1;
    }
    uint32_t first = 0;
    const Py_ssize_t ids_at = t->ids_used;
    if (k > 1 && reserve((void **)&t->ids, &t->ids_cap, ids_at + k, sizeof(uint32_t)) < 0) {
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        const unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "token ids are below 2**32");
            Py_DECREF(seq);
            return -1;
        }
        if (k == 1) first = (uint32_t)v; else t->ids[ids_at + i] = (uint32_t)v;
    }
    Py_DECREF(seq);
    const uint64_t h = fnv1a(s, n);
    Entry *e = find(t, s, n, h);
    if (e->hash == 0) {  /* a new piece (an existing one keeps its key, gets the new ids) */
        if (n > INLINE_KEY) {
            if (reserve((void **)&t->keys, &t->keys_cap, t->keys_used + n, 1) < 0) return -1;
            memcpy(t->keys + t->keys_used, s, n);
            e->key.off = (uint32_t)t->keys_used;
            t->keys_used += n;
        } else {
            memcpy(e->key.bytes, s, n);
        }
        e->key_len = (uint16_t)n, e->hash = h;
        t->count++;
    }
    e->n_ids = (uint16_t)k;
    e->ids = k == 1 ? first : (uint32_t)ids_at;
    if (k > 1) t->ids_used += k;
    return 2 * t->count > t->mask ? grow(t) : 0;
}

/* appends the entry's ids to `out`; -1 on error */
static int append_ids(const PieceTable *t, const Entry *e, PyObject *out) {
    const uint32_t *ids = e->n_ids == 1 ? &e->ids : t->ids + e->ids;
    for (Py_ssize_t i = 0; i < e->n_ids; i++) {
        PyObject *id = PyLong_FromUnsignedLong(ids[i]);
        if (id == NULL) return -1;
        const int rc = PyList_Append(out, id);
        Py_DECREF(id);
        if (rc < 0) return -1;
    }
    return 0;
}

static PyObject *table_get(PieceTable *t, PyObject *piece) {
    Py_ssize_t n;
    const unsigned char *s = ascii_piece(piece, &n);
    if (s == NULL) return NULL;
    Entry *e = find(t, s, n, fnv1a(s, n));
    if (e->hash == 0) {
        PyErr_SetObject(PyExc_KeyError, piece);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out != NULL && append_ids(t, e, out) < 0) Py_CLEAR(out);
    return out;
}

static int table_contains(PieceTable *t, PyObject *piece) {
    if (!PyUnicode_Check(piece) || !PyUnicode_IS_ASCII(piece)) return 0;
    const Py_ssize_t n = PyUnicode_GET_LENGTH(piece);
    const unsigned char *s = PyUnicode_1BYTE_DATA(piece);
    return find(t, s, n, fnv1a(s, n))->hash != 0;  /* an empty or too long key is never stored */
}

static Py_ssize_t table_len(PieceTable *t) { return t->count; }

static PyObject *table_clear(PieceTable *t, PyObject *unused) {
    if (alloc_slots(t, 1024) < 0) return NULL;
    t->count = t->keys_used = t->ids_used = 0;
    Py_RETURN_NONE;
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "PieceTable() takes no arguments");
        return NULL;
    }
    PieceTable *t = (PieceTable *)type->tp_alloc(type, 0);
    if (t != NULL && alloc_slots(t, 1024) < 0) Py_CLEAR(t);
    return (PyObject *)t;
}

static void table_dealloc(PieceTable *t) {
    PyMem_Free(t->slots);
    PyMem_Free(t->keys);
    PyMem_Free(t->ids);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMappingMethods table_mapping = {
    (lenfunc)table_len, (binaryfunc)table_get, (objobjargproc)table_set,
};
static PySequenceMethods table_sequence = {.sq_contains = (objobjproc)table_contains};
static PyMethodDef table_methods[] = {
    {"clear", (PyCFunction)table_clear, METH_NOARGS, "clear() -> None: forgets every piece"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PieceTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prompt_split.PieceTable",
    .tp_basicsize = sizeof(PieceTable),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_as_mapping = &table_mapping,
    .tp_as_sequence = &table_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ASCII piece -> its token ids (see the module's comment)",
    .tp_methods = table_methods,
    .tp_new = table_new,
};

/* ---------------------------------------------------------------- the split */

enum { OTHER, LETTER, DIGIT, SPACE };

static inline int kind(unsigned char c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return LETTER;
    if (c >= '0' && c <= '9') return DIGIT;
    if (c == ' ' || (c >= '\t' && c <= '\r')) return SPACE;  /* \t \n \v \f \r */
    return OTHER;
}

/* the length of a contraction at s[i] ('s 't 're 've 'm 'll 'd), or 0 */
static Py_ssize_t contraction(const unsigned char *s, Py_ssize_t i, Py_ssize_t end) {
    if (s[i] != '\'' || i + 1 >= end) return 0;
    const unsigned char a = s[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 < end) {
        const unsigned char b = s[i + 2];
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    }
    return 0;
}

static Py_ssize_t run(const unsigned char *s, Py_ssize_t i, Py_ssize_t end, int k) {
    while (i < end && kind(s[i]) == k) i++;
    return i;
}

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyUnicode_Check(args[0]) || !PyObject_TypeCheck(args[3], &PieceTableType)
            || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "encode(text: str, start: int, end: int, pieces: PieceTable, ids: list)");
        return NULL;
    }
    PyObject *text = args[0], *ids = args[4];
    const PieceTable *pieces = (const PieceTable *)args[3];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || end == -1) && PyErr_Occurred()) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "encode takes ASCII text");
        return NULL;
    }
    const Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    if (start < 0) start = 0;
    if (end > len) end = len;
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t i = start;
    while (i < end) {
        Py_ssize_t j;
        const int k = kind(s[i]);
        const Py_ssize_t c = contraction(s, i, end);
        if (c) {
            j = i + c;
        } else if (k != SPACE) {
            j = run(s, i, end, k);
        } else if (s[i] == ' ' && i + 1 < end && kind(s[i + 1]) != SPACE) {
            j = run(s, i + 1, end, kind(s[i + 1]));
        } else {
            j = run(s, i, end, SPACE);
            if (j < end && j - i > 1) j--;  /* the last one goes with what follows */
        }
        const Entry *e = find(pieces, s + i, j - i, fnv1a(s + i, j - i));
        if (e->hash == 0) return Py_BuildValue("(nn)", i, j);
        if (append_ids(pieces, e, ids) < 0) return NULL;
        i = j;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL,
     "encode(text, start, end, pieces: PieceTable, ids) -> None or (i, j): cached ids of ASCII text's pieces, "
     "up to a miss"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "prompt_split", NULL, -1, methods};

PyMODINIT_FUNC PyInit_prompt_split(void) {
    if (PyType_Ready(&PieceTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PieceTableType);
    if (PyModule_AddObject(m, "PieceTable", (PyObject *)&PieceTableType) < 0) {
        Py_DECREF(&PieceTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
