/* The compiled twin of Recorder.on_op for the telemetry window's common op (tl_dist/_fastpath.py).
 *
 * Every ATen op of a captured step passes through the recorder; in Python its per-op work (tags, shapes,
 * dtype, phase, module, the row) costs ~48,000 instructions, a third of them bytecode evaluation, spread too
 * thin for any one Python change to matter (docs/telemetry.md, "Cost"). This file does the same work for
 * the ops a metadata + timing window sees most: no tensor subclass, no collective, no tensor list, no
 * intervention, CPU tensors or a view, outputs not saved. In-place writes and output statistics are left
 * to the recorder's own Python helpers.
 * Anything else returns to Recorder.on_op, which stays the reference: tests/test_fastop.py checks that
 * both build the same rows.
 *
 * It uses the CPython API only (no torch headers): torch is reached through the Python objects handed to
 * configure(), so the extension does not depend on torch's C++ ABI. Field order of a row is
 * schema.OP_FIELDS's; _fastpath.py asserts it at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

/* Set once by configure(). */
static PyObject *g_tensor_type, *g_parameter_type;
static PyObject *g_entries;      /* id(func) -> entry tuple, or None for an op that always takes the slow path */
static PyObject *g_make_entry;   /* func -> entry tuple or None */
static PyObject *g_dtype_names, *g_device_names, *g_dtype_name, *g_device_name;
static PyObject *g_flat_outputs, *g_shape_of, *g_flop_count;
static PyObject *g_graph_task_id, *g_grad_enabled, *g_accumulating_param;
static PyObject *g_perf_counter_ns, *g_current_node;
static PyObject *g_labels;       /* func name -> [its labels func_1, func_2, ...]: made once per process */
static PyObject *g_tag;          /* "_tl_src": the attribute on tensors and the key in autograd metadata */

/* Interned names. */
static PyObject *s_pending, *s_n_ops, *s_edits, *s_phase, *s_last_write, *s_hooks_on, *s_grad_fn, *s_metadata,
    *s_dtype, *s_device, *s_is_cpu, *s_is_cuda, *s_shape, *s_nelement, *s_element_size, *s_current, *s_cpu, *s_factory, *s_other, *s_view, *s_backward, *s_recompute, *s_empty,
    *s_current_builtin, *s_current_source, *s_step_source, *s_optimizer, *s_untyped_storage, *s_nbytes,
    *s_data_ptr, *s_base;

/* Entry tuple layout, built by _fastpath.make_entry. */
enum { E_FUNC, E_INFO, E_CALL, E_NAME, E_ATEN, E_KIND, E_FLOPS, E_SPECIAL, E_MUTATES, E_SIZE };

#define N_FIELDS 22

typedef struct {
    PyObject_HEAD
    PyObject *rec;              /* the Recorder */
    PyObject *on_op;            /* rec.on_op: the slow path */
    PyObject *rows, *label_counts, *params, *writes, *backward_sources, *token;
    PyObject *modules, *training;
    PyObject *link_pending, *written_since, *record_failure, *phase_special, *recomputed, *owner_of;
    PyObject *locate;           /* rec.locate: the user's file:line of an op, or None when not recorded */
    PyObject *mode;             /* weak reference to the mode this is the __torch_dispatch__ of */
    PyObject *storage_refs;     /* rec._storage_refs: saved tensors to copy before a write (saving windows) */
    PyObject *note_writes, *with_written_bases;
    int hooks_on;               /* training.hooks_on: gradient hooks on each output's node (fixed per window) */
    int stats_on;               /* rec.stats_on: output statistics (TrainingState.out_stats, in Python) */
    PyObject *in_flight, *out_stats, *arrived; /* training's collectives awaiting their statistics */
} FastOp;

static int
lookup_attr(PyObject *obj, PyObject *name, PyObject **result)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, result);
#else
    return _PyObject_LookupAttr(obj, name, result);
#endif
}

static PyObject *
now_ns(void)
{
#if defined(__linux__)
    /* time.perf_counter_ns() is CLOCK_MONOTONIC on Linux; the rest of tl_dist compares against it. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
#else
    return PyObject_CallNoArgs(g_perf_counter_ns);
#endif
}

static int
is_tensor(PyObject *o)
{
    /* isinstance(o, torch.Tensor): torch's metaclass does not override the check, so a subtype test is it. */
    return PyObject_TypeCheck(o, (PyTypeObject *)g_tensor_type);
}

/* Takes a tuple of atoms (ints, strs, tuples already untracked) off the cyclic GC's list, as the GC's own
 * first pass over it would: the window's rows then cost that pass nothing when the window closes. */
static void
untrack_atomic(PyObject *t)
{
    if (!PyTuple_CheckExact(t) || !PyObject_GC_IsTracked(t))
        return;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        if (PyObject_IS_GC(item) && PyObject_GC_IsTracked(item))
            return;
    }
    PyObject_GC_UnTrack(t);
}

