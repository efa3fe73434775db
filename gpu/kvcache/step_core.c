/* The scheduler's per-step bookkeeping over its request table (gpu/kvcache/req_table.py builds
 * this on first use and keeps a numpy version of each method where it cannot be built).
 *
 * A decode step touches every running row a few times: pick the rows that decode, give
 * those at a page boundary a page, gather their next token, position and pages for the
 * runner, then append each sampled token, check length and stop tokens, and fill its
 * TOKEN_OUT record. As numpy that is dozens of calls a step, each with a fixed cost whatever
 * the batch, together a large share of what a null-model step costs the scheduler
 * (docs/perf-notes.md); here it is a few calls that loop over the rows.
 *
 * StepCore(ids, page_table, length, kv_len, num_pages, prompt_len, max_len, min_len, stop_ids,
 *          active, events, layout) holds the table's arrays (C-contiguous, int32 but `active`,
 *          bool, and `events`, TOKEN_OUT records); layout = (record size, offsets of token,
 *          logprob, finish and completion_tokens, finish codes of length and stop).
 *   decode_rows(page_size, rows, need) -> (n, k): rows[:n] the active rows whose every known
 *       token but the last is in the KV cache (they decode one token), need[:k] those of them
 *       whose pages are full; rows and need are int64 [num_rows].
 *   add_pages(rows, pages): each row's next page (rows int64 [n], pages int32 [n]).
 *   step_input(rows, q_lens, starts, token_ids, num_pages, page_table, sample) -> P: the
 *       runner's columns for rows (int64 [n]) each running q_lens (int64 [n]) tokens from its
 *       kv_len: starts int64 [n] (= kv_len), token_ids int32 [sum(q_lens)], num_pages int64
 *       [n], page_table int32 [n * P] (each row's first P pages; it must hold n * max_pages),
 *       sample bool [n] (the row's last known token is among them); P = the most pages of
 *       any of the rows.
 *   reserved_tokens(ratio, clip) -> float: over active rows, the known tokens not yet in the
 *       KV cache plus ratio times what each may still generate, at most clip a row.
 *   append(rows, tokens, logprobs, events, finished) -> k: appends tokens (int32 [n]) to rows
 *       (int64 [n]), fills events[:n] (TOKEN_OUT) from each row's record with the token, its
 *       logprob (float32 [n]), finish and completion tokens, and finished[:k] (int64) with
 *       the rows that finished, in order. A stop token counts only past min_len and wins over
 *       length.
 *   draft(row, k, min_window, max_window) -> (start, n): the n-gram draft of gpu/kvcache/ngram.py's
 *       ngram_draft over the row's known tokens, as ids[row, start:start + n] (n = 0: none).
 * Row indices out of range raise IndexError before anything is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { IDS, PAGE_TABLE, LENGTH, KV_LEN, NUM_PAGES, PROMPT_LEN, MAX_LEN, MIN_LEN, STOP_IDS, ACTIVE, EVENTS,
       N_ARRAYS };
static const char *const array_names[N_ARRAYS] = {"ids", "page_table", "length", "kv_len", "num_pages",
                                                  "prompt_len", "max_len", "min_len", "stop_ids", "active",
                                                  "events"};

typedef struct {
    PyObject_HEAD
    Py_buffer arrays[N_ARRAYS];
    int held;  /* buffers acquired */
    Py_ssize_t rows, max_seq, max_pages, max_stops, rec_size;
    Py_ssize_t token_off, logprob_off, finish_off, completion_off;
    uint8_t finish_length, finish_stop;
} StepCore;

static PyTypeObject StepCoreType;

#define COL(c, a) ((int32_t *)(c)->arrays[a].buf)

