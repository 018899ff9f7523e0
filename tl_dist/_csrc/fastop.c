/* The compiled twin of Recorder.on_op for the telemetry window's common op (tl_dist/_fastpath.py).
 *
 * Every ATen op of a captured step passes through the recorder; in Python its per-op work (tags, shapes,
 * dtype, phase, module, the row) costs ~48,000 instructions, a third of them bytecode evaluation, spread too
 * thin for any one Python change to matter (docs/telemetry.md, "Cost"). This extension does the same work for
 * the ops a metadata + timing window sees most: no tensor subclass, no collective, no tensor list, no
 * intervention, CPU tensors or a view. Outputs saved by a selector, in-place writes and output statistics are
 * left to the recorder's own Python helpers (saved.c keeps what save=True keeps).
 * Anything else returns to Recorder.on_op, which stays the reference: tests/test_fastop.py checks that
 * both build the same rows. This file: the dispatch, the FastOp type and the module; record.c: the parts
 * of a row.
 *
 * It uses the CPython API only (no torch headers): torch is reached through the Python objects handed to
 * configure(), so the extension does not depend on torch's C++ ABI. A row's values go where
 * schema.OP_FIELDS, handed to configure(), puts their names.
 */
#include "fastop.h"

#include <stddef.h>
#include <string.h>

/* The objects declared in fastop.h, set by configure() and at import. */
int g_slot[N_FIELDS];
static const char *const FIELD_NAMES[N_FIELDS] = {
    "index", "label", "func", "aten", "kind", "phase", "fwd_op", "module", "module_stack", "module_call",
    "out_shapes", "dtype", "device", "out_bytes", "in_shapes", "parents", "inplace", "flops", "start_ns",
    "duration_ns", "source", "params",
};
PyObject *g_tensor_type, *g_parameter_type;
PyObject *g_entries;      /* id(func) -> entry tuple, or None for an op that always takes the slow path */
PyObject *g_make_entry;   /* func -> entry tuple or None */
PyObject *g_dtype_names, *g_device_names, *g_dtype_name, *g_device_name;
PyObject *g_flat_outputs, *g_shape_of, *g_flop_count;
PyObject *g_graph_task_id, *g_grad_enabled;
PyObject *g_perf_counter_ns, *g_current_node, *g_sequence_nr;
PyObject *g_labels;       /* func name -> [its labels func_1, func_2, ...]: made once per process */
PyObject *g_flop_memo;
PyObject *g_itemsizes;    /* dtype -> its itemsize, filled as dtypes come */
PyObject *g_tag;          /* "_tl_src": the attribute on tensors and the key in autograd metadata */
PyObject *s_variable, *s_pending, *s_n_ops, *s_edits, *s_phase, *s_last_write, *s_hooks_on, *s_stats_on, *s_grad_fn,
    *s_metadata,
    *s_dtype, *s_device, *s_is_cpu, *s_is_cuda, *s_shape, *s_element_size, *s_current, *s_cpu,
    *s_factory, *s_other, *s_view, *s_backward, *s_recompute, *s_empty,
    *s_step_source, *s_optimizer, *s_untyped_storage, *s_nbytes,
    *s_data_ptr, *s_base, *s_itemsize, *s_saving, *s_storage_offset, *s_is_contiguous, *s_numel, *s_stride,
    *s_sequence_nr, *s_writes_generation, *s_detach, *s_clone, *s_layout, *s_save_all, *s_keep_graph;

/* The outputs as the list Python's callbacks take: a single output is a tuple (one allocation, from CPython's
 * free list) until one of them needs it. */
static int
outs_as_list(PyObject **outs)
{
    if (PyList_CheckExact(*outs))
        return 0;
    PyObject *list = PySequence_List(*outs);
    if (list == NULL)
        return -1;
    Py_SETREF(*outs, list);
    return 0;
}

/* After an op that wrote its inputs in place: the write log (writes.c), and the bases of views it wrote into
 * as extra outputs (a write into a view changes its base). */
static int
after_writes(FastOp *self, PyObject *index, PyObject *written, PyObject **outs)
{
    if (note_writes(self, index, written) < 0 || outs_as_list(outs) < 0)
        return -1;
    int views = PyList_GET_SIZE(*outs) > 0 ? any_base(written) : 0;
    if (views <= 0)
        return views;
    PyObject *with_bases = PyObject_CallFunctionObjArgs(self->with_written_bases, written, *outs, NULL);
    if (with_bases == NULL)
        return -1;
    Py_SETREF(*outs, with_bases);
    if (!PyList_Check(*outs)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: _with_written_bases must return a list");
        return -1;
    }
    return 0;
}

