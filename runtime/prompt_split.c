/* GPT-2's pre-tokenizer split of ASCII text, in C (runtime/prompt_encoder.py builds this on
 * first use): the same pieces as prompt_encoder.ASCII_SPLIT.findall, the regex
 *     's|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\s A-Za-z0-9]+|\s+(?!\S)|\s+
 * with \s = [\t\n\v\f\r ], which Python's re runs at ~0.2 µs a piece (a 110-token prompt:
 * ~25 µs). Alternatives are tried in that order at each position, so:
 *   - a contraction wins at an apostrophe;
 *   - a space followed by a letter, digit or other character joins that run;
 *   - a run of whitespace followed by a non-space leaves its last character to the next
 *     piece (\s+(?!\S) backtracks one), unless the run is that one character.
 *
 * Each piece's ids come from a cache (a dict filled by the tokenizer's BPE, which the caller
 * runs): looked up here too, so a prompt whose pieces are all cached is encoded in one call
 * with no Python per piece (the lookups in Python cost ~0.35 µs a piece, three times the split).
 *
 * encode(text: str, start: int, end: int, pieces: dict[str, list[int]], ids: list[int])
 *     -> None, or (i, j): appends the cached ids of text[start:end]'s pieces to `ids` up to the
 *     first piece text[i:j] not in `pieces`; text must be ASCII.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
    if (nargs != 5 || !PyUnicode_Check(args[0]) || !PyDict_Check(args[3]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "encode(text: str, start: int, end: int, pieces: dict, ids: list)");
        return NULL;
    }
    PyObject *text = args[0], *pieces = args[3], *ids = args[4];
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
        PyObject *piece = PyUnicode_FromKindAndData(PyUnicode_1BYTE_KIND, s + i, j - i);
        if (piece == NULL) return NULL;
        PyObject *piece_ids = PyDict_GetItemWithError(pieces, piece);  /* borrowed */
        Py_DECREF(piece);
        if (piece_ids == NULL) {
            if (PyErr_Occurred()) return NULL;
            return Py_BuildValue("(nn)", i, j);
        }
        const Py_ssize_t n = PyList_GET_SIZE(ids);
        if (PyList_SetSlice(ids, n, n, piece_ids) < 0) return NULL;  /* ids += piece_ids */
        i = j;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL,
     "encode(text, start, end, pieces, ids) -> None or (i, j): cached ids of ASCII text's pieces, up to a miss"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "prompt_split", NULL, -1, methods};

PyMODINIT_FUNC PyInit_prompt_split(void) { return PyModule_Create(&module); }
