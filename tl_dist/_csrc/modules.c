/* The common case of the module tracker's two global hooks (tl_dist/_modules.py: ModuleTracker._pre, _post),
 * compiled. Python's interpreter is not what a module call costs: it is the dict and list operations the
 * module-call table needs, which are the same C calls here, so this halves the hooks' own time (4.5 to 2.1 us
 * a call and return, warm) rather than removing it; benchmarks/bench_telemetry.py's part 5 reads ~14 us more
 * per module call than per op before, ~11.5 us after (with the compiled source walk, source.c).
 *
 * The Python hooks stay the ones registered with torch: they test torch.compiler.is_compiling() first (Dynamo,
 * tracing a compiled module's call, inlines them and must see that test), then call module_pre / module_post
 * here. These return True when they did the hook's whole work, and False, having changed nothing, where the
 * call needs the Python hook: another thread, the autograd engine (checkpoint recomputation), a module not
 * named yet, a compiled wrapper in the tree, a class not seen yet, a call that is not the innermost one open,
 * interventions on module outputs, an output that is not plain tensors. The Python hooks are the reference
 * (tests/test_fastop.py compares the module-call tables of both paths on every zoo model, and counts the
 * Python that runs).
 *
 * The tracker's state is read from and written to its instance dict by name, as the Python hooks do with
 * attributes: nothing here holds the tracker, so it adds no reference cycle. */
#include "fastop.h"

#include <pythread.h>

PyObject *g_leaf_spec;    /* the pytree spec of one tensor (_modules.LEAF_SPEC) */
PyObject *g_class_facts;  /* type -> (torch.compile's wrapper class, forward is torch's own) (_modules.CLASS_FACTS) */
PyObject *g_call_columns; /* the module-call table's column names, in schema.MODULE_CALL_FIELDS order */
PyObject *g_flat_tuple_specs; /* n -> the spec of a plain tuple of n leaves (_modules.FLAT_TUPLE_SPECS) */

/* The columns this file appends to, in schema.MODULE_CALL_FIELDS order (checked at configure()). */
enum { C_ADDRESS, C_TYPE, C_CALL, C_PARENT, C_DEPTH, C_FIRST_OP, C_END_OP, C_OUT_OPS, C_OUT_POS, C_SOURCE, N_COLUMNS };
static const char *const COLUMN_NAMES[N_COLUMNS] = {
    "address", "type", "call", "parent", "depth", "first_op", "end_op", "out_ops", "out_pos", "source",
};

static PyObject *s_thread, *s_names, *s_wrapper_of, *s_calls, *s_call_counts, *s_current_call, *s_address_stack,
    *s_current_builtin, *s_current_source, *s_current_address, *s_recorder, *s_locate, *s_call_site, *s_stack,
    *s_forward_calls, *s_last_call, *s_stack_of_address, *s_out_trees, *s_module_output, *s_save_selector,
    *s_training, *s_stats_all, *s_token, *s_requires_grad, *s_node_ops, *s_link_module_output, *s_output_of;

static int
check_call_columns(PyObject *names)
{
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != N_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "tl_dist._fastop fills %d module-call columns; schema.MODULE_CALL_FIELDS "
                     "has another count", N_COLUMNS);
        return -1;
    }
    for (int k = 0; k < N_COLUMNS; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, COLUMN_NAMES[k]) != 0) {
            PyErr_Format(PyExc_ValueError, "schema.MODULE_CALL_FIELDS[%d] is not %s, which tl_dist._fastop fills "
                         "there", k, COLUMN_NAMES[k]);
            return -1;
        }
    }
    return 0;
}

/* d[name], borrowed; NULL with KeyError set when missing. */
static PyObject *
item(PyObject *d, PyObject *name)
{
    PyObject *v = PyDict_GetItemWithError(d, name);
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, name);
    return v;
}

