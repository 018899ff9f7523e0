/* The window's in-place write log, as Recorder._note_writes and Recorder._written_since keep and read it:
 * rec._writes maps a storage's address to [(op, first byte, end byte)] of the writes into it, and
 * rec._written_storage that address to a weak reference to the storage (an address reused by a new storage
 * is a new log). Kept in C for the compiled path: a training step writes in place ~200 times (the
 * optimizer, gradient accumulation, ReLU(inplace=True)) and reads parameters after writes ~1,000 times. */
#include "fastop.h"

/* t.untyped_storage(), or NULL with no error where it has none (sparse: NotImplementedError). */
PyObject *
storage_of(PyObject *t)
{
    PyObject *storage = tensor_call(t, M_UNTYPED_STORAGE);
    if (storage == NULL && PyErr_ExceptionMatches(PyExc_NotImplementedError))
        PyErr_Clear();
    return storage;
}

/* _common.storage_address: the storage's address (and *nbytes its size), or NULL with no error when it is empty
 * or has none. */
PyObject *
storage_address(PyObject *storage, long long *nbytes)
{
    PyObject *size = PyObject_CallMethodNoArgs(storage, s_nbytes);
    *nbytes = size == NULL ? -1 : PyLong_AsLongLong(size);
    Py_XDECREF(size);
    int empty = *nbytes == -1 && PyErr_Occurred() ? -1 : *nbytes == 0;
    PyObject *key = empty == 0 ? PyObject_CallMethodNoArgs(storage, s_data_ptr) : NULL;
    if (key == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_RuntimeError))
        PyErr_Clear();
    return key;
}

/* -- where the logged storages lie ----------------------------------------------------------------------
 * Most tensors an op reads after the window's first write in place are in no logged storage (parameters read
 * after a dropout mask was written, gradients read by the optimizer). Finding a tensor's storage makes a
 * storage object and asks it two things; its data pointer alone says it is in none of them, when it falls
 * outside every [address, address + nbytes) of the log: a sorted list of disjoint spans, their union (a
 * superset: spans of storages freed since stay). Writes logged by Recorder._note_writes (the Python path) move
 * rec.writes_generation: the spans are then made again from rec._written_storage. */

void
clear_spans(FastOp *self)
{
    PyMem_Free(self->written_spans);
    self->written_spans = NULL;
    self->n_spans = self->spans_cap = 0;
    self->spans_generation = -1;
}

/* Adds [lo, hi) to the union. */
static int
add_span(FastOp *self, unsigned long long lo, unsigned long long hi)
{
    struct span *v = self->written_spans;
    Py_ssize_t n = self->n_spans, first = 0;
    while (first < n && v[first].hi < lo) /* the first span that touches or follows [lo, hi) */
        first++;
    Py_ssize_t last = first; /* one past the last span [lo, hi) touches */
    while (last < n && v[last].lo <= hi) {
        lo = Py_MIN(lo, v[last].lo);
        hi = Py_MAX(hi, v[last].hi);
        last++;
    }
    if (last == first) { /* touches none: one more span */
        if (n == self->spans_cap) {
            Py_ssize_t cap = n ? 2 * n : 16;
            struct span *grown = PyMem_Realloc(v, cap * sizeof(struct span));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->written_spans = v = grown;
            self->spans_cap = cap;
        }
        memmove(v + first + 1, v + first, (n - first) * sizeof(struct span));
        self->n_spans = n + 1;
    } else if (last > first + 1) { /* merged: the spans after it move down */
        memmove(v + first + 1, v + last, (n - last) * sizeof(struct span));
        self->n_spans = n - (last - first - 1);
    }
    v[first].lo = lo;
    v[first].hi = hi;
    return 0;
}