/* The row field f: borrowed, NULL while unset. */
#define FIELD(row, f) PyTuple_GET_ITEM(row, g_slot[f])

/* Puts value (a new reference, stolen) at field f of a row being made; -1 when value is NULL (an error set).
 * Sets *tracked when value is a container the cyclic GC tracks, which keeps the row tracked too: checked here,
 * where value was just made or read, rather than by walking the row once it is done, after the kernel evicted
 * every value's header from the caches. */
static int
put(PyObject *row, int f, PyObject *value, int *tracked)
{
    if (value == NULL)
        return -1;
    if (PyType_IS_GC(Py_TYPE(value)) && PyObject_GC_IsTracked(value))
        *tracked = 1;
    PyObject **slot = &((PyTupleObject *)row)->ob_item[g_slot[f]];
    Py_XSETREF(*slot, value);
    return 0;
}

/* The shapes of tensors as tuples of ints (shapes_of); NULL without an error where one is a nested tensor's,
 * whose ragged sizes need shape_of. */
static PyObject *
plain_shapes(PyObject *tensors)
{
    PyObject *shapes = shapes_of(tensors, 0);
    if (shapes == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError))
        PyErr_Clear();
    return shapes;
}

/* Moves where the op ran (place_op) into the row. */
static int
put_place(PyObject *row, struct place *pl, int *tracked)
{
    untrack_atomic(pl->stack); /* a module's address stack: its addresses */
    PyObject **parts[] = {&pl->phase, &pl->fwd_op, &pl->address, &pl->stack, &pl->call, &pl->source};
    const int fields[] = {F_PHASE, F_FWD_OP, F_MODULE, F_MODULE_STACK, F_MODULE_CALL, F_SOURCE};
    for (int i = 0; i < 6; i++) {
        if (put(row, fields[i], *parts[i], tracked) < 0)
            return -1;
        *parts[i] = NULL; /* the row's */
    }
    return 0;
}

/* Gives back label number n of func `name`, taken by an op that raised or was not recorded: Recorder.on_op
 * counts an op once it ran. Keeps the error set. */
static void
restore_label(FastOp *self, PyObject *name, long n)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *before = n > 1 ? PyLong_FromLong(n - 1) : NULL;
    int rc = n > 1 ? (before == NULL ? -1 : PyDict_SetItem(self->label_counts, name, before))
                   : PyDict_DelItem(self->label_counts, name);
    Py_XDECREF(before);
    if (rc < 0)
        PyErr_Clear(); /* the error that got here matters more */
    PyErr_Restore(type, value, tb);
}

