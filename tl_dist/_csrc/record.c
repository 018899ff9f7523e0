/* What one op's row is made of: inputs, outputs and their tags, where the op ran (phase, module, source),
 * the links autograd nodes carry, the in-place write log's checks. Each helper follows the Python rule it
 * names in tl_dist/_recorder.py, tl_dist/_kept.py, tl_dist/training.py or tl_dist/_opinfo.py. */
#include "fastop.h"

#include <string.h>
#include <time.h>

int
lookup_attr(PyObject *obj, PyObject *name, PyObject **result)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, result);
#else
    return _PyObject_LookupAttr(obj, name, result);
#endif
}

long long
clock_ns(void)
{
#if defined(__linux__)
    /* time.perf_counter_ns() is CLOCK_MONOTONIC on Linux; the rest of tl_dist compares against it. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#else
    PyObject *t = PyObject_CallNoArgs(g_perf_counter_ns);
    long long ns = t == NULL ? -1 : PyLong_AsLongLong(t);
    Py_XDECREF(t);
    return ns;
#endif
}

#if PY_VERSION_HEX >= 0x030C0000
#define TL_T_OBJECT_EX Py_T_OBJECT_EX
#define TL_READONLY Py_READONLY
#else
#include <structmember.h>
#define TL_T_OBJECT_EX T_OBJECT_EX
#define TL_READONLY READONLY
#endif

/* The offset of attribute `name` in obj when its class declares it in __slots__ (a writable object member),
 * else 0. A slot is a pointer at that offset in every instance: reading it costs no dict lookup, which between
 * two large kernels (caches emptied) is a few cache misses less per op. */
Py_ssize_t
slot_offset(PyObject *obj, PyObject *name)
{
    PyObject *descr = _PyType_Lookup(Py_TYPE(obj), name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return 0;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == TL_T_OBJECT_EX && !(member->flags & TL_READONLY) ? member->offset : 0;
}

/* obj.<name>, read at its slot's offset (slot_offset) when there is one. New reference, or NULL with an error. */
PyObject *
slot_get(PyObject *obj, Py_ssize_t offset, PyObject *name)
{
    if (offset == 0)
        return PyObject_GetAttr(obj, name);
    PyObject *value = *(PyObject **)((char *)obj + offset);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "tl_dist: %s has no attribute %U", Py_TYPE(obj)->tp_name, name);
    return Py_XNewRef(value);
}

/* The names of the ST_* state, in that order. */
static PyObject **const state_names[ST_COUNT] = {&s_pending, &s_n_ops, &s_edits, &s_phase, &s_last_write,
                                                 &s_step_source, &s_writes_generation};

PyObject *
rec_get(FastOp *self, int which)
{
    return slot_get(self->rec, self->state_slot[which], *state_names[which]);
}

/* Where the per-op state is: the slots of the recorder's class (and the module tracker's `current`). */
void
find_state_slots(FastOp *self)
{
    for (int i = 0; i < ST_COUNT; i++)
        self->state_slot[i] = slot_offset(self->rec, *state_names[i]);
    self->current_slot = slot_offset(self->modules, s_current);
}

int
rec_set(FastOp *self, int which, PyObject *value)
{
    Py_ssize_t offset = self->state_slot[which];
    if (offset == 0)
        return PyObject_SetAttr(self->rec, *state_names[which], value);
    PyObject **slot = (PyObject **)((char *)self->rec + offset);
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

int
is_tensor(PyObject *o)
{
    /* isinstance(o, torch.Tensor): torch's metaclass does not override the check, so a subtype test is it. */
    return PyObject_TypeCheck(o, (PyTypeObject *)g_tensor_type);
}

/* Takes a tuple of atoms (ints, strs, tuples already untracked) off the cyclic GC's list, as the GC's own
 * first pass over it would: the window's rows then cost that pass nothing when the window closes. Returns t
 * (NULL passes through, its error set). */
PyObject *
untrack_atomic(PyObject *t)
{
    if (t == NULL || !PyTuple_CheckExact(t) || !PyObject_GC_IsTracked(t))
        return t;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        /* PyType_IS_GC first: a flag test, where the ints and strings of shapes and tags stop */
        if (PyType_IS_GC(Py_TYPE(item)) && PyObject_GC_IsTracked(item))
            return t;
    }
    PyObject_GC_UnTrack(t);
    return t;
}

/* A direct-mapped cache in front of g_entries: hashing id(func) into the dict costs an int object and a
 * lookup per op (~700 instructions); a slot holds a reference to its func, so the address stays that func's. */
#define ENTRY_SLOTS 1024
static struct {
    PyObject *func, *entry;
} entry_cache[ENTRY_SLOTS];

void
clear_entry_cache(void)
{
    for (int i = 0; i < ENTRY_SLOTS; i++) {
        Py_CLEAR(entry_cache[i].func);
        Py_CLEAR(entry_cache[i].entry);
    }
}

/* The entry of func: a tuple, Py_None (slow path), or NULL with an error set. Borrowed. */
PyObject *
entry_of(PyObject *func)
{
    size_t slot = ((size_t)func >> 4) % ENTRY_SLOTS;
    if (entry_cache[slot].func == func)
        return entry_cache[slot].entry;
    PyObject *key = PyLong_FromVoidPtr(func);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(g_entries, key);
    if (entry == NULL || (entry != Py_None && PyTuple_GET_ITEM(entry, E_FUNC) != func)) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        entry = PyObject_CallOneArg(g_make_entry, func);
        if (entry == NULL || PyDict_SetItem(g_entries, key, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(entry); /* the dict holds it */
    }
    Py_DECREF(key);
    Py_XSETREF(entry_cache[slot].func, Py_NewRef(func));
    Py_XSETREF(entry_cache[slot].entry, Py_NewRef(entry));
    return entry;
}

/* Tags the autograd node of the previous op's single output with that op (TrainingState.link_pending's
 * common case); anything else calls it. */
int
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
    if (rec_set(self, ST_PENDING, Py_None) < 0) {
        Py_DECREF(pending);
        return -1;
    }
    int rc = -1;
    PyObject *node = tensor_get(PyList_GET_ITEM(outs, 0), T_GRAD_FN);
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
        PyTuple_GET_ITEM(old, 0) != token) {
        rc = PyObject_SetItem(meta, g_tag, link); /* training.tag_node: the tag, and the number noted */
        PyObject *number = rc < 0 ? NULL : PyObject_CallMethodNoArgs(node, s_sequence_nr);
        rc = number == NULL ? -1 : PySet_Add(self->tagged_nodes, number);
        Py_XDECREF(number);
    } else {
        rc = 0;
    }
    Py_XDECREF(old);
    Py_DECREF(meta);
done:
    Py_XDECREF(node);
    Py_DECREF(pending);
    return rc;
}

