/* What a saving window keeps of an op, as Recorder._save keeps it, and the check at close that what it kept
 * still has its memory (capture._drop_freed, _common.has_its_bytes). Kept in C for the compiled path: in
 * Python, keeping an op's outputs and the inputs its replay reads makes ~9 calls per op (detach, the storage's
 * key, the watch list), each paid with caches the kernel before it emptied; on a small model (an MLP of 11
 * ops) that is as much as the window's whole fixed cost. */
#include "fastop.h"

static PyObject *g_strided; /* torch.strided, looked up at the first sparse output */

/* Recorder.watch: adds `entry` (op, what, position) to rec._storage_refs under t's storage address, so that an
 * in-place write into that memory first copies what the entry names. 1, 0 when t has no storage to watch
 * (_common.storage_key is None), -1 with an error set. */
static int
watch(FastOp *self, PyObject *t, PyObject *index, int what, Py_ssize_t pos)
{
    PyObject *storage = storage_of(t);
    if (storage == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long long nbytes;
    PyObject *key = storage_address(storage, &nbytes);
    Py_DECREF(storage);
    if (key == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int rc = -1;
    PyObject *entry = Py_BuildValue("(Oin)", index, what, pos);
    PyObject *entries = entry == NULL ? NULL : PyDict_GetItemWithError(self->storage_refs, key);
    if (entries != NULL) {
        rc = PyList_Check(entries) ? PyList_Append(entries, entry) : -1;
        if (rc < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "tl_dist: Recorder._storage_refs holds lists");
    } else if (entry != NULL && !PyErr_Occurred()) {
        PyObject *fresh = PyList_New(1);
        if (fresh != NULL) {
            PyList_SET_ITEM(fresh, 0, Py_NewRef(entry));
            rc = PyDict_SetItem(self->storage_refs, key, fresh);
            Py_DECREF(fresh);
        }
    }
    Py_XDECREF(entry);
    Py_DECREF(key);
    return rc < 0 ? -1 : 1;
}

/* t, or t.detach() where the window does not keep the graph (keep_graph=False): a new reference. */
static PyObject *
kept(FastOp *self, PyObject *t)
{
    return self->keep_graph ? Py_NewRef(t) : tensor_call(t, M_DETACH);
}

/* Whether t is not strided (sparse: no one storage to watch, so its value is copied): 1, 0, -1 with an error. */
static int
not_strided(PyObject *t)
{
    if (g_strided == NULL) {
        PyObject *torch = PyImport_ImportModule("torch");
        g_strided = torch == NULL ? NULL : PyObject_GetAttrString(torch, "strided");
        Py_XDECREF(torch);
        if (g_strided == NULL)
            return -1;
    }
    PyObject *layout = PyObject_GetAttr(t, s_layout);
    if (layout == NULL)
        return -1;
    Py_DECREF(layout);
    return layout != g_strided;
}

int
save_outputs(FastOp *self, PyObject *index, PyObject *outs, PyObject *func, PyObject *args, PyObject *kwargs,
             PyObject *tensors, PyObject *srcs, PyObject *pre_write)
{
    Py_ssize_t n_out = PySequence_Fast_GET_SIZE(outs), n_in = PyTuple_GET_SIZE(tensors);
    PyObject **items = PySequence_Fast_ITEMS(outs);
    PyObject *saved = PyList_New(n_out), *consts = NULL, *record = NULL;
    if (saved == NULL)
        return -1;
    for (Py_ssize_t pos = 0; pos < n_out; pos++) {
        PyObject *value = kept(self, items[pos]);
        if (value == NULL)
            goto error;
        PyList_SET_ITEM(saved, pos, value);
    }
    if (PyDict_SetItem(self->saved, index, saved) < 0)
        goto error;
    for (Py_ssize_t pos = 0; pos < n_out; pos++) {
        int watched = watch(self, items[pos], index, 0, pos);
        int sparse = watched == 0 ? not_strided(items[pos]) : 0;
        if (watched < 0 || sparse < 0)
            goto error;
        if (sparse) {
            PyObject *copy = PyObject_CallMethodNoArgs(PyList_GET_ITEM(saved, pos), s_clone);
            if (copy == NULL || PyList_SetItem(saved, pos, copy) < 0)
                goto error;
        }
    }
    /* Replay info: the arguments as the dispatcher passed them (their tensors act as slots), and the value of
     * each input no op of the window made (a parameter, the input), watched for a later write in place. */
    if (!PyList_Check(srcs) || PyList_GET_SIZE(srcs) != n_in) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: one source per input tensor");
        goto error;
    }
    if ((consts = PyList_New(n_in)) == NULL)
        goto error;
    for (Py_ssize_t k = 0; k < n_in; k++) {
        PyObject *value = Py_None, *t = PyTuple_GET_ITEM(tensors, k);
        if (PyList_GET_ITEM(srcs, k) == Py_None) {
            PyObject *before = NULL;
            if (pre_write != NULL && pre_write != Py_None) {
                PyObject *slot = PyLong_FromSsize_t(k);
                before = slot == NULL ? NULL : PyDict_GetItemWithError(pre_write, slot);
                Py_XDECREF(slot);
                if (before == NULL && PyErr_Occurred())
                    goto error;
            }
            value = before != NULL ? Py_NewRef(before) : kept(self, t); /* the value before this op wrote it */
            if (value == NULL)
                goto error;
            PyList_SET_ITEM(consts, k, value);
            if (watch(self, t, index, 1, k) < 0)
                goto error;
        } else {
            PyList_SET_ITEM(consts, k, Py_NewRef(Py_None));
        }
    }
    record = PyTuple_Pack(5, func, args, kwargs, srcs, consts);
    if (record == NULL || PyDict_SetItem(self->replay_records, index, record) < 0)
        goto error;
    Py_DECREF(record);
    Py_DECREF(consts);
    Py_DECREF(saved);
    return 0;
error:
    Py_XDECREF(record);
    Py_XDECREF(consts);
    Py_DECREF(saved);
    return -1;
}

/* -- at close --------------------------------------------------------------------------------------------- */

/* _common.has_its_bytes for a plain tensor or Parameter: 1, 0 (its storage was resized below what it reads:
 * FSDP freed it), -1 with an error set. */
static int
plain_has_its_bytes(PyObject *t)
{
    PyObject *storage = tensor_call(t, M_UNTYPED_STORAGE);
    if (storage == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_NotImplementedError) && !PyErr_ExceptionMatches(PyExc_RuntimeError))
            return -1;
        PyErr_Clear(); /* no one storage (sparse, nested): nothing that could have been freed */
        return 1;
    }
    PyObject *size = PyObject_CallMethodNoArgs(storage, s_nbytes);
    if (size == NULL) {
        Py_DECREF(storage);
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    long long nbytes = PyLong_AsLongLong(size), lo, hi;
    Py_DECREF(size);
    int rc = nbytes == -1 && PyErr_Occurred() ? -1 : byte_extent(t, storage, &lo, &hi);
    Py_DECREF(storage);
    return rc < 0 ? -1 : nbytes >= hi;
}