static void
forget_node(FastOp *self)
{
    Py_CLEAR(self->last_node);
    Py_CLEAR(self->last_fwd);
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
    PyObject *tensors = NULL, *parents = NULL, *param_names = NULL, *out = NULL, *name = NULL;
    PyObject *outs = NULL, *index = NULL, *index_before = NULL, *dtype = NULL, *device = NULL, *link = NULL;
    PyObject *out_shapes = NULL, *row = NULL;
    PyObject *pending = NULL, *written = NULL, *srcs = NULL, *save_kwargs = NULL;
    PyObject *pre_write = NULL, *task = NULL;
    struct place pl = {NULL, NULL, NULL, NULL, NULL, NULL};
    long long out_bytes = 0;
    long label_n = 0; /* the label number this op took, until it is recorded */
    int tracked = 0;  /* the row holds a container the GC tracks (put) */
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
    PyObject *edits = rec_get(self, ST_EDITS);
    if (edits == NULL)
        goto cleanup;
    Py_DECREF(edits);
    if (edits != Py_None) {
        slow = 1;
        goto cleanup;
    }
    PyObject *kind = PyTuple_GET_ITEM(entry, E_KIND);

    if ((tensors = input_tensors(args, kwargs)) == NULL)
        goto cleanup;
    Py_ssize_t n_in = PyTuple_GET_SIZE(tensors);
    if (n_in > 0 && PyUnicode_Compare(kind, s_view) != 0) {
        /* Device time from CUDA events: Recorder.on_op. */
        int cuda = tensor_true(PyTuple_GET_ITEM(tensors, 0), T_IS_CUDA);
        if (cuda != 0) {
            slow = cuda > 0;
            goto cleanup;
        }
    }

    PyObject *mutated = PyTuple_GET_ITEM(entry, E_MUTATES);
    int mutates = PyTuple_GET_SIZE(mutated) > 0;
    if (mutates && (written = mutated_tensors(mutated, args, kwargs)) == NULL)
        goto cleanup;

    pending = rec_get(self, ST_PENDING);
    if (pending == NULL || (pending != Py_None && link_pending(self, pending) < 0))
        goto cleanup;

    /* Inputs: parents (the ops that made them), parameters read, in-place writes since. */
    PyObject *token = self->token;
    parents = PyList_New(0);
    /* Where each input's value comes from (op, output position), for replay: only when outputs may be saved. */
    if (self->saving && (srcs = PyList_New(0)) == NULL)
        goto cleanup;
    if (parents == NULL || scan_inputs(self, tensors, parents, &param_names, srcs) < 0)
        goto cleanup;

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

    /* Saved tensors the op would overwrite are copied first, and a saving window keeps the value each untracked
     * tensor it writes had (Recorder._before_write). */
    if (mutates && (self->saving || PyDict_GET_SIZE(self->storage_refs) > 0)) {
        pre_write = PyObject_CallFunctionObjArgs(self->before_write, written, tensors, srcs ? srcs : Py_None, NULL);
        if (pre_write == NULL)
            goto cleanup;
    }

    /* Where the op runs (the autograd engine's graph task; -1 outside it), and the number its autograd node, if
     * it makes one, got before this dispatch: Recorder.on_op's rule (training.py, "backward -> forward"). */
    if ((task = PyObject_CallNoArgs(g_graph_task_id)) == NULL)
        goto cleanup;
    long task_id = PyLong_AsLong(task);
    if (task_id == -1 && PyErr_Occurred())
        goto cleanup;
    if (task_id == -1 && self->last_node != NULL)
        forget_node(self); /* the backward pass is over: its node is not kept alive */
    PyObject *grad = PyObject_CallNoArgs(g_grad_enabled); /* an op cannot change it: read once */
    if (grad == NULL)
        goto cleanup;
    int grad_on = grad == Py_True;
    Py_DECREF(grad);
    long long number = -1;
    int by_number = grad_on && !mutates && !self->hooks_on && task_id == -1;
    if (by_number) {
        PyObject *counter = PyObject_CallNoArgs(g_sequence_nr);
        number = counter == NULL ? -1 : PyLong_AsLongLong(counter) - 1;
        Py_XDECREF(counter);
        if (counter == NULL || PyErr_Occurred())
            goto cleanup;
    }

    /* The row is made before the op, with what it needs of the inputs and of where the op runs: the caches still
     * hold what the previous op's recording touched (its dicts, the objects the row holds, this code), which the
     * kernel about to run evicts. All of it is the same after the op: an op that writes no input changes no
     * input's shape; the phase, module, autograd node and source are the call's (an op with a SPECIAL phase
     * rule, which may change the phase, is placed after it); and a plain op records no ops of its own while it
     * runs (the op count says so, else it is numbered and placed again). */
    name = PyTuple_GET_ITEM(entry, E_NAME);
    int special = PyTuple_GET_ITEM(entry, E_SPECIAL) == Py_True;
    if ((index_before = rec_get(self, ST_N_OPS)) == NULL || (row = PyTuple_New(N_FIELDS)) == NULL)
        goto cleanup;
    /* Label: func_<n>, numbered per func in the window; taken back if the op raises (restore_label). */
    PyObject *seen = PyDict_GetItemWithError(self->label_counts, name);
    label_n = 1;
    if (seen != NULL) {
        label_n = PyLong_AsLong(seen) + 1;
        if (label_n == 0 && PyErr_Occurred())
            goto cleanup;
    } else if (PyErr_Occurred())
        goto cleanup;
    PyObject *count = PyLong_FromLong(label_n);
    int counted = count == NULL ? -1 : PyDict_SetItem(self->label_counts, name, count);
    Py_XDECREF(count);
    if (counted < 0) {
        label_n = 0;
        goto cleanup;
    }
    if (put(row, F_LABEL, label_of(name, label_n), &tracked) < 0 || put(row, F_INDEX, Py_NewRef(index_before), &tracked) < 0 ||
        put(row, F_FUNC, Py_NewRef(name), &tracked) < 0 || put(row, F_ATEN, Py_NewRef(PyTuple_GET_ITEM(entry, E_ATEN)), &tracked) < 0 ||
        put(row, F_INPLACE, Py_NewRef(mutates ? Py_True : Py_False), &tracked) < 0 ||
        put(row, F_PARENTS, untrack_atomic(PyList_AsTuple(parents)), &tracked) < 0 ||
        put(row, F_PARAMS, param_names == NULL ? PyTuple_New(0) : untrack_atomic(PyList_AsTuple(param_names)), &tracked) < 0)
        goto cleanup;
    Py_CLEAR(parents);
    Py_CLEAR(param_names);
    if (!mutates) { /* else after the op: a write in place may change an input's shape (resize_, t_) */
        PyObject *shapes = plain_shapes(tensors);
        if (shapes == NULL) {
            if (PyErr_Occurred())
                goto cleanup; /* else a nested tensor: shape_of, after the op */
        } else {
            put(row, F_IN_SHAPES, shapes, &tracked);
            PyObject *known = op_flops(entry, args, kwargs, NULL, shapes);
            if (known == NULL && PyErr_Occurred())
                goto cleanup;
            if (known != NULL)
                put(row, F_FLOPS, known, &tracked);
        }
    }
    if (!special && (place_op(self, entry, args, task, task_id, grad_on, &pl) < 0 || put_place(row, &pl, &tracked) < 0))
        goto cleanup;
    if (FIELD(row, F_IN_SHAPES) != NULL && !self->saving)
        Py_CLEAR(tensors); /* released now, while its tensors are in the caches */
    Py_CLEAR(task);

    /* The op. */
    long long start = clock_ns();
    if ((start == -1 && PyErr_Occurred()) || (out = run_op(self, entry, args, kwargs)) == NULL)
        goto cleanup;
    long long end = clock_ns();
    if ((end == -1 && PyErr_Occurred()) || put(row, F_START_NS, PyLong_FromLongLong(start), &tracked) < 0 ||
        put(row, F_DURATION_NS, PyLong_FromLongLong(end - start), &tracked) < 0 || (index = rec_get(self, ST_N_OPS)) == NULL)
        goto cleanup;
    long idx = PyLong_AsLong(index);
    if (idx == -1 && PyErr_Occurred())
        goto cleanup;
    int moved = index == index_before ? 0 : PyObject_RichCompareBool(index, index_before, Py_NE);
    if (moved < 0 || (moved && put(row, F_INDEX, Py_NewRef(index), &tracked) < 0))
        goto cleanup;
    if (special || moved) {
        place_clear(&pl);
        if ((task = PyLong_FromLong(task_id)) == NULL || place_op(self, entry, args, task, task_id, grad_on, &pl) < 0 ||
            put_place(row, &pl, &tracked) < 0)
            goto cleanup;
    }

    if (is_tensor(out) == 1)
        outs = PyTuple_Pack(1, out);
    else if (!PyErr_Occurred())
        outs = PyObject_CallOneArg(g_flat_outputs, out);
    if (outs == NULL || (mutates && after_writes(self, index, written, &outs) < 0))
        goto cleanup;
    if (!PyList_CheckExact(outs) && !PyTuple_CheckExact(outs)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: flat_outputs must return a list");
        goto cleanup;
    }
    Py_ssize_t n_out = PySequence_Fast_GET_SIZE(outs);
    if (put(row, F_KIND, Py_NewRef(n_out == 0 ? s_other : n_in > 0 ? kind : s_factory), &tracked) < 0)
        goto cleanup;

    /* Output shapes; input shapes where they wait for the op. */
    PyObject *in_shapes = FIELD(row, F_IN_SHAPES);
    int fallback = 0;
    if (in_shapes == NULL) {
        if ((in_shapes = plain_shapes(tensors)) == NULL) {
            if (PyErr_Occurred())
                goto cleanup;
            fallback = 1;
            in_shapes = shapes_of(tensors, 1);
        }
        if (put(row, F_IN_SHAPES, in_shapes, &tracked) < 0)
            goto cleanup;
    }
    if (!fallback && (out_shapes = plain_shapes(outs)) == NULL) {
        if (PyErr_Occurred())
            goto cleanup;
        fallback = 1;
    }
    if (fallback && (out_shapes = shapes_of(outs, 1)) == NULL)
        goto cleanup;
    if (put(row, F_OUT_SHAPES, Py_NewRef(out_shapes), &tracked) < 0 ||
        describe_outputs(outs, out_shapes, token, index, &dtype, &device, &out_bytes, &link) < 0)
        goto cleanup;
    put(row, F_DTYPE, dtype, &tracked);
    put(row, F_DEVICE, device, &tracked);
    dtype = device = NULL; /* the row's */
    if (put(row, F_OUT_BYTES, PyLong_FromLongLong(out_bytes), &tracked) < 0)
        goto cleanup;
    if (FIELD(row, F_FLOPS) == NULL && put(row, F_FLOPS, op_flops(entry, args, kwargs, out, in_shapes), &tracked) < 0)
        goto cleanup;
    if (!tracked)
        PyObject_GC_UnTrack(row); /* of atoms and untracked tuples: nothing for the GC to walk at close */
    if (PyList_Append(self->rows, row) < 0)
        goto cleanup;
    label_n = 0; /* recorded: the label stays taken */

    if (n_out > 0 && by_number) {
        if (number >= self->seq_floor) { /* below it, or taken by an earlier op: no node of its own */
            PyObject *key = PyLong_FromLongLong(number);
            PyObject *owner = key == NULL ? NULL : PyDict_SetDefault(self->node_ops, key, index);
            Py_XDECREF(key);
            if (owner == NULL)
                goto cleanup;
        }
    } else if (n_out > 0) {
        if (grad_on) {
            PyObject *next = outs_as_list(&outs) < 0 ? NULL : PyTuple_Pack(2, link, outs);
            int rc = next == NULL ? -1 : rec_set(self, ST_PENDING, next);
            Py_XDECREF(next);
            if (rc < 0)
                goto cleanup;
        }
    }
    if (n_out > 0 && self->stats_on) {
        PyObject *r = outs_as_list(&outs) < 0 ? NULL : PyObject_CallFunctionObjArgs(self->out_stats, index, outs, row, NULL);
        if (r == NULL)
            goto cleanup;
        Py_DECREF(r);
    }
    PyObject *next_index = PyLong_FromLong(idx + 1);
    int rc = next_index == NULL ? -1 : rec_set(self, ST_N_OPS, next_index);
    Py_XDECREF(next_index);
    if (rc < 0)
        goto cleanup;
    if (self->saving && n_out > 0) {
        save_kwargs = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
        if (save_kwargs == NULL)
            goto cleanup;
        if (self->save_all) {
            if (save_outputs(self, index, outs, func, args, save_kwargs, tensors, srcs, pre_write) < 0)
                goto cleanup;
        } else { /* a selector: Recorder._save_op matches the row (Python), then keeps what it selects */
            PyObject *r = outs_as_list(&outs) < 0 ? NULL
                                                  : PyObject_CallFunctionObjArgs(self->save_op, index, row, outs, func,
                                                                                 args, save_kwargs, tensors, srcs,
                                                                                 pre_write ? pre_write : Py_None, NULL);
            if (r == NULL)
                goto cleanup;
            Py_DECREF(r);
        }
    }
    result = Py_NewRef(out);

cleanup:
    if (label_n > 0 && result == NULL)
        restore_label(self, name, label_n);
    Py_XDECREF(index_before);
    Py_XDECREF(tensors);
    Py_XDECREF(parents);
    Py_XDECREF(param_names);
    Py_XDECREF(out);
    Py_XDECREF(outs);
    Py_XDECREF(index);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(link);
    Py_XDECREF(out_shapes);
    Py_XDECREF(row);
    place_clear(&pl);
    Py_XDECREF(pending);
    Py_XDECREF(written);
    Py_XDECREF(srcs);
    Py_XDECREF(save_kwargs);
    Py_XDECREF(pre_write);
    Py_XDECREF(task);
    if (slow && !PyErr_Occurred())
        result = call_slow(self, func, args, kwargs, 0);
    Py_XDECREF(empty_args);
    return result;
}