/* A value of a FLOP memo key: a non-tensor argument as it is (a list as a tuple), a tensor as the Tensor type
 * (its shape is in the key's input shapes, in the same order; a None argument stays None); NULL without an
 * error when the argument holds a tensor in a list (no memo: the formula runs). */
static PyObject *
memo_part(PyObject *a)
{
    if (is_tensor(a) == 1)
        return Py_NewRef(g_tensor_type);
    if (!PyList_Check(a) && !PyTuple_Check(a))
        return Py_NewRef(a);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    for (Py_ssize_t i = 0; i < n; i++)
        if (is_tensor(PySequence_Fast_GET_ITEM(a, i)) == 1)
            return NULL;
    return PyList_Check(a) ? PyList_AsTuple(a) : Py_NewRef(a);
}

/* The memo key of a call whose FLOPs depend on shapes and non-tensor arguments only: (aten, input shapes, each
 * argument by memo_part, then each keyword and its value's). NULL without an error when the call cannot be
 * memoised. */
static PyObject *
memo_key(PyObject *aten, PyObject *args, PyObject *kwargs, PyObject *in_shapes)
{
    Py_ssize_t n_args = PyTuple_GET_SIZE(args), n_kw = kwargs != NULL ? PyDict_GET_SIZE(kwargs) : 0;
    PyObject *key = PyTuple_New(2 + n_args + 2 * n_kw);
    if (key == NULL)
        return NULL;
    PyTuple_SET_ITEM(key, 0, Py_NewRef(aten));
    PyTuple_SET_ITEM(key, 1, Py_NewRef(in_shapes));
    Py_ssize_t at = 2;
    for (Py_ssize_t i = 0; i < n_args; i++) {
        PyObject *part = memo_part(PyTuple_GET_ITEM(args, i));
        if (part == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, at++, part);
    }
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    while (kwargs != NULL && PyDict_Next(kwargs, &pos, &name, &value)) {
        PyObject *part = memo_part(value);
        if (part == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, at++, Py_NewRef(name));
        PyTuple_SET_ITEM(key, at++, part);
    }
    return key;
}

/* The op's FLOPs (_opinfo.flop_count): 0 without a formula; a formula of shapes alone is memoised here, so a
 * repeated call (every layer of a stack, every step) costs a dict lookup rather than a Python call. Before the
 * op runs (out NULL) only those two are known: NULL without an error otherwise. */
PyObject *
op_flops(PyObject *entry, PyObject *args, PyObject *kwargs, PyObject *out, PyObject *in_shapes)
{
    if (PyTuple_GET_ITEM(entry, E_FLOPS) == Py_None)
        return PyLong_FromLong(0);
    PyObject *key = NULL;
    if (PyTuple_GET_ITEM(entry, E_SHAPE_FLOPS) == Py_True) {
        key = memo_key(PyTuple_GET_ITEM(entry, E_ATEN), args, kwargs, in_shapes);
        if (key == NULL && PyErr_Occurred())
            return NULL;
        PyObject *known = key == NULL ? NULL : PyDict_GetItemWithError(g_flop_memo, key);
        if (known != NULL) {
            Py_DECREF(key);
            return Py_NewRef(known);
        }
        if (PyErr_Occurred()) { /* an unhashable argument: no memo */
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                Py_XDECREF(key);
                return NULL;
            }
            PyErr_Clear();
            Py_CLEAR(key);
        }
    }
    if (out == NULL) {
        Py_XDECREF(key);
        return NULL;
    }
    PyObject *kw = kwargs != NULL ? Py_NewRef(kwargs) : PyDict_New();
    PyObject *flops = kw == NULL ? NULL
                                 : PyObject_CallFunctionObjArgs(g_flop_count, PyTuple_GET_ITEM(entry, E_INFO), args,
                                                                kw, out, NULL);
    Py_XDECREF(kw);
    if (flops != NULL && key != NULL) {
        /* varying shapes (dynamic sequence lengths): memory stays bounded, as flop_count's own memo */
        if (PyDict_GET_SIZE(g_flop_memo) >= 65536)
            PyDict_Clear(g_flop_memo);
        if (PyDict_SetItem(g_flop_memo, key, flops) < 0)
            Py_CLEAR(flops);
    }
    Py_XDECREF(key);
    return flops;
}

