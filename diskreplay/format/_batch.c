/* A batch's frames checked and decoded without the GIL (see lz4_blocks.py: `first_bad_checksum`,
 * `LZ4Frames`).
 *
 * Called once per frame from Python, python-lz4's and google-crc32c's functions take and give
 * back the GIL per frame, so decode threads mostly wait for each other. Here each thread runs one
 * loop with the GIL released, taking the batch's blocks a few at a time until none is left. The
 * functions are theirs, passed by address (`LZ4_decompress_safe`, `crc32c_value`): this file
 * links against nothing but Python.
 *
 * A batch's rows are copied here too: runs of rows end to end (`copy_runs`, ragged.py), and rows
 * at random of several fields (`take_rows`, storage/outputs.py), row by row with the memory of the
 * rows ahead asked for first: the loads of several rows are then in flight at once, where a take
 * per field waits for each row's.
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

/* Whether the CRC32C of the body of size bytes at body is the little-endian uint32 after it (as
 * zarr's crc32c codec writes it). */
static int checksum_matches(crc32c_fn crc32c, const uint8_t *body, int64_t size) {
    const uint8_t *stored = body + size;
    uint32_t expected = (uint32_t)stored[0] | (uint32_t)stored[1] << 8 | (uint32_t)stored[2] << 16
                        | (uint32_t)stored[3] << 24;
    return crc32c(body, (size_t)size) == expected;
}

static PyObject *decode_lz4(PyObject *self, PyObject *args) {
    unsigned long long decoder_address, crc_address;
    Py_buffer sources, sizes, targets, checks, cursor;
    Py_ssize_t width, head, take, count = -1, failed = -1, taken = 0;
    int code = 0, bad_checksum = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKy*y*y*ny*nw*n", &decoder_address, &crc_address, &sources, &sizes, &targets,
                          &width, &checks, &head, &cursor, &take))
        return NULL;
    if (!int64_vector(&sources, "sources", &count) || !int64_vector(&sizes, "sizes", &count)
        || !int64_vector(&targets, "targets", &count))
        goto done;
    if (decoder_address == 0 || width <= 0 || width > INT32_MAX || head < 0 || take < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "decode_lz4 needs a decoder, a row width in [1, 2**31 - 1], a head >= 0 and a take >= 1");
        goto done;
    }
    if (checks.len != count || cursor.len != 8) {
        PyErr_SetString(PyExc_ValueError, "decode_lz4 needs one check byte per block and one int64 cursor");
        goto done;
    }
    const uint8_t *check = checks.buf;
    if (crc_address == 0 && memchr(check, 1, (size_t)count) != NULL) {
        PyErr_SetString(PyExc_ValueError, "decode_lz4 needs a crc32c function to check blocks");
        goto done;
    }
    lz4_decode_fn decode = (lz4_decode_fn)(uintptr_t)decoder_address;
    crc32c_fn crc32c = (crc32c_fn)(uintptr_t)crc_address;
    const int64_t *source = sources.buf, *size = sizes.buf, *target = targets.buf;
    int64_t *next = cursor.buf;
    Py_BEGIN_ALLOW_THREADS
    while (failed < 0) {
        int64_t first = __atomic_fetch_add(next, (int64_t)take, __ATOMIC_RELAXED);
        if (first >= count)
            break;
        int64_t end = first + take < count ? first + take : count;
        taken += end - first;
        for (int64_t i = first; i < end && failed < 0; i++) {
            const char *block = (const char *)(uintptr_t)source[i];
            char *row = (char *)(uintptr_t)target[i];
            if (check[i] && (size[i] < 0 || !checksum_matches(crc32c, (const uint8_t *)block - head, size[i] + head))) {
                failed = i;
                bad_checksum = 1;
            } else if (size[i] == width) { /* stored as it was: the row's bytes */
                memcpy(row, block, (size_t)width);
            } else if ((code = size[i] > 0 && size[i] <= INT32_MAX ? decode(block, row, (int)size[i], (int)width)
                                                                   : -1) != width) {
                failed = i;
            }
        }
    }
    if (failed >= 0) /* the other threads stop at their next take */
        __atomic_store_n(next, (int64_t)count, __ATOMIC_RELAXED);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&sources);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&targets);
    PyBuffer_Release(&checks);
    PyBuffer_Release(&cursor);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(nnii)", taken, failed, bad_checksum, failed < 0 || bad_checksum ? 0 : code);
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
        if (!checksum_matches(crc32c, body, size[i])) {
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

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    Py_buffer source, target, starts, lengths;
    Py_ssize_t count = -1, i;
    int64_t used = 0, bad = -1;
    if (!PyArg_ParseTuple(args, "y*w*y*y*", &source, &target, &starts, &lengths))
        return NULL;
    if (int64_vector(&starts, "starts", &count) && int64_vector(&lengths, "lengths", &count)) {
        const int64_t *start = (const int64_t *)starts.buf, *length = (const int64_t *)lengths.buf;
        for (i = 0; i < count && bad < 0; i++) {
            if (start[i] < 0 || length[i] < 0 || start[i] > source.len - length[i] || used > target.len - length[i])
                bad = i;
            used += length[i];
        }
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "run %lld falls outside the source or the target", (long long)bad);
        } else {
            Py_BEGIN_ALLOW_THREADS
            char *out = (char *)target.buf;
            for (i = 0; i < count; i++) {
                memcpy(out, (const char *)source.buf + start[i], (size_t)length[i]);
                out += length[i];
            }
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&source);
    PyBuffer_Release(&target);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