/* -- the FastOp type ------------------------------------------------------------------------------------ */

/* What a FastOp reads of its recorder once, when the window opens: each attribute of the recorder (or of its
 * module tracker, training state or phase tracker) and the field it goes to. The names are interned at import
 * (attr_names): a window opens after a forward has emptied the caches, and making each name's string again
 * there cost a tenth of opening it. */
enum { FROM_REC, FROM_MODULES, FROM_TRAINING, FROM_PHASES, FROM_COUNT };
static const struct {
    const char *name;
    int owner;
    Py_ssize_t field;
    PyTypeObject *type; /* what the attribute must be, or NULL for any object */
} attrs[] = {
    {"on_op", FROM_REC, offsetof(FastOp, on_op), NULL},
    {"rows", FROM_REC, offsetof(FastOp, rows), &PyList_Type},
    {"_label_counts", FROM_REC, offsetof(FastOp, label_counts), &PyDict_Type},
    {"params", FROM_REC, offsetof(FastOp, params), &PyDict_Type},
    {"_writes", FROM_REC, offsetof(FastOp, writes), &PyDict_Type},
    {"_backward_sources", FROM_REC, offsetof(FastOp, backward_sources), &PyDict_Type},
    {"token", FROM_REC, offsetof(FastOp, token), NULL},
    {"_written_storage", FROM_REC, offsetof(FastOp, written_storage), &PyDict_Type},
    {"_record_failure", FROM_REC, offsetof(FastOp, record_failure), NULL},
    {"locate", FROM_REC, offsetof(FastOp, locate), NULL},
    {"_storage_refs", FROM_REC, offsetof(FastOp, storage_refs), &PyDict_Type},
    {"_with_written_bases", FROM_REC, offsetof(FastOp, with_written_bases), NULL},
    {"_before_write", FROM_REC, offsetof(FastOp, before_write), NULL},
    {"node_ops", FROM_REC, offsetof(FastOp, node_ops), &PyDict_Type},
    {"tagged_nodes", FROM_REC, offsetof(FastOp, tagged_nodes), &PySet_Type},
    {"recomputed", FROM_MODULES, offsetof(FastOp, recomputed), NULL},
    {"stack_of_address", FROM_MODULES, offsetof(FastOp, stack_of_address), &PyDict_Type},
    {"link_pending", FROM_TRAINING, offsetof(FastOp, link_pending), NULL},
    {"in_flight", FROM_TRAINING, offsetof(FastOp, in_flight), &PyDict_Type},
    {"out_stats", FROM_TRAINING, offsetof(FastOp, out_stats), NULL},
    {"arrived", FROM_TRAINING, offsetof(FastOp, arrived), NULL},
    {"special", FROM_PHASES, offsetof(FastOp, phase_special), NULL},
};
#define N_ATTRS ((int)(sizeof(attrs) / sizeof(attrs[0])))
static PyObject *attr_names[N_ATTRS];
/* The recorder's parts (FROM_*, after FROM_REC), the windows' flags and what a saving window adds. */
static PyObject *s_modules, *s_training, *s_phases, *s_seq_floor, *s_save_op, *s_saved, *s_replay_records;