/* Appends each distinct value of an int-like op index to parents (a list kept in first-seen order). */
int
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

/* The label of the n-th call of a func in a window, the same string object in every window. */
PyObject *
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
PyObject *
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
int
any_base(PyObject *written)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(written); i++) {
        PyObject *base = tensor_get(PyList_GET_ITEM(written, i), T_BASE);
        if (base == NULL)
            return -1;
        int view = base != Py_None;
        Py_DECREF(base);
        if (view)
            return 1;
    }
    return 0;
}

/* training.backward_link: the forward op whose autograd node is running now, -1 when unknown: the node's tag
 * of this window where its number is a tagged node's (rec.tagged_nodes), else its sequence number among the
 * forward ops' nodes (rec.node_ops). A node runs several ops in a row (mm's backward: two mm and their t):
 * the last node's answer is kept with the node, which the reference keeps from being another's. */
static PyObject *
backward_link(FastOp *self)
{
    PyObject *node = PyObject_CallNoArgs(g_current_node);
    if (node == NULL || node == Py_None) {
        Py_XDECREF(node);
        return node == NULL ? NULL : PyLong_FromLong(-1);
    }
    if (node == self->last_node) {
        Py_DECREF(node);
        return Py_NewRef(self->last_fwd);
    }
    PyObject *fwd = NULL, *link = NULL;
    PyObject *number = PyObject_CallMethodNoArgs(node, s_sequence_nr);
    int tagged = number == NULL ? -1 : PySet_Contains(self->tagged_nodes, number);
    if (tagged < 0)
        goto done;
    if (tagged) {
        PyObject *meta = PyObject_GetAttr(node, s_metadata);
        if (meta == NULL)
            goto done;
        link = PyDict_Check(meta) ? Py_XNewRef(PyDict_GetItemWithError(meta, g_tag)) : NULL;
        Py_DECREF(meta);
        if (link == NULL && PyErr_Occurred())
            goto done;
        if (link != NULL && PyTuple_Check(link) && PyTuple_GET_SIZE(link) >= 2 &&
            PyTuple_GET_ITEM(link, 0) == self->token) {
            fwd = Py_NewRef(PyTuple_GET_ITEM(link, 1));
            goto done;
        }
    }
    fwd = Py_XNewRef(PyDict_GetItemWithError(self->node_ops, number));
    if (fwd == NULL && !PyErr_Occurred())
        fwd = PyLong_FromLong(-1);
done:
    Py_XDECREF(link);
    Py_XDECREF(number);
    if (fwd != NULL) {
        Py_XSETREF(self->last_node, node); /* the reference is the cache's now */
        Py_XSETREF(self->last_fwd, Py_NewRef(fwd));
    } else {
        Py_DECREF(node);
    }
    return fwd;
}

/* Shapes as tuples, each met before given as the same tuple (process-wide, direct-mapped, bounded): a step's
 * shapes repeat, every layer and every step, so an op's input and output shapes cost a lookup rather than
 * tuples made, and their window holds (and frees at close) one tuple per distinct shape rather than per op.
 * A shape tuple of up to SHAPE_DIMS plain ints is kept with its values; a tuple of shapes with its items'
 * addresses, each alive (the tuple holds it), so equal addresses are the same shapes. The GIL guards both
 * tables (the extension is built for a CPython with one). */
#define SHAPE_SLOTS 1024
#define SHAPE_DIMS 8   /* the most dimensions of a cached shape */
#define SHAPES_ITEMS 8 /* the most tensors of a cached tuple of shapes */
static struct {
    PyObject *tuple;
    Py_ssize_t n;
    long long dims[SHAPE_DIMS];
} shape_cache[SHAPE_SLOTS];
static struct {
    PyObject *tuple;
    Py_ssize_t n;
    PyObject *items[SHAPES_ITEMS];
} shapes_cache[SHAPE_SLOTS];

static size_t
mix(size_t h, unsigned long long v)
{
    h ^= (size_t)(v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2));
    return h;
}

/* tuple(size): the cached tuple of these values where there is one, else a new one (cached when plain). */
static PyObject *
shape_tuple(PyObject *t)
{
    PyObject *size = tensor_get(t, T_SHAPE);
    if (size == NULL)
        return NULL;
    if (!PyTuple_Check(size)) {
        PyObject *shape = PySequence_Tuple(size);
        Py_DECREF(size);
        return untrack_atomic(shape);
    }
    Py_ssize_t n = PyTuple_GET_SIZE(size);
    long long dims[SHAPE_DIMS];
    int plain = n <= SHAPE_DIMS;
    size_t h = (size_t)n;
    for (Py_ssize_t i = 0; plain && i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(size, i);
        int overflow = 0;
        dims[i] = PyLong_CheckExact(d) ? PyLong_AsLongLongAndOverflow(d, &overflow) : -1;
        plain = PyLong_CheckExact(d) && !overflow; /* a SymInt (a traced shape) is not cached */
        h = mix(h, (unsigned long long)dims[i]);
    }
    size_t slot = h % SHAPE_SLOTS;
    if (plain && shape_cache[slot].tuple != NULL && shape_cache[slot].n == n &&
        memcmp(shape_cache[slot].dims, dims, (size_t)n * sizeof(long long)) == 0) {
        Py_DECREF(size);
        return Py_NewRef(shape_cache[slot].tuple);
    }
    PyObject *shape = untrack_atomic(PyTuple_GetSlice(size, 0, PY_SSIZE_T_MAX));
    Py_DECREF(size);
    if (shape != NULL && plain) {
        Py_XSETREF(shape_cache[slot].tuple, Py_NewRef(shape));
        shape_cache[slot].n = n;
        memcpy(shape_cache[slot].dims, dims, (size_t)n * sizeof(long long));
    }
    return shape;
}

