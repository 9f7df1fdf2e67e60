/* Uniform integer draws in one call, the numbers numpy's `Generator.integers` gives (see draws.py).
 *
 * `Generator.integers(low, high, size=n)` spends most of a small batch's time in Python-level
 * argument handling. For a range of at most 2**32 - 1 values it takes each number from one 32-bit
 * output of the bit generator by Lemire's multiply-and-reject method (D. Lemire, "Fast Random
 * Integer Generation in an Interval", ACM TOMACS 2019). Done here the same way, through the bit
 * generator's own `next_uint32`, the stream is the same and the generator's state ends the same.
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

static PyMethodDef methods[] = {
    {"integers", integers, METH_VARARGS,
     "integers(capsule, low, span, out) -> None\n\n"
     "Fill out (an int64 buffer) with numbers in [low, low + span], span in [1, 2**32 - 2], drawn\n"
     "from the bit generator behind capsule (BitGenerator.capsule) as Generator.integers draws\n"
     "them. The caller holds the bit generator's lock."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draws", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__draws(void) { return PyModule_Create(&module); }