/* The entry of func: a tuple, Py_None (slow path), or NULL with an error set. Borrowed. */
static PyObject *
entry_of(PyObject *func)
{
    PyObject *key = PyLong_FromVoidPtr(func);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(g_entries, key);
    if (entry != NULL && (entry == Py_None || PyTuple_GET_ITEM(entry, E_FUNC) == func)) {
        Py_DECREF(key);
        return entry;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *made = PyObject_CallOneArg(g_make_entry, func);
    if (made == NULL || PyDict_SetItem(g_entries, key, made) < 0) {
        Py_XDECREF(made);
        Py_DECREF(key);
        return NULL;
    }
    Py_DECREF(key);
    Py_DECREF(made); /* the dict holds it */
    return made;
}

/* Tags the autograd node of the previous op's single output with that op (TrainingState.link_pending's
 * common case); anything else calls it. */
static int
link_pending(FastOp *self, PyObject *pending)
{
    int hooks = self->hooks_on;
    PyObject *outs = PyTuple_Check(pending) && PyTuple_GET_SIZE(pending) == 2 ? PyTuple_GET_ITEM(pending, 1) : NULL;
    if (hooks || outs == NULL || !PyList_Check(outs) || PyList_GET_SIZE(outs) != 1) {
        PyObject *r = PyObject_CallNoArgs(self->link_pending);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *link = PyTuple_GET_ITEM(pending, 0);
    Py_INCREF(pending); /* keeps link and outs alive past the reset */
    if (PyObject_SetAttr(self->rec, s_pending, Py_None) < 0) {
        Py_DECREF(pending);
        return -1;
    }
    int rc = -1;
    PyObject *node = PyObject_GetAttr(PyList_GET_ITEM(outs, 0), s_grad_fn);
    if (node == NULL)
        goto done;
    if (node == Py_None) {
        rc = 0;
        goto done;
    }
    PyObject *meta = PyObject_GetAttr(node, s_metadata);
    if (meta == NULL)
        goto done;
    PyObject *old = PyDict_Check(meta) ? Py_XNewRef(PyDict_GetItemWithError(meta, g_tag)) : PyObject_GetItem(meta, g_tag);
    if (old == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_KeyError)) {
            Py_DECREF(meta);
            goto done;
        }
        PyErr_Clear();
    }
    PyObject *token = PyTuple_GET_ITEM(link, 0);
    if (old == NULL || old == Py_None || !PyTuple_Check(old) || PyTuple_GET_SIZE(old) < 1 ||
        PyTuple_GET_ITEM(old, 0) != token)
        rc = PyObject_SetItem(meta, g_tag, link);
    else
        rc = 0;
    Py_XDECREF(old);
    Py_DECREF(meta);
done:
    Py_XDECREF(node);
    Py_DECREF(pending);
    return rc;
}

/* Appends each distinct value of an int-like op index to parents (a list kept in first-seen order). */
static int
add_parent(PyObject *parents, PyObject *op)
{
    Py_ssize_t n = PyList_GET_SIZE(parents);
    for (Py_ssize_t i = 0; i < n; i++) {
        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(parents, i), op, Py_EQ);
        if (eq != 0)
            return eq < 0 ? -1 : 0;
    }
    return PyList_Append(parents, op);
}

/* storage_key(t): the address of t's storage, or NULL with no error when it has none to write (sparse, an
 * empty storage, a wrapper subclass); NULL with an error set for anything else. */
static PyObject *
storage_key(PyObject *t)
{
    PyObject *storage = PyObject_CallMethodNoArgs(t, s_untyped_storage);
    PyObject *key = NULL;
    if (storage != NULL) {
        PyObject *nbytes = PyObject_CallMethodNoArgs(storage, s_nbytes);
        int empty = nbytes == NULL ? -1 : !PyObject_IsTrue(nbytes);
        Py_XDECREF(nbytes);
        if (empty == 0)
            key = PyObject_CallMethodNoArgs(storage, s_data_ptr);
        Py_DECREF(storage);
        if (empty == 1)
            return NULL;
    }
    if (key == NULL && (PyErr_ExceptionMatches(PyExc_NotImplementedError) || PyErr_ExceptionMatches(PyExc_RuntimeError)))
        PyErr_Clear();
    return key;
}

/* Adds to parents the latest in-place write into t's memory after op `since`, as Recorder.on_op does. Most
 * inputs' memory was never written in the window: that is checked here, Recorder._written_since does the rest. */
static int
add_writer(FastOp *self, PyObject *parents, PyObject *t, PyObject *since)
{
    PyObject *key = storage_key(t);
    if (key == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int written = PyDict_Contains(self->writes, key);
    Py_DECREF(key);
    if (written <= 0)
        return written;
    PyObject *writer = PyObject_CallFunctionObjArgs(self->written_since, t, since, NULL);
    if (writer == NULL)
        return -1;
    long w = PyLong_AsLong(writer);
    int rc = (w == -1 && PyErr_Occurred()) ? -1 : (w >= 0 ? add_parent(parents, writer) : 0);
    Py_DECREF(writer);
    return rc;
}

/* The label of the n-th call of a func in a window, the same string object in every window. */
static PyObject *
label_of(PyObject *name, long n)
{
    PyObject *labels = PyDict_GetItemWithError(g_labels, name);
    if (labels == NULL) {
        if (PyErr_Occurred() || (labels = PyList_New(0)) == NULL)
            return NULL;
        int rc = PyDict_SetItem(g_labels, name, labels);
        Py_DECREF(labels); /* the dict holds it */
        if (rc < 0)
            return NULL;
    }
    while (PyList_GET_SIZE(labels) < n) {
        PyObject *label = PyUnicode_FromFormat("%U_%zd", name, PyList_GET_SIZE(labels) + 1);
        int rc = label == NULL ? -1 : PyList_Append(labels, label);
        Py_XDECREF(label);
        if (rc < 0)
            return NULL;
    }
    return Py_NewRef(PyList_GET_ITEM(labels, n - 1));
}

/* _opinfo.mutated_tensors: the tensors the op gets in the argument slots it writes into. */
static PyObject *
mutated_tensors(PyObject *mutated, PyObject *args, PyObject *kwargs)
{
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mutated); i++) {
        PyObject *slot = PyTuple_GET_ITEM(mutated, i);
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(slot, 0));
        if (pos == -1 && PyErr_Occurred())
            goto error;
        PyObject *value = pos < PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, pos)
                          : kwargs != NULL ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(slot, 1))
                                           : NULL;
        if (value == NULL) {
            if (PyErr_Occurred())
                goto error;
            continue;
        }
        if (is_tensor(value)) {
            if (PyList_Append(found, value) < 0)
                goto error;
        } else if (PyList_Check(value) || PyTuple_Check(value)) {
            PyObject *seq = PySequence_Fast(value, "");
            if (seq == NULL)
                goto error;
            for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
                PyObject *v = PySequence_Fast_GET_ITEM(seq, k);
                if (is_tensor(v) && PyList_Append(found, v) < 0) {
                    Py_DECREF(seq);
                    goto error;
                }
            }
            Py_DECREF(seq);
        }
    }
    return found;
error:
    Py_DECREF(found);
    return NULL;
}

/* Whether any tensor written is a view (has a _base): only then can the write add outputs. */
static int
any_base(PyObject *written)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(written); i++) {
        PyObject *base = PyObject_GetAttr(PyList_GET_ITEM(written, i), s_base);
        if (base == NULL)
            return -1;
        int view = base != Py_None;
        Py_DECREF(base);
        if (view)
            return 1;
    }
    return 0;
}