/* The cached tuple of these shapes (shapes[0..n)), or NULL without an error when there is none. */
static PyObject *
cached_shapes(PyObject **shapes, Py_ssize_t n, size_t *slot)
{
    size_t h = (size_t)n + 1;
    for (Py_ssize_t i = 0; i < n; i++)
        h = mix(h, (unsigned long long)(size_t)shapes[i]);
    *slot = h % SHAPE_SLOTS;
    if (shapes_cache[*slot].tuple == NULL || shapes_cache[*slot].n != n ||
        memcmp(shapes_cache[*slot].items, shapes, (size_t)n * sizeof(PyObject *)) != 0)
        return NULL;
    return Py_NewRef(shapes_cache[*slot].tuple);
}

/* tuple(tuple(t.shape) for t in tensors); falls back to shape_of for every tensor (nested tensors have
 * ragged sizes that raise RuntimeError) when `fallback` is set. */
PyObject *
shapes_of(PyObject *tensors, int fallback)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors); /* a list or a tuple */
    PyObject *found[SHAPES_ITEMS];
    int cacheable = !fallback && n <= SHAPES_ITEMS;
    if (cacheable) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if ((found[i] = shape_tuple(PySequence_Fast_GET_ITEM(tensors, i))) == NULL) {
                while (i > 0)
                    Py_DECREF(found[--i]);
                return NULL;
            }
        }
        size_t slot;
        PyObject *shapes = cached_shapes(found, n, &slot);
        if (shapes == NULL) {
            shapes = PyTuple_New(n);
            if (shapes != NULL) {
                memcpy(((PyTupleObject *)shapes)->ob_item, found, (size_t)n * sizeof(PyObject *)); /* stolen */
                untrack_atomic(shapes);
                Py_XSETREF(shapes_cache[slot].tuple, Py_NewRef(shapes));
                shapes_cache[slot].n = n;
                memcpy(shapes_cache[slot].items, found, (size_t)n * sizeof(PyObject *));
                return shapes;
            }
        }
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(found[i]);
        return shapes;
    }
    PyObject *shapes = PyTuple_New(n);
    if (shapes == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tensors, i);
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

/* Tensor attributes read by calling their getter through its descriptor on torch._C.TensorBase: the function
 * PyObject_GetAttr ends in, without the walk there (the type's attribute cache, the descriptor protocol). With
 * a large kernel between two ops evicting the caches, that walk's cache misses cost more than the getter.
 * Only for plain tensors and Parameters, whose attributes are TensorBase's (a subclass may override one), and
 * only where torch's attribute is a getset descriptor; else PyObject_GetAttr. The names are the T_* ones, in
 * that order. */
static PyObject **const getter_names[T_COUNT] = {&s_shape, &s_dtype, &s_device, &s_is_cpu, &s_is_cuda, &s_grad_fn,
                                                 &s_base};
static PyObject *getter_descrs[T_COUNT];
static PyGetSetDef *getters[T_COUNT];

/* The same for methods: t.<method>() is its method descriptor called with t, without PyObject_CallMethod's
 * lookup of the name through the type's attribute cache and MRO, where torch's method is TensorBase's (the
 * same object on Tensor and Parameter, not overridden in Python); else the lookup. The write log calls these
 * ~1,000 times a training step. The names are the M_* ones, in that order. */
static PyObject **const method_names[M_COUNT] = {&s_data_ptr, &s_storage_offset, &s_element_size, &s_is_contiguous,
                                                 &s_numel, &s_stride, &s_untyped_storage, &s_detach};
static PyObject *method_descrs[M_COUNT]; /* a PyMethodDescr, or NULL where the name is looked up per call */

/* *descr: torch's attribute `name` where it is one object of `kind` on both Tensor and Parameter (TensorBase's,
 * not overridden in Python), else NULL. 0, or -1 with an error set. */
static int
shared_descr(PyObject *name, PyTypeObject *kind, PyObject **descr)
{
    PyObject *on_tensor = PyObject_GetAttr(g_tensor_type, name);
    PyObject *on_parameter = on_tensor == NULL ? NULL : PyObject_GetAttr(g_parameter_type, name);
    if (on_parameter == NULL) {
        Py_XDECREF(on_tensor);
        return -1;
    }
    *descr = on_tensor == on_parameter && PyObject_TypeCheck(on_tensor, kind) ? Py_NewRef(on_tensor) : NULL;
    Py_DECREF(on_tensor);
    Py_DECREF(on_parameter);
    return 0;
}

static int
set_tensor_methods(void)
{
    for (int i = 0; i < M_COUNT; i++) {
        Py_CLEAR(method_descrs[i]);
        if (shared_descr(*method_names[i], &PyMethodDescr_Type, &method_descrs[i]) < 0)
            return -1;
    }
    return 0;
}

/* t.<method which>(): a new reference, or NULL with an error set. */
PyObject *
tensor_call(PyObject *t, int which)
{
    PyObject *descr = method_descrs[which];
    PyTypeObject *type = Py_TYPE(t);
    if (descr != NULL && (type == (PyTypeObject *)g_tensor_type || type == (PyTypeObject *)g_parameter_type))
        return PyObject_Vectorcall(descr, &t, 1, NULL);
    return PyObject_CallMethodNoArgs(t, *method_names[which]);
}