/* Whether this runs on the tracker's thread: 1, 0, or -1 with an error set. */
static int
on_tracker_thread(PyObject *d)
{
    PyObject *thread = item(d, s_thread);
    if (thread == NULL)
        return -1;
    unsigned long ident = PyLong_AsUnsignedLong(thread);
    if (ident == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    return ident == PyThread_get_thread_ident();
}

/* ModuleTracker._set_current: the tracker's current call from the top of its call stack. */
static int
set_current(PyObject *tracker, PyObject *d, PyObject *stack)
{
    PyObject *row, *addresses, *source, *builtin, *address;
    Py_ssize_t n = PyList_GET_SIZE(stack);
    PyObject *empty = NULL;
    if (n > 0) {
        PyObject *top = PyList_GET_ITEM(stack, n - 1);
        if (!PyTuple_Check(top) || PyTuple_GET_SIZE(top) != 5) {
            PyErr_SetString(PyExc_TypeError, "tl_dist: a module call stack entry is (id, row, stack, source, builtin)");
            return -1;
        }
        row = PyTuple_GET_ITEM(top, 1);
        addresses = PyTuple_GET_ITEM(top, 2);
        source = PyTuple_GET_ITEM(top, 3);
        builtin = PyTuple_GET_ITEM(top, 4);
        if (!PyTuple_Check(addresses) || PyTuple_GET_SIZE(addresses) == 0) {
            PyErr_SetString(PyExc_TypeError, "tl_dist: a module call's address stack is a non-empty tuple");
            return -1;
        }
        address = PyTuple_GET_ITEM(addresses, PyTuple_GET_SIZE(addresses) - 1);
        Py_INCREF(row);
    } else {
        if ((empty = PyTuple_New(0)) == NULL || (row = PyLong_FromLong(-1)) == NULL) {
            Py_XDECREF(empty);
            return -1;
        }
        addresses = empty;
        source = address = s_empty;
        builtin = Py_False;
    }
    PyObject *current = PyTuple_Pack(5, address, addresses, row, builtin, source);
    int rc = current == NULL || PyDict_SetItem(d, s_current_call, row) < 0 ||
                     PyDict_SetItem(d, s_current_address, address) < 0 ||
                     PyDict_SetItem(d, s_address_stack, addresses) < 0 ||
                     PyDict_SetItem(d, s_current_source, source) < 0 ||
                     PyDict_SetItem(d, s_current_builtin, builtin) < 0 ||
                         PyObject_SetAttr(tracker, s_current, current) < 0 /* a slot: read by every op */
                 ? -1
                 : 0;
    Py_XDECREF(current);
    Py_DECREF(row);
    Py_XDECREF(empty);
    return rc;
}

/* The source of the call starting now: as ModuleTracker._pre finds it. New reference, NULL with an error. */
static PyObject *
call_source(PyObject *d, PyObject *recorder)
{
    PyObject *locate = PyObject_GetAttr(recorder, s_locate);
    if (locate == NULL)
        return NULL;
    PyObject *source;
    if (locate == Py_None) {
        source = Py_NewRef(s_empty);
    } else {
        PyObject *builtin = item(d, s_current_builtin);
        int inside = builtin == NULL ? -1 : PyObject_IsTrue(builtin);
        if (inside < 0)
            source = NULL;
        else if (inside) /* called from a torch module's forward: the same site as its ops' */
            source = Py_XNewRef(item(d, s_current_source));
        else if (source_configured()) {
            PyObject *enclosing = item(d, s_current_source);
            source = enclosing == NULL ? NULL : call_site_source(enclosing);
        } else {
            source = PyObject_CallMethodNoArgs(locate, s_call_site);
        }
    }
    Py_DECREF(locate);
    return source;
}

/* module_pre(tracker, module) -> bool: ModuleTracker._pre's work for a call outside the autograd engine on
 * the tracker's thread, of a named module of a known class that is not a compiled wrapper, with no compiled
 * wrapper in the tree. False (nothing changed) for any other call. */
PyObject *
module_pre(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "module_pre(tracker, module)");
        return NULL;
    }
    PyObject *tracker = args[0], *module = args[1];
    if (g_call_columns == NULL)
        Py_RETURN_FALSE; /* configure_modules() never ran: the Python hook does it all */
    PyObject *d = PyObject_GenericGetDict(tracker, NULL);
    if (d == NULL)
        return NULL;
    PyObject *result = NULL, *key = NULL, *task = NULL, *type_name = NULL, *source = NULL, *first = NULL;
    PyObject *n_call = NULL, *next_count = NULL, *depth = NULL, *row_obj = NULL, *stack = NULL, *entry = NULL;
    PyObject *forward = NULL, *empty = NULL;
    if (!PyDict_CheckExact(d)) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if ((task = PyObject_CallNoArgs(g_graph_task_id)) == NULL)
        goto done;
    int same = on_tracker_thread(d);
    if (same < 0)
        goto done;
    if (task != Py_None && PyLong_Check(task) && PyLong_AsLong(task) != -1) { /* inside the autograd engine */
        result = Py_NewRef(Py_False);
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    PyObject *names = item(d, s_names), *wrapper_of = item(d, s_wrapper_of);
    if (names == NULL || wrapper_of == NULL || (key = PyLong_FromVoidPtr(module)) == NULL)
        goto done;
    PyObject *address = PyDict_GetItemWithError(names, key);
    PyObject *facts = address == NULL ? NULL : PyDict_GetItemWithError(g_class_facts, (PyObject *)Py_TYPE(module));
    if (PyErr_Occurred())
        goto done;
    if (!same || address == NULL || !PyUnicode_Check(address) || PyDict_GET_SIZE(wrapper_of) > 0 ||
        facts == NULL || !PyTuple_Check(facts) || PyTuple_GET_SIZE(facts) != 2 ||
        PyTuple_GET_ITEM(facts, 0) != Py_False) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    PyObject *builtin = PyTuple_GET_ITEM(facts, 1);

    PyObject *calls = item(d, s_calls), *counts = item(d, s_call_counts), *recorder = item(d, s_recorder);
    PyObject *parent = item(d, s_current_call), *addresses = item(d, s_address_stack);
    PyObject *calls_stack = item(d, s_stack), *forward_calls = item(d, s_forward_calls);
    PyObject *last_call = item(d, s_last_call), *stack_of_address = item(d, s_stack_of_address);
    if (!calls || !counts || !recorder || !parent || !addresses || !calls_stack || !forward_calls || !last_call ||
        !stack_of_address)
        goto done;
    if (!PyDict_Check(calls) || !PyDict_Check(counts) || !PyTuple_Check(addresses) || !PyList_Check(calls_stack) ||
        !PyDict_Check(forward_calls) || !PyDict_Check(last_call) || !PyDict_Check(stack_of_address)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: module_pre needs a ModuleTracker");
        goto done;
    }
    PyObject *columns[N_COLUMNS];
    for (int k = 0; k < N_COLUMNS; k++) {
        columns[k] = item(calls, PyTuple_GET_ITEM(g_call_columns, k));
        if (columns[k] == NULL)
            goto done;
        if (!PyList_Check(columns[k])) {
            PyErr_SetString(PyExc_TypeError, "tl_dist: a module-call column is a list");
            goto done;
        }
    }
    /* Everything that can fail before the table grows: the call site, the counts, the new objects. */
    if ((source = call_source(d, recorder)) == NULL || (first = PyObject_GetAttr(recorder, s_n_ops)) == NULL ||
        (type_name = PyType_GetName(Py_TYPE(module))) == NULL)
        goto done;
    PyObject *seen = PyDict_GetItemWithError(counts, address);
    if (seen == NULL && PyErr_Occurred())
        goto done;
    long n = seen == NULL ? 0 : PyLong_AsLong(seen);
    if (n == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t row = PyList_GET_SIZE(columns[C_ADDRESS]);
    if ((n_call = PyLong_FromLong(n)) == NULL || (next_count = PyLong_FromLong(n + 1)) == NULL ||
        (depth = PyLong_FromSsize_t(PyTuple_GET_SIZE(addresses))) == NULL ||
        (row_obj = PyLong_FromSsize_t(row)) == NULL || (empty = PyTuple_New(0)) == NULL)
        goto done;
    Py_ssize_t n_addresses = PyTuple_GET_SIZE(addresses);
    if ((stack = PyTuple_New(n_addresses + 1)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n_addresses; i++)
        PyTuple_SET_ITEM(stack, i, Py_NewRef(PyTuple_GET_ITEM(addresses, i)));
    PyTuple_SET_ITEM(stack, n_addresses, Py_NewRef(address));
    if ((entry = PyTuple_Pack(5, key, row_obj, stack, source, builtin)) == NULL ||
        (forward = PyTuple_Pack(2, stack, source)) == NULL)
        goto done;

    if (PyDict_SetItem(counts, address, next_count) < 0)
        goto done;
    PyObject *values[N_COLUMNS] = {address, type_name, n_call, parent, depth, first, first, empty, empty, source};
    for (int k = 0; k < N_COLUMNS; k++) {
        if (PyList_Append(columns[k], values[k]) < 0)
            goto done;
    }
    if (PyList_Append(calls_stack, entry) < 0 || PyDict_SetItem(forward_calls, key, forward) < 0 ||
        PyDict_SetItem(last_call, key, row_obj) < 0 || PyDict_SetItem(stack_of_address, address, stack) < 0 ||
        set_current(tracker, d, calls_stack) < 0)
        goto done;
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(d);
    Py_XDECREF(key);
    Py_XDECREF(task);
    Py_XDECREF(type_name);
    Py_XDECREF(source);
    Py_XDECREF(first);
    Py_XDECREF(n_call);
    Py_XDECREF(next_count);
    Py_XDECREF(depth);
    Py_XDECREF(row_obj);
    Py_XDECREF(stack);
    Py_XDECREF(entry);
    Py_XDECREF(forward);
    Py_XDECREF(empty);
    return result;
}

/* Sets *op and *pos (new references) to the op that made one output leaf of a module call and which of its
 * outputs it is, as Recorder.module_output's loop finds them (-1 and -1: no op of this window made it), with
 * that loop's side effects: the module noted in output_of, and the leaf's autograd node linked where its own
 * op did not make it (a custom Function's: TrainingState.link_module_output, in Python). -1 with an error. */
static int
leaf_op(PyObject *recorder, PyObject *training, PyObject *token, PyObject *address, PyObject *leaf,
        PyObject **op, PyObject **pos)
{
    int rc = -1;
    PyObject *tag = NULL, *requires_grad = NULL, *node = NULL, *number = NULL;
    PyObject *node_ops = NULL, *output_of = NULL, *modules_out = NULL, *empty = NULL, *hooks_on = NULL;
    int ours = 0; /* a None in a tuple of outputs (nn.MultiheadAttention's weights) is no op's */
    if (leaf != Py_None && lookup_attr(leaf, g_tag, &tag) < 0)
        goto done;
    if (tag != NULL && PyTuple_Check(tag) && PyTuple_GET_SIZE(tag) >= 3 &&
        (ours = PyObject_RichCompareBool(PyTuple_GET_ITEM(tag, 0), token, Py_EQ)) < 0)
        goto done;
    if (!ours) {
        if ((*op = PyLong_FromLong(-1)) == NULL)
            goto done;
        *pos = Py_NewRef(*op);
        rc = 0;
        goto done;
    }
    PyObject *index = PyTuple_GET_ITEM(tag, 1);
    if ((requires_grad = PyObject_GetAttr(leaf, s_requires_grad)) == NULL)
        goto done;
    if (requires_grad == Py_True) {
        if ((node = tensor_get(leaf, T_GRAD_FN)) == NULL || (hooks_on = PyObject_GetAttr(training, s_hooks_on)) == NULL)
            goto done;
        int linked = node == Py_None;
        if (!linked && hooks_on == Py_False) { /* TrainingState.link_module_output's early exit, by number */
            if ((number = PyObject_CallMethodNoArgs(node, s_sequence_nr)) == NULL ||
                (node_ops = PyObject_GetAttr(recorder, s_node_ops)) == NULL)
                goto done;
            PyObject *owner = PyDict_Check(node_ops) ? PyDict_GetItemWithError(node_ops, number) : NULL;
            if (owner == NULL && PyErr_Occurred())
                goto done;
            if (owner != NULL && (linked = PyObject_RichCompareBool(owner, index, Py_EQ)) < 0)
                goto done;
        }
        if (!linked) {
            PyObject *r = PyObject_CallMethodObjArgs(training, s_link_module_output, leaf, tag, NULL);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    if ((output_of = PyObject_GetAttr(recorder, s_output_of)) == NULL || (empty = PyList_New(0)) == NULL)
        goto done;
    if (!PyDict_Check(output_of)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: Recorder.output_of is a dict");
        goto done;
    }
    modules_out = Py_XNewRef(PyDict_SetDefault(output_of, index, empty));
    int known = modules_out == NULL || !PyList_Check(modules_out) ? -1 : PySequence_Contains(modules_out, address);
    if (known < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "tl_dist: Recorder.output_of holds lists");
        goto done;
    }
    /* several output leaves of one module from one op count once */
    if (!known && PyList_Append(modules_out, address) < 0)
        goto done;
    *op = Py_NewRef(index);
    *pos = Py_NewRef(PyTuple_GET_ITEM(tag, 2));
    rc = 0;
done:
    Py_XDECREF(tag);
    Py_XDECREF(requires_grad);
    Py_XDECREF(node);
    Py_XDECREF(number);
    Py_XDECREF(node_ops);
    Py_XDECREF(output_of);
    Py_XDECREF(modules_out);
    Py_XDECREF(empty);
    Py_XDECREF(hooks_on);
    return rc;
}

/* (out_ops, out_pos) of a call's output leaves (tensors, and Nones in a tuple), as Recorder.module_output
 * gives them, which runs where the window needs more than the ops that made the leaves: a previous op's
 * outputs still to link, output statistics, a save selector. New reference, NULL with an error. */
static PyObject *
output_ops(PyObject *recorder, PyObject *address, PyObject *leaves)
{
    PyObject *result = NULL, *pending = NULL, *selector = NULL, *training = NULL, *stats_all = NULL;
    PyObject *token = NULL, *ops = NULL, *poss = NULL;
    if ((pending = PyObject_GetAttr(recorder, s_pending)) == NULL ||
        (selector = PyObject_GetAttr(recorder, s_save_selector)) == NULL ||
        (training = PyObject_GetAttr(recorder, s_training)) == NULL ||
        (stats_all = PyObject_GetAttr(training, s_stats_all)) == NULL)
        goto done;
    if (pending != Py_None || selector != Py_None || stats_all != Py_False) {
        result = PyObject_CallMethodObjArgs(recorder, s_module_output, address, leaves, NULL);
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(leaves);
    if ((token = PyObject_GetAttr(recorder, s_token)) == NULL || (ops = PyTuple_New(n)) == NULL ||
        (poss = PyTuple_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) { /* in order: the first leaf of an op notes the module */
        PyObject *op = NULL, *pos = NULL;
        if (leaf_op(recorder, training, token, address, PyList_GET_ITEM(leaves, i), &op, &pos) < 0)
            goto done;
        PyTuple_SET_ITEM(ops, i, op);
        PyTuple_SET_ITEM(poss, i, pos);
    }
    result = PyTuple_Pack(2, ops, poss);
done:
    Py_XDECREF(pending);
    Py_XDECREF(selector);
    Py_XDECREF(training);
    Py_XDECREF(stats_all);
    Py_XDECREF(token);
    Py_XDECREF(ops);
    Py_XDECREF(poss);
    return result;
}

/* The leaves and the pytree spec of an output the C post-hook takes, as _modules._flatten gives them: one
 * plain tensor, or a plain tuple of plain tensors and Nones whose spec _flatten has made already. Sets *leaves
 * and *spec (new references); 0 when the output is another kind (nothing set), -1 with an error. */
static int
flat_output(PyObject *output, PyObject **leaves, PyObject **spec)
{
    PyObject *type = (PyObject *)Py_TYPE(output);
    if (type == g_tensor_type || type == g_parameter_type) {
        if ((*leaves = PyList_New(1)) == NULL)
            return -1;
        PyList_SET_ITEM(*leaves, 0, Py_NewRef(output));
        *spec = Py_NewRef(g_leaf_spec);
        return 1;
    }
    if (!PyTuple_CheckExact(output))
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(output);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(output, i);
        PyObject *t = (PyObject *)Py_TYPE(v);
        if (v != Py_None && t != g_tensor_type && t != g_parameter_type)
            return 0;
    }
    PyObject *length = PyLong_FromSsize_t(n);
    PyObject *found = length == NULL ? NULL : PyDict_GetItemWithError(g_flat_tuple_specs, length); /* borrowed */
    Py_XDECREF(length);
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0; /* the Python hook makes that length's spec, once */
    if ((*leaves = PySequence_List(output)) == NULL)
        return -1;
    *spec = Py_NewRef(found);
    return 1;
}

/* module_post(tracker, module, output) -> bool: ModuleTracker._post's work when the call ending is the
 * innermost one open, on the tracker's thread, a forward call (not a recomputation), the window has no
 * interventions on module outputs, and the output is one plain tensor or a plain tuple of them and Nones
 * (flat_output). False (nothing changed) otherwise. */
PyObject *
module_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "module_post(tracker, module, output)");
        return NULL;
    }
    PyObject *tracker = args[0], *module = args[1], *output = args[2];
    if (g_call_columns == NULL)
        Py_RETURN_FALSE;
    PyObject *d = PyObject_GenericGetDict(tracker, NULL);
    if (d == NULL)
        return NULL;
    PyObject *result = NULL, *top = NULL, *n_ops = NULL, *address = NULL, *outs = NULL, *leaves = NULL;
    PyObject *tree_leaves = NULL, *tree = NULL, *spec = NULL;
    PyObject *stack = PyDict_CheckExact(d) ? item(d, s_stack) : NULL;
    if (stack == NULL) {
        if (!PyErr_Occurred())
            result = Py_NewRef(Py_False);
        goto done;
    }
    Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
    PyObject *edits = item(d, s_edits);
    int same = edits == NULL ? -1 : on_tracker_thread(d);
    if (same < 0)
        goto done;
    int plain = depth > 0 && same && edits == Py_None;
    if (plain && (plain = flat_output(output, &leaves, &spec)) < 0)
        goto done;
    long row = -1;
    if (plain) {
        PyObject *last = PyList_GET_ITEM(stack, depth - 1);
        plain = PyTuple_Check(last) && PyTuple_GET_SIZE(last) == 5 && PyLong_Check(PyTuple_GET_ITEM(last, 0)) &&
                PyLong_AsVoidPtr(PyTuple_GET_ITEM(last, 0)) == (void *)module;
        if (plain && (row = PyLong_AsLong(PyTuple_GET_ITEM(last, 1))) == -1 && PyErr_Occurred())
            goto done;
        plain = plain && row >= 0;
        if (PyErr_Occurred())
            goto done;
    }
    if (!plain) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    PyObject *calls = item(d, s_calls), *recorder = item(d, s_recorder), *out_trees = item(d, s_out_trees);
    PyObject *ends = calls == NULL ? NULL : item(calls, PyTuple_GET_ITEM(g_call_columns, C_END_OP));
    PyObject *addresses = ends == NULL ? NULL : item(calls, PyTuple_GET_ITEM(g_call_columns, C_ADDRESS));
    PyObject *out_ops = addresses == NULL ? NULL : item(calls, PyTuple_GET_ITEM(g_call_columns, C_OUT_OPS));
    PyObject *out_pos = out_ops == NULL ? NULL : item(calls, PyTuple_GET_ITEM(g_call_columns, C_OUT_POS));
    if (recorder == NULL || out_trees == NULL || out_pos == NULL)
        goto done;
    if (!PyList_Check(ends) || !PyList_Check(addresses) || !PyList_Check(out_ops) || !PyList_Check(out_pos) ||
        !PyDict_Check(out_trees) || row >= PyList_GET_SIZE(ends) || row >= PyList_GET_SIZE(addresses) ||
        row >= PyList_GET_SIZE(out_ops) || row >= PyList_GET_SIZE(out_pos)) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: module_post needs a ModuleTracker");
        goto done;
    }
    if ((n_ops = PyObject_GetAttr(recorder, s_n_ops)) == NULL)
        goto done;
    /* The call ends: the table and the current call first, as the Python hook does, then its output ops. */
    top = Py_NewRef(PyList_GET_ITEM(stack, depth - 1));
    if (PyList_SetSlice(stack, depth - 1, depth, NULL) < 0 || PyList_SetItem(ends, row, Py_NewRef(n_ops)) < 0 ||
        set_current(tracker, d, stack) < 0)
        goto done;
    address = Py_NewRef(PyList_GET_ITEM(addresses, row));
    outs = output_ops(recorder, address, leaves);
    if (outs == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(leaves);
    if (!PyTuple_Check(outs) || PyTuple_GET_SIZE(outs) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(outs, 0)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(outs, 0)) != n) {
        PyErr_SetString(PyExc_TypeError, "tl_dist: Recorder.module_output returns (out_ops, out_pos), one per leaf");
        goto done;
    }
    PyObject *ops = PyTuple_GET_ITEM(outs, 0), *pos = PyTuple_GET_ITEM(outs, 1);
    if (PyList_SetItem(out_ops, row, Py_NewRef(ops)) < 0 || PyList_SetItem(out_pos, row, Py_NewRef(pos)) < 0)
        goto done;
    /* (spec, the leaves no op made): rebuilding the output needs only those. */
    if ((tree_leaves = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long op = PyLong_AsLong(PyTuple_GET_ITEM(ops, i));
        if (op == -1 && PyErr_Occurred())
            goto done;
        PyList_SET_ITEM(tree_leaves, i, Py_NewRef(op >= 0 ? Py_None : PyList_GET_ITEM(leaves, i)));
    }
    PyObject *row_key = PyLong_FromLong(row);
    tree = row_key == NULL ? NULL : PyTuple_Pack(2, spec, tree_leaves);
    int rc = tree == NULL ? -1 : PyDict_SetItem(out_trees, row_key, tree);
    Py_XDECREF(row_key);
    if (rc < 0)
        goto done;
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(d);
    Py_XDECREF(top);
    Py_XDECREF(n_ops);
    Py_XDECREF(address);
    Py_XDECREF(outs);
    Py_XDECREF(leaves);
    Py_XDECREF(tree_leaves);
    Py_XDECREF(tree);
    Py_XDECREF(spec);
    return result;
}

/* configure_modules(leaf_spec, flat_tuple_specs, class_facts, call_fields): the objects the module hooks share with _modules.py
 * (once, at import). Nothing changes when call_fields is not the column list this file fills. */
PyObject *
fastop_configure_modules(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"leaf_spec", "flat_tuple_specs", "class_facts", "call_fields", NULL};
    PyObject *leaf_spec, *flat_tuple_specs, *class_facts, *call_fields;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OO!O!O!:configure_modules", names, &leaf_spec, &PyDict_Type,
                                     &flat_tuple_specs, &PyDict_Type, &class_facts, &PyTuple_Type, &call_fields))
        return NULL;
    if (check_call_columns(call_fields) < 0)
        return NULL;
    Py_XSETREF(g_leaf_spec, Py_NewRef(leaf_spec));
    Py_XSETREF(g_flat_tuple_specs, Py_NewRef(flat_tuple_specs));
    Py_XSETREF(g_class_facts, Py_NewRef(class_facts));
    Py_XSETREF(g_call_columns, Py_NewRef(call_fields));
    Py_RETURN_NONE;
}

