/* A batch's frames checked and decoded in one call each, without the GIL (see codecs.py:
 * `first_bad_checksum`, `decode_lz4_at`).
 *
 * Called once per frame from Python, python-lz4's and google-crc32c's functions take and give
 * back the GIL per frame, so decode threads mostly wait for each other. Here a whole part of a
 * batch is done in one loop with the GIL released. The functions are theirs, passed by address
 * (`LZ4_decompress_safe`, `crc32c_value`): this file links against nothing but Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*lz4_decode_fn)(const char *source, char *target, int source_size, int target_capacity);
typedef uint32_t (*crc32c_fn)(const uint8_t *data, size_t count);

/* Check that a buffer holds int64 values, as many as *count (or set *count, if it is -1). */
static int int64_vector(Py_buffer *view, const char *name, Py_ssize_t *count) {
    if (view->len % 8 != 0 || (*count >= 0 && view->len / 8 != *count)) {
        PyErr_Format(PyExc_ValueError, "%s must hold one int64 per block", name);
        return 0;
    }
    *count = view->len / 8;
    return 1;
}

static PyObject *decode_lz4(PyObject *self, PyObject *args) {
    unsigned long long decoder_address;
    Py_buffer sources, sizes, targets;
    Py_ssize_t width, count = -1, failed = -1;
    int code = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*y*y*n", &decoder_address, &sources, &sizes, &targets, &width))
        return NULL;
    if (!int64_vector(&sources, "sources", &count) || !int64_vector(&sizes, "sizes", &count)
        || !int64_vector(&targets, "targets", &count)) {
        goto done;
    }
    if (decoder_address == 0 || width <= 0 || width > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "decode_lz4 needs a decoder and a row width in [1, 2**31 - 1]");
        goto done;
    }
    lz4_decode_fn decode = (lz4_decode_fn)(uintptr_t)decoder_address;
    const int64_t *source = sources.buf, *size = sizes.buf, *target = targets.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        char *row = (char *)(uintptr_t)target[i];
        const char *block = (const char *)(uintptr_t)source[i];
        if (size[i] == width) { /* stored as it was: the row's bytes */
            memcpy(row, block, (size_t)width);
            continue;
        }
        code = size[i] > 0 && size[i] <= INT32_MAX ? decode(block, row, (int)size[i], (int)width) : -1;
        if (code != width) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&sources);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&targets);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(ni)", failed, failed < 0 ? 0 : code);
}

static PyObject *first_bad_checksum(PyObject *self, PyObject *args) {
    unsigned long long crc_address;
    Py_buffer sources, sizes;
    Py_ssize_t count = -1, failed = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*y*", &crc_address, &sources, &sizes))
        return NULL;
    if (!int64_vector(&sources, "sources", &count) || !int64_vector(&sizes, "sizes", &count))
        goto done;
    if (crc_address == 0) {
        PyErr_SetString(PyExc_ValueError, "first_bad_checksum needs a crc32c function");
        goto done;
    }
    crc32c_fn crc32c = (crc32c_fn)(uintptr_t)crc_address;
    const int64_t *source = sources.buf, *size = sizes.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint8_t *body = (const uint8_t *)(uintptr_t)source[i];
        if (size[i] < 0) {
            failed = i;
            break;
        }
        const uint8_t *stored = body + size[i]; /* little-endian, as zarr's crc32c codec writes it */
        uint32_t expected = (uint32_t)stored[0] | (uint32_t)stored[1] << 8 | (uint32_t)stored[2] << 16
                            | (uint32_t)stored[3] << 24;
        if (crc32c(body, (size_t)size[i]) != expected) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&sources);
    PyBuffer_Release(&sizes);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(failed);
}

static PyMethodDef methods[] = {
    {"decode_lz4", decode_lz4, METH_VARARGS,
     "decode_lz4(decoder, sources, sizes, targets, width) -> (failed, code)\n\n"
     "Decode LZ4 blocks of sizes[i] bytes at addresses sources[i] into width bytes at addresses\n"
     "targets[i] (int64 arrays), with decoder = the address of LZ4_decompress_safe; a block of\n"
     "width bytes is copied as it is. Returns (-1, 0), or the first block that did not decode to\n"
     "width bytes and the decoder's result for it. The caller vouches for every address."},
    {"first_bad_checksum", first_bad_checksum, METH_VARARGS,
     "first_bad_checksum(crc32c, sources, sizes) -> index or -1\n\n"
     "The first body of sizes[i] bytes at addresses sources[i] (int64 arrays) whose CRC32C, by\n"
     "crc32c = the address of crc32c_value(data, count), is not the little-endian uint32 that\n"
     "follows it; -1 when all match. The caller vouches for every address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batch", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