/* Called by configure(), once g_tensor_type and g_parameter_type are set (before any tensor_get). */
int
set_tensor_getters(void)
{
    for (int i = 0; i < T_COUNT; i++) {
        getters[i] = NULL;
        Py_CLEAR(getter_descrs[i]);
        PyObject *descr = NULL;
        if (shared_descr(*getter_names[i], &PyGetSetDescr_Type, &descr) < 0)
            return -1;
        PyGetSetDef *def = descr == NULL ? NULL : ((PyGetSetDescrObject *)descr)->d_getset;
        if (def != NULL && def->get != NULL) {
            getters[i] = def;
            getter_descrs[i] = descr; /* keeps the definition alive */
        } else
            Py_XDECREF(descr);
    }
    return set_tensor_methods();
}

/* t.<attribute which>: a new reference, or NULL with an error set. */
PyObject *
tensor_get(PyObject *t, int which)
{
    PyGetSetDef *def = getters[which];
    PyTypeObject *type = Py_TYPE(t);
    if (def != NULL && (type == (PyTypeObject *)g_tensor_type || type == (PyTypeObject *)g_parameter_type))
        return def->get(t, def->closure);
    return PyObject_GetAttr(t, *getter_names[which]);
}

/* bool(t.<attribute which>): 1 or 0, -1 with an error set. */
int
tensor_true(PyObject *t, int which)
{
    PyObject *value = tensor_get(t, which);
    if (value == NULL)
        return -1;
    int truth = value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* bool(obj.name): 1 or 0, -1 with an error set. */
int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* `names.get(key) or fallback_fn(key)`: the name of a dtype or device (_common). */
static PyObject *
name_of(PyObject *key, PyObject *names, PyObject *fallback_fn)
{
    PyObject *name = PyDict_GetItemWithError(names, key);
    if (name != NULL && PyObject_IsTrue(name) == 1)
        return Py_NewRef(name);
    return PyErr_Occurred() ? NULL : PyObject_CallOneArg(fallback_fn, key);
}

/* name_of(t.<attribute which>): the dtype or device name of a tensor. */
static PyObject *
attr_name(PyObject *t, int which, PyObject *names, PyObject *fallback_fn)
{
    PyObject *key = tensor_get(t, which);
    if (key == NULL)
        return NULL;
    PyObject *name = name_of(key, names, fallback_fn);
    Py_DECREF(key);
    return name;
}

/* _phases.accumulating_param and ModuleTracker.owner_of in one, for a backward op that differentiates no
 * recorded op: (address, stack) of the innermost called module owning the parameter whose gradient the running
 * AccumulateGrad node accumulates (a parameter of a module used without being called, MultiheadAttention's
 * out_proj, belongs to its caller), ("", ()) when there is none. New reference, NULL with an error. */
static PyObject *
param_owner(FastOp *self)
{
    PyObject *node = PyObject_CallNoArgs(g_current_node);
    if (node == NULL)
        return NULL;
    PyObject *result = NULL, *type_name = NULL, *param = NULL, *key = NULL, *address = NULL;
    if (node != Py_None && (type_name = PyType_GetName(Py_TYPE(node))) == NULL)
        goto done;
    int accumulates = type_name != NULL && PyUnicode_Check(type_name) &&
                      PyUnicode_CompareWithASCIIString(type_name, "AccumulateGrad") == 0;
    if (!accumulates) {
        result = Py_BuildValue("(O())", s_empty);
        goto done;
    }
    if ((param = PyObject_GetAttr(node, s_variable)) == NULL || (key = PyLong_FromVoidPtr(param)) == NULL)
        goto done;
    PyObject *name = PyDict_GetItemWithError(self->params, key); /* borrowed */
    if (name == NULL && PyErr_Occurred())
        goto done;
    if (name == NULL || !PyUnicode_Check(name)) {
        result = Py_BuildValue("(O())", s_empty);
        goto done;
    }
    address = Py_NewRef(name);
    while (PyUnicode_GET_LENGTH(address) > 0) { /* address.rpartition(".")[0], outward */
        Py_ssize_t dot = PyUnicode_FindChar(address, '.', 0, PyUnicode_GET_LENGTH(address), -1);
        if (dot == -2)
            goto done;
        Py_SETREF(address, dot < 0 ? Py_NewRef(s_empty) : PyUnicode_Substring(address, 0, dot));
        if (address == NULL)
            goto done;
        PyObject *stack = PyDict_GetItemWithError(self->stack_of_address, address); /* borrowed */
        if (stack != NULL) {
            result = PyTuple_Pack(2, address, stack);
            goto done;
        }
        if (PyErr_Occurred())
            goto done;
    }
    result = Py_BuildValue("(O())", s_empty);
done:
    Py_DECREF(node);
    Py_XDECREF(type_name);
    Py_XDECREF(param);
    Py_XDECREF(key);
    Py_XDECREF(address);
    return result;
}

/* The user's file:line issuing the op, or "" when the window records none: SourceLocator.__call__'s walk
 * (source.c), which ends at the enclosing call's source, `enclosing` (modules.current[4]). */
static PyObject *
locate(FastOp *self, PyObject *enclosing)
{
    if (self->locate == Py_None)
        return Py_NewRef(s_empty);
    if (!source_configured())
        return PyObject_CallNoArgs(self->locate); /* it reads the enclosing source itself */
    return op_source(enclosing);
}

/* locate() where the caller holds no current call: it is read from modules.current. */
static PyObject *
locate_here(FastOp *self)
{
    if (self->locate == Py_None || !source_configured())
        return locate(self, s_empty);
    PyObject *current = slot_get(self->modules, self->current_slot, s_current);
    if (current == NULL)
        return NULL;
    PyObject *source = NULL;
    if (!PyTuple_Check(current) || PyTuple_GET_SIZE(current) != 5)
        PyErr_SetString(PyExc_TypeError, "tl_dist: ModuleTracker.current is (address, stack, call, builtin, source)");
    else
        source = locate(self, PyTuple_GET_ITEM(current, 4));
    Py_DECREF(current);
    return source;
}

/* Recorder.on_op's source of a forward or optimizer op; builtin and current_source are the tracker's
 * current_builtin and current_source. */
static PyObject *
forward_source(FastOp *self, PyObject *phase, PyObject *builtin, PyObject *current_source)
{
    if (self->locate == Py_None)
        return Py_NewRef(s_empty);
    int inside = PyObject_IsTrue(builtin);
    if (inside < 0)
        return NULL;
    if (inside) /* inside nn.Linear & co: no user frame below its call site */
        return Py_NewRef(current_source);
    int optimizer = PyUnicode_Check(phase) ? PyUnicode_Compare(phase, s_optimizer) : -1;
    if (optimizer == -1 && PyErr_Occurred())
        return NULL;
    if (optimizer == 0) { /* every op of one step() call has that call's source */
        PyObject *step = rec_get(self, ST_STEP_SOURCE);
        if (step == NULL || step != Py_None)
            return step;
        Py_DECREF(step);
    }
    return locate(self, current_source);
}

PyObject *
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

/* The op's tensor arguments, positional then keyword, as a tuple (Recorder.on_op's list for ops without tensor
 * lists). */
PyObject *
input_tensors(PyObject *args, PyObject *kwargs)
{
    /* Counted first: a tuple of the exact size comes off CPython's free list, where a growing list costs two
     * allocations and a resize. */
    Py_ssize_t n = 0, pos = 0;
    PyObject *k, *v;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++)
        n += is_tensor(PyTuple_GET_ITEM(args, i));
    if (kwargs != NULL) {
        while (PyDict_Next(kwargs, &pos, &k, &v))
            n += is_tensor(v);
    }
    PyObject *tensors = PyTuple_New(n);
    if (tensors == NULL || n == 0)
        return tensors;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        if (is_tensor(a))
            PyTuple_SET_ITEM(tensors, j++, Py_NewRef(a));
    }
    for (pos = 0; kwargs != NULL && PyDict_Next(kwargs, &pos, &k, &v);) {
        if (is_tensor(v))
            PyTuple_SET_ITEM(tensors, j++, Py_NewRef(v));
    }
    return tensors;
}