static void StepCore_dealloc(StepCore *c) {
    for (int i = 0; i < c->held; i++)
        PyBuffer_Release(&c->arrays[i]);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int StepCore_init(StepCore *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"ids", "page_table", "length", "kv_len", "num_pages", "prompt_len", "max_len",
                            "min_len", "stop_ids", "active", "events", "layout", NULL};
    PyObject *objs[N_ARRAYS];
    Py_ssize_t off[4];
    int f_length, f_stop;
    if (c->held) {
        PyErr_SetString(PyExc_RuntimeError, "StepCore is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOO(nnnnnii)", names, &objs[0], &objs[1], &objs[2],
                                     &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9],
                                     &objs[10], &c->rec_size, &off[0], &off[1], &off[2], &off[3], &f_length,
                                     &f_stop))
        return -1;
    for (int i = 0; i < N_ARRAYS; i++) {
        if (PyObject_GetBuffer(objs[i], &c->arrays[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        c->held = i + 1;
    }
    Py_ssize_t R = c->arrays[LENGTH].len / 4;
    c->rows = R;
    for (int i = LENGTH; i <= MIN_LEN; i++)
        if (c->arrays[i].len != 4 * R) {
            PyErr_Format(PyExc_ValueError, "%s must be int32 [%zd]", array_names[i], R);
            return -1;
        }
    if (R == 0 || c->arrays[ACTIVE].len != R || c->rec_size < 1 || c->arrays[EVENTS].len != R * c->rec_size ||
        c->arrays[IDS].len % (4 * R) || c->arrays[PAGE_TABLE].len % (4 * R) || c->arrays[STOP_IDS].len % (4 * R)) {
        PyErr_SetString(PyExc_ValueError, "StepCore: arrays of another row count or element size");
        return -1;
    }
    c->max_seq = c->arrays[IDS].len / (4 * R);
    c->max_pages = c->arrays[PAGE_TABLE].len / (4 * R);
    c->max_stops = c->arrays[STOP_IDS].len / (4 * R);
    c->token_off = off[0], c->logprob_off = off[1], c->finish_off = off[2], c->completion_off = off[3];
    if (off[0] + 4 > c->rec_size || off[1] + 4 > c->rec_size || off[2] + 1 > c->rec_size ||
        off[3] + 4 > c->rec_size || off[0] < 0 || off[1] < 0 || off[2] < 0 || off[3] < 0) {
        PyErr_SetString(PyExc_ValueError, "StepCore: a field offset outside the record");
        return -1;
    }
    c->finish_length = (uint8_t)f_length, c->finish_stop = (uint8_t)f_stop;
    return 0;
}

/* An argument's buffer, C-contiguous, of `itemsize` bytes an element and at least `n`
   elements (n < 0: any). */
static int arg(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize || (n >= 0 && view->len < n * itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd-byte elements, at least %zd of them expected", what, itemsize, n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* args[0] of a method of `want` arguments, the rows (int64): their count, or -1 with an exception. */
static Py_ssize_t rows_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage,
                           Py_buffer *rows) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (arg(args[0], rows, 8, -1, 0, "rows") < 0)
        return -1;
    return rows->len / 8;
}

static int check_rows(StepCore *c, const int64_t *rows, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= c->rows) {
            PyErr_Format(PyExc_IndexError, "row %lld outside the table's %zd rows", (long long)rows[i], c->rows);
            return -1;
        }
    return 0;
}

static PyObject *StepCore_decode_rows(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "decode_rows(page_size, rows, need)");
        return NULL;
    }
    Py_ssize_t ps = PyLong_AsSsize_t(args[0]);
    if (ps == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer rows_v, need_v;
    if (arg(args[1], &rows_v, 8, c->rows, 1, "rows") < 0)
        return NULL;
    if (arg(args[2], &need_v, 8, c->rows, 1, "need") < 0) {
        PyBuffer_Release(&rows_v);
        return NULL;
    }
    const uint8_t *active = c->arrays[ACTIVE].buf;
    const int32_t *kv = COL(c, KV_LEN), *len = COL(c, LENGTH), *pages = COL(c, NUM_PAGES);
    int64_t *rows = rows_v.buf, *need = need_v.buf;
    Py_ssize_t n = 0, k = 0;
    for (Py_ssize_t r = 0; r < c->rows; r++)
        if (active[r] && kv[r] == len[r] - 1) {
            rows[n++] = r;
            if ((int64_t)pages[r] * ps <= kv[r])
                need[k++] = r;
        }
    PyBuffer_Release(&rows_v);
    PyBuffer_Release(&need_v);
    return Py_BuildValue("(nn)", n, k);
}