/* training.backward_link: the forward op whose autograd node is running now, -1 when unknown. */
static PyObject *
backward_link(PyObject *token)
{
    PyObject *node = PyObject_CallNoArgs(g_current_node);
    if (node == NULL)
        return NULL;
    long fwd = -1;
    if (node != Py_None) {
        PyObject *meta = PyObject_GetAttr(node, s_metadata);
        if (meta == NULL) {
            Py_DECREF(node);
            return NULL;
        }
        PyObject *link = PyDict_Check(meta) ? Py_XNewRef(PyDict_GetItemWithError(meta, g_tag)) : NULL;
        Py_DECREF(meta);
        if (link == NULL && PyErr_Occurred()) {
            Py_DECREF(node);
            return NULL;
        }
        if (link != NULL && PyTuple_Check(link) && PyTuple_GET_SIZE(link) >= 2 && PyTuple_GET_ITEM(link, 0) == token)
            fwd = PyLong_AsLong(PyTuple_GET_ITEM(link, 1));
        Py_XDECREF(link);
    }
    Py_DECREF(node);
    return fwd == -1 && PyErr_Occurred() ? NULL : PyLong_FromLong(fwd);
}

static PyObject *
shape_tuple(PyObject *t)
{
    PyObject *size = PyObject_GetAttr(t, s_shape);
    if (size == NULL)
        return NULL;
    PyObject *shape = PyTuple_Check(size) ? PyTuple_GetSlice(size, 0, PY_SSIZE_T_MAX) : PySequence_Tuple(size);
    Py_DECREF(size);
    if (shape != NULL)
        untrack_atomic(shape);
    return shape;
}

/* tuple(tuple(t.shape) for t in tensors); falls back to shape_of for every tensor (nested tensors have
 * ragged sizes that raise RuntimeError) when `fallback` is set. */
static PyObject *
shapes_of(PyObject *tensors, int fallback)
{
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *shapes = PyTuple_New(n);
    if (shapes == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i);
        PyObject *s = fallback ? PyObject_CallOneArg(g_shape_of, t) : shape_tuple(t);
        if (s == NULL) {
            Py_DECREF(shapes);
            return NULL;
        }
        PyTuple_SET_ITEM(shapes, i, s);
    }
    untrack_atomic(shapes);
    return shapes;
}