/* Appends to parents the ops whose outputs (or in-place writes) the op reads, and to *param_names the names of
 * the parameters it reads (the list made at the first: most ops read none). */
int
scan_inputs(FastOp *self, PyObject *tensors, PyObject *parents, PyObject **param_names, PyObject *srcs)
{
    PyObject *token = self->token;
    int writes = PyDict_GET_SIZE(self->writes) > 0;
    long last = -1;
    if (writes) {
        PyObject *last_write = rec_get(self, ST_LAST_WRITE);
        if (last_write == NULL)
            return -1;
        last = PyLong_AsLong(last_write);
        Py_DECREF(last_write);
        if (last == -1 && PyErr_Occurred())
            return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
        PyObject *t = PyTuple_GET_ITEM(tensors, i);
        PyObject *tag;
        if (lookup_attr(t, g_tag, &tag) < 0)
            return -1;
        int ours = 0;
        if (tag != NULL && tag != Py_None && PyTuple_Check(tag) && PyTuple_GET_SIZE(tag) >= 3) {
            ours = PyObject_RichCompareBool(PyTuple_GET_ITEM(tag, 0), token, Py_EQ);
            if (ours < 0) {
                Py_DECREF(tag);
                return -1;
            }
        }
        if (ours) {
            PyObject *producer = PyTuple_GET_ITEM(tag, 1);
            int rc = add_parent(parents, producer);
            if (rc == 0 && writes) {
                long p = PyLong_AsLong(producer);
                if (p == -1 && PyErr_Occurred())
                    rc = -1;
                else if (last > p) /* an alias was written in place after t was made */
                    rc = add_writer(self, parents, t, p);
            }
            if (rc >= 0 && srcs != NULL) { /* the writer holds t's value now, not its producer's output */
                PyObject *src = rc == 1 ? Py_NewRef(Py_None) : PyTuple_Pack(2, producer, PyTuple_GET_ITEM(tag, 2));
                rc = src == NULL ? -1 : PyList_Append(srcs, src);
                Py_XDECREF(src);
            }
            Py_DECREF(tag);
            if (rc < 0)
                return -1;
            continue;
        }
        Py_XDECREF(tag);
        if (srcs != NULL && PyList_Append(srcs, Py_None) < 0)
            return -1;
        PyObject *key = PyLong_FromVoidPtr(t);
        if (key == NULL)
            return -1;
        PyObject *name = PyDict_GetItemWithError(self->params, key);
        Py_DECREF(key);
        if (name == NULL && PyErr_Occurred())
            return -1;
        if (name != NULL && ((*param_names == NULL && (*param_names = PyList_New(0)) == NULL) ||
                             PyList_Append(*param_names, name) < 0))
            return -1;
        if (writes && add_writer(self, parents, t, -1) < 0) /* a parameter the optimizer updated earlier */
            return -1;
    }
    return 0;
}