static PyObject *StepCore_add_pages(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer rows_v, pages_v;
    Py_ssize_t n = rows_arg(args, nargs, 2, "add_pages(rows, pages)", &rows_v);
    if (n < 0)
        return NULL;
    if (arg(args[1], &pages_v, 4, n, 0, "pages") < 0) {
        PyBuffer_Release(&rows_v);
        return NULL;
    }
    const int64_t *rows = rows_v.buf;
    const int32_t *pages = pages_v.buf;
    int32_t *num = COL(c, NUM_PAGES), *table = COL(c, PAGE_TABLE);
    PyObject *result = NULL;
    if (check_rows(c, rows, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (num[rows[i]] >= c->max_pages) {
            PyErr_Format(PyExc_IndexError, "row %lld holds its most pages already", (long long)rows[i]);
            goto done;
        }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (num[r] >= c->max_pages) {  /* a row given twice: checked above only once */
            PyErr_Format(PyExc_IndexError, "row %lld holds its most pages already", (long long)r);
            goto done;
        }
        table[r * c->max_pages + num[r]++] = pages[i];
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&rows_v);
    PyBuffer_Release(&pages_v);
    return result;
}

static PyObject *StepCore_step_input(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[7] = {{0}};
    PyObject *result = NULL;
    Py_ssize_t n = rows_arg(args, nargs, 7, "step_input(rows, q_lens, starts, token_ids, num_pages, page_table, "
                            "sample)", &v[0]);
    if (n < 0)
        return NULL;
    int got = 1;
    if (arg(args[1], &v[1], 8, n, 0, "q_lens") < 0)
        goto done;
    got = 2;
    const int64_t *rows = v[0].buf, *q = v[1].buf;
    if (check_rows(c, rows, n) < 0)
        goto done;
    const int32_t *kv = COL(c, KV_LEN), *len = COL(c, LENGTH), *ids = COL(c, IDS), *num = COL(c, NUM_PAGES),
                  *table = COL(c, PAGE_TABLE);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        /* past its known tokens (len) a row's ids may hold its drafts (speculative decoding) */
        if (q[i] < 1 || kv[r] < 0 || kv[r] + q[i] > c->max_seq || len[r] > c->max_seq) {
            PyErr_Format(PyExc_IndexError, "row %lld: %lld new tokens from %d: past its %lld token ids", (long long)r,
                         (long long)q[i], kv[r], (long long)c->max_seq);
            goto done;
        }
        total += q[i];
    }
    const Py_ssize_t sizes[7] = {8, 8, 8, 4, 8, 4, 1};
    const Py_ssize_t counts[7] = {n, n, n, total, n, n * c->max_pages, n};
    const char *what[7] = {"rows", "q_lens", "starts", "token_ids", "num_pages", "page_table", "sample"};
    for (; got < 7; got++)
        if (arg(args[got], &v[got], sizes[got], counts[got], 1, what[got]) < 0)
            goto done;
    int64_t *starts = v[2].buf, *num_out = v[4].buf;
    int32_t *tok = v[3].buf, *pt_out = v[5].buf;
    uint8_t *sample = v[6].buf;
    Py_ssize_t P = 0;
    for (Py_ssize_t i = 0, at = 0; i < n; i++) {
        int64_t r = rows[i];
        starts[i] = kv[r];
        memcpy(tok + at, ids + r * c->max_seq + kv[r], q[i] * sizeof(int32_t));
        at += q[i];
        num_out[i] = num[r];
        sample[i] = kv[r] + q[i] == len[r];
        if (num[r] > P)
            P = num[r];
    }
    if (P > c->max_pages)
        P = c->max_pages;
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(pt_out + i * P, table + rows[i] * c->max_pages, P * sizeof(int32_t));
    result = PyLong_FromSsize_t(P);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

/* KV tokens the running requests are still expected to need (Scheduler._reserved_tokens). */
static PyObject *StepCore_reserved_tokens(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "reserved_tokens(ratio, clip)");
        return NULL;
    }
    double ratio = PyFloat_AsDouble(args[0]);
    long long clip = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    const uint8_t *active = c->arrays[ACTIVE].buf;
    const int32_t *kv = COL(c, KV_LEN), *len = COL(c, LENGTH), *max_len = COL(c, MAX_LEN);
    long long pending = 0, future = 0;
    for (Py_ssize_t r = 0; r < c->rows; r++)
        if (active[r]) {
            long long left = (long long)max_len[r] - len[r];
            pending += len[r] - kv[r];
            future += left < clip ? left : clip;
        }
    return PyFloat_FromDouble((double)pending + ratio * (double)future);
}

