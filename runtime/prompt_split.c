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
 * split(text: str, start: int, end: int) -> list[str]; text must be ASCII.
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

static PyObject *split(PyObject *self, PyObject *args) {
    PyObject *text;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "Unn", &text, &start, &end)) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "split takes ASCII text");
        return NULL;
    }
    const Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    if (start < 0) start = 0;
    if (end > len) end = len;
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    PyObject *pieces = PyList_New(0);
    if (pieces == NULL) return NULL;
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
        if (piece == NULL || PyList_Append(pieces, piece) < 0) {
            Py_XDECREF(piece);
            Py_DECREF(pieces);
            return NULL;
        }
        Py_DECREF(piece);
        i = j;
    }
    return pieces;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(text, start, end) -> GPT-2's pre-tokenizer pieces of ASCII text"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "prompt_split", NULL, -1, methods};

PyMODINIT_FUNC PyInit_prompt_split(void) { return PyModule_Create(&module); }