static PyObject *
name_of(PyObject *names, PyObject *fallback_fn, PyObject *key)
{
    PyObject *name = PyDict_GetItemWithError(names, key);
    if (name != NULL && PyObject_IsTrue(name) == 1) {
        Py_INCREF(name);
        return name;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyObject_CallOneArg(fallback_fn, key);
}

static PyObject *
int_of_attr(PyObject *obj, PyObject *name, long *value)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return NULL;
    *value = PyLong_AsLong(v);
    if (*value == -1 && PyErr_Occurred()) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

/* The user's file:line issuing the op, or "" when the window records none. */
static PyObject *
locate(FastOp *self)
{
    return self->locate == Py_None ? Py_NewRef(s_empty) : PyObject_CallNoArgs(self->locate);
}

/* Recorder.on_op's source of a forward or optimizer op. */
static PyObject *
forward_source(FastOp *self, PyObject *phase)
{
    if (self->locate == Py_None)
        return Py_NewRef(s_empty);
    PyObject *builtin = PyObject_GetAttr(self->modules, s_current_builtin);
    if (builtin == NULL)
        return NULL;
    int inside = PyObject_IsTrue(builtin);
    Py_DECREF(builtin);
    if (inside < 0)
        return NULL;
    if (inside) /* inside nn.Linear & co: no user frame below its call site */
        return PyObject_GetAttr(self->modules, s_current_source);
    int optimizer = PyUnicode_Check(phase) ? PyUnicode_Compare(phase, s_optimizer) : -1;
    if (optimizer == -1 && PyErr_Occurred())
        return NULL;
    if (optimizer == 0) { /* every op of one step() call has that call's source */
        PyObject *step = PyObject_GetAttr(self->rec, s_step_source);
        if (step == NULL || step != Py_None)
            return step;
        Py_DECREF(step);
    }
    return locate(self);
}

static PyObject *
call_slow(FastOp *self, PyObject *func, PyObject *args, PyObject *kwargs, int subclass)
{
    PyObject *kw = kwargs;
    if (kw == NULL || kw == Py_None)
        kw = PyDict_New();
    else
        Py_INCREF(kw);
    if (kw == NULL)
        return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(self->on_op, func, args, kw, subclass ? Py_True : Py_False, NULL);
    Py_DECREF(kw);
    return r;
}

/* fast(func, types, args=(), kwargs=None): the mode's __torch_dispatch__. */
static PyObject *
fastop_call(PyObject *callable, PyObject *call_args, PyObject *call_kwargs)
{
    Py_ssize_t argc = PyTuple_GET_SIZE(call_args);
    if (argc < 2 || argc > 4 || (call_kwargs != NULL && PyDict_GET_SIZE(call_kwargs) > 0)) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(func, types, args=(), kwargs=None)");
        return NULL;
    }
    FastOp *self = (FastOp *)callable;
    PyObject *func = PyTuple_GET_ITEM(call_args, 0), *types = PyTuple_GET_ITEM(call_args, 1);
    PyObject *args = argc > 2 ? PyTuple_GET_ITEM(call_args, 2) : NULL;
    PyObject *kwargs = argc > 3 ? PyTuple_GET_ITEM(call_args, 3) : NULL;
    PyObject *empty_args = NULL;
    if (args == NULL) {
        args = empty_args = PyTuple_New(0);
        if (args == NULL)
            return NULL;
    }
    if (kwargs == Py_None)
        kwargs = NULL;

    PyObject *result = NULL;
    PyObject *tensors = NULL, *parents = NULL, *param_names = NULL, *t0 = NULL, *t1 = NULL, *out = NULL;
    PyObject *outs = NULL, *index = NULL, *label = NULL, *dtype = NULL, *device = NULL, *link = NULL;
    PyObject *in_shapes = NULL, *out_shapes = NULL, *flops = NULL, *phase = NULL, *fwd_op = NULL;
    PyObject *address = NULL, *stack = NULL, *call = NULL, *source = NULL, *row = NULL, *task = NULL;
    PyObject *count = NULL, *pending = NULL, *owner = NULL, *last_write = NULL, *written = NULL;
    long long out_bytes = 0;
    int slow = 0;

    /* A tensor subclass runs its own dispatch inside the op: Recorder.on_op's subclass path. */
    if (PyTuple_Check(types)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
            PyObject *t = PyTuple_GET_ITEM(types, i);
            if (t != g_tensor_type && t != g_parameter_type) {
                result = call_slow(self, func, args, kwargs, 1);
                goto cleanup;
            }
        }
    }
    PyObject *entry = entry_of(func);
    if (entry == NULL)
        goto cleanup;
    if (entry == Py_None || !PyTuple_CheckExact(args) || (kwargs != NULL && !PyDict_Check(kwargs))) {
        slow = 1;
        goto cleanup;
    }
    PyObject *edits = PyObject_GetAttr(self->rec, s_edits);
    if (edits == NULL)
        goto cleanup;
    Py_DECREF(edits);
    if (edits != Py_None) {
        slow = 1;
        goto cleanup;
    }
    PyObject *kind = PyTuple_GET_ITEM(entry, E_KIND);

    tensors = PyList_New(0);
    if (tensors == NULL)
        goto cleanup;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int is = is_tensor(a);
        if (is < 0 || (is && PyList_Append(tensors, a) < 0))
            goto cleanup;
    }
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            int is = is_tensor(v);
            if (is < 0 || (is && PyList_Append(tensors, v) < 0))
                goto cleanup;
        }
    }
    Py_ssize_t n_in = PyList_GET_SIZE(tensors);
    if (n_in > 0 && PyUnicode_Compare(kind, s_view) != 0) {
        /* Device time from CUDA events: Recorder.on_op. */
        PyObject *is_cuda = PyObject_GetAttr(PyList_GET_ITEM(tensors, 0), s_is_cuda);
        if (is_cuda == NULL)
            goto cleanup;
        int cuda = PyObject_IsTrue(is_cuda);
        Py_DECREF(is_cuda);
        if (cuda != 0) {
            slow = cuda > 0;
            goto cleanup;
        }
    }

    PyObject *mutated = PyTuple_GET_ITEM(entry, E_MUTATES);
    int mutates = PyTuple_GET_SIZE(mutated) > 0;
    if (mutates) {
        if (PyDict_GET_SIZE(self->storage_refs) > 0) { /* saved tensors to copy first: Recorder._before_write */
            slow = 1;
            goto cleanup;
        }
        if ((written = mutated_tensors(mutated, args, kwargs)) == NULL)
            goto cleanup;
    }

    pending = PyObject_GetAttr(self->rec, s_pending);
    if (pending == NULL || (pending != Py_None && link_pending(self, pending) < 0))
        goto cleanup;

    /* Inputs: parents (the ops that made them), parameters read, in-place writes since. */
    PyObject *token = self->token;
    parents = PyList_New(0);
    param_names = PyList_New(0);
    if (parents == NULL || param_names == NULL)
        goto cleanup;
    int writes = PyDict_GET_SIZE(self->writes) > 0;
    long last = -1;
    if (writes && (last_write = int_of_attr(self->rec, s_last_write, &last)) == NULL)
        goto cleanup;
    for (Py_ssize_t i = 0; i < n_in; i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i);
        PyObject *tag;
        if (lookup_attr(t, g_tag, &tag) < 0)
            goto cleanup;
        int ours = 0;
        if (tag != NULL && tag != Py_None && PyTuple_Check(tag) && PyTuple_GET_SIZE(tag) >= 3) {
            ours = PyObject_RichCompareBool(PyTuple_GET_ITEM(tag, 0), token, Py_EQ);
            if (ours < 0) {
                Py_DECREF(tag);
                goto cleanup;
            }
        }
        if (ours) {
            PyObject *producer = PyTuple_GET_ITEM(tag, 1);
            int rc = add_parent(parents, producer);
            if (rc == 0 && writes) {
                long p = PyLong_AsLong(producer);
                if (p == -1 && PyErr_Occurred())
                    rc = -1;
                else if (last > p)
                    rc = add_writer(self, parents, t, producer);
            }
            Py_DECREF(tag);
            if (rc < 0)
                goto cleanup;
            continue;
        }
        Py_XDECREF(tag);
        PyObject *key = PyLong_FromVoidPtr(t);
        if (key == NULL)
            goto cleanup;
        PyObject *name = PyDict_GetItemWithError(self->params, key);
        Py_DECREF(key);
        if ((name == NULL && PyErr_Occurred()) || (name != NULL && PyList_Append(param_names, name) < 0))
            goto cleanup;
        if (writes) {
            PyObject *minus_one = PyLong_FromLong(-1);
            int rc = minus_one == NULL ? -1 : add_writer(self, parents, t, minus_one);
            Py_XDECREF(minus_one);
            if (rc < 0)
                goto cleanup;
        }
    }

    if (self->stats_on && PyDict_GET_SIZE(self->in_flight) > 0) {
        /* reading a collective's buffer: its result is there (TrainingState.arrived) */
        PyObject *kw = Py_BuildValue("{s:O}", "reader", Py_True);
        if (kw == NULL)
            goto cleanup;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parents); i++) {
            PyObject *one = PyTuple_Pack(1, PyList_GET_ITEM(parents, i));
            PyObject *r = one == NULL ? NULL : PyObject_Call(self->arrived, one, kw);
            Py_XDECREF(one);
            if (r == NULL) {
                Py_DECREF(kw);
                goto cleanup;
            }
            Py_DECREF(r);
        }
        Py_DECREF(kw);
    }

    /* The op. */
    PyObject *info = PyTuple_GET_ITEM(entry, E_INFO);
    t0 = now_ns();
    if (t0 == NULL)
        goto cleanup;
    out = PyObject_Call(PyTuple_GET_ITEM(entry, E_CALL), args, kwargs);
    if (out == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *r = PyObject_CallFunctionObjArgs(self->record_failure, info, value, NULL);
        if (r == NULL) {
            /* The op's own error matters more than one in recording it. */
            PyErr_Clear();
        }
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
        goto cleanup;
    }
    t1 = now_ns();
    if (t1 == NULL)
        goto cleanup;
    index = PyObject_GetAttr(self->rec, s_n_ops);
    if (index == NULL)
        goto cleanup;
    long idx = PyLong_AsLong(index);
    if (idx == -1 && PyErr_Occurred())
        goto cleanup;

    if (is_tensor(out) == 1) {
        outs = PyList_New(1);
        if (outs == NULL)
            goto cleanup;
        Py_INCREF(out);
        PyList_SET_ITEM(outs, 0, out);
    } else {
        if (PyErr_Occurred())
            goto cleanup;
        outs = PyObject_CallOneArg(g_flat_outputs, out);
        if (outs == NULL)
            goto cleanup;
    }

    if (mutates) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->note_writes, index, written, NULL);
        if (r == NULL)
            goto cleanup;
        Py_DECREF(r);
        int views = PyList_GET_SIZE(outs) > 0 ? any_base(written) : 0;
        if (views < 0)
            goto cleanup;
        if (views) { /* a write into a view changes its base: an extra output */
            PyObject *with_bases = PyObject_CallFunctionObjArgs(self->with_written_bases, written, outs, NULL);
            if (with_bases == NULL)
                goto cleanup;
            Py_SETREF(outs, with_bases);
            if (!PyList_Check(outs)) {
                PyErr_SetString(PyExc_TypeError, "tl_dist: _with_written_bases must return a list");
                goto cleanup;
            }
        }
    }

    /* Label: func_<n>, numbered per func in the window. */
    PyObject *name = PyTuple_GET_ITEM(entry, E_NAME);
    PyObject *seen = PyDict_GetItemWithError(self->label_counts, name);
    long n = 1;
    if (seen != NULL) {
        n = PyLong_AsLong(seen) + 1;
        if (n == 0 && PyErr_Occurred())
            goto cleanup;
    } else if (PyErr_Occurred())
        goto cleanup;
    count = PyLong_FromLong(n);
    if (count == NULL || PyDict_SetItem(self->label_counts, name, count) < 0)
        goto cleanup;
    label = label_of(name, n);
    if (label == NULL)
        goto cleanup;

    Py_ssize_t n_out = PyList_GET_SIZE(outs);
    PyObject *row_kind;
    if (n_out > 0) {
        PyObject *first = PyList_GET_ITEM(outs, 0);
        PyObject *dt = PyObject_GetAttr(first, s_dtype);
        if (dt == NULL)
            goto cleanup;
        dtype = name_of(g_dtype_names, g_dtype_name, dt);
        Py_DECREF(dt);
        if (dtype == NULL)
            goto cleanup;
        PyObject *is_cpu = PyObject_GetAttr(first, s_is_cpu);
        if (is_cpu == NULL)
            goto cleanup;
        int cpu = PyObject_IsTrue(is_cpu);
        Py_DECREF(is_cpu);
        if (cpu < 0)
            goto cleanup;
        if (cpu) {
            device = Py_NewRef(s_cpu);
        } else {
            PyObject *dev = PyObject_GetAttr(first, s_device);
            if (dev == NULL)
                goto cleanup;
            device = name_of(g_device_names, g_device_name, dev);
            Py_DECREF(dev);
            if (device == NULL)
                goto cleanup;
        }
        for (Py_ssize_t pos = 0; pos < n_out; pos++) {
            PyObject *o = PyList_GET_ITEM(outs, pos);
            PyObject *ne = PyObject_CallMethodNoArgs(o, s_nelement);
            PyObject *es = ne == NULL ? NULL : PyObject_CallMethodNoArgs(o, s_element_size);
            long long a = ne == NULL ? -1 : PyLong_AsLongLong(ne);
            long long b = es == NULL ? -1 : PyLong_AsLongLong(es);
            Py_XDECREF(ne);
            Py_XDECREF(es);
            if (es == NULL || PyErr_Occurred())
                goto cleanup;
            out_bytes += a * b;
            PyObject *p = PyLong_FromSsize_t(pos);
            PyObject *tag = p == NULL ? NULL : PyTuple_Pack(3, token, index, p);
            Py_XDECREF(p);
            if (tag == NULL)
                goto cleanup;
            untrack_atomic(tag);
            int rc = PyObject_SetAttr(o, g_tag, tag);
            if (n_out == 1)
                link = tag; /* its tag, and the link of its autograd node */
            else
                Py_DECREF(tag);
            if (rc < 0)
                goto cleanup;
        }
        if (n_out != 1 && (link = PyTuple_Pack(2, token, index)) == NULL)
            goto cleanup;
        row_kind = n_in > 0 ? kind : s_factory;
    } else {
        dtype = Py_NewRef(s_empty);
        device = Py_NewRef(s_empty);
        if ((link = PyTuple_Pack(2, token, index)) == NULL)
            goto cleanup;
        row_kind = s_other;
    }

    /* Shapes. */
    in_shapes = shapes_of(tensors, 0);
    out_shapes = in_shapes == NULL ? NULL : shapes_of(outs, 0);
    if (out_shapes == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            goto cleanup;
        PyErr_Clear();
        Py_CLEAR(in_shapes);
        in_shapes = shapes_of(tensors, 1);
        out_shapes = in_shapes == NULL ? NULL : shapes_of(outs, 1);
        if (out_shapes == NULL)
            goto cleanup;
    }

    PyObject *flop_fn = PyTuple_GET_ITEM(entry, E_FLOPS);
    if (flop_fn == Py_None)
        flops = PyLong_FromLong(0);
    else
    {
        PyObject *kw = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
        flops = kw == NULL ? NULL : PyObject_CallFunctionObjArgs(g_flop_count, info, args, kw, out, NULL);
        Py_XDECREF(kw);
    }
    if (flops == NULL)
        goto cleanup;

    /* Phase and module. */
    task = PyObject_CallNoArgs(g_graph_task_id);
    if (task == NULL)
        goto cleanup;
    long task_id = PyLong_AsLong(task);
    if (task_id == -1 && PyErr_Occurred())
        goto cleanup;
    PyObject *modules = self->modules;
    if (task_id == -1) {
        phase = PyObject_GetAttr(self->rec, s_phase);
        if (phase == NULL)
            goto cleanup;
        if (PyTuple_GET_ITEM(entry, E_SPECIAL) == Py_True) {
            PyObject *p = PyObject_CallFunctionObjArgs(self->phase_special, name, args, phase, NULL);
            if (p == NULL)
                goto cleanup;
            Py_SETREF(phase, p);
        }
        fwd_op = PyLong_FromLong(-1);
        PyObject *current = PyObject_GetAttr(modules, s_current);
        if (current == NULL)
            goto cleanup;
        if (!PyTuple_Check(current) || PyTuple_GET_SIZE(current) != 3) {
            Py_DECREF(current);
            PyErr_SetString(PyExc_TypeError, "tl_dist: ModuleTracker.current must be (address, stack, call)");
            goto cleanup;
        }
        address = Py_NewRef(PyTuple_GET_ITEM(current, 0));
        stack = Py_NewRef(PyTuple_GET_ITEM(current, 1));
        call = Py_NewRef(PyTuple_GET_ITEM(current, 2));
        Py_DECREF(current);
        if (fwd_op == NULL || (source = forward_source(self, phase)) == NULL)
            goto cleanup;
    } else {
        PyObject *grad = PyObject_CallNoArgs(g_grad_enabled);
        if (grad == NULL)
            goto cleanup;
        int enabled = grad == Py_True;
        Py_DECREF(grad);
        PyObject *recomputed = NULL;
        if (enabled && (recomputed = PyObject_CallNoArgs(self->recomputed)) == NULL)
            goto cleanup;
        if (recomputed != NULL && recomputed != Py_None) {
            /* Checkpoint recomputation: forward code run again by the engine. */
            owner = recomputed;
            phase = Py_NewRef(s_recompute);
            fwd_op = PyLong_FromLong(-1);
            call = PyLong_FromLong(-1);
        } else {
            Py_XDECREF(recomputed);
            phase = Py_NewRef(s_backward);
            fwd_op = backward_link(token);
            call = PyLong_FromLong(-1);
            if (fwd_op == NULL || call == NULL)
                goto cleanup;
            long fwd = PyLong_AsLong(fwd_op);
            if (fwd == -1 && PyErr_Occurred())
                goto cleanup;
            if (fwd >= 0) { /* the module of the forward op this op differentiates */
                PyObject *forward_row = PyList_GetItem(self->rows, fwd);
                if (forward_row == NULL)
                    goto cleanup;
                address = Py_NewRef(PyTuple_GET_ITEM(forward_row, 7));
                stack = Py_NewRef(PyTuple_GET_ITEM(forward_row, 8));
            } else {
                PyObject *param = PyObject_CallNoArgs(g_accumulating_param);
                if (param == NULL)
                    goto cleanup;
                owner = PyObject_CallOneArg(self->owner_of, param);
                Py_DECREF(param);
                if (owner == NULL)
                    goto cleanup;
            }
        }
        if (owner != NULL) {
            if (!PyTuple_Check(owner) || PyTuple_GET_SIZE(owner) != 2) {
                PyErr_SetString(PyExc_TypeError, "tl_dist: a module owner must be (address, stack)");
                goto cleanup;
            }
            address = Py_NewRef(PyTuple_GET_ITEM(owner, 0));
            stack = Py_NewRef(PyTuple_GET_ITEM(owner, 1));
        }
        if (fwd_op == NULL || call == NULL)
            goto cleanup;
        if (phase == s_backward) {
            /* Every op of one backward pass has the same Python stack above the engine. */
            source = Py_XNewRef(PyDict_GetItemWithError(self->backward_sources, task));
            if (source == NULL) {
                if (PyErr_Occurred() || (source = locate(self)) == NULL ||
                    PyDict_SetItem(self->backward_sources, task, source) < 0)
                    goto cleanup;
            }
        } else if ((source = locate(self)) == NULL) {
            goto cleanup;
        }
    }

    PyObject *parents_tuple = PyList_AsTuple(parents);
    PyObject *params_tuple = parents_tuple == NULL ? NULL : PyList_AsTuple(param_names);
    PyObject *duration = params_tuple == NULL ? NULL : PyNumber_Subtract(t1, t0);
    PyObject *bytes = duration == NULL ? NULL : PyLong_FromLongLong(out_bytes);
    if (bytes == NULL) {
        Py_XDECREF(parents_tuple);
        Py_XDECREF(params_tuple);
        Py_XDECREF(duration);
        goto cleanup;
    }
    row = PyTuple_New(N_FIELDS);
    if (row == NULL) {
        Py_DECREF(parents_tuple);
        Py_DECREF(params_tuple);
        Py_DECREF(duration);
        Py_DECREF(bytes);
        goto cleanup;
    }
    /* schema.OP_FIELDS order; PyTuple_SET_ITEM steals, so the borrowed ones get a reference first. */
    PyObject *fields[N_FIELDS] = {
        Py_NewRef(index), Py_NewRef(label), Py_NewRef(name), Py_NewRef(PyTuple_GET_ITEM(entry, E_ATEN)),
        Py_NewRef(row_kind), Py_NewRef(phase), Py_NewRef(fwd_op), Py_NewRef(address), Py_NewRef(stack),
        Py_NewRef(call), Py_NewRef(out_shapes), Py_NewRef(dtype), Py_NewRef(device), bytes,
        Py_NewRef(in_shapes), parents_tuple, Py_NewRef(mutates ? Py_True : Py_False), Py_NewRef(flops), Py_NewRef(t0), duration,
        Py_NewRef(source), params_tuple,
    };
    for (int i = 0; i < N_FIELDS; i++)
        PyTuple_SET_ITEM(row, i, fields[i]);
    untrack_atomic(parents_tuple);
    untrack_atomic(params_tuple);
    untrack_atomic(stack); /* a module's address stack: its addresses */
    untrack_atomic(row);
    if (PyList_Append(self->rows, row) < 0)
        goto cleanup;

    if (n_out > 0) {
        PyObject *grad = PyObject_CallNoArgs(g_grad_enabled);
        if (grad == NULL)
            goto cleanup;
        int enabled = grad == Py_True;
        Py_DECREF(grad);
        if (enabled) {
            PyObject *next = PyTuple_Pack(2, link, outs);
            int rc = next == NULL ? -1 : PyObject_SetAttr(self->rec, s_pending, next);
            Py_XDECREF(next);
            if (rc < 0)
                goto cleanup;
        }
    }
    if (n_out > 0 && self->stats_on) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->out_stats, index, outs, row, NULL);
        if (r == NULL)
            goto cleanup;
        Py_DECREF(r);
    }
    PyObject *next_index = PyLong_FromLong(idx + 1);
    int rc = next_index == NULL ? -1 : PyObject_SetAttr(self->rec, s_n_ops, next_index);
    Py_XDECREF(next_index);
    if (rc < 0)
        goto cleanup;
    result = Py_NewRef(out);