static int
intern_attr_names(void)
{
    for (int i = 0; i < N_ATTRS; i++)
        if ((attr_names[i] = PyUnicode_InternFromString(attrs[i].name)) == NULL)
            return -1;
    return 0;
}

/* *field = owner.name, checked against type; 0, or -1 with an error set. */
static int
read_attr(PyObject *owner, PyObject *name, PyObject **field, PyTypeObject *type)
{
    if ((*field = PyObject_GetAttr(owner, name)) == NULL)
        return -1;
    if (type != NULL && !PyObject_TypeCheck(*field, type)) {
        PyErr_Format(PyExc_TypeError, "tl_dist: FastOp needs a Recorder (its %U is a %s)", name,
                     Py_TYPE(*field)->tp_name);
        return -1;
    }
    return 0;
}

static int
fastop_init(FastOp *self, PyObject *args, PyObject *kwds)
{
    PyObject *rec, *mode;
    if (!PyArg_ParseTuple(args, "OO:FastOp", &rec, &mode))
        return -1;
    clear_spans(self);
    if (g_entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tl_dist._fastop: configure() was not called (import tl_dist._fastpath)");
        return -1;
    }
    PyObject *phases = NULL;
    self->rec = Py_NewRef(rec);
    if ((self->mode = PyWeakref_NewRef(mode, NULL)) == NULL || read_attr(rec, s_modules, &self->modules, NULL) < 0 ||
        read_attr(rec, s_training, &self->training, NULL) < 0 || read_attr(rec, s_phases, &phases, NULL) < 0)
        goto error;
    PyObject *owners[FROM_COUNT] = {rec, self->modules, self->training, phases};
    for (int i = 0; i < N_ATTRS; i++)
        if (read_attr(owners[attrs[i].owner], attr_names[i], (PyObject **)((char *)self + attrs[i].field),
                      attrs[i].type) < 0)
            goto error;
    Py_CLEAR(phases);
    find_state_slots(self);
    self->hooks_on = attr_true(self->training, s_hooks_on);
    self->stats_on = self->hooks_on < 0 ? -1 : attr_true(rec, s_stats_on);
    self->saving = self->stats_on < 0 ? -1 : attr_true(rec, s_saving);
    if (self->saving < 0)
        return -1;
    if (!self->saving) {
        self->save_op = Py_NewRef(Py_None);
    } else {
        self->save_all = attr_true(rec, s_save_all);
        self->keep_graph = self->save_all < 0 ? -1 : attr_true(rec, s_keep_graph);
        if (self->keep_graph < 0 || read_attr(rec, s_save_op, &self->save_op, NULL) < 0 ||
            read_attr(rec, s_saved, &self->saved, &PyDict_Type) < 0 ||
            read_attr(rec, s_replay_records, &self->replay_records, &PyDict_Type) < 0)
            return -1;
    }
    PyObject *floor = PyObject_GetAttr(rec, s_seq_floor);
    self->seq_floor = floor == NULL ? -1 : PyLong_AsLongLong(floor);
    Py_XDECREF(floor);
    if (floor == NULL || (self->seq_floor == -1 && PyErr_Occurred()))
        return -1;
    return 0;
error:
    Py_XDECREF(phases);
    return -1;
}

