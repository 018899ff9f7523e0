/* Shared by the parts of the compiled per-op path (tl_dist/_fastpath.py): record.c, what one op's row is made
 * of; fastop.c, the dispatch that builds it, the FastOp type and the module; writes.c, the in-place write log;
 * columns.c, the rows as columns; modules.c, the module-call table's common case;
 * source.c, the source field's walk over the Python frames. */
#ifndef TL_DIST_FASTOP_H
#define TL_DIST_FASTOP_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Set once by configure(). */
extern PyObject *g_tensor_type, *g_parameter_type;
extern PyObject *g_entries;      /* id(func) -> entry tuple, or None for an op that always takes the slow path */
extern PyObject *g_make_entry;   /* func -> entry tuple or None */
extern PyObject *g_dtype_names, *g_device_names, *g_dtype_name, *g_device_name;
extern PyObject *g_flat_outputs, *g_shape_of, *g_flop_count;
extern PyObject *g_graph_task_id, *g_grad_enabled;
extern PyObject *g_perf_counter_ns, *g_current_node;
extern PyObject *g_sequence_nr; /* torch._C._autograd._get_sequence_nr: this thread's autograd node counter */
extern PyObject *g_labels;       /* func name -> [its labels func_1, func_2, ...]: made once per process */
extern PyObject *g_flop_memo;   /* (aten, input shapes, other arguments) -> FLOPs, for shape-only formulas */
extern PyObject *g_itemsizes;    /* dtype -> its itemsize, filled as dtypes come */
extern PyObject *g_tag;          /* "_tl_src": the attribute on tensors and the key in autograd metadata */

/* Interned names. */
extern PyObject *s_pending, *s_n_ops, *s_edits, *s_phase, *s_last_write, *s_hooks_on, *s_stats_on, *s_grad_fn,
    *s_metadata,
    *s_dtype, *s_device, *s_is_cpu, *s_is_cuda, *s_shape, *s_element_size, *s_current, *s_cpu,
    *s_factory, *s_other, *s_view, *s_backward, *s_recompute, *s_empty,
    *s_step_source, *s_optimizer, *s_untyped_storage, *s_nbytes,
    *s_data_ptr, *s_base, *s_itemsize, *s_saving, *s_storage_offset, *s_is_contiguous, *s_numel, *s_stride,
    *s_sequence_nr, *s_writes_generation, *s_variable, *s_detach, *s_clone, *s_layout, *s_save_all, *s_keep_graph;

/* Entry tuple layout, built by _fastpath.make_entry. */
enum { E_FUNC, E_INFO, E_CALL, E_NAME, E_ATEN, E_KIND, E_FLOPS, E_SPECIAL, E_MUTATES, E_SHAPE_FLOPS, E_SIZE };

/* The values of a row, named as in schema.OP_FIELDS; their positions in the row come from that list at
 * configure() (g_slot), so the schema's order is written down once. */
enum {
    F_INDEX, F_LABEL, F_FUNC, F_ATEN, F_KIND, F_PHASE, F_FWD_OP, F_MODULE, F_MODULE_STACK, F_MODULE_CALL,
    F_OUT_SHAPES, F_DTYPE, F_DEVICE, F_OUT_BYTES, F_IN_SHAPES, F_PARENTS, F_INPLACE, F_FLOPS, F_START_NS,
    F_DURATION_NS, F_SOURCE, F_PARAMS, N_FIELDS
};
extern int g_slot[N_FIELDS]; /* F_* -> position in the row */

/* The recorder's per-op state, read and written every op (rec_get, rec_set): __slots__ of Recorder (and
 * ModuleTracker.current), so each is a pointer at a fixed offset in the object, not a dict entry. */
enum { ST_PENDING, ST_N_OPS, ST_EDITS, ST_PHASE, ST_LAST_WRITE, ST_STEP_SOURCE, ST_WRITES_GENERATION, ST_COUNT };

struct span {
    unsigned long long lo, hi;
};

/* One window's compiled recorder. Every Python callable it holds is also in _fastpath._called_from_c (hidden
 * from Dynamo). */
typedef struct {
    PyObject_HEAD
    PyObject *rec;              /* the Recorder */
    Py_ssize_t state_slot[ST_COUNT]; /* each ST_* name's offset in rec, or 0 where it is not a slot (getattr) */
    Py_ssize_t current_slot;    /* the offset of modules.current, or 0 */
    PyObject *on_op;            /* rec.on_op: the slow path */
    PyObject *rows, *label_counts, *params, *writes, *backward_sources, *token;
    PyObject *modules, *training;
    PyObject *link_pending, *record_failure, *phase_special, *recomputed;
    PyObject *stack_of_address; /* modules.stack_of_address: address -> the stack of its last forward call */
    PyObject *locate;           /* rec.locate: the user's file:line of an op, or None when not recorded */
    PyObject *mode;             /* weak reference to the mode this is the __torch_dispatch__ of */
    PyObject *storage_refs;     /* rec._storage_refs: saved tensors to copy before a write (saving windows) */
    PyObject *written_storage;  /* rec._written_storage: the in-place write log's storages (writes.c) */
    PyObject *with_written_bases;
    PyObject *before_write;     /* rec._before_write: copies saved tensors an in-place op would overwrite */
    int hooks_on;               /* training.hooks_on: gradient hooks on each output's node (fixed per window) */
    int stats_on;               /* rec.stats_on: output statistics (TrainingState.out_stats, in Python) */
    int saving;                 /* rec.saving: outputs may be kept (save=True or a selector) */
    PyObject *save_op;          /* rec._save_op: keeps the op's outputs and replay record if selected (Python) */
    int save_all;               /* rec.save_all: every op's outputs are kept (saved.c keeps them, not save_op) */
    int keep_graph;             /* rec.keep_graph: kept outputs stay attached to autograd (no detach) */
    PyObject *saved, *replay_records; /* rec.saved, rec.replay_records (saving windows) */
    PyObject *in_flight, *out_stats, *arrived; /* training's collectives awaiting their statistics */
    PyObject *node_ops;         /* rec.node_ops: autograd node sequence number -> forward op */
    PyObject *tagged_nodes;     /* rec.tagged_nodes: the numbers of nodes tagged in their metadata */
    PyObject *last_node, *last_fwd; /* the autograd node the last backward op ran in, and its forward op */
    long long seq_floor;        /* rec.seq_floor: the counter when the window opened */
    PyObject *running;          /* borrowed: the OpInfo of the op running now (a post-mortem names it), or NULL */
    struct span *written_spans; /* writes.c: where in memory the logged storages lie, sorted, disjoint */
    Py_ssize_t n_spans, spans_cap;
    long long spans_generation; /* the rec.writes_generation they include, -1 before the first */
} FastOp;