#define TAKE_AHEAD 16 /* rows whose memory is asked for ahead of the row being copied */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif
#define TAKE_FIELDS 64

/* A C-contiguous buffer of rows (ndim >= 1) as (address, rows, bytes per row); 0 if not. */
static int row_buffer(PyObject *array, Py_buffer *view, int writable, const char *name, Py_ssize_t i) {
    if (PyObject_GetBuffer(array, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    if (view->ndim < 1) {
        PyErr_Format(PyExc_ValueError, "%s[%zd] must be an array of rows (ndim >= 1)", name, i);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static Py_ssize_t row_bytes(const Py_buffer *view) { return view->shape[0] ? view->len / view->shape[0] : 0; }

/* Whether row i of every field's index is the row after row i - 1 (rows read in order: copied
 * as one run). */
static int follows(const int64_t *const *at, Py_ssize_t fields, Py_ssize_t i) {
    for (Py_ssize_t f = 0; f < fields; f++)
        if (at[f][i] != at[f][i - 1] + 1)
            return 0;
    return 1;
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    PyObject *source_list, *target_list, *index_list;
    Py_buffer sources[TAKE_FIELDS], targets[TAKE_FIELDS], indexes[TAKE_FIELDS];
    const int64_t *at[TAKE_FIELDS];
    Py_ssize_t width[TAKE_FIELDS];
    Py_ssize_t fields, got = 0, count = -1, f, i, run;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyTuple_Type, &source_list, &PyTuple_Type, &target_list, &PyTuple_Type,
                          &index_list))
        return NULL;
    fields = PyTuple_GET_SIZE(source_list);
    if (fields > TAKE_FIELDS || PyTuple_GET_SIZE(target_list) != fields || PyTuple_GET_SIZE(index_list) != fields) {
        PyErr_Format(PyExc_ValueError, "take_rows needs as many targets and indexes as sources, at most %d",
                     TAKE_FIELDS);
        return NULL;
    }
    for (; got < fields; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(index_list, got), &indexes[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (!row_buffer(PyTuple_GET_ITEM(source_list, got), &sources[got], 0, "sources", got)) {
            PyBuffer_Release(&indexes[got]);
            goto done;
        }
        if (!row_buffer(PyTuple_GET_ITEM(target_list, got), &targets[got], 1, "targets", got)) {
            PyBuffer_Release(&indexes[got]);
            PyBuffer_Release(&sources[got]);
            goto done;
        }
        width[got] = row_bytes(&sources[got]);
        at[got] = (const int64_t *)indexes[got].buf;
        if (!got)
            count = indexes[got].len / 8;
        if (indexes[got].len % 8 != 0 || indexes[got].len / 8 != count) {
            PyErr_Format(PyExc_ValueError, "indexes[%zd] must hold %zd int64 rows, as indexes[0] does", got, count);
            got++;
            goto done;
        }
        if (targets[got].shape[0] < count || (count && row_bytes(&targets[got]) != width[got])) {
            PyErr_Format(PyExc_ValueError, "targets[%zd] must hold %zd rows of %zd bytes, as sources[%zd] has", got,
                         count, width[got], got);
            got++;
            goto done;
        }
        for (i = 0; i < count; i++)
            if (at[got][i] < 0 || at[got][i] >= sources[got].shape[0]) {
                PyErr_Format(PyExc_IndexError, "indexes[%zd][%zd] = %lld is outside the %zd rows of sources[%zd]", got,
                             i, (long long)at[got][i], sources[got].shape[0], got);
                got++;
                goto done;
            }
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < count; i += run) {
        run = 1;
        while (i + run < count && follows(at, fields, i + run))
            run++;
        if (run == 1 && i + TAKE_AHEAD < count)
            for (f = 0; f < fields; f++) {
                const char *row = (const char *)sources[f].buf + at[f][i + TAKE_AHEAD] * width[f];
                PREFETCH(row);
                PREFETCH(row + width[f] - 1);
            }
        for (f = 0; f < fields; f++)
            memcpy((char *)targets[f].buf + i * width[f], (const char *)sources[f].buf + at[f][i] * width[f],
                   (size_t)(run * width[f]));
    }
    Py_END_ALLOW_THREADS
done:
    for (f = 0; f < got; f++) {
        PyBuffer_Release(&indexes[f]);
        PyBuffer_Release(&sources[f]);
        PyBuffer_Release(&targets[f]);
    }
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(source, target, starts, lengths)\n\n"
     "Copy the runs of lengths[i] bytes at byte starts[i] of source (int64 arrays) into target, end\n"
     "to end, without the GIL. Raises ValueError for a run outside source or past target's end."},
    {"decode_lz4", decode_lz4, METH_VARARGS,
     "decode_lz4(decoder, crc32c, sources, sizes, targets, width, checks, head, cursor, take)\n"
     "    -> (taken, failed, bad_checksum, code)\n\n"
     "Decode LZ4 blocks of sizes[i] bytes at addresses sources[i] into width bytes at addresses\n"
     "targets[i] (int64 arrays), with decoder = the address of LZ4_decompress_safe; a block of\n"
     "width bytes is copied as it is. Where checks[i] (uint8) is 1, the block's body (the head\n"
     "bytes before it and the block) is first checked against the CRC32C after it, by crc32c =\n"
     "the address of crc32c_value(data, count). Threads share the blocks through cursor (one\n"
     "int64, the first block not yet taken; 0 at the start): each call takes take blocks at a\n"
     "time until none is left or one fails, which stops the others at their next take. Returns\n"
     "how many blocks this call took, and -1 or the block that failed here: its checksum, or the\n"
     "decoder's result (code) for a block that did not decode to width bytes. The caller vouches\n"
     "for every address."},
    {"first_bad_checksum", first_bad_checksum, METH_VARARGS,
     "first_bad_checksum(crc32c, sources, sizes) -> index or -1\n\n"
     "The first body of sizes[i] bytes at addresses sources[i] (int64 arrays) whose CRC32C, by\n"
     "crc32c = the address of crc32c_value(data, count), is not the little-endian uint32 that\n"
     "follows it; -1 when all match. The caller vouches for every address."},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(sources, targets, indexes)\n\n"
     "targets[f][i] = sources[f][indexes[f][i]] for every field f (tuples of equal length:\n"
     "C-contiguous arrays of rows, indexes int64 arrays of one length) and every row i: the rows one\n"
     "after another, a row's fields together, the memory of the rows 16 ahead asked for first (a run\n"
     "of consecutive rows in every index: one copy per field), without the GIL. Raises IndexError\n"
     "for an index outside its source, ValueError for indexes of other lengths, a target too short\n"
     "or of another row size, an array that is not C-contiguous (or, for a target, not writable);\n"
     "nothing is copied then."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batch", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
