/* Episode bounds and frame-stack windows of a batch's steps, one call each (see index.py:
 * `EpisodeIndex.bounds`, `EpisodeIndex.stack_windows`).
 *
 * Each lane's ends are kept as [-1, *ends, NO_END], and the start of the episode each closes at
 * the same places. The first end >= a step is found by binary search; numpy would need a
 * searchsorted and two takes per lane, and several calls more for a stack's windows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Lanes' arrays: `at` holds the addresses of every lane's ends, then of every lane's starts;
 * `counts` the ends each holds between its -1 and NO_END. The caller vouches for the addresses. */
typedef struct {
    const int64_t *at, *counts;
    Py_ssize_t lanes;
} lanes_t;

static int int64s(Py_buffer *view, const char *name, Py_ssize_t count) {
    if (view->len != count * 8) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd int64 values, got %zd bytes", name, count, view->len);
        return 0;
    }
    return 1;
}

/* The start and end of the episode holding `step` of `lane`: the first end >= step. */
static int search(const lanes_t *lanes, int64_t lane, int64_t step, int64_t *start, int64_t *end) {
    if (lane < 0 || lane >= lanes->lanes || step < 0) {
        PyErr_Format(PyExc_ValueError, "step %lld of lane %lld: expected a step >= 0 of a lane in [0, %zd)",
                     (long long)step, (long long)lane, lanes->lanes);
        return 0;
    }
    const int64_t *ends = (const int64_t *)(uintptr_t)lanes->at[lane];
    const int64_t *starts = (const int64_t *)(uintptr_t)lanes->at[lanes->lanes + lane];
    int64_t low = 1, high = lanes->counts[lane] + 1; /* ends[0] = -1 < step <= ends[high] = NO_END */
    while (low < high) {
        int64_t middle = low + (high - low) / 2;
        if (ends[middle] < step)
            low = middle + 1;
        else
            high = middle;
    }
    *start = starts[low];
    *end = ends[low];
    return 1;
}

static PyObject *bounds(PyObject *self, PyObject *args) {
    Py_buffer at, counts, lane, step, start, end;
    Py_ssize_t rows;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*", &at, &counts, &lane, &step, &start, &end))
        return NULL;
    lanes_t lanes = {at.buf, counts.buf, counts.len / 8};
    rows = lane.len / 8;
    if (int64s(&at, "at", 2 * lanes.lanes) && int64s(&lane, "lane", rows) && int64s(&step, "step", rows)
        && int64s(&start, "start", rows) && int64s(&end, "end", rows)) {
        const int64_t *ln = lane.buf, *st = step.buf;
        int64_t *first = start.buf, *next_end = end.buf;
        for (Py_ssize_t i = 0; i < rows; i++)
            if (!search(&lanes, ln[i], st[i], &first[i], &next_end[i]))
                break;
    }
    PyBuffer_Release(&at);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&lane);
    PyBuffer_Release(&step);
    PyBuffer_Release(&start);
    PyBuffer_Release(&end);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* One row's window: step + offsets, raised to `first`; its last column lowered to `last` if clamped. */
static void window_of(int64_t step, const int64_t *offsets, Py_ssize_t width, int64_t first, int64_t last,
                      int clamp_last, int64_t *window) {
    for (Py_ssize_t j = 0; j < width; j++) {
        int64_t at = step + offsets[j];
        window[j] = at < first ? first : at;
    }
    if (clamp_last && window[width - 1] > last)
        window[width - 1] = last;
}

static PyObject *stack_windows(PyObject *self, PyObject *args) {
    Py_buffer at, counts, lane, step, lo, hi, offsets, window, kept, ended;
    int clamp_last;
    Py_ssize_t rows, width, found = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*pw*w*w*", &at, &counts, &lane, &step, &lo, &hi, &offsets,
                          &clamp_last, &window, &kept, &ended))
        return NULL;
    lanes_t lanes = {at.buf, counts.buf, counts.len / 8};
    rows = lane.len / 8;
    width = offsets.len / 8;
    if (width > 0 && int64s(&at, "at", 2 * lanes.lanes) && int64s(&lane, "lane", rows)
        && int64s(&step, "step", rows) && int64s(&lo, "lo", lanes.lanes) && int64s(&hi, "hi", lanes.lanes)
        && int64s(&window, "window", rows * width) && int64s(&kept, "kept", rows) && ended.len == rows) {
        const int64_t *ln = lane.buf, *st = step.buf, *low = lo.buf, *high = hi.buf;
        int64_t *kept_row = kept.buf;
        char *kept_ended = ended.buf;
        for (Py_ssize_t i = 0; i < rows; i++) {
            int64_t start, end;
            if (!search(&lanes, ln[i], st[i], &start, &end))
                break;
            int64_t first = start > low[ln[i]] ? start : low[ln[i]];
            int64_t last = end < high[ln[i]] - 1 ? end : high[ln[i]] - 1;
            window_of(st[i], offsets.buf, width, first, last, clamp_last, (int64_t *)window.buf + i * width);
            if (clamp_last && last == st[i]) {
                kept_row[found] = i;
                kept_ended[found++] = end == st[i];
            }
        }
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "stack_windows needs offsets and one ended flag per row");
    }
    PyBuffer_Release(&at);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&lane);
    PyBuffer_Release(&step);
    PyBuffer_Release(&lo);
    PyBuffer_Release(&hi);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&window);
    PyBuffer_Release(&kept);
    PyBuffer_Release(&ended);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"bounds", bounds, METH_VARARGS,
     "bounds(at, counts, lane, step, start, end) -> None\n\n"
     "Write the first step and the end step of the episode holding each (lane[i], step[i]) into\n"
     "start[i] and end[i] (int64 buffers); at and counts describe the lanes' arrays (see _search.c)."},
    {"stack_windows", stack_windows, METH_VARARGS,
     "stack_windows(at, counts, lane, step, lo, hi, offsets, clamp_last, window, kept, ended) -> kept count\n\n"
     "Write each row's window step + offsets, raised to max(episode start, lo[lane]) and, with\n"
     "clamp_last, its last column lowered to last = min(episode end, hi[lane] - 1), into window\n"
     "(int64 [rows * width]); the rows whose last == step into kept (int64), and whether each of\n"
     "them ends its episode into ended (bool). Returns how many rows were kept."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_search", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__search(void) { return PyModule_Create(&module); }
