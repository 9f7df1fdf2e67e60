/* Uniform integer draws in one call, the numbers numpy's `Generator.integers` gives (see draws.py).
 *
 * `Generator.integers(low, high, size=n)` spends most of a small batch's time in Python-level
 * argument handling. For a range of at most 2**32 - 1 values it takes each number from one 32-bit
 * output of the bit generator by Lemire's multiply-and-reject method (D. Lemire, "Fast Random
 * Integer Generation in an Interval", ACM TOMACS 2019). Done here the same way, through the bit
 * generator's own `next_uint32`, the stream is the same and the generator's state ends the same.
 *
 * Also PCG64 states set many at a time: `PCG64.state = {...}` costs ~2 us of dict handling per
 * generator; a dataset sets one per batch (torch/batch_rng.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* numpy's `bitgen_t` (numpy/random/bitgen.h), behind a BitGenerator's "BitGenerator" capsule. */
typedef struct {
    void *state;
    uint64_t (*next_uint64)(void *state);
    uint32_t (*next_uint32)(void *state);
    double (*next_double)(void *state);
    uint64_t (*next_raw)(void *state);
} bitgen_t;

/* numpy's PCG64 state (numpy/random/src/pcg64/pcg64.h), behind a PCG64's `bitgen_t.state`, where the
 * compiler has 128-bit integers (numpy's pcg128_t is then __uint128_t). draws.py checks this layout
 * against numpy's own state setter at import and does not call `set_pcg64` where they differ. */
#ifdef __SIZEOF_INT128__
typedef struct {
    __uint128_t state;
    __uint128_t inc;
} pcg64_words;

typedef struct {
    pcg64_words *words;
    int has_uint32;
    uint32_t uinteger;
} pcg64_state;
#endif

/* A number in [0, span] (span < 2**32 - 1): the high half of a 32-bit draw times span + 1,
 * drawn again while the low half falls below the threshold that makes every value equally likely. */
static uint32_t bounded(bitgen_t *bits, uint32_t span) {
    const uint32_t values = span + 1;
    uint64_t product = (uint64_t)bits->next_uint32(bits->state) * values;
    uint32_t low = (uint32_t)product;
    if (low < values) {
        const uint32_t threshold = (UINT32_MAX - span) % values;
        while (low < threshold) {
            product = (uint64_t)bits->next_uint32(bits->state) * values;
            low = (uint32_t)product;
        }
    }
    return (uint32_t)(product >> 32);
}

static PyObject *integers(PyObject *self, PyObject *args) {
    PyObject *capsule;
    long long low;
    unsigned long long span;
    Py_buffer out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLKw*", &capsule, &low, &span, &out))
        return NULL;
    bitgen_t *bits = PyCapsule_GetPointer(capsule, "BitGenerator");
    if (bits == NULL)
        goto done;
    if (span == 0 || span >= UINT32_MAX || out.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "integers needs a span in [1, 2**32 - 2] and an int64 buffer");
        goto done;
    }
    int64_t *value = out.buf;
    for (Py_ssize_t i = 0; i < out.len / 8; i++)
        value[i] = low + (int64_t)bounded(bits, (uint32_t)span);
done:
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *set_pcg64(PyObject *self, PyObject *args) {
    PyObject *capsules;
    Py_buffer words;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!y*", &PyList_Type, &capsules, &words))
        return NULL;
#ifdef __SIZEOF_INT128__
    Py_ssize_t count = PyList_GET_SIZE(capsules);
    if (words.len != count * 4 * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "set_pcg64 needs 4 uint64 words per capsule");
        goto done;
    }
    const uint64_t *word = words.buf;
    for (Py_ssize_t i = 0; i < count; i++, word += 4) {
        bitgen_t *bits = PyCapsule_GetPointer(PyList_GET_ITEM(capsules, i), "BitGenerator");
        if (bits == NULL)
            goto done;
        pcg64_state *state = bits->state;
        state->words->state = (__uint128_t)word[0] << 64 | word[1];
        state->words->inc = (__uint128_t)word[2] << 64 | word[3];
        state->has_uint32 = 0;
        state->uinteger = 0;
    }
#else
    PyErr_SetString(PyExc_NotImplementedError, "set_pcg64 needs a compiler with 128-bit integers");
    goto done;
#endif
done:
    PyBuffer_Release(&words);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"integers", integers, METH_VARARGS,
     "integers(capsule, low, span, out) -> None\n\n"
     "Fill out (an int64 buffer) with numbers in [low, low + span], span in [1, 2**32 - 2], drawn\n"
     "from the bit generator behind capsule (BitGenerator.capsule) as Generator.integers draws\n"
     "them. The caller holds the bit generator's lock."},
    {"set_pcg64", set_pcg64, METH_VARARGS,
     "set_pcg64(capsules, words) -> None\n\n"
     "Set the PCG64 bit generators behind capsules (a list of PCG64.capsule) to the states in words\n"
     "(uint64 [len(capsules), 4]: state high, state low, increment high, increment low), with no\n"
     "buffered 32-bit output: what PCG64.state's setter does. Only for PCG64 capsules."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draws", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__draws(void) { return PyModule_Create(&module); }
