/* A window's rows as columns, once, when it closes (Recorder.columns): the transpose Python does with
 * zip(*rows) and one list() per field, without the per-field tuples in between, and the clock shift of the
 * start times in the same pass. A column of atoms (ints, strings, untracked tuples of them: every field of the
 * schema) leaves the cyclic GC's list: the collection that follows a window (the GC is off inside it) would
 * otherwise visit every value of every column, a cache miss each. */
#include "fastop.h"

/* columns(rows, width, shift_field, shift): a list of `width` lists, item k of list f being rows[k][f]; rows
 * are tuples of `width` values; `shift` (an int) is added to each value of field `shift_field` (-1: none). */
PyObject *
fastop_columns(PyObject *module, PyObject *args)
{
    PyObject *rows, *shift;
    Py_ssize_t width, shift_field;
    if (!PyArg_ParseTuple(args, "O!nnO:columns", &PyList_Type, &rows, &width, &shift_field, &shift))
        return NULL;
    if (width < 0 || shift_field >= width) {
        PyErr_Format(PyExc_ValueError, "columns: width %zd and shift_field %zd do not fit", width, shift_field);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *row = PyList_GET_ITEM(rows, k);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width) {
            PyErr_Format(PyExc_ValueError, "columns: row %zd is not a tuple of %zd values", k, width);
            return NULL;
        }
    }
    PyObject *columns = PyList_New(width);
    if (columns == NULL)
        return NULL;
    for (Py_ssize_t f = 0; f < width; f++) {
        PyObject *column = PyList_New(n);
        if (column == NULL) {
            Py_DECREF(columns);
            return NULL;
        }
        PyList_SET_ITEM(columns, f, column);
    }
    /* Row by row: each row's tuple is read once (its values are scattered over the heap; going down a column
     * at a time would walk all of them once per field). */
    char *holds_container = PyMem_Calloc(width ? width : 1, 1);
    if (holds_container == NULL) {
        Py_DECREF(columns);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *row = PyList_GET_ITEM(rows, k);
        for (Py_ssize_t f = 0; f < width; f++) {
            PyObject *value = PyTuple_GET_ITEM(row, f);
            if (f == shift_field) {
                value = PyNumber_Add(value, shift);
                if (value == NULL) {
                    PyMem_Free(holds_container);
                    Py_DECREF(columns); /* the items not set yet are NULL: list_dealloc skips them */
                    return NULL;
                }
            } else {
                Py_INCREF(value);
            }
            /* a list holding no tracked object is in no reference cycle while it holds none */
            holds_container[f] |= PyObject_GC_IsTracked(value); /* 0 for a type the GC never tracks */
            PyList_SET_ITEM(PyList_GET_ITEM(columns, f), k, value);
        }
    }
    for (Py_ssize_t f = 0; f < width; f++) {
        if (!holds_container[f])
            PyObject_GC_UnTrack(PyList_GET_ITEM(columns, f));
    }
    PyMem_Free(holds_container);
    return columns;
}

/* untrack_rows(rows): takes a closed window's list of rows off the cyclic GC's list. Its rows hold the schema's
 * values (ints, strings, tuples of them), none of which refers back to the list, so the list is in no reference
 * cycle; untracked, the collection after the window does not visit its rows (a cache miss each). */
PyObject *
fastop_untrack_rows(PyObject *module, PyObject *rows)
{
    if (!PyList_CheckExact(rows)) {
        PyErr_Format(PyExc_TypeError, "untrack_rows: rows must be a list, got %s", Py_TYPE(rows)->tp_name);
        return NULL;
    }
    if (PyObject_GC_IsTracked(rows))
        PyObject_GC_UnTrack(rows);
    Py_RETURN_NONE;
}