cleanup:
    Py_XDECREF(tensors);
    Py_XDECREF(parents);
    Py_XDECREF(param_names);
    Py_XDECREF(t0);
    Py_XDECREF(t1);
    Py_XDECREF(out);
    Py_XDECREF(outs);
    Py_XDECREF(index);
    Py_XDECREF(label);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(link);
    Py_XDECREF(in_shapes);
    Py_XDECREF(out_shapes);
    Py_XDECREF(flops);
    Py_XDECREF(phase);
    Py_XDECREF(fwd_op);
    Py_XDECREF(address);
    Py_XDECREF(stack);
    Py_XDECREF(call);
    Py_XDECREF(source);
    Py_XDECREF(row);
    Py_XDECREF(task);
    Py_XDECREF(count);
    Py_XDECREF(pending);
    Py_XDECREF(owner);
    Py_XDECREF(last_write);
    Py_XDECREF(written);
    if (slow && !PyErr_Occurred())
        result = call_slow(self, func, args, kwargs, 0);
    Py_XDECREF(empty_args);
    return result;
}

/* -- the FastOp type ------------------------------------------------------------------------------------ */

static int
fastop_init(FastOp *self, PyObject *args, PyObject *kwds)
{
    PyObject *rec, *mode;
    if (!PyArg_ParseTuple(args, "OO:FastOp", &rec, &mode))
        return -1;
    if (g_entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tl_dist._fastop: configure() was not called (import tl_dist._fastpath)");
        return -1;
    }
    PyObject *modules = PyObject_GetAttrString(rec, "modules");
    PyObject *training = modules == NULL ? NULL : PyObject_GetAttrString(rec, "training");
    PyObject *phases = training == NULL ? NULL : PyObject_GetAttrString(rec, "phases");
    if (phases == NULL) {
        Py_XDECREF(modules);
        Py_XDECREF(training);
        return -1;
    }
    self->rec = Py_NewRef(rec);
    self->mode = PyWeakref_NewRef(mode, NULL);
    if (self->mode == NULL) {
        Py_DECREF(modules);
        Py_DECREF(training);
        Py_DECREF(phases);
        return -1;
    }
    self->modules = modules;
    self->training = training;
    self->on_op = PyObject_GetAttrString(rec, "on_op");
    self->rows = PyObject_GetAttrString(rec, "rows");
    self->label_counts = PyObject_GetAttrString(rec, "_label_counts");
    self->params = PyObject_GetAttrString(rec, "params");
    self->writes = PyObject_GetAttrString(rec, "_writes");
    self->backward_sources = PyObject_GetAttrString(rec, "_backward_sources");
    self->token = PyObject_GetAttrString(rec, "token");
    self->written_since = PyObject_GetAttrString(rec, "_written_since");
    self->record_failure = PyObject_GetAttrString(rec, "_record_failure");
    self->link_pending = PyObject_GetAttrString(training, "link_pending");
    self->phase_special = PyObject_GetAttrString(phases, "special");
    self->recomputed = PyObject_GetAttrString(modules, "recomputed");
    self->owner_of = PyObject_GetAttrString(modules, "owner_of");
    self->locate = PyObject_GetAttrString(rec, "locate");
    self->storage_refs = PyObject_GetAttrString(rec, "_storage_refs");
    self->note_writes = PyObject_GetAttrString(rec, "_note_writes");
    self->with_written_bases = PyObject_GetAttrString(rec, "_with_written_bases");
    PyObject *hooks_on = PyObject_GetAttrString(training, "hooks_on");
    self->hooks_on = hooks_on == NULL ? -1 : PyObject_IsTrue(hooks_on);
    Py_XDECREF(hooks_on);
    if (self->hooks_on < 0)
        return -1;
    PyObject *stats_on = PyObject_GetAttrString(rec, "stats_on");
    self->stats_on = stats_on == NULL ? -1 : PyObject_IsTrue(stats_on);
    Py_XDECREF(stats_on);
    if (self->stats_on < 0)
        return -1;
    self->in_flight = PyObject_GetAttrString(training, "in_flight");
    self->out_stats = PyObject_GetAttrString(training, "out_stats");
    self->arrived = PyObject_GetAttrString(training, "arrived");
    if (self->in_flight == NULL || self->out_stats == NULL || self->arrived == NULL)
        return -1;
    if (!PyDict_Check(self->in_flight)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: FastOp needs a Recorder");
        return -1;
    }
    Py_DECREF(phases);
    if (!self->on_op || !self->rows || !self->label_counts || !self->params || !self->writes ||
        !self->backward_sources || !self->token || !self->written_since || !self->record_failure ||
        !self->link_pending || !self->phase_special || !self->recomputed || !self->owner_of ||
        !self->locate || !self->storage_refs || !self->note_writes || !self->with_written_bases)
        return -1;
    if (!PyList_Check(self->rows) || !PyDict_Check(self->label_counts) || !PyDict_Check(self->params) ||
        !PyDict_Check(self->writes) || !PyDict_Check(self->backward_sources) || !PyDict_Check(self->storage_refs)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: FastOp needs a Recorder");
        return -1;
    }
    return 0;
}