/* Adds the span of a logged storage: its address `key` (an int) and its size. */
static int
add_storage_span(FastOp *self, PyObject *key, long long nbytes)
{
    unsigned long long address = PyLong_AsUnsignedLongLong(key);
    if (address == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return add_span(self, address, address + (unsigned long long)nbytes);
}

/* Makes the spans again from rec._written_storage when Python's write log moved since they were made. */
static int
spans_current(FastOp *self)
{
    PyObject *value = rec_get(self, ST_WRITES_GENERATION);
    long long generation = value == NULL ? -1 : PyLong_AsLongLong(value);
    Py_XDECREF(value);
    if (generation == -1 && PyErr_Occurred())
        return -1;
    if (generation == self->spans_generation)
        return 0;
    self->n_spans = 0;
    Py_ssize_t pos = 0;
    PyObject *key, *ref;
    while (PyDict_Next(self->written_storage, &pos, &key, &ref)) {
        PyObject *storage = PyWeakref_Check(ref) ? PyWeakref_GetObject(ref) : NULL;
        if (storage == NULL || storage == Py_None) /* freed: nothing of it is read again */
            continue;
        long long nbytes;
        PyObject *address = storage_address(storage, &nbytes);
        int rc = address == NULL ? (PyErr_Occurred() ? -1 : 0) : add_storage_span(self, address, nbytes);
        Py_XDECREF(address);
        if (rc < 0)
            return -1;
    }
    self->spans_generation = generation;
    return 0;
}

/* Whether t's data pointer is in a span: 1; 0 when it is in none (no logged storage holds t); -1 with an error.
 * A tensor without a data pointer counts as in one (the storage path decides). */
static int
in_spans(FastOp *self, PyObject *t)
{
    if (spans_current(self) < 0)
        return -1;
    PyObject *value = tensor_call(t, M_DATA_PTR);
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    unsigned long long p = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    if (p == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    struct span *v = self->written_spans;
    Py_ssize_t lo = 0, hi = self->n_spans; /* the first span ending after p */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (v[mid].hi <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < self->n_spans && v[lo].lo <= p;
}

/* *value = r as a C integer; r is a new reference (consumed) or NULL with an error set. */
static int
long_of(PyObject *r, long long *value)
{
    if (r == NULL)
        return -1;
    *value = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* _common.byte_extent: [*lo, *hi) bytes of its storage t can touch (a superset for strided views). */
int
byte_extent(PyObject *t, PyObject *storage, long long *lo, long long *hi)
{
    long long offset, itemsize, numel;
    if (long_of(tensor_call(t, M_STORAGE_OFFSET), &offset) < 0 || long_of(tensor_call(t, M_ELEMENT_SIZE), &itemsize) < 0)
        return -1;
    PyObject *contiguous = tensor_call(t, M_IS_CONTIGUOUS);
    int dense = contiguous == NULL ? -1 : PyObject_IsTrue(contiguous);
    Py_XDECREF(contiguous);
    if (dense < 0)
        return -1;
    if (dense) {
        if (long_of(tensor_call(t, M_NUMEL), &numel) < 0)
            return -1;
        *lo = numel ? offset * itemsize : 0;
        *hi = numel ? (offset + numel) * itemsize : 0;
        return 0;
    }
    PyObject *strides = tensor_call(t, M_STRIDE);
    if (strides == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) /* a nested tensor: no strides; any byte of it */
            return -1;
        PyErr_Clear();
        *lo = 0;
        return long_of(PyObject_CallMethodNoArgs(storage, s_nbytes), hi);
    }
    PyObject *shape = tensor_get(t, T_SHAPE);
    PyObject *sizes = shape == NULL ? NULL : PySequence_Fast(shape, "shape");
    PyObject *steps = sizes == NULL ? NULL : PySequence_Fast(strides, "stride()");
    Py_XDECREF(shape);
    Py_DECREF(strides);
    if (steps == NULL) {
        Py_XDECREF(sizes);
        return -1;
    }
    long long end = offset + 1;
    Py_ssize_t dims = Py_MIN(PySequence_Fast_GET_SIZE(sizes), PySequence_Fast_GET_SIZE(steps));
    int rc = 0, empty = 0;
    for (Py_ssize_t d = 0; d < dims && !empty; d++) {
        long long size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sizes, d));
        long long step = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(steps, d));
        if ((size == -1 || step == -1) && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        if (size == 0)
            empty = 1;
        else
            end += (size - 1) * (step < 0 ? -step : step);
    }
    Py_DECREF(sizes);
    Py_DECREF(steps);
    *lo = empty ? 0 : offset * itemsize;
    *hi = empty ? 0 : end * itemsize;
    return rc;
}

/* Whether rec._written_storage[key] is a reference to `storage`: 1, 0, or -1 with an error set. */
static int
same_storage(FastOp *self, PyObject *key, PyObject *storage)
{
    PyObject *owner = PyDict_GetItemWithError(self->written_storage, key);
    if (owner == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyWeakref_Check(owner)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: Recorder._written_storage holds weak references");
        return -1;
    }
    return PyWeakref_GetObject(owner) == storage;
}

int
note_writes(FastOp *self, PyObject *index, PyObject *written)
{
    if (rec_set(self, ST_LAST_WRITE, index) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(written); i++) {
        PyObject *t = PyList_GET_ITEM(written, i);
        PyObject *storage = storage_of(t);
        if (storage == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        long long lo = 0, hi = 0, nbytes;
        PyObject *key = storage_address(storage, &nbytes);
        int rc = key == NULL ? (PyErr_Occurred() ? -1 : 0) : byte_extent(t, storage, &lo, &hi);
        if (rc == 0 && key != NULL && hi > lo) {
            PyObject *entry = add_storage_span(self, key, nbytes) < 0 ? NULL : Py_BuildValue("(OLL)", index, lo, hi);
            int same = entry == NULL ? -1 : same_storage(self, key, storage);
            if (same == 1) {
                PyObject *entries = PyDict_GetItemWithError(self->writes, key);
                if (entries != NULL && PyList_Check(entries)) {
                    rc = PyList_Append(entries, entry);
                } else { /* Recorder._note_writes keeps a list for every storage it logs */
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_TypeError, "tl_dist: a written storage without its write log list");
                    rc = -1;
                }
            } else if (same == 0) {
                PyObject *ref = PyWeakref_NewRef(storage, NULL);
                PyObject *entries = ref == NULL ? NULL : PyList_New(1);
                if (entries != NULL) {
                    PyList_SET_ITEM(entries, 0, Py_NewRef(entry));
                    rc = PyDict_SetItem(self->written_storage, key, ref) < 0 ||
                                 PyDict_SetItem(self->writes, key, entries) < 0
                             ? -1
                             : 0;
                } else {
                    rc = -1;
                }
                Py_XDECREF(ref);
                Py_XDECREF(entries);
            } else {
                rc = -1;
            }
            Py_XDECREF(entry);
        }
        Py_XDECREF(key);
        Py_DECREF(storage);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* Recorder._written_since: the latest op after op `since` that wrote in place into memory t covers, or -1;
 * -2 with an error set. */
static long
written_since(FastOp *self, PyObject *t, PyObject *storage, PyObject *key, long since)
{
    PyObject *entries = PyDict_GetItemWithError(self->writes, key);
    if (entries == NULL)
        return PyErr_Occurred() ? -2 : -1;
    if (!PyList_Check(entries) || PyList_GET_SIZE(entries) == 0)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    long last = PyLong_AsLong(PyTuple_GET_ITEM(PyList_GET_ITEM(entries, n - 1), 0));
    if (last == -1 && PyErr_Occurred())
        return -2;
    if (last <= since)
        return -1;
    int same = same_storage(self, key, storage);
    if (same <= 0)
        return same < 0 ? -2 : -1;
    long long lo, hi;
    if (byte_extent(t, storage, &lo, &hi) < 0)
        return -2;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        long op = PyLong_AsLong(PyTuple_GET_ITEM(entry, 0));
        long long wlo = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
        long long whi = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 2));
        if (PyErr_Occurred())
            return -2;
        if (op <= since)
            break;
        if (wlo < hi && lo < whi)
            return op;
    }
    return -1;
}

int
add_writer(FastOp *self, PyObject *parents, PyObject *t, long since)
{
    int maybe = in_spans(self, t);
    if (maybe <= 0)
        return maybe;
    PyObject *storage = storage_of(t);
    if (storage == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long long nbytes;
    PyObject *key = storage_address(storage, &nbytes);
    long writer = -1;
    if (key == NULL) {
        writer = PyErr_Occurred() ? -2 : -1;
    } else {
        int written = PyDict_Contains(self->writes, key); /* most inputs' memory was never written */
        writer = written < 0 ? -2 : written ? written_since(self, t, storage, key, since) : -1;
        Py_DECREF(key);
    }
    Py_DECREF(storage);
    if (writer < 0)
        return writer == -2 ? -1 : 0;
    PyObject *op = PyLong_FromLong(writer);
    int rc = op == NULL ? -1 : add_parent(parents, op);
    Py_XDECREF(op);
    return rc < 0 ? -1 : 1;
}