static PyObject *StepCore_append(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer v[5] = {{0}};
    PyObject *result = NULL;
    Py_ssize_t n = rows_arg(args, nargs, 5, "append(rows, tokens, logprobs, events, finished)", &v[0]);
    if (n < 0)
        return NULL;
    int got = 1;
    const Py_ssize_t sizes[5] = {8, 4, 4, c->rec_size, 8};
    const int writable[5] = {0, 0, 0, 1, 1};
    const char *what[5] = {"rows", "tokens", "logprobs", "events", "finished"};
    for (; got < 5; got++)
        if (arg(args[got], &v[got], sizes[got], n, writable[got], what[got]) < 0)
            goto done;
    const int64_t *rows = v[0].buf;
    const int32_t *tokens = v[1].buf;
    const float *logprobs = v[2].buf;
    char *out = v[3].buf;
    int64_t *finished = v[4].buf;
    int32_t *ids = COL(c, IDS), *len = COL(c, LENGTH);
    const int32_t *max_len = COL(c, MAX_LEN), *min_len = COL(c, MIN_LEN), *prompt = COL(c, PROMPT_LEN),
                  *stops = COL(c, STOP_IDS);
    const char *src = c->arrays[EVENTS].buf;
    if (check_rows(c, rows, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (len[rows[i]] < 0 || len[rows[i]] >= c->max_seq) {
            PyErr_Format(PyExc_IndexError, "row %lld is full: %d tokens", (long long)rows[i], len[rows[i]]);
            goto done;
        }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int32_t t = tokens[i], L = len[r];
        if (L >= c->max_seq) {  /* a row given twice: checked above only once */
            PyErr_Format(PyExc_IndexError, "row %lld is full: %d tokens", (long long)r, L);
            goto done;
        }
        ids[r * c->max_seq + L] = t;
        len[r] = ++L;
        uint8_t finish = L >= max_len[r] ? c->finish_length : 0;
        if (L > min_len[r]) {
            const int32_t *s = stops + r * c->max_stops;
            for (Py_ssize_t j = 0; j < c->max_stops && s[j] != -1; j++)
                if (s[j] == t) {
                    finish = c->finish_stop;
                    break;
                }
        }
        char *rec = out + i * c->rec_size;
        memcpy(rec, src + r * c->rec_size, c->rec_size);
        uint32_t token = (uint32_t)t, completion = (uint32_t)(L - prompt[r]);
        memcpy(rec + c->token_off, &token, 4);
        memcpy(rec + c->logprob_off, &logprobs[i], 4);
        rec[c->finish_off] = (char)finish;
        memcpy(rec + c->completion_off, &completion, 4);
        if (finish)
            finished[k++] = r;
    }
    result = PyLong_FromSsize_t(k);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

/* ngram_draft's search without its arrays: the occurrences of the last token are tried from
   the latest back, each matched backwards up to the window, so the first longest is the latest */
static PyObject *StepCore_draft(StepCore *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "draft(row, k, min_window, max_window)");
        return NULL;
    }
    Py_ssize_t v[4];
    for (int i = 0; i < 4; i++)
        if ((v[i] = PyLong_AsSsize_t(args[i])) == -1 && PyErr_Occurred())
            return NULL;
    Py_ssize_t row = v[0], k = v[1], lo = v[2], hi = v[3];
    if (row < 0 || row >= c->rows) {
        PyErr_Format(PyExc_IndexError, "row %zd outside the table's %zd rows", row, c->rows);
        return NULL;
    }
    Py_ssize_t L = COL(c, LENGTH)[row];
    if (L < 0 || L > c->max_seq) {
        PyErr_Format(PyExc_IndexError, "row %zd holds %zd tokens", row, L);
        return NULL;
    }
    if (L <= lo || k <= 0)
        return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    const int32_t *ids = COL(c, IDS) + row * c->max_seq;
    const int32_t last = ids[L - 1];
    Py_ssize_t cap = hi < L - 1 ? hi : L - 1, best = 0, best_end = -1;
    for (Py_ssize_t end = L - 2; end >= 0 && best < cap; end--) {
        if (ids[end] != last)
            continue;
        Py_ssize_t m = 1;
        while (m < cap && end - m >= 0 && ids[end - m] == ids[L - 1 - m])
            m++;
        if (m > best)
            best = m, best_end = end;
    }
    if (best_end < 0 || best < lo)
        return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    Py_ssize_t n = L - best_end - 1 < k ? L - best_end - 1 : k;
    return Py_BuildValue("(nn)", best_end + 1, n);
}

static PyMethodDef StepCore_methods[] = {
    {"decode_rows", (PyCFunction)(void (*)(void))StepCore_decode_rows, METH_FASTCALL,
     "decode_rows(page_size, rows, need) -> (n, k)"},
    {"add_pages", (PyCFunction)(void (*)(void))StepCore_add_pages, METH_FASTCALL, "add_pages(rows, pages)"},
    {"step_input", (PyCFunction)(void (*)(void))StepCore_step_input, METH_FASTCALL,
     "step_input(rows, q_lens, starts, token_ids, num_pages, page_table, sample) -> P"},
    {"reserved_tokens", (PyCFunction)(void (*)(void))StepCore_reserved_tokens, METH_FASTCALL,
     "reserved_tokens(ratio, clip) -> float"},
    {"append", (PyCFunction)(void (*)(void))StepCore_append, METH_FASTCALL,
     "append(rows, tokens, logprobs, events, finished) -> k"},
    {"draft", (PyCFunction)(void (*)(void))StepCore_draft, METH_FASTCALL,
     "draft(row, k, min_window, max_window) -> (start, n)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "step_core.StepCore",
    .tp_basicsize = sizeof(StepCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The request table's per-step bookkeeping (see step_core.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)StepCore_init,
    .tp_dealloc = (destructor)StepCore_dealloc,
    .tp_methods = StepCore_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "step_core", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_step_core(void) {
    if (PyType_Ready(&StepCoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StepCoreType);
    if (PyModule_AddObject(m, "StepCore", (PyObject *)&StepCoreType) < 0) {
        Py_DECREF(&StepCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