static int
fastop_clear(FastOp *self)
{
    Py_CLEAR(self->rec);
    Py_CLEAR(self->on_op);
    Py_CLEAR(self->rows);
    Py_CLEAR(self->label_counts);
    Py_CLEAR(self->params);
    Py_CLEAR(self->writes);
    Py_CLEAR(self->backward_sources);
    Py_CLEAR(self->token);
    Py_CLEAR(self->modules);
    Py_CLEAR(self->training);
    Py_CLEAR(self->link_pending);
    Py_CLEAR(self->written_since);
    Py_CLEAR(self->record_failure);
    Py_CLEAR(self->phase_special);
    Py_CLEAR(self->recomputed);
    Py_CLEAR(self->owner_of);
    Py_CLEAR(self->locate);
    Py_CLEAR(self->mode);
    Py_CLEAR(self->arrived);
    Py_CLEAR(self->out_stats);
    Py_CLEAR(self->in_flight);
    Py_CLEAR(self->with_written_bases);
    Py_CLEAR(self->note_writes);
    Py_CLEAR(self->storage_refs);
    return 0;
}

static int
fastop_traverse(FastOp *self, visitproc visit, void *arg)
{
    Py_VISIT(self->rec);
    Py_VISIT(self->on_op);
    Py_VISIT(self->rows);
    Py_VISIT(self->label_counts);
    Py_VISIT(self->params);
    Py_VISIT(self->writes);
    Py_VISIT(self->backward_sources);
    Py_VISIT(self->token);
    Py_VISIT(self->modules);
    Py_VISIT(self->training);
    Py_VISIT(self->link_pending);
    Py_VISIT(self->written_since);
    Py_VISIT(self->record_failure);
    Py_VISIT(self->phase_special);
    Py_VISIT(self->recomputed);
    Py_VISIT(self->owner_of);
    Py_VISIT(self->locate);
    Py_VISIT(self->mode);
    Py_VISIT(self->arrived);
    Py_VISIT(self->out_stats);
    Py_VISIT(self->in_flight);
    Py_VISIT(self->with_written_bases);
    Py_VISIT(self->note_writes);
    Py_VISIT(self->storage_refs);
    return 0;
}