/* Runs the op; if it raises, the recorder notes the failure (Recorder._record_failure) and the error stands. */
PyObject *
run_op(FastOp *self, PyObject *entry, PyObject *args, PyObject *kwargs)
{
    PyObject *running = self->running; /* the entry stays in g_entries: the borrowed OpInfo outlives the op */
    self->running = PyTuple_GET_ITEM(entry, E_INFO);
    PyObject *out = PyObject_Call(PyTuple_GET_ITEM(entry, E_CALL), args, kwargs);
    self->running = running;
    if (out != NULL)
        return out;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *r = PyObject_CallFunctionObjArgs(self->record_failure, PyTuple_GET_ITEM(entry, E_INFO), value, NULL);
    if (r == NULL)
        PyErr_Clear(); /* the op's own error matters more than one in recording it */
    Py_XDECREF(r);
    PyErr_Restore(type, value, tb);
    return NULL;
}

/* dtype.itemsize, cached per dtype (g_itemsizes): a tensor's bytes are its shape's product times it, which
 * costs two method calls per output less than numel() * element_size(). -1 with an error set. */
static long long
itemsize_of(PyObject *dtype)
{
    PyObject *size = PyDict_GetItemWithError(g_itemsizes, dtype);
    if (size == NULL) {
        if (PyErr_Occurred() || (size = PyObject_GetAttr(dtype, s_itemsize)) == NULL)
            return -1;
        int rc = PyDict_SetItem(g_itemsizes, dtype, size);
        Py_DECREF(size); /* the dict holds it */
        if (rc < 0)
            return -1;
    }
    return PyLong_AsLongLong(size);
}

/* The product of a shape of plain ints, or -1 where it is not one (shape_of's -1 for a ragged dimension). */
static long long
numel_of(PyObject *shape)
{
    if (!PyTuple_Check(shape))
        return -1;
    long long n = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        PyObject *d = PyTuple_GET_ITEM(shape, i);
        long long size = PyLong_CheckExact(d) ? PyLong_AsLongLong(d) : -1;
        if (size < 0) {
            PyErr_Clear();
            return -1;
        }
        n *= size;
    }
    return n;
}

/* The bytes of output o of that dtype: its shape's product times the dtype's itemsize; numel() *
 * element_size() where the shape is not plain (a nested tensor's). -1 with an error set. */
static long long
bytes_of(PyObject *o, PyObject *shape, PyObject *dtype)
{
    long long n = numel_of(shape);
    if (n >= 0) {
        long long size = itemsize_of(dtype);
        return size < 0 ? -1 : n * size;
    }
    PyObject *ne = tensor_call(o, M_NUMEL);
    PyObject *es = ne == NULL ? NULL : tensor_call(o, M_ELEMENT_SIZE);
    long long a = ne == NULL ? -1 : PyLong_AsLongLong(ne);
    long long b = es == NULL ? -1 : PyLong_AsLongLong(es);
    Py_XDECREF(ne);
    Py_XDECREF(es);
    return es == NULL || PyErr_Occurred() ? -1 : a * b;
}

/* name_of(dtype, g_dtype_names, g_dtype_name), remembering the last answer: consecutive ops mostly make one
 * dtype (dtypes are singletons), and the pointer test spares a dict probe into lines a kernel evicted. */
static PyObject *
dtype_name_of(PyObject *dtype)
{
    static PyObject *last_dtype, *last_name;
    if (dtype == last_dtype)
        return Py_NewRef(last_name);
    PyObject *name = name_of(dtype, g_dtype_names, g_dtype_name);
    if (name != NULL) {
        Py_XSETREF(last_dtype, Py_NewRef(dtype));
        Py_XSETREF(last_name, Py_NewRef(name));
    }
    return name;
}

/* dtype and device of the first output (outs: a list or a tuple), the bytes of all (out_shapes: their shapes);
 * tags each output with (token, op, position) and sets *link: the tag of a single output (also its autograd
 * node's link), else (token, op). */
int
describe_outputs(PyObject *outs, PyObject *out_shapes, PyObject *token, PyObject *index, PyObject **dtype,
                 PyObject **device, long long *out_bytes, PyObject **link)
{
    Py_ssize_t n_out = PySequence_Fast_GET_SIZE(outs);
    if (n_out == 0) {
        *dtype = Py_NewRef(s_empty);
        *device = Py_NewRef(s_empty);
        *link = PyTuple_Pack(2, token, index); /* a collective's outputs may still come (Recorder.on_op) */
        return *link == NULL ? -1 : 0;
    }
    PyObject *first = PySequence_Fast_GET_ITEM(outs, 0);
    int cpu = tensor_true(first, T_IS_CPU);
    if (cpu < 0)
        return -1;
    *device = cpu ? Py_NewRef(s_cpu) : attr_name(first, T_DEVICE, g_device_names, g_device_name);
    if (*device == NULL)
        return -1;
    for (Py_ssize_t pos = 0; pos < n_out; pos++) {
        PyObject *o = PySequence_Fast_GET_ITEM(outs, pos);
        PyObject *o_dtype = tensor_get(o, T_DTYPE);
        if (o_dtype == NULL)
            return -1;
        if (pos == 0 && (*dtype = dtype_name_of(o_dtype)) == NULL) {
            Py_DECREF(o_dtype);
            return -1;
        }
        long long b = bytes_of(o, PyTuple_GET_ITEM(out_shapes, pos), o_dtype);
        Py_DECREF(o_dtype);
        if (b < 0)
            return -1;
        *out_bytes += b;
        PyObject *p = PyLong_FromSsize_t(pos);
        PyObject *tag = p == NULL ? NULL : PyTuple_Pack(3, token, index, p);
        Py_XDECREF(p);
        if (tag == NULL)
            return -1;
        untrack_atomic(tag);
        int rc = PyObject_SetAttr(o, g_tag, tag);
        if (n_out == 1)
            *link = tag;
        else
            Py_DECREF(tag);
        if (rc < 0)
            return -1;
    }
    if (n_out != 1 && (*link = PyTuple_Pack(2, token, index)) == NULL)
        return -1;
    return 0;
}