/* Every object a FastOp holds: what the GC clears and visits. */
#define FASTOP_OBJECTS(X) \
    X(rec) X(on_op) X(rows) X(label_counts) X(params) X(writes) X(backward_sources) X(token) X(modules) \
    X(training) X(link_pending) X(written_storage) X(record_failure) X(phase_special) X(recomputed) \
    X(stack_of_address) X(locate) X(mode) X(arrived) X(out_stats) X(in_flight) X(with_written_bases) \
    X(storage_refs) X(save_op) X(saved) X(replay_records) X(before_write) X(node_ops) X(tagged_nodes) \
    X(last_node) X(last_fwd)

static int
fastop_clear(FastOp *self)
{
#define CLEAR_ONE(field) Py_CLEAR(self->field);
    FASTOP_OBJECTS(CLEAR_ONE)
#undef CLEAR_ONE
    return 0;
}

static int
fastop_traverse(FastOp *self, visitproc visit, void *arg)
{
#define VISIT_ONE(field) Py_VISIT(self->field);
    FASTOP_OBJECTS(VISIT_ONE)
#undef VISIT_ONE
    return 0;
}

static void
fastop_dealloc(FastOp *self)
{
    PyObject_GC_UnTrack(self);
    fastop_clear(self);
    clear_spans(self);
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

/* What a post-mortem names as the op in flight (Recorder.on_op's frame says it on the Python path). */
static PyObject *
fastop_running(FastOp *self, void *closure)
{
    return Py_NewRef(self->running == NULL ? Py_None : self->running);
}

static PyObject *
fastop_close(FastOp *self, PyObject *unused)
{
    forget_node(self);
    Py_RETURN_NONE;
}

static PyMethodDef fastop_methods[] = {
    {"close", (PyCFunction)fastop_close, METH_NOARGS,
     PyDoc_STR("close(): the window has closed; drops what was kept from one op to the next (an autograd node).")},
    {NULL},
};

static PyGetSetDef fastop_getset[] = {
    {"__self__", (getter)fastop_self, NULL, PyDoc_STR("the mode this dispatches for"), NULL},
    {"running", (getter)fastop_running, NULL, PyDoc_STR("the OpInfo of the op running now, or None"), NULL},
    {NULL},
};

static PyTypeObject FastOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tl_dist._fastop.FastOp",
    .tp_doc = PyDoc_STR("FastOp(recorder, mode): mode's __torch_dispatch__ for recorder, compiled."),
    .tp_call = fastop_call,
    .tp_getset = fastop_getset,
    .tp_methods = fastop_methods,
    .tp_basicsize = sizeof(FastOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fastop_init,
    .tp_dealloc = (destructor)fastop_dealloc,
    .tp_traverse = (traverseproc)fastop_traverse,
    .tp_clear = (inquiry)fastop_clear,
};

/* g_slot from schema.OP_FIELDS's names: each of this extension's values must be there, and nothing else.
 * Nothing changes when they are not. */
static int
set_slots(PyObject *row_fields)
{
    int slot[N_FIELDS];
    if (PyTuple_GET_SIZE(row_fields) != N_FIELDS) {
        PyErr_Format(PyExc_ValueError, "tl_dist._fastop builds rows of %d fields; schema.OP_FIELDS has %zd",
                     N_FIELDS, PyTuple_GET_SIZE(row_fields));
        return -1;
    }
    for (int k = 0; k < N_FIELDS; k++) {
        slot[k] = -1;
        for (Py_ssize_t pos = 0; pos < N_FIELDS; pos++) {
            PyObject *name = PyTuple_GET_ITEM(row_fields, pos);
            if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, FIELD_NAMES[k]) == 0)
                slot[k] = (int)pos;
        }
        if (slot[k] < 0) {
            PyErr_Format(PyExc_ValueError, "schema.OP_FIELDS has no field %s, which tl_dist._fastop fills",
                         FIELD_NAMES[k]);
            return -1;
        }
    }
    memcpy(g_slot, slot, sizeof(slot));
    return 0;
}