static void
fastop_dealloc(FastOp *self)
{
    PyObject_GC_UnTrack(self);
    fastop_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* torch checks that a mode's __torch_dispatch__ is bound to the mode: `__self__` says so, without the
 * strong reference (mode -> its __torch_dispatch__ -> mode) a bound method would make a cycle of. */
static PyObject *
fastop_self(FastOp *self, void *closure)
{
    PyObject *mode = self->mode == NULL ? Py_None : PyWeakref_GetObject(self->mode);
    return Py_NewRef(mode);
}

static PyGetSetDef fastop_getset[] = {
    {"__self__", (getter)fastop_self, NULL, PyDoc_STR("the mode this dispatches for"), NULL},
    {NULL},
};

static PyTypeObject FastOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tl_dist._fastop.FastOp",
    .tp_doc = PyDoc_STR("FastOp(recorder, mode): mode's __torch_dispatch__ for recorder, compiled."),
    .tp_call = fastop_call,
    .tp_getset = fastop_getset,
    .tp_basicsize = sizeof(FastOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fastop_init,
    .tp_dealloc = (destructor)fastop_dealloc,
    .tp_traverse = (traverseproc)fastop_traverse,
    .tp_clear = (inquiry)fastop_clear,
};

static PyObject *
fastop_configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"tensor_type", "parameter_type", "entries", "make_entry", "dtype_names",
                            "device_names", "dtype_name", "device_name", "flat_outputs", "shape_of",
                            "flop_count", "graph_task_id", "grad_enabled", "current_node",
                            "accumulating_param", "perf_counter_ns", "tag", NULL};
    PyObject *v[17];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOO!OO!O!OOOOOOOOOOU:configure", names, &v[0], &v[1],
                                     &PyDict_Type, &v[2], &v[3], &PyDict_Type, &v[4], &PyDict_Type, &v[5], &v[6],
                                     &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14], &v[15], &v[16]))
        return NULL;
    PyObject **slots[17] = {&g_tensor_type, &g_parameter_type, &g_entries, &g_make_entry, &g_dtype_names,
                            &g_device_names, &g_dtype_name, &g_device_name, &g_flat_outputs, &g_shape_of,
                            &g_flop_count, &g_graph_task_id, &g_grad_enabled, &g_current_node,
                            &g_accumulating_param, &g_perf_counter_ns, &g_tag};
    for (int i = 0; i < 17; i++)
        Py_XSETREF(*slots[i], Py_NewRef(v[i]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))fastop_configure, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("configure(**objects): the torch and tl_dist objects the fast path calls (once, at import).")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastop_module = {
    PyModuleDef_HEAD_INIT, "_fastop", "The compiled per-op path of a telemetry window.", -1, module_methods,
};