PyObject *
fastop_freed(PyObject *module, PyObject *args)
{
    PyObject *kept_by_op, *fallback;
    if (!PyArg_ParseTuple(args, "O!O:freed", &PyDict_Type, &kept_by_op, &fallback))
        return NULL;
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    Py_ssize_t at = 0;
    PyObject *index, *outs;
    while (PyDict_Next(kept_by_op, &at, &index, &outs)) {
        if (!PyList_Check(outs)) {
            PyErr_SetString(PyExc_TypeError, "tl_dist: saved outputs are lists");
            goto error;
        }
        for (Py_ssize_t pos = 0; pos < PyList_GET_SIZE(outs); pos++) {
            PyObject *t = PyList_GET_ITEM(outs, pos);
            if (t == Py_None)
                continue;
            PyTypeObject *type = Py_TYPE(t);
            int has;
            if (type == (PyTypeObject *)g_tensor_type || type == (PyTypeObject *)g_parameter_type) {
                has = plain_has_its_bytes(t);
            } else { /* a wrapper subclass: its local tensor's bytes (Python) */
                PyObject *r = PyObject_CallOneArg(fallback, t);
                has = r == NULL ? -1 : PyObject_IsTrue(r);
                Py_XDECREF(r);
            }
            if (has < 0)
                goto error;
            if (!has) {
                PyObject *where = Py_BuildValue("(On)", index, pos);
                if (where == NULL || PyList_Append(found, where) < 0) {
                    Py_XDECREF(where);
                    goto error;
                }
                Py_DECREF(where);
            }
        }
    }
    return found;
error:
    Py_DECREF(found);
    return NULL;
}