#define INTERN(var, text)                                                                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                                   \
        return -1;

int
init_module_hooks(void)
{
    INTERN(s_thread, "thread");
    INTERN(s_names, "names");
    INTERN(s_wrapper_of, "_wrapper_of");
    INTERN(s_calls, "calls");
    INTERN(s_call_counts, "_call_counts");
    INTERN(s_current_call, "current_call");
    INTERN(s_address_stack, "address_stack");
    INTERN(s_current_builtin, "current_builtin");
    INTERN(s_current_source, "current_source");
    INTERN(s_current_address, "current_address");
    INTERN(s_recorder, "_recorder");
    INTERN(s_locate, "locate");
    INTERN(s_call_site, "call_site");
    INTERN(s_stack, "_stack");
    INTERN(s_forward_calls, "_forward_calls");
    INTERN(s_last_call, "_last_call");
    INTERN(s_stack_of_address, "stack_of_address");
    INTERN(s_out_trees, "out_trees");
    INTERN(s_module_output, "module_output");
    INTERN(s_save_selector, "save_selector");
    INTERN(s_training, "training");
    INTERN(s_stats_all, "stats_all");
    INTERN(s_token, "token");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_node_ops, "node_ops");
    INTERN(s_link_module_output, "link_module_output");
    INTERN(s_output_of, "output_of");
    return 0;
}