void
place_clear(struct place *pl)
{
    Py_CLEAR(pl->phase);
    Py_CLEAR(pl->fwd_op);
    Py_CLEAR(pl->address);
    Py_CLEAR(pl->stack);
    Py_CLEAR(pl->call);
    Py_CLEAR(pl->source);
}

int
place_op(FastOp *self, PyObject *entry, PyObject *args, PyObject *task, long task_id, int grad_on,
         struct place *pl)
{
    PyObject *owner = NULL;
    PyObject *name = PyTuple_GET_ITEM(entry, E_NAME);
    int rc = -1;
    PyObject *modules = self->modules;
    if (task_id == -1) {
        pl->phase = rec_get(self, ST_PHASE);
        if (pl->phase == NULL)
            goto done;
        if (PyTuple_GET_ITEM(entry, E_SPECIAL) == Py_True) {
            PyObject *p = PyObject_CallFunctionObjArgs(self->phase_special, name, args, pl->phase, NULL);
            if (p == NULL)
                goto done;
            Py_SETREF(pl->phase, p);
        }
        pl->fwd_op = PyLong_FromLong(-1);
        PyObject *current = slot_get(modules, self->current_slot, s_current);
        if (current == NULL)
            goto done;
        if (!PyTuple_Check(current) || PyTuple_GET_SIZE(current) != 5) {
            Py_DECREF(current);
            PyErr_SetString(PyExc_TypeError,
                            "tl_dist: ModuleTracker.current must be (address, stack, call, builtin, source)");
            goto done;
        }
        pl->address = Py_NewRef(PyTuple_GET_ITEM(current, 0));
        pl->stack = Py_NewRef(PyTuple_GET_ITEM(current, 1));
        pl->call = Py_NewRef(PyTuple_GET_ITEM(current, 2));
        if (pl->fwd_op != NULL)
            pl->source = forward_source(self, pl->phase, PyTuple_GET_ITEM(current, 3), PyTuple_GET_ITEM(current, 4));
        Py_DECREF(current);
        if (pl->fwd_op == NULL || pl->source == NULL)
            goto done;
    } else {
        PyObject *recomputed = NULL;
        if (grad_on && (recomputed = PyObject_CallNoArgs(self->recomputed)) == NULL)
            goto done;
        if (recomputed != NULL && recomputed != Py_None) {
            /* Checkpoint recomputation: forward code run again by the engine. */
            owner = recomputed;
            pl->phase = Py_NewRef(s_recompute);
            pl->fwd_op = PyLong_FromLong(-1);
            pl->call = PyLong_FromLong(-1);
        } else {
            Py_XDECREF(recomputed);
            pl->phase = Py_NewRef(s_backward);
            pl->fwd_op = backward_link(self);
            pl->call = PyLong_FromLong(-1);
            if (pl->fwd_op == NULL || pl->call == NULL)
                goto done;
            long fwd = PyLong_AsLong(pl->fwd_op);
            if (fwd == -1 && PyErr_Occurred())
                goto done;
            if (fwd >= 0) { /* the module of the forward op this op differentiates */
                PyObject *forward_row = PyList_GetItem(self->rows, fwd);
                if (forward_row == NULL)
                    goto done;
                pl->address = Py_NewRef(PyTuple_GET_ITEM(forward_row, g_slot[F_MODULE]));
                pl->stack = Py_NewRef(PyTuple_GET_ITEM(forward_row, g_slot[F_MODULE_STACK]));
            } else if ((owner = param_owner(self)) == NULL) {
                goto done;
            }
        }
        if (owner != NULL) {
            if (!PyTuple_Check(owner) || PyTuple_GET_SIZE(owner) != 2) {
                PyErr_SetString(PyExc_TypeError, "tl_dist: a module owner must be (address, stack)");
                goto done;
            }
            pl->address = Py_NewRef(PyTuple_GET_ITEM(owner, 0));
            pl->stack = Py_NewRef(PyTuple_GET_ITEM(owner, 1));
        }
        if (pl->fwd_op == NULL || pl->call == NULL)
            goto done;
        if (pl->phase == s_backward) {
            /* Every op of one backward pass has the same Python stack above the engine. */
            pl->source = Py_XNewRef(PyDict_GetItemWithError(self->backward_sources, task));
            if (pl->source == NULL) {
                if (PyErr_Occurred() || (pl->source = locate_here(self)) == NULL ||
                    PyDict_SetItem(self->backward_sources, task, pl->source) < 0)
                    goto done;
            }
        } else if ((pl->source = locate_here(self)) == NULL) {
            goto done;
        }
    }

    rc = 0;
done:
    Py_XDECREF(owner);
    return rc;
}
