/* The source field in C: the file:line of the user code behind an op or a module call, found by the walk
 * tl_dist/_source.py's SourceLocator makes (which stays the reference, and the path without the extension).
 *
 * The walk goes outward from the innermost Python frame, skipping torch's, tl_dist's and the standard
 * library's frames, and stops at the first user frame or at the first frame of nn.Module's call machinery
 * (outside it is the enclosing module call, whose call site is known). It shares SourceLocator's two caches:
 * code object -> kind, and (code, bytecode offset) -> "file:line"; a code object not seen yet is classified by
 * _source.code_kind, in Python, once per process. */
#include "fastop.h"

static PyObject *g_code_kinds;   /* _source.CODE_KINDS: code -> USER / INTERNAL / MODULE_CALL */
static PyObject *g_source_names; /* _source.SOURCE_NAMES: (code, offset) -> "file:line" */
static PyObject *g_code_kind;    /* _source.code_kind: classifies a code object and caches its kind */

enum { K_USER = 0, K_INTERNAL = 1, K_MODULE_CALL = 2 }; /* SourceLocator._USER, _INTERNAL, _MODULE_CALL */

int
source_configured(void)
{
    return g_code_kinds != NULL;
}

PyObject *
fastop_configure_source(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"code_kinds", "source_names", "code_kind", NULL};
    PyObject *kinds, *source_names, *code_kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!O!O:configure_source", names, &PyDict_Type, &kinds,
                                     &PyDict_Type, &source_names, &code_kind))
        return NULL;
    Py_XSETREF(g_code_kinds, Py_NewRef(kinds));
    Py_XSETREF(g_source_names, Py_NewRef(source_names));
    Py_XSETREF(g_code_kind, Py_NewRef(code_kind));
    Py_RETURN_NONE;
}

/* The kind of a frame's code: K_*, or -1 with an error set. */
static int
kind_of(PyCodeObject *code)
{
    PyObject *kind = PyDict_GetItemWithError(g_code_kinds, (PyObject *)code); /* borrowed */
    if (kind != NULL)
        return (int)PyLong_AsLong(kind);
    if (PyErr_Occurred())
        return -1;
    PyObject *found = PyObject_CallOneArg(g_code_kind, (PyObject *)code);
    if (found == NULL)
        return -1;
    long value = PyLong_AsLong(found);
    Py_DECREF(found);
    return (int)value;
}

/* "file:line" of a user frame, the same string object for every visit of that bytecode offset. New reference. */
static PyObject *
frame_name(PyFrameObject *frame, PyCodeObject *code)
{
    PyObject *offset = PyLong_FromLong(PyFrame_GetLasti(frame));
    PyObject *key = offset == NULL ? NULL : PyTuple_Pack(2, (PyObject *)code, offset);
    Py_XDECREF(offset);
    if (key == NULL)
        return NULL;
    PyObject *name = Py_XNewRef(PyDict_GetItemWithError(g_source_names, key));
    if (name == NULL && !PyErr_Occurred()) {
        name = PyUnicode_FromFormat("%U:%d", code->co_filename, PyFrame_GetLineNumber(frame));
        if (name != NULL && PyDict_SetItem(g_source_names, key, name) < 0)
            Py_CLEAR(name);
    }
    Py_DECREF(key);
    return name;
}

/* SourceLocator._walk from frame (a new reference, or NULL: no frame), which it consumes. New reference. */
static PyObject *
walk(PyFrameObject *frame, PyObject *enclosing)
{
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int kind = kind_of(code);
        PyObject *found = NULL;
        if (kind == K_USER)
            found = frame_name(frame, code);
        else if (kind == K_MODULE_CALL)
            found = Py_NewRef(enclosing);
        Py_DECREF(code);
        if (kind < 0 || kind == K_USER || kind == K_MODULE_CALL) {
            Py_DECREF(frame);
            return found; /* NULL with the error when kind_of or frame_name failed */
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    return Py_NewRef(s_empty);
}

/* SourceLocator.__call__ from C: the source of the op being dispatched, from the innermost Python frame (the
 * op's caller: the compiled per-op path has no frame of its own). New reference, NULL with an error. */
PyObject *
op_source(PyObject *enclosing)
{
    return walk((PyFrameObject *)Py_XNewRef(PyEval_GetFrame()), enclosing);
}

/* SourceLocator.call_site from C, called from the module pre-hook's C half: the innermost Python frame is that
 * hook (ModuleTracker._pre), the one below it the call machinery of the module starting now. */
PyObject *
call_site_source(PyObject *enclosing)
{
    PyFrameObject *hook = PyEval_GetFrame(); /* borrowed */
    PyFrameObject *frame = hook == NULL ? NULL : PyFrame_GetBack(hook);
    while (frame != NULL) { /* step out of this call's own machinery frames */
        PyCodeObject *code = PyFrame_GetCode(frame);
        int kind = kind_of(code);
        Py_DECREF(code);
        if (kind < 0) {
            Py_DECREF(frame);
            return NULL;
        }
        if (kind != K_MODULE_CALL)
            break;
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    return walk(frame, enclosing);
}