/* Where an op ran: its phase, the forward op it differentiates, its module (address, stack, call) and source,
 * by Recorder.on_op's rules: outside the autograd engine, checkpoint recomputation, backward. */
struct place {
    PyObject *phase, *fwd_op, *address, *stack, *call, *source;
};

int attr_true(PyObject *obj, PyObject *name);
/* Tensor attributes read through their getset descriptor (record.c, tensor_get). */
enum { T_SHAPE, T_DTYPE, T_DEVICE, T_IS_CPU, T_IS_CUDA, T_GRAD_FN, T_BASE, T_COUNT };
int set_tensor_getters(void);
PyObject * tensor_get(PyObject *t, int which);
int tensor_true(PyObject *t, int which);
/* Tensor methods called through their method descriptor (record.c, tensor_call). */
enum { M_DATA_PTR, M_STORAGE_OFFSET, M_ELEMENT_SIZE, M_IS_CONTIGUOUS, M_NUMEL, M_STRIDE, M_UNTYPED_STORAGE, M_DETACH,
       M_COUNT };
PyObject * tensor_call(PyObject *t, int which);
int lookup_attr(PyObject *obj, PyObject *name, PyObject **result);
PyObject * rec_get(FastOp *self, int which);
int rec_set(FastOp *self, int which, PyObject *value);
PyObject * slot_get(PyObject *obj, Py_ssize_t offset, PyObject *name);
Py_ssize_t slot_offset(PyObject *obj, PyObject *name);
void find_state_slots(FastOp *self);
long long clock_ns(void); /* time.perf_counter_ns(); -1 with an error set */
int is_tensor(PyObject *o);
PyObject * untrack_atomic(PyObject *t);
PyObject * entry_of(PyObject *func);
void clear_entry_cache(void);
int link_pending(FastOp *self, PyObject *pending);
PyObject * op_flops(PyObject *entry, PyObject *args, PyObject *kwargs, PyObject *out, PyObject *in_shapes);
PyObject * label_of(PyObject *name, long n);
PyObject * mutated_tensors(PyObject *mutated, PyObject *args, PyObject *kwargs);
int any_base(PyObject *written);
PyObject * shapes_of(PyObject *tensors, int fallback);
PyObject * call_slow(FastOp *self, PyObject *func, PyObject *args, PyObject *kwargs, int subclass);
PyObject * input_tensors(PyObject *args, PyObject *kwargs);
int scan_inputs(FastOp *self, PyObject *tensors, PyObject *parents, PyObject **param_names, PyObject *srcs);
PyObject * run_op(FastOp *self, PyObject *entry, PyObject *args, PyObject *kwargs);
int describe_outputs(PyObject *outs, PyObject *out_shapes, PyObject *token, PyObject *index, PyObject **dtype,
                     PyObject **device, long long *out_bytes, PyObject **link);
void place_clear(struct place *pl);
int place_op(FastOp *self, PyObject *entry, PyObject *args, PyObject *task, long task_id, int grad_on,
         struct place *pl);
PyObject * fastop_columns(PyObject *module, PyObject *args);
PyObject * fastop_untrack_rows(PyObject *module, PyObject *rows);
int add_parent(PyObject *parents, PyObject *op);
int note_writes(FastOp *self, PyObject *index, PyObject *written);
int add_writer(FastOp *self, PyObject *parents, PyObject *t, long since);
void clear_spans(FastOp *self);
PyObject * storage_of(PyObject *t);
PyObject * storage_address(PyObject *storage, long long *nbytes);
int byte_extent(PyObject *t, PyObject *storage, long long *lo, long long *hi);
/* saved.c: Recorder._save, and the check at close of what was saved (capture._drop_freed). */
int save_outputs(FastOp *self, PyObject *index, PyObject *outs, PyObject *func, PyObject *args, PyObject *kwargs,
                 PyObject *tensors, PyObject *srcs, PyObject *pre_write);
PyObject * fastop_freed(PyObject *module, PyObject *args);

/* modules.c: the common case of the module tracker's global hooks. */
int init_module_hooks(void);
PyObject * fastop_configure_modules(PyObject *module, PyObject *args, PyObject *kwds);
PyObject * module_pre(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject * module_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* source.c: the source field's walk over the Python frames (SourceLocator's, in C). */
int source_configured(void);
PyObject * fastop_configure_source(PyObject *module, PyObject *args, PyObject *kwds);
PyObject * op_source(PyObject *enclosing);
PyObject * call_site_source(PyObject *enclosing);
#endif