static PyObject *
fastop_configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"tensor_type", "parameter_type", "entries", "make_entry", "dtype_names",
                            "device_names", "dtype_name", "device_name", "flat_outputs", "shape_of",
                            "flop_count", "graph_task_id", "grad_enabled", "current_node",
                            "perf_counter_ns", "tag", "sequence_nr", "row_fields", NULL};
    PyObject *v[17], *row_fields;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOO!OO!O!OOOOOOOOOUOO!:configure", names, &v[0], &v[1],
                                     &PyDict_Type, &v[2], &v[3], &PyDict_Type, &v[4], &PyDict_Type, &v[5], &v[6],
                                     &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14], &v[15], &v[16],
                                     &PyTuple_Type, &row_fields))
        return NULL;
    if (set_slots(row_fields) < 0)
        return NULL;
    PyObject **slots[17] = {&g_tensor_type, &g_parameter_type, &g_entries, &g_make_entry, &g_dtype_names,
                            &g_device_names, &g_dtype_name, &g_device_name, &g_flat_outputs, &g_shape_of,
                            &g_flop_count, &g_graph_task_id, &g_grad_enabled, &g_current_node,
                            &g_perf_counter_ns, &g_tag, &g_sequence_nr};
    for (int i = 0; i < 17; i++)
        Py_XSETREF(*slots[i], Py_NewRef(v[i]));
    if (set_tensor_getters() < 0)
        return NULL;
    clear_entry_cache(); /* its entries came from the old g_entries */
    PyDict_Clear(g_flop_memo); /* its counts came from the old flop_count */
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))fastop_configure, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("configure(**objects): the torch and tl_dist objects the fast path calls (once, at import).")},
    {"columns", fastop_columns, METH_VARARGS,
     PyDoc_STR("columns(rows, width, shift_field, shift): the rows as `width` lists, `shift` added to one field.")},
    {"configure_modules", (PyCFunction)(void (*)(void))fastop_configure_modules, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("configure_modules(**objects): what the module hooks share with tl_dist._modules (once).")},
    {"configure_source", (PyCFunction)(void (*)(void))fastop_configure_source, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("configure_source(**objects): the caches the source walk shares with tl_dist._source (once).")},
    {"module_pre", (PyCFunction)(void (*)(void))module_pre, METH_FASTCALL,
     PyDoc_STR("module_pre(tracker, module) -> bool: ModuleTracker._pre's common case done; False: nothing done.")},
    {"module_post", (PyCFunction)(void (*)(void))module_post, METH_FASTCALL,
     PyDoc_STR("module_post(tracker, module, output) -> bool: ModuleTracker._post's common case done.")},
    {"freed", fastop_freed, METH_VARARGS,
     PyDoc_STR("freed(kept, has_its_bytes) -> [(op, position)] of the tensors in kept ({op: [tensor | None]}) whose "
               "storage no longer holds the bytes they read; has_its_bytes decides for a wrapper subclass.")},
    {"untrack_rows", fastop_untrack_rows, METH_O,
     PyDoc_STR("untrack_rows(rows): a closed window's rows list off the cyclic GC's list (it is in no cycle).")},
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
    INTERN(s_stats_on, "stats_on");
    INTERN(s_saving, "saving");
    INTERN(s_grad_fn, "grad_fn");
    INTERN(s_metadata, "metadata");
    INTERN(s_dtype, "dtype");
    INTERN(s_device, "device");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_cuda, "is_cuda");
    INTERN(s_shape, "shape");
    INTERN(s_element_size, "element_size");
    INTERN(s_current, "current");
    INTERN(s_cpu, "cpu");
    INTERN(s_factory, "factory");
    INTERN(s_other, "other");
    INTERN(s_view, "view");
    INTERN(s_backward, "backward");
    INTERN(s_recompute, "recompute");
    INTERN(s_empty, "");
    INTERN(s_step_source, "step_source");
    INTERN(s_optimizer, "optimizer");
    INTERN(s_untyped_storage, "untyped_storage");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_writes_generation, "writes_generation");
    INTERN(s_base, "_base");
    INTERN(s_itemsize, "itemsize");
    INTERN(s_storage_offset, "storage_offset");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_numel, "numel");
    INTERN(s_stride, "stride");
    INTERN(s_sequence_nr, "_sequence_nr");
    INTERN(s_variable, "variable");
    INTERN(s_detach, "detach");
    INTERN(s_clone, "clone");
    INTERN(s_layout, "layout");
    INTERN(s_save_all, "save_all");
    INTERN(s_keep_graph, "keep_graph");
    INTERN(s_modules, "modules");
    INTERN(s_training, "training");
    INTERN(s_phases, "phases");
    INTERN(s_seq_floor, "seq_floor");
    INTERN(s_save_op, "_save_op");
    INTERN(s_saved, "saved");
    INTERN(s_replay_records, "replay_records");
    if (intern_attr_names() < 0)
        return NULL;
    if ((g_labels = PyDict_New()) == NULL || (g_itemsizes = PyDict_New()) == NULL || (g_flop_memo = PyDict_New()) == NULL)
        return NULL;
    if (init_module_hooks() < 0 || PyType_Ready(&FastOpType) < 0)
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