#define INTERN(var, text)                                                                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                                   \
        return NULL;

PyMODINIT_FUNC
PyInit__fastop(void)
{
    INTERN(s_pending, "pending");
    INTERN(s_n_ops, "n_ops");
    INTERN(s_edits, "edits");
    INTERN(s_phase, "phase");
    INTERN(s_last_write, "_last_write");
    INTERN(s_hooks_on, "hooks_on");
    INTERN(s_grad_fn, "grad_fn");
    INTERN(s_metadata, "metadata");
    INTERN(s_dtype, "dtype");
    INTERN(s_device, "device");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_cuda, "is_cuda");
    INTERN(s_shape, "shape");
    INTERN(s_nelement, "nelement");
    INTERN(s_element_size, "element_size");
    INTERN(s_current, "current");
    INTERN(s_cpu, "cpu");
    INTERN(s_factory, "factory");
    INTERN(s_other, "other");
    INTERN(s_view, "view");
    INTERN(s_backward, "backward");
    INTERN(s_recompute, "recompute");
    INTERN(s_empty, "");
    INTERN(s_current_builtin, "current_builtin");
    INTERN(s_current_source, "current_source");
    INTERN(s_step_source, "step_source");
    INTERN(s_optimizer, "optimizer");
    INTERN(s_untyped_storage, "untyped_storage");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_base, "_base");
    if ((g_labels = PyDict_New()) == NULL)
        return NULL;
    if (PyType_Ready(&FastOpType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fastop_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "FastOp", (PyObject *)&FastOpType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
