/* _lorakit.c — the CPython extension under `import lorakit` (python/lorakit/
 * __init__.py is the Python face; this file is the thin C layer under it).
 *
 * Why it is built this way:
 * - Zero copy: every tensor is borrowed where it lives, through the buffer
 *   protocol (NumPy: it tells dtype, strides and read-only) or DLPack
 *   (`__dlpack__`: PyTorch CPU tensors, including bfloat16 and FP8, which
 *   the buffer protocol cannot describe). The borrowed views become
 *   lk_tensor views and go straight into the C library.
 * - Validate everything first: every value is checked (dtype, contiguity,
 *   writable, CPU) and all views taken before any library call, so a bad
 *   value raises ValueError/TypeError naming its key and nothing is written.
 * - Collective calls never raise on one rank alone: a local failure (a bad
 *   value, a malformed argument found by the Python layer) goes through
 *   lk_comm_agree before anything else, so every rank raises (the failing
 *   one its own ValueError/TypeError, the others LoraError "rank R: ...").
 * - The GIL is released around every fuse, swap, digest and collective;
 *   the views keep their owners alive (a reference, or the DLPack deleter
 *   called only when the view is released).
 * - Every lorakit failure is LoraError(message) with .status the lk_status
 *   name ("LK_ERR_UNMATCHED", ...). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>

#include "lorakit/lorakit.h"
#ifdef LK_HAVE_MPI
#include "lorakit/comm_mpi.h"
#endif

#ifndef LK_PY_VERSION
#define LK_PY_VERSION "0.0.0"
#endif

static PyObject *LoraError;

/* e.name = v (a str), or None when v is NULL or "". 0 / -1 (exception set). */
static int set_attr_str(PyObject *e, const char *name, const char *v) {
    PyObject *o = v && *v ? PyUnicode_FromString(v) : Py_NewRef(Py_None);
    if (!o) return -1;
    int rc = PyObject_SetAttrString(e, name, o);
    Py_DECREF(o);
    return rc;
}

/* Raises LoraError for s with lk_last_error() (or msg when given), .status
 * the status name, .path and .key where the failure is (lk_last_error_path
 * / _key) when the message is the library's, None otherwise. */
static PyObject *raise_lk(lk_status s, const char *msg) {
    const int lib = !msg || !strcmp(msg, lk_last_error()); /* a message of ours: the library's where is stale */
    PyObject *e = PyObject_CallFunction(LoraError, "s", msg ? msg : lk_last_error());
    if (!e) return NULL;
    if (set_attr_str(e, "status", lk_status_str(s)) < 0 ||
        set_attr_str(e, "path", lib ? lk_last_error_path() : NULL) < 0 ||
        set_attr_str(e, "key", lib ? lk_last_error_key() : NULL) < 0) {
        Py_DECREF(e);
        return NULL;
    }
    PyErr_SetObject(LoraError, e);
    Py_DECREF(e);
    return NULL;
}

/* ---- DLPack (the v0.x ABI every exporter offers by default) ---- */

typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { kDLCPU = 1, kDLCUDA = 2 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6, kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12 };

static lk_dtype dl_dtype(DLDataType t) {
    if (t.lanes != 1) return LK_DTYPE_INVALID;
    switch (t.code) {
    case kDLFloat: return t.bits == 32 ? LK_DTYPE_F32 : t.bits == 16 ? LK_DTYPE_F16 : t.bits == 64 ? LK_DTYPE_F64 : LK_DTYPE_INVALID;
    case kDLBfloat: return t.bits == 16 ? LK_DTYPE_BF16 : LK_DTYPE_INVALID;
    case kDLFloat8_e4m3fn: return t.bits == 8 ? LK_DTYPE_F8_E4M3 : LK_DTYPE_INVALID;
    case kDLFloat8_e5m2: return t.bits == 8 ? LK_DTYPE_F8_E5M2 : LK_DTYPE_INVALID;
    case kDLBool: return t.bits == 8 ? LK_DTYPE_BOOL : LK_DTYPE_INVALID;
    case kDLInt:
        return t.bits == 8 ? LK_DTYPE_I8 : t.bits == 16 ? LK_DTYPE_I16 : t.bits == 32 ? LK_DTYPE_I32
             : t.bits == 64 ? LK_DTYPE_I64 : LK_DTYPE_INVALID;
    case kDLUInt:
        return t.bits == 8 ? LK_DTYPE_U8 : t.bits == 16 ? LK_DTYPE_U16 : t.bits == 32 ? LK_DTYPE_U32
             : t.bits == 64 ? LK_DTYPE_U64 : LK_DTYPE_INVALID;
    }
    return LK_DTYPE_INVALID;
}

/* ---- DLPack export: lorakit's memory as tensors for Python ----
 *
 * A DLManagedTensor over memory lorakit owns (an EmulTensor's, or a device
 * buffer handed to the host communicator's callbacks), its shape beside it;
 * owner (may be NULL) is kept alive until the consumer calls the deleter. */

typedef struct dl_export {
    DLManagedTensor m;
    int64_t shape[LK_MAX_DIMS];
    PyObject *owner;
} dl_export;

static void dl_export_delete(DLManagedTensor *m) {
    dl_export *e = (dl_export *)m;
    if (e->owner) {
        PyGILState_STATE g = PyGILState_Ensure();
        Py_DECREF(e->owner);
        PyGILState_Release(g);
    }
    PyMem_RawFree(e);
}

static void dl_capsule_free(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return; /* consumed: the consumer calls the deleter */
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
}

static DLDataType dl_of_dtype(lk_dtype d) {
    switch (d) {
    case LK_DTYPE_F32: return (DLDataType){kDLFloat, 32, 1};
    case LK_DTYPE_F16: return (DLDataType){kDLFloat, 16, 1};
    case LK_DTYPE_F64: return (DLDataType){kDLFloat, 64, 1};
    case LK_DTYPE_BF16: return (DLDataType){kDLBfloat, 16, 1};
    case LK_DTYPE_F8_E4M3: return (DLDataType){kDLFloat8_e4m3fn, 8, 1};
    case LK_DTYPE_F8_E5M2: return (DLDataType){kDLFloat8_e5m2, 8, 1};
    case LK_DTYPE_I64: return (DLDataType){kDLInt, 64, 1};
    case LK_DTYPE_I32: return (DLDataType){kDLInt, 32, 1};
    default: return (DLDataType){kDLUInt, 8, 1};
    }
}

/* A "dltensor" capsule over data (ndim dims of shape, dtype dt) on dev. */
static PyObject *dl_capsule(void *data, DLDevice dev, DLDataType dt, int ndim, const int64_t *shape, PyObject *owner) {
    dl_export *e = PyMem_RawCalloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    for (int i = 0; i < ndim && i < LK_MAX_DIMS; i++) e->shape[i] = shape[i];
    static char empty[256];
    e->m.dl_tensor = (DLTensor){.data = data ? data : empty, .device = dev, .ndim = ndim, .dtype = dt,
                                .shape = e->shape, .strides = NULL, .byte_offset = 0};
    e->m.deleter = dl_export_delete;
    Py_XINCREF(owner);
    e->owner = owner;
    e->m.manager_ctx = e;
    PyObject *cap = PyCapsule_New(&e->m, "dltensor", dl_capsule_free);
    if (!cap) dl_export_delete(&e->m);
    return cap;
}

/* A buffer-protocol format string (native, standard sizes) as a dtype. */
static lk_dtype fmt_dtype(const char *f, Py_ssize_t itemsize) {
    if (!f) return itemsize == 1 ? LK_DTYPE_U8 : LK_DTYPE_INVALID;
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] && f[1]) return LK_DTYPE_INVALID;
    switch (*f) {
    case 'f': return itemsize == 4 ? LK_DTYPE_F32 : LK_DTYPE_INVALID;
    case 'e': return itemsize == 2 ? LK_DTYPE_F16 : LK_DTYPE_INVALID;
    case 'd': return itemsize == 8 ? LK_DTYPE_F64 : LK_DTYPE_INVALID;
    case '?': return LK_DTYPE_BOOL;
    case 'b': return LK_DTYPE_I8;
    case 'B': return LK_DTYPE_U8;
    case 'h': return LK_DTYPE_I16;
    case 'H': return LK_DTYPE_U16;
    case 'i': case 'l': case 'q':
        return itemsize == 4 ? LK_DTYPE_I32 : itemsize == 8 ? LK_DTYPE_I64 : LK_DTYPE_INVALID;
    case 'I': case 'L': case 'Q':
        return itemsize == 4 ? LK_DTYPE_U32 : itemsize == 8 ? LK_DTYPE_U64 : LK_DTYPE_INVALID;
    }
    return LK_DTYPE_INVALID;
}

/* ---- views: borrowed tensors ---- */

typedef struct view {
    lk_tensor t;
    PyObject *name;  /* the key as a str (t.name points into its UTF-8) */
    int has_buf;
    Py_buffer buf;
    DLManagedTensor *dl;
    PyObject *frozen; /* bytes (UTF-8) t.frozen points into, or NULL */
} view;

static void view_release(view *v) {
    if (v->has_buf) PyBuffer_Release(&v->buf);
    if (v->dl && v->dl->deleter) v->dl->deleter(v->dl);
    Py_XDECREF(v->name);
    Py_XDECREF(v->frozen);
    memset(v, 0, sizeof *v);
}

static void views_free(view *v, size_t n) {
    if (!v) return;
    for (size_t i = 0; i < n; i++) view_release(&v[i]);
    PyMem_Free(v);
}

/* ALLOW_CUDA: a CUDA tensor is borrowed as device memory (lk_tensor.device
 * cuda:N), for the calls whose library side takes device memory (fuse_,
 * the tracker, sync_grads, digests); elsewhere it is refused. */
enum { NEED_WRITE = 1, NEED_F32 = 2, ALLOW_CUDA = 4 };

static int set_shape(view *v, int ndim, const int64_t *shape, const Py_ssize_t *pyshape) {
    if (ndim > LK_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: %d dimensions, lorakit handles at most %d", v->t.name, ndim, LK_MAX_DIMS);
        return -1;
    }
    v->t.ndim = ndim;
    size_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        v->t.shape[d] = shape ? shape[d] : (int64_t)pyshape[d];
        numel *= (size_t)v->t.shape[d];
    }
    v->t.nbytes = numel * lk_dtype_size(v->t.dtype);
    return 0;
}

static int check_dtype(view *v, lk_dtype d, int flags, const char *what) {
    if (d == LK_DTYPE_INVALID) {
        PyErr_Format(PyExc_TypeError,
                     "%s: dtype %s is not one lorakit reads (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
                     "float64, integers, bool)", v->t.name, what);
        return -1;
    }
    if ((flags & NEED_F32) && d != LK_DTYPE_F32) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s, float32 expected", v->t.name, lk_dtype_name(d));
        return -1;
    }
    v->t.dtype = d;
    return 0;
}

/* TEST ONLY (lorakit._testing, python/tests/test_device_emul.py): while
 * set, memory a DLPack exporter calls kDLCUDA is taken as lorakit's `emul`
 * device instead, and must lie inside an emul allocation (the EmulTensor
 * objects below make them). So CI, which has no GPU, runs the very binding
 * code CUDA tensors take (the device branches, streams, the host
 * communicator's device buffers) against the emulated device, and compares
 * the bytes with the CPU path. Off unless a test turns it on. */
static int g_emul_as_cuda;

static lk_device cuda_device_of(int id) {
    return g_emul_as_cuda ? (lk_device){LK_DEVICE_EMUL, 0} : (lk_device){LK_DEVICE_CUDA, id};
}

/* The DLPack device (type, id) obj reports (__dlpack_device__), or (0, 0)
 * when it has none. */
static void dl_device_of(PyObject *obj, int *type, int *id) {
    *type = *id = 0;
    PyObject *dd = PyObject_HasAttrString(obj, "__dlpack_device__") ? PyObject_CallMethod(obj, "__dlpack_device__", NULL)
                                                                    : NULL;
    if (!dd || !PyArg_ParseTuple(dd, "ii", type, id)) *type = *id = 0;
    Py_XDECREF(dd);
    PyErr_Clear();
}

/* obj.__dlpack__(): a CUDA producer is asked with stream=-1 (the DLPack
 * protocol's "no synchronisation"): lorakit queues its work on torch's
 * current stream, the stream the producer's own writes are on, so they are
 * ordered already (the tracker queues there too and synchronises the
 * current stream first, for the collectives on the comm's stream). */
static PyObject *dlpack_of(PyObject *obj) {
    int type, id;
    dl_device_of(obj, &type, &id);
    if (type != kDLCUDA) return PyObject_CallMethod(obj, "__dlpack__", NULL);
    PyObject *f = PyObject_GetAttrString(obj, "__dlpack__");
    if (!f) return NULL;
    PyObject *args = PyTuple_New(0), *kw = Py_BuildValue("{s:i}", "stream", -1);
    PyObject *r = args && kw ? PyObject_Call(f, args, kw) : NULL;
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(f);
    return r;
}

/* Borrows obj (keyed by name) into v: the buffer protocol first, then
 * DLPack. dtype_hint (may be NULL): the lorakit dtype of a raw-integer
 * NumPy view the Python layer made of an ml_dtypes array ("BF16" over
 * uint16). On failure v holds nothing and an exception is set. */
static int view_acquire(view *v, PyObject *name, PyObject *obj, const char *dtype_hint, int flags) {
    memset(v, 0, sizeof *v);
    Py_INCREF(name);
    v->name = name;
    v->t.name = PyUnicode_AsUTF8(name);
    if (!v->t.name) goto fail;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &v->buf, PyBUF_RECORDS_RO) < 0) goto fail;
        v->has_buf = 1;
        lk_dtype d = dtype_hint ? lk_dtype_from_name(dtype_hint, strlen(dtype_hint)) : fmt_dtype(v->buf.format, v->buf.itemsize);
        if (dtype_hint && lk_dtype_size(d) != (size_t)v->buf.itemsize) d = LK_DTYPE_INVALID;
        if (check_dtype(v, d, flags, dtype_hint ? dtype_hint : v->buf.format ? v->buf.format : "?") < 0) goto fail;
        if (!PyBuffer_IsContiguous(&v->buf, 'C')) {
            PyErr_Format(PyExc_ValueError, "%s: not contiguous: lorakit writes an array's own memory, and "
                         "a contiguous copy would leave the original unchanged; make the original C-contiguous and "
                         "pass it", v->t.name);
            goto fail;
        }
        if ((flags & NEED_WRITE) && v->buf.readonly) {
            PyErr_Format(PyExc_ValueError, "%s: read-only (lorakit writes it in place)", v->t.name);
            goto fail;
        }
        if (set_shape(v, v->buf.ndim, NULL, v->buf.shape) < 0) goto fail;
        if ((Py_ssize_t)v->t.nbytes != v->buf.len) {
            PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes for %zu expected", v->t.name, v->buf.len, v->t.nbytes);
            goto fail;
        }
        v->t.data = v->buf.buf;
        return 0;
    }
    /* a DLPack capsule itself (torch.utils.dlpack.to_dlpack) is consumed as
     * the protocol says; anything else is asked for one */
    PyObject *cap = PyCapsule_IsValid(obj, "dltensor") ? (Py_INCREF(obj), obj) : dlpack_of(obj);
    if (!cap) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: %.200s is neither an array (buffer protocol) nor a tensor with "
                         "__dlpack__ (or an unused DLPack capsule)", v->t.name, Py_TYPE(obj)->tp_name);
        } else { /* e.g. a tensor that requires grad */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *msg = ev ? PyObject_Str(ev) : NULL;
            PyErr_Format(PyExc_ValueError, "%s: cannot be borrowed through DLPack: %s", v->t.name,
                         msg ? PyUnicode_AsUTF8(msg) : "?");
            Py_XDECREF(msg);
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb);
        }
        goto fail;
    }
    DLManagedTensor *dl = PyCapsule_GetPointer(cap, "dltensor");
    if (!dl) {
        Py_DECREF(cap);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a DLPack capsule", v->t.name);
        goto fail;
    }
    /* consumed: the deleter is now ours to call (view_release) */
    PyCapsule_SetName(cap, "used_dltensor");
    Py_DECREF(cap);
    v->dl = dl;
    DLTensor *t = &dl->dl_tensor;
    if (t->device.device_type == kDLCUDA && (flags & ALLOW_CUDA))
        v->t.device = cuda_device_of((int)t->device.device_id);
    else if (t->device.device_type == kDLCUDA) {
        PyErr_Format(PyExc_ValueError, "%s: a CUDA tensor where lorakit reads host memory only (move it with .cpu())",
                     v->t.name);
        goto fail;
    } else if (t->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_ValueError, "%s: on device type %d; lorakit works on CPU memory (move it with .cpu())",
                     v->t.name, (int)t->device.device_type);
        goto fail;
    }
    char what[32];
    snprintf(what, sizeof what, "(DLPack code %u, %u bits)", (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
    lk_dtype d = dl_dtype(t->dtype);
    if (dtype_hint) { /* a raw unsigned view of a dtype the exporter cannot name */
        lk_dtype h = lk_dtype_from_name(dtype_hint, strlen(dtype_hint));
        d = t->dtype.code == kDLUInt && t->dtype.lanes == 1 && (size_t)t->dtype.bits == 8 * lk_dtype_size(h) ? h
                                                                                                           : LK_DTYPE_INVALID;
    }
    if (check_dtype(v, d, flags, what) < 0) goto fail;
    if (t->ndim < 0 || set_shape(v, t->ndim, t->shape, NULL) < 0) goto fail;
    if (t->strides && v->t.nbytes) { /* row-major compact, ignoring dims of size 1; an empty tensor's strides
                                      * address nothing (torch gives one made by .to() strides of 0) */
        int64_t want = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != want) {
                PyErr_Format(PyExc_ValueError, "%s: not contiguous: lorakit writes a tensor's own memory, "
                             "and a .contiguous() copy would leave the model unchanged; make the model's tensor "
                             "itself contiguous and pass it", v->t.name);
                goto fail;
            }
            want *= t->shape[d];
        }
    }
    v->t.data = (char *)t->data + t->byte_offset;
    if (v->t.device.kind == LK_DEVICE_EMUL && v->t.nbytes && !lk_device_owns(v->t.device, v->t.data, v->t.nbytes)) {
        PyErr_Format(PyExc_ValueError, "%s: (test hook) CUDA memory taken as emul, but %zu bytes at %p are not inside "
                     "an emul allocation", v->t.name, v->t.nbytes, v->t.data);
        goto fail;
    }
    return 0;
fail:
    view_release(v);
    return -1;
}

/* The device of a call's views (every view on one: the Python layer
 * refuses mixed calls naming the keys, the library again), cpu for none. */
static lk_device views_device(const view *v, size_t n) { return n ? v[0].t.device : (lk_device){LK_DEVICE_CPU, 0}; }

/* The stream a call on device d works on: torch's current stream, whose
 * cudaStream_t the Python layer passes as an int (0: the default stream),
 * wrapped (lk_stream_wrap; freed by the caller with lk_stream_free). NULL
 * for host memory. -1 with LoraError set on failure. */
static int call_stream(lk_device d, PyObject *handle, lk_stream **out) {
    *out = NULL;
    if (d.kind == LK_DEVICE_CPU) return 0;
    void *native = handle == Py_None ? NULL : PyLong_AsVoidPtr(handle);
    if (PyErr_Occurred()) return -1;
    lk_status s = lk_stream_wrap(d, native, out);
    if (s) return raise_lk(s, NULL), -1;
    return 0;
}

/* items: a sequence of (name: str, value, dtype_hint: str | None[, frozen: str | None[, axes: int]]): frozen
 * says why value is a copy of the caller's tensor that the call must not write (lk_tensor.frozen); axes is
 * lk_tensor.axes (how the owning layer stores a 2-D weight, from its type). On failure nothing is held and
 * an exception is set. */
static view *views_from(PyObject *items, int flags, size_t *n_out) {
    PyObject *seq = PySequence_Fast(items, "tensors must be a sequence of (name, tensor, hint) items");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    view *v = PyMem_Calloc(n ? (size_t)n : 1, sizeof *v);
    if (!v) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i), *name, *val, *hint;
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) < 3 || PyTuple_GET_SIZE(it) > 5) {
            PyErr_SetString(PyExc_TypeError, "internal: tensors items must be (name, tensor, hint[, frozen[, axes]])");
            break;
        }
        name = PyTuple_GET_ITEM(it, 0);
        val = PyTuple_GET_ITEM(it, 1);
        hint = PyTuple_GET_ITEM(it, 2);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "tensor names must be str, got %.100s", Py_TYPE(name)->tp_name);
            break;
        }
        const char *h = hint == Py_None ? NULL : PyUnicode_AsUTF8(hint);
        if (hint != Py_None && !h) break;
        if (view_acquire(&v[i], name, val, h, flags) < 0) break;
        if (PyTuple_GET_SIZE(it) == 5) {
            long ax = PyLong_Check(PyTuple_GET_ITEM(it, 4)) ? PyLong_AsLong(PyTuple_GET_ITEM(it, 4)) : -1;
            if (ax < LK_AXES_UNKNOWN || ax > LK_AXES_IN_OUT) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "internal: axes must be 0, 1 or 2");
                view_release(&v[i]);
                break;
            }
            v[i].t.axes = (lk_axes)ax;
        }
        if (PyTuple_GET_SIZE(it) >= 4 && PyTuple_GET_ITEM(it, 3) != Py_None) {
            PyObject *fz = PyTuple_GET_ITEM(it, 3);
            v[i].frozen = PyUnicode_Check(fz) ? PyUnicode_AsUTF8String(fz) : NULL;
            if (!v[i].frozen) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "internal: frozen must be a str");
                view_release(&v[i]);
                break;
            }
            v[i].t.frozen = PyBytes_AS_STRING(v[i].frozen);
        }
    }
    Py_DECREF(seq);
    if (i < n) {
        views_free(v, (size_t)i);
        return NULL;
    }
    *n_out = (size_t)n;
    return v;
}

static lk_tensor *tensor_table(view *v, size_t n) {
    lk_tensor *t = PyMem_Calloc(n ? n : 1, sizeof *t);
    if (!t) {
        PyErr_NoMemory();
        return NULL;
    }
    for (size_t i = 0; i < n; i++) t[i] = v[i].t;
    return t;
}

/* ---- adapter requests ---- */

typedef struct request {
    lk_fuse_input *in;
    PyObject **paths; /* bytes objects the paths point into */
    PyObject **held;  /* per entry: the in-memory adapter's (bytes, config) tuple, or NULL */
    lk_adapter_source *src;
    const lk_adapter_source **srcp; /* per entry: &src[i] or NULL (a file) */
    size_t n;
} request;

static void request_free(request *r) {
    for (size_t i = 0; i < r->n; i++) {
        Py_XDECREF(r->paths[i]);
        if (r->held) Py_XDECREF(r->held[i]);
    }
    PyMem_Free(r->in);
    PyMem_Free(r->paths);
    PyMem_Free(r->held);
    PyMem_Free(r->src);
    PyMem_Free(r->srcp);
    memset(r, 0, sizeof *r);
}

/* loras: a sequence of (path: bytes, strength: float, format: str[,
 * memory[, alpha]]), memory being an in-memory adapter's (bytes, config
 * JSON str or None); path is then its label; alpha a float or None. */
static int request_from(PyObject *loras, request *r) {
    memset(r, 0, sizeof *r);
    PyObject *seq = PySequence_Fast(loras, "loras must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t m = n ? (size_t)n : 1;
    r->in = PyMem_Calloc(m, sizeof *r->in);
    r->paths = PyMem_Calloc(m, sizeof *r->paths);
    r->held = PyMem_Calloc(m, sizeof *r->held);
    r->src = PyMem_Calloc(m, sizeof *r->src);
    r->srcp = PyMem_Calloc(m, sizeof *r->srcp);
    if (!r->in || !r->paths || !r->held || !r->src || !r->srcp) {
        Py_DECREF(seq);
        request_free(r);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path, *mem = Py_None, *alpha = Py_None;
        double strength;
        const char *fmt;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Sds|OO", &path, &strength, &fmt, &mem, &alpha))
            goto fail;
        Py_INCREF(path);
        r->paths[i] = path;
        r->n = (size_t)i + 1;
        r->in[i].path = PyBytes_AS_STRING(path);
        r->in[i].strength = strength;
        if (alpha != Py_None) { /* the adapter's alpha (lk_fuse_input.has_alpha) */
            r->in[i].alpha = PyFloat_AsDouble(alpha);
            if (r->in[i].alpha == -1.0 && PyErr_Occurred()) goto fail;
            r->in[i].has_alpha = 1;
        }
        if (mem != Py_None) {
            PyObject *bytes, *cfg;
            if (!PyArg_ParseTuple(mem, "SO", &bytes, &cfg)) goto fail;
            const char *cj = cfg == Py_None ? NULL : PyUnicode_AsUTF8(cfg);
            if (cfg != Py_None && !cj) goto fail;
            Py_INCREF(mem);
            r->held[i] = mem;
            r->src[i] = (lk_adapter_source){r->in[i].path, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes), cj};
            r->srcp[i] = &r->src[i];
        }
        if (lk_adapter_format_parse(fmt, &r->in[i].format)) {
            raise_lk(LK_ERR_ARG, NULL);
            goto fail;
        }
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    request_free(r);
    return -1;
}

/* ---- communicators ---- */

typedef struct {
    PyObject_HEAD
    lk_comm *c;
} CommObject;

static void Comm_dealloc(CommObject *self) {
    lk_comm_free(self->c); /* the MPI backend skips MPI_Comm_free after MPI_Finalize */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- the host backend over a Python object (torch.distributed) ----
 *
 * lorakit/_torch.py's _TorchHost has barrier(), bcast(mv, root),
 * allreduce(mv, kind, op), allgather(send_mv, recv_mv) and, for overlap,
 * ibcast(mv, root) -> handle, test(handle) -> bool, wait(handle). The
 * memoryviews are zero-copy windows on lorakit's buffers (torch.frombuffer
 * makes tensors of them). The callbacks run on the thread that released the
 * GIL around a lorakit call, and take it back for the Python call. A Python
 * exception becomes the callback's failure (LK_ERR_COMM with its text;
 * TimeoutError, raised by _TorchHost past the communicator's timeout that
 * set_timeout passed on, LK_ERR_TIMEOUT). */

static lk_status py_host_failed(const char *op) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    PyObject *msg = ev ? PyObject_Str(ev) : NULL;
    const char *m = msg ? PyUnicode_AsUTF8(msg) : NULL;
    const int timed_out = et && PyErr_GivenExceptionMatches(et, PyExc_TimeoutError);
    lk_status s = lk_error(timed_out ? LK_ERR_TIMEOUT : LK_ERR_COMM, "torch.distributed %s: %s: %s", op,
                           et ? ((PyTypeObject *)et)->tp_name : "?", m ? m : "?");
    PyErr_Clear();
    Py_XDECREF(msg);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return s;
}

static PyObject *mv_of(const void *p, size_t n) {
    static char empty;
    return PyMemoryView_FromMemory(n ? (char *)p : &empty, (Py_ssize_t)n, PyBUF_WRITE);
}

typedef struct py_host {
    PyObject *obj;   /* the _TorchHost */
    int size;
    lk_status failed; /* the last callback failure's status */
    lk_device dev;   /* the device whose memory its collectives take (its `device`: cuda:N over NCCL), else cpu */
} py_host;

/* What a callback hands Python for n bytes at p: a memoryview of host
 * memory, or, for memory of the host's device, a "dltensor" capsule over it
 * (uint8, n; kDLCUDA for cuda, kDLCPU for emul, whose memory is the
 * process's): zero-copy, turned into a tensor by torch.from_dlpack. */
static PyObject *buf_of(const py_host *h, void *p, size_t n) {
    if (h->dev.kind == LK_DEVICE_CPU || !n || !lk_device_owns(h->dev, p, n)) return mv_of(p, n);
    const int64_t shape[1] = {(int64_t)n};
    const DLDevice dd = h->dev.kind == LK_DEVICE_CUDA ? (DLDevice){kDLCUDA, h->dev.index} : (DLDevice){kDLCPU, 0};
    return dl_capsule(p, dd, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL);
}

/* Calls host.<name>(*args built from fmt); returns the result (new
 * reference) or NULL with the failure recorded. The GIL is held. */
static PyObject *host_call(void *ctx, const char *name, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *args = Py_VaBuildValue(fmt, ap);
    va_end(ap);
    PyObject *r = NULL;
    if (args) {
        PyObject *f = PyObject_GetAttrString(((py_host *)ctx)->obj, name);
        if (f) r = PyObject_Call(f, args, NULL);
        Py_XDECREF(f);
        Py_DECREF(args);
    }
    if (!r) ((py_host *)ctx)->failed = py_host_failed(name);
    return r;
}

static lk_status h_barrier(void *ctx) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "barrier", "()");
    Py_XDECREF(r);
    PyGILState_Release(g);
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

static lk_status h_bcast(void *ctx, void *buf, size_t n, int root) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "bcast", "(Ni)", buf_of(ctx, buf, n), root);
    Py_XDECREF(r);
    PyGILState_Release(g);
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

/* u64 min/max through a signed int64 reduction: flipping the top bit maps
 * unsigned order onto signed order (sums wrap alike either way). */
static void flip_top(void *buf, size_t n) {
    uint64_t *u = buf;
    for (size_t i = 0; i < n; i++) u[i] ^= (uint64_t)1 << 63;
}

static lk_status h_allreduce(void *ctx, void *buf, size_t n, lk_comm_dtype t, lk_reduce_op op) {
    int flip = t == LK_COMM_U64 && op != LK_REDUCE_SUM; /* u64 travels in host memory only (agreements) */
    if (flip) flip_top(buf, n);
    PyGILState_STATE g = PyGILState_Ensure();
    const size_t bytes = n * (t == LK_COMM_F32 ? 4 : 8);
    PyObject *r = host_call(ctx, "allreduce", "(Nss)", flip ? mv_of(buf, bytes) : buf_of(ctx, buf, bytes),
                            t == LK_COMM_F32 ? "f32" : "i64", op == LK_REDUCE_SUM ? "sum" : op == LK_REDUCE_MIN ? "min" : "max");
    Py_XDECREF(r);
    PyGILState_Release(g);
    if (flip) flip_top(buf, n); /* also on failure: the caller's values as they were */
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

static lk_status h_allgather(void *ctx, const void *send, size_t n, void *recv) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "allgather", "(NN)", buf_of(ctx, (void *)send, n),
                            buf_of(ctx, recv, n * (size_t)((py_host *)ctx)->size));
    Py_XDECREF(r);
    PyGILState_Release(g);
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

/* The handle ibcast returns is kept (a reference) until test reports it
 * done or wait completes it. */
static lk_status h_ibcast(void *ctx, void *buf, size_t n, int root, void **req) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "ibcast", "(Ni)", buf_of(ctx, buf, n), root);
    PyGILState_Release(g);
    *req = r;
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

static lk_status h_test(void *ctx, void *req, int *done) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "test", "(O)", (PyObject *)req);
    int d = r ? PyObject_IsTrue(r) : 0;
    Py_XDECREF(r);
    if (d < 0) ((py_host *)ctx)->failed = py_host_failed("test");
    *done = d > 0;
    if (d > 0) Py_DECREF((PyObject *)req);
    PyGILState_Release(g);
    return r && d >= 0 ? LK_OK : ((py_host *)ctx)->failed;
}

static lk_status h_wait(void *ctx, void *req) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = host_call(ctx, "wait", "(O)", (PyObject *)req);
    Py_XDECREF(r);
    Py_DECREF((PyObject *)req);
    PyGILState_Release(g);
    return r ? LK_OK : ((py_host *)ctx)->failed;
}

/* Called whenever the comm's timeout changes, also while a failed call's
 * exception is pending and lk_last_error() holds its message: both stay
 * untouched. */
static void h_set_timeout(void *ctx, double seconds) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethod(((py_host *)ctx)->obj, "set_timeout", "(d)", seconds);
    if (!r) {
        PyErr_Clear();
        lk_log(LK_LOG_WARN, "torch.distributed: set_timeout(%g) failed; the group keeps its own timeout", seconds);
    }
    Py_XDECREF(r);
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(g);
}

static void h_destroy(void *ctx) {
    py_host *h = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(h->obj);
    PyGILState_Release(g);
    PyMem_RawFree(h);
}

/* A host communicator over obj (a _TorchHost) at rank of size. Collective. */
static lk_status comm_from_py_host(PyObject *obj, int rank, int size, int nonblocking, lk_comm **out) {
    py_host *h = PyMem_RawMalloc(sizeof *h);
    if (!h) return lk_error(LK_ERR_NOMEM, "comm: out of memory");
    Py_INCREF(obj);
    h->obj = obj;
    h->size = size;
    h->failed = LK_ERR_COMM;
    h->dev = (lk_device){LK_DEVICE_CPU, 0};
    PyObject *dv = PyObject_GetAttrString(obj, "device"); /* "cuda:N" (NCCL), "emul" (tests) or None */
    const char *dn = dv && PyUnicode_Check(dv) ? PyUnicode_AsUTF8(dv) : NULL;
    if (dn && lk_device_parse(dn, &h->dev)) h->dev = (lk_device){LK_DEVICE_CPU, 0};
    if (dn && h->dev.kind == LK_DEVICE_CUDA) h->dev = cuda_device_of(h->dev.index);
    Py_XDECREF(dv);
    PyErr_Clear();
    lk_comm_host_ops ops = {.barrier = h_barrier, .bcast = h_bcast, .allreduce = h_allreduce,
                            .allgather = h_allgather, .destroy = h_destroy, .set_timeout = h_set_timeout,
                            .max_bytes = (size_t)1 << 30}; /* torch.frombuffer takes any size; keep rounds bounded */
    if (nonblocking) {
        ops.ibcast = h_ibcast;
        ops.test = h_test;
        ops.wait = h_wait;
    }
    lk_status s;
    Py_BEGIN_ALLOW_THREADS
    s = lk_comm_from_host(&ops, h, rank, size, out);
    Py_END_ALLOW_THREADS
    return s;
}

/* Comm(address): address is None (one process) or the address of an
 * MPI_Comm (mpi4py's MPI._addressof(comm)); collective (MPI_Comm_dup).
 * Comm(host=obj, rank=r, size=n, nonblocking=True): the host backend over a
 * _TorchHost (collective: lk_comm_from_host agrees on the group). */
static int Comm_init(CommObject *self, PyObject *args, PyObject *kw) {
    PyObject *addr = Py_None, *host = Py_None;
    int rank = 0, size = 1, nonblocking = 1;
    static char *kwl[] = {"address", "host", "rank", "size", "nonblocking", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOiip", kwl, &addr, &host, &rank, &size, &nonblocking)) return -1;
    if (self->c) {
        PyErr_SetString(PyExc_RuntimeError, "Comm already initialised");
        return -1;
    }
    lk_status s;
    if (host != Py_None) {
        s = comm_from_py_host(host, rank, size, nonblocking, &self->c);
    } else if (addr == Py_None) {
        s = lk_comm_self(&self->c);
    } else {
#ifdef LK_HAVE_MPI
        void *p = PyLong_AsVoidPtr(addr);
        if (!p) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "comm: NULL MPI_Comm address");
            return -1;
        }
        MPI_Comm mc = *(MPI_Comm *)p;
        int init = 0;
        MPI_Initialized(&init);
        if (!init) {
            raise_lk(LK_ERR_STATE, "comm: MPI is not initialised (import mpi4py.MPI first)");
            return -1;
        }
        Py_BEGIN_ALLOW_THREADS
        s = lk_comm_from_mpi(mc, &self->c);
        Py_END_ALLOW_THREADS
#else
        raise_lk(LK_ERR_UNSUPPORTED, "comm: this lorakit was built without MPI; only comm=None works");
        return -1;
#endif
    }
    if (s) {
        raise_lk(s, NULL);
        return -1;
    }
    return 0;
}

static PyObject *Comm_rank(CommObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->c ? lk_comm_rank(self->c) : 0);
}
static PyObject *Comm_size(CommObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->c ? lk_comm_size(self->c) : 1);
}
static PyObject *Comm_backend(CommObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(lk_comm_backend(self->c));
}

static PyGetSetDef Comm_getset[] = {
    {"rank", (getter)Comm_rank, NULL, "this process's rank", NULL},
    {"size", (getter)Comm_size, NULL, "number of ranks", NULL},
    {"backend", (getter)Comm_backend, NULL, "self, mpi or host", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lorakit._lorakit.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_dealloc = (destructor)Comm_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a lorakit communicator (one process, or a duplicate of an MPI communicator)",
    .tp_init = (initproc)Comm_init,
    .tp_new = PyType_GenericNew,
    .tp_getset = Comm_getset,
};

static lk_comm *comm_of(PyObject *o) {
    if (!PyObject_TypeCheck(o, &CommType) || !((CommObject *)o)->c) {
        PyErr_SetString(PyExc_TypeError, "internal: expected a lorakit Comm");
        return NULL;
    }
    return ((CommObject *)o)->c;
}

/* The agreement every collective entry point starts with: ok is whether
 * this rank's local preparation succeeded (its exception, if any, is
 * pending). Returns 0 when every rank succeeded; else -1 with this rank's
 * own exception when it failed, LoraError "rank R: ..." otherwise. */
static int agree_local(lk_comm *c, int ok) {
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    lk_status local = LK_OK;
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "invalid argument");
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        PyObject *msg = ev ? PyObject_Str(ev) : NULL;
        const char *m = msg ? PyUnicode_AsUTF8(msg) : NULL;
        local = lk_error(LK_ERR_ARG, "%s", m ? m : "invalid argument");
        PyErr_Clear();
        Py_XDECREF(msg);
    }
    lk_status s;
    Py_BEGIN_ALLOW_THREADS
    s = lk_comm_agree(c, local);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    if (s) {
        if (s == LK_ERR_TIMEOUT) lk_error_prefix(s, "agreeing on the call's arguments");
        raise_lk(s, NULL);
        return -1;
    }
    return 0;
}

/* ---- module functions ---- */

static PyObject *json_result(lk_status s, char *js) {
    if (s) return raise_lk(s, NULL);
    PyObject *r = PyUnicode_FromString(js);
    lk_free(js);
    return r;
}

/* strength_parse(text: str) -> float: the CLI's and the plan's strength
 * parser (lk_fuse_strength_parse), so a strength given as text means the
 * same everywhere; LoraError(LK_ERR_ARG) naming it as typed. */
static PyObject *py_strength_parse(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *text;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "s#", &text, &len)) return NULL;
    double v;
    lk_status s = lk_fuse_strength_parse(text, &v);
    if (s) return raise_lk(s, NULL);
    return PyFloat_FromDouble(v);
}

static PyObject *py_digest(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *path;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path)) return NULL;
    char hex[LK_DIGEST_HEX];
    lk_status s;
    lk_ckpt *ck = NULL;
    Py_BEGIN_ALLOW_THREADS
    s = lk_ckpt_open(PyBytes_AS_STRING(path), &ck);
    if (!s) s = lk_digest_ckpt(ck, hex);
    lk_ckpt_close(ck);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (s) return raise_lk(s, NULL);
    return PyUnicode_FromString(hex);
}

/* The digest of n views (views_digest's GIL is released by the caller):
 * host tensors directly; device tensors once stream (torch's current one)
 * has run what it queued on them, read back in pieces (lk_weights_digest). */
static lk_status views_digest(const lk_tensor *t, size_t n, lk_stream *stream, char hex[LK_DIGEST_HEX]) {
    const lk_device d = n ? t[0].device : (lk_device){LK_DEVICE_CPU, 0};
    if (d.kind == LK_DEVICE_CPU) return lk_digest_tensors(t, n, hex);
    lk_weights *w = NULL;
    lk_status s = lk_stream_sync(d, stream);
    if (!s) s = lk_weights_wrap(t, n, &w);
    if (!s) s = lk_weights_digest(w, hex);
    lk_weights_free(w);
    return s;
}

/* digest_tensors(items[, stream]) */
static PyObject *py_digest_tensors(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *items, *stream = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &items, &stream)) return NULL;
    size_t n = 0;
    view *v = views_from(items, ALLOW_CUDA, &n);
    if (!v) return NULL;
    lk_tensor *t = tensor_table(v, n);
    lk_stream *ls = NULL;
    char hex[LK_DIGEST_HEX];
    lk_status s = LK_OK;
    int ok = t && call_stream(views_device(v, n), stream, &ls) == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        s = views_digest(t, n, ls, hex);
        Py_END_ALLOW_THREADS
    }
    lk_stream_free(ls);
    PyMem_Free(t);
    views_free(v, n);
    if (!ok) return NULL;
    if (s) return raise_lk(s, NULL);
    return PyUnicode_FromString(hex);
}

/* alpha_from: "auto", "tensors" or "metadata" (lk_alpha_from_parse). */
static int alpha_from_of(const char *name, lk_alpha_from *out) {
    if (lk_alpha_from_parse(name, out) == LK_OK) return 0;
    raise_lk(LK_ERR_ARG, NULL);
    return -1;
}

/* convention: "lorakit", "comfyui", "lycoris" or "peft" (lk_convention_parse;
 * the Python layer checks the name first, with its own message). */
static int convention_of(const char *name, lk_convention *out) {
    if (lk_convention_parse(name, out) == LK_OK) return 0;
    raise_lk(LK_ERR_ARG, NULL);
    return -1;
}

static PyObject *py_inspect(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *path;
    const char *af = "auto", *cv = "lorakit";
    lk_adapter_opts ao = {0};
    if (!PyArg_ParseTuple(args, "O&|ss", PyUnicode_FSConverter, &path, &af, &cv)) return NULL;
    if (alpha_from_of(af, &ao.alpha_from) < 0 || convention_of(cv, &ao.convention) < 0) {
        Py_DECREF(path);
        return NULL;
    }
    char *js = NULL;
    lk_status s;
    Py_BEGIN_ALLOW_THREADS
    s = lk_inspect_json_opts(PyBytes_AS_STRING(path), &ao, &js);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    return json_result(s, js);
}

/* adapter_check(label, data, config_json|None, format, alpha|None,
 * convention): opens the in-memory adapter as a fuse would (every key
 * paired, shapes and ranks checked, the config read) and frees it: an
 * Adapter built from a state_dict raises at construction, naming the key
 * (LoraError .key). No model is involved (matching comes at the fuse). */
static PyObject *py_adapter_check(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *label, *cj = NULL, *fmt, *cv;
    Py_buffer data;
    PyObject *alpha;
    if (!PyArg_ParseTuple(args, "sy*zsOs", &label, &data, &cj, &fmt, &alpha, &cv)) return NULL;
    lk_adapter_opts ao = {0};
    PyObject *res = NULL;
    if (lk_adapter_format_parse(fmt, &ao.format)) {
        raise_lk(LK_ERR_ARG, NULL);
        goto done;
    }
    if (convention_of(cv, &ao.convention) < 0) goto done;
    if (alpha != Py_None) {
        ao.alpha = PyFloat_AsDouble(alpha);
        if (ao.alpha == -1.0 && PyErr_Occurred()) goto done;
        ao.has_alpha = 1;
    }
    const lk_adapter_source src = {label, data.buf, (size_t)data.len, cj};
    lk_adapter *a = NULL;
    lk_status s;
    Py_BEGIN_ALLOW_THREADS
    s = lk_adapter_open_mem(&src, &ao, &a);
    Py_END_ALLOW_THREADS
    lk_adapter_free(a);
    res = s ? raise_lk(s, NULL) : Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    return res;
}

/* The name tables of a call (arch, maps: `lorakit fuse --arch / --map`):
 * arch a str or None, maps a sequence of paths, held as bytes while the
 * call runs. */
typedef struct tables {
    PyObject *arch;   /* bytes, or NULL for None */
    PyObject **held;  /* n bytes objects */
    const char **p;   /* n paths into held */
    size_t n;
} tables;

static void tables_free(tables *t) {
    for (size_t i = 0; t->held && i < t->n; i++) Py_XDECREF(t->held[i]);
    PyMem_Free(t->held);
    PyMem_Free(t->p);
    Py_XDECREF(t->arch);
    memset(t, 0, sizeof *t);
}

/* 0, or -1 with a Python error set (t freed). */
static int tables_from(PyObject *arch, PyObject *maps, tables *t) {
    memset(t, 0, sizeof *t);
    if (arch != Py_None && !PyUnicode_Check(arch)) {
        PyErr_Format(PyExc_TypeError, "arch must be a family name (str) or None, not %.100s", Py_TYPE(arch)->tp_name);
        return -1;
    }
    if (arch != Py_None && !(t->arch = PyUnicode_AsUTF8String(arch))) return -1;
    PyObject *seq = PySequence_Fast(maps, "maps must be a sequence of paths");
    if (!seq) {
        tables_free(t);
        return -1;
    }
    Py_ssize_t nm = PySequence_Fast_GET_SIZE(seq);
    t->held = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof *t->held);
    t->p = PyMem_Calloc((size_t)(nm ? nm : 1), sizeof *t->p);
    int ok = t->held && t->p;
    if (!ok) PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < nm; i++) {
        ok = PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &t->held[i]);
        if (ok) t->p[t->n++] = PyBytes_AS_STRING(t->held[i]);
    }
    Py_DECREF(seq);
    if (!ok) tables_free(t);
    return ok ? 0 : -1;
}

static const char *tables_arch(const tables *t) { return t->arch ? PyBytes_AS_STRING(t->arch) : NULL; }

/* lk_inspect_base_json_opts (strength 0) or lk_fuse_conventions_json
 * (base may be NULL) with the name tables arch, maps, the GIL released. */
static PyObject *tables_call(const char *adapter, const char *base, PyObject *arch, PyObject *maps,
                             const lk_adapter_opts *ao, double strength) {
    tables tb;
    if (tables_from(arch, maps, &tb) < 0) return NULL;
    lk_resolve_opts ro = {.arch = tables_arch(&tb), .maps = tb.p, .n_maps = tb.n};
    char *js = NULL;
    lk_status s;
    Py_BEGIN_ALLOW_THREADS
    s = strength != 0.0 ? lk_fuse_conventions_json(adapter, base, &ro, ao, strength, &js)
                        : lk_inspect_base_json_opts(adapter, base, &ro, ao, &js);
    Py_END_ALLOW_THREADS
    tables_free(&tb);
    return json_result(s, js);
}

/* inspect_base(adapter, base, arch or None, maps: a sequence of paths[, alpha_from[, convention]]) */
static PyObject *py_inspect_base(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *adapter, *base, *arch, *maps, *res = NULL;
    const char *af = "auto", *cv = "lorakit";
    lk_adapter_opts ao = {0};
    if (!PyArg_ParseTuple(args, "O&O&OO|ss", PyUnicode_FSConverter, &adapter, PyUnicode_FSConverter, &base, &arch,
                          &maps, &af, &cv))
        return NULL;
    if (alpha_from_of(af, &ao.alpha_from) == 0 && convention_of(cv, &ao.convention) == 0)
        res = tables_call(PyBytes_AS_STRING(adapter), PyBytes_AS_STRING(base), arch, maps, &ao, 0.0);
    Py_DECREF(adapter);
    Py_DECREF(base);
    return res;
}

/* conventions(adapter, base or None, arch or None, maps, alpha_from, convention, strength != 0): where the
 * conventions give different weights (lk_fuse_conventions_json), or None when path is not an adapter. */
static PyObject *py_conventions(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *adapter, *base, *arch, *maps, *bb = NULL, *res = NULL;
    const char *af, *cv;
    double strength;
    lk_adapter_opts ao = {0};
    if (!PyArg_ParseTuple(args, "O&OOOssd", PyUnicode_FSConverter, &adapter, &base, &arch, &maps, &af, &cv, &strength))
        return NULL;
    if ((base == Py_None || PyUnicode_FSConverter(base, &bb)) && alpha_from_of(af, &ao.alpha_from) == 0 &&
        convention_of(cv, &ao.convention) == 0) {
        const char *a = PyBytes_AS_STRING(adapter), *b = bb ? PyBytes_AS_STRING(bb) : NULL;
        if (!b && !lk_inspect_is_adapter(a)) {
            Py_INCREF(Py_None);
            res = Py_None;
        } else if (strength == 0.0) {
            PyErr_SetString(PyExc_ValueError, "strength: 0 compares nothing");
        } else {
            res = tables_call(a, b, arch, maps, &ao, strength);
        }
    }
    Py_XDECREF(bb);
    Py_DECREF(adapter);
    return res;
}

/* ---- interrupts: Ctrl-C and SIGTERM during fuse, fuse_ and Tracker calls ----
 *
 * The work runs with the GIL released, so Python's own SIGINT handler
 * (which only trips a flag for the interpreter) could not stop it until it
 * finished. For the length of one such call on the main thread, a C handler
 * for SIGINT and SIGTERM sets the call's lk_cancel flag (lorakit/cancel.h:
 * the library stops at its next cancellation point, removes its
 * temporaries, leaves the output and the weights as they were). Then the
 * previous actions are put back and the signal gets its due, with the GIL:
 *   - a program's own Python-level handler is called with (signum, frame),
 *     as Python would have: its exception propagates;
 *   - the default action (Python's signal.default_int_handler for SIGINT,
 *     SIG_DFL or lorakit's temporary-removing handler for SIGTERM): a
 *     cancelled call raises KeyboardInterrupt("<call> interrupted (SIGINT):
 *     <file>: cancelled") instead of ending the process; a call that had
 *     passed its last cancellation point (complete) re-raises the signal,
 *     which then does what it would have done (KeyboardInterrupt from
 *     Python's handler; the end of the process for SIGTERM);
 *   - another C handler (not installed through Python's signal module) is
 *     run by re-raising the signal;
 *   - an ignored signal is left ignored (no handler installed).
 * A cancelled call whose handler returned without raising still raises
 * KeyboardInterrupt: the work was not done. The handler is installed only
 * on the main thread (where Python runs signal handlers); a call on
 * another thread is not interruptible by signals (it runs to its end, and
 * the signal is handled by Python as usual afterwards). Under a Tracker
 * over several ranks, the rank that caught the signal raises
 * KeyboardInterrupt, every other rank LoraError with status
 * LK_ERR_CANCELLED naming it ("rank R: ... cancelled"), all with their
 * weights unchanged. The flag the handler sets is the one global it
 * needs: a signal handler has no other way to reach the call. */
enum { SG_NONE = 0, SG_PY, SG_DFL, SG_C };
static const int g_guard_sig[2] = {SIGINT, SIGTERM};
static lk_cancel *volatile g_guard_cancel; /* the guarded call's flag, or NULL */
static volatile sig_atomic_t g_guard_caught[2];

static void on_interrupt(int sig) {
    g_guard_caught[sig == SIGINT ? 0 : 1] = 1;
    lk_cancel_request(g_guard_cancel);
}

typedef struct sig_guard {
    int mode[2];       /* SG_NONE: not installed */
    PyObject *pyh[2];  /* SG_PY: the Python-level handler (a reference) */
    struct sigaction old[2];
} sig_guard;

/* 1 on the main thread (of the main interpreter); -1 with an exception. */
static int on_main_thread(void) {
    PyObject *th = PyImport_ImportModule("threading");
    PyObject *m = th ? PyObject_CallMethod(th, "main_thread", NULL) : NULL;
    PyObject *id = m ? PyObject_GetAttrString(m, "ident") : NULL;
    int r = id ? PyLong_AsUnsignedLong(id) == PyThread_get_thread_ident() : -1;
    Py_XDECREF(id);
    Py_XDECREF(m);
    Py_XDECREF(th);
    return r;
}

/* How signal sig is handled now (SG_NONE: ignored), its Python handler in *pyh. */
static int guard_mode(PyObject *sigmod, int sig, PyObject **pyh) {
    PyObject *h = PyObject_CallMethod(sigmod, "getsignal", "i", sig);
    if (!h) return -1;
    int mode;
    if (h == Py_None) mode = lk_temp_cleanup_handles(sig) ? SG_DFL : SG_C;
    else if (PyLong_Check(h)) mode = PyLong_AsLong(h) == (long)(intptr_t)SIG_IGN ? SG_NONE : SG_DFL;
    else mode = SG_PY;
    if (mode == SG_PY) { /* Python's own default: a cancelled call raises KeyboardInterrupt with its reason */
        PyObject *dflt = PyObject_GetAttrString(sigmod, "default_int_handler");
        if (dflt == h) mode = SG_DFL;
        Py_XDECREF(dflt);
    }
    if (mode == SG_PY) *pyh = h;
    else Py_DECREF(h);
    return mode;
}

/* Before a guarded call (with the GIL): clears *target and, on the main
 * thread, makes SIGINT and SIGTERM set it. -1 with an exception. */
static int guard_begin(sig_guard *g, lk_cancel *target) {
    memset(g, 0, sizeof *g);
    lk_cancel_clear(target);
    int main_thread = on_main_thread();
    if (main_thread <= 0 || g_guard_cancel) return main_thread < 0 ? -1 : 0;
    PyObject *sigmod = PyImport_ImportModule("signal");
    if (!sigmod) return -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sa.sa_flags = SA_RESTART; /* the call's reads and writes go on; it stops at its next check */
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGTERM);
    g_guard_caught[0] = g_guard_caught[1] = 0;
    g_guard_cancel = target;
    for (int k = 0; k < 2; k++) {
        int mode = guard_mode(sigmod, g_guard_sig[k], &g->pyh[k]);
        if (mode < 0) {
            Py_DECREF(sigmod);
            return -1;
        }
        if (mode != SG_NONE && sigaction(g_guard_sig[k], &sa, &g->old[k]) == 0) g->mode[k] = mode;
        else Py_CLEAR(g->pyh[k]);
    }
    Py_DECREF(sigmod);
    return 0;
}

/* After the call (with the GIL), s its status: the previous actions back,
 * then each caught signal handled as the block above says. Returns -1 with
 * the exception to raise, or 0 (carry on with s). */
static int guard_end(sig_guard *g, lk_status s, const char *what) {
    int caught[2] = {0, 0}, any = 0;
    for (int k = 0; k < 2; k++) {
        if (!g->mode[k]) continue;
        sigaction(g_guard_sig[k], &g->old[k], NULL);
        caught[k] = g_guard_caught[k];
        any |= caught[k];
    }
    if (g->mode[0] || g->mode[1]) g_guard_cancel = NULL;
    int failed = 0;
    for (int k = 0; k < 2; k++) {
        if (caught[k] && !failed) {
            if (g->mode[k] == SG_PY) {
                PyObject *frame = (PyObject *)PyEval_GetFrame();
                PyObject *r = PyObject_CallFunction(g->pyh[k], "iO", g_guard_sig[k], frame ? frame : Py_None);
                failed = r == NULL;
                Py_XDECREF(r);
            } else if (g->mode[k] == SG_C || s != LK_ERR_CANCELLED) {
                raise(g_guard_sig[k]); /* the action put back: what the signal would have done */
                failed = PyErr_CheckSignals() < 0; /* Python's default_int_handler: KeyboardInterrupt now */
            }
        }
        Py_CLEAR(g->pyh[k]);
    }
    if (failed) return -1;
    if (any && s == LK_ERR_CANCELLED) {
        PyErr_Format(PyExc_KeyboardInterrupt, "%s interrupted (%s): %s", what,
                     caught[0] ? "SIGINT" : "SIGTERM", lk_last_error());
        return -1;
    }
    return 0;
}

/* threads within LK_KNOB_THREADS's bounds, else ValueError and 0. */
static int threads_ok(int threads) {
    if (lk_knob_in_range(LK_KNOB_THREADS, threads)) return 1;
    char r[64];
    PyErr_Format(PyExc_ValueError, "threads must be in %s, got %d", lk_knob_range(LK_KNOB_THREADS, r, sizeof r),
                 threads);
    return 0;
}

/* Before the first file written: handlers removing lorakit's temporaries
 * on every signal whose action is still the default (SIGTERM under Python:
 * a killed fuse leaves no full-size temporary; the process still ends by
 * the signal). Python's own SIGINT handler, and any the program installed,
 * stay as they are (lk_temp_cleanup_on_signals). */
static int temp_handlers(void) {
    static int done;
    if (done) return 0;
    lk_status s = lk_temp_cleanup_on_signals();
    if (s) return raise_lk(s, NULL), -1;
    done = 1;
    return 0;
}

static PyObject *py_fuse(PyObject *mod, PyObject *args) {
    (void)mod;
    if (temp_handlers() < 0) return NULL;
    PyObject *base, *out, *loras, *arch, *maps, *tied = NULL;
    lk_fuse_file_opts o = {0};
    const char *af, *cv = "lorakit";
    if (!PyArg_ParseTuple(args, "O&O&OiiisOO|sO", PyUnicode_FSConverter, &base, PyUnicode_FSConverter, &out, &loras,
                          &o.fuse.threads, &o.allow_unmatched, &o.fuse.allow_nonfinite, &af, &arch, &maps, &cv, &tied))
        return NULL;
    request r;
    tables tb = {0}, tt = {0};
    PyObject *res = NULL;
    if (threads_ok(o.fuse.threads) && alpha_from_of(af, &o.alpha_from) == 0 &&
        convention_of(cv, &o.fuse.convention) == 0 && tables_from(arch, maps, &tb) == 0 &&
        (!tied || tables_from(Py_None, tied, &tt) == 0) && request_from(loras, &r) == 0) {
        o.arch = tables_arch(&tb);
        o.maps = tb.p;
        o.n_maps = tb.n;
        o.tied = tt.p;
        o.n_tied = tt.n / 2;
        lk_fuse_stats st;
        char *js = NULL;
        lk_status s;
        const char *b = PyBytes_AS_STRING(base), *ou = PyBytes_AS_STRING(out);
        lk_cancel cancel = LK_CANCEL_INIT;
        sig_guard g;
        o.fuse.cancel = &cancel;
        if (guard_begin(&g, &cancel) == 0) {
            Py_BEGIN_ALLOW_THREADS
            s = lk_fuse_file_src(b, r.in, r.srcp, r.n, ou, &o, &st);
            if (!s && !(js = lk_fuse_summary_json(b, ou, r.in, r.n, &st)))
                s = lk_error(LK_ERR_UNSUPPORTED, "%s written, but its summary cannot be built (a path that is not UTF-8)", ou);
            Py_END_ALLOW_THREADS
            if (guard_end(&g, s, "lorakit.fuse") == 0) res = json_result(s, js);
            else lk_free(js);
        }
        request_free(&r);
    }
    tables_free(&tb);
    tables_free(&tt);
    Py_DECREF(base);
    Py_DECREF(out);
    return res;
}

/* The summary JSON of an in-memory fuse on device d: with "device",
 * "keys_device" and "keys_host_fallback" (lk_fuse_stats) added. */
static PyObject *fuse_summary(lk_device d, const lk_fuse_stats *st, char *js) {
    PyObject *r = PyUnicode_FromString(js);
    lk_free(js);
    if (!r || d.kind == LK_DEVICE_CPU) return r;
    char dn[LK_DEVICE_STR_MAX];
    PyObject *head = PyUnicode_Substring(r, 0, PyUnicode_GET_LENGTH(r) - 1); /* without the closing brace */
    Py_DECREF(r);
    if (!head) return NULL;
    PyObject *full = PyUnicode_FromFormat("%U, \"device\": \"%s\", \"keys_device\": %zu, \"keys_host_fallback\": %zu}",
                                          head, lk_device_str(d, dn), st->keys_device, st->keys_host_fallback);
    Py_DECREF(head);
    return full;
}

/* fuse_(items, loras, threads, allow_unmatched, allow_nonfinite, alpha_from, arch, maps[, convention[, stream[,
 * tied]]]): device tensors (CUDA, one device) are fused where they are, on stream (torch's current stream's
 * handle); tied a flat sequence of (name, key) pairs of str: lk_resolve_opts.tied. */
static PyObject *py_fuse_inplace(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *items, *loras, *arch, *maps, *stream = Py_None, *tied = NULL;
    lk_fuse_file_opts o = {0};
    const char *af, *cv = "lorakit";
    if (!PyArg_ParseTuple(args, "OOiiisOO|sOO", &items, &loras, &o.fuse.threads, &o.allow_unmatched,
                          &o.fuse.allow_nonfinite, &af, &arch, &maps, &cv, &stream, &tied))
        return NULL;
    request r;
    tables tb, tt = {0};
    if (!threads_ok(o.fuse.threads) || alpha_from_of(af, &o.alpha_from) < 0 ||
        convention_of(cv, &o.fuse.convention) < 0 || tables_from(arch, maps, &tb) < 0)
        return NULL;
    if ((tied && tables_from(Py_None, tied, &tt) < 0) || request_from(loras, &r) < 0) {
        tables_free(&tt);
        tables_free(&tb);
        return NULL;
    }
    o.arch = tables_arch(&tb);
    o.maps = tb.p;
    o.n_maps = tb.n;
    o.tied = tt.p;
    o.n_tied = tt.n / 2;
    size_t n = 0;
    view *v = views_from(items, NEED_WRITE | ALLOW_CUDA, &n);
    lk_tensor *t = v ? tensor_table(v, n) : NULL;
    lk_stream *ls = NULL;
    PyObject *res = NULL;
    if (t && call_stream(views_device(v, n), stream, &ls) == 0) {
        o.stream = ls;
        lk_fuse_stats st;
        char *js = NULL;
        lk_status s;
        lk_cancel cancel = LK_CANCEL_INIT;
        sig_guard g;
        o.fuse.cancel = &cancel;
        if (guard_begin(&g, &cancel) == 0) {
            Py_BEGIN_ALLOW_THREADS
            s = lk_fuse_tensors_src(t, n, r.in, r.srcp, r.n, &o, &st);
            if (!s && !(js = lk_fuse_summary_json(NULL, NULL, r.in, r.n, &st)))
                s = lk_error(LK_ERR_UNSUPPORTED, "fused, but the summary cannot be built (a path that is not UTF-8)");
            Py_END_ALLOW_THREADS
            if (guard_end(&g, s, "lorakit.fuse_") == 0)
                res = s ? raise_lk(s, NULL) : fuse_summary(views_device(v, n), &st, js);
            else lk_free(js);
        }
    }
    lk_stream_free(ls);
    PyMem_Free(t);
    views_free(v, n);
    request_free(&r);
    tables_free(&tb);
    tables_free(&tt);
    return res;
}

/* knobs() -> {id: {name, unit, default, min, max, layer, what}}: the table
 * of lorakit/knobs.h (ids in lower case: "swap_bucket_mb"), where the
 * package takes its defaults and bounds from. */
static PyObject *py_knobs(PyObject *mod, PyObject *noargs) {
    (void)mod;
    (void)noargs;
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < LK_KNOB_COUNT; i++) {
        const lk_knob *k = lk_knob_get((lk_knob_id)i);
        char id[64];
        size_t j = 0;
        for (; k->id[j] && j < sizeof id - 1; j++) id[j] = (char)(k->id[j] >= 'A' && k->id[j] <= 'Z' ? k->id[j] + 32 : k->id[j]);
        id[j] = '\0';
        PyObject *row = Py_BuildValue("{s:s, s:s, s:d, s:d, s:d, s:s, s:s}", "name", k->name, "unit", k->unit,
                                      "default", k->def, "min", k->min, "max", k->max, "layer", k->layer, "what",
                                      k->what);
        if (!row || PyDict_SetItemString(d, id, row) < 0) Py_CLEAR(d);
        Py_XDECREF(row);
    }
    return d;
}

/* mib_bytes(id, mib) -> bytes: lk_knob_mib_bytes, the one MiB -> bytes
 * conversion (ValueError naming the knob and value when out of bounds or
 * 0 bytes). id as in knobs(). */
static PyObject *py_mib_bytes(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *id;
    double mib;
    if (!PyArg_ParseTuple(args, "sd", &id, &mib)) return NULL;
    for (int i = 0; i < LK_KNOB_COUNT; i++) {
        const lk_knob *k = lk_knob_get((lk_knob_id)i);
        if (strcasecmp(k->id, id)) continue;
        size_t b;
        if (lk_knob_mib_bytes((lk_knob_id)i, mib, &b)) {
            PyErr_SetString(PyExc_ValueError, lk_last_error());
            return NULL;
        }
        return PyLong_FromSize_t(b);
    }
    PyErr_Format(PyExc_KeyError, "no knob %s", id);
    return NULL;
}

/* 1 when c's allreduce takes d's memory: NCCL on cuda, or this module's
 * host communicator whose _TorchHost moves d's memory (its `device`). */
static int comm_takes(lk_comm *c, lk_device d) {
    if (d.kind == LK_DEVICE_CUDA && lk_comm_takes_cuda(c)) return 1;
    const py_host *h = strcmp(lk_comm_backend(c), "host") ? NULL : lk_comm_host_ctx(c);
    return h && d.kind != LK_DEVICE_CPU && lk_device_equal(h->dev, d);
}

/* sync_grads(comm, items, bucket_bytes[, stream]) -> collectives: averages
 * float32 tensors over comm in place; bucket_bytes from mib_bytes. Device
 * tensors (one device) are averaged there (lk_lora_average_dev) on stream
 * (torch's current stream's handle). */
static PyObject *py_sync_grads(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *co, *items, *stream = Py_None;
    Py_ssize_t bucket;
    int ok = 1;
    if (!PyArg_ParseTuple(args, "OOn|O", &co, &items, &bucket, &stream)) return NULL;
    lk_comm *c = comm_of(co);
    if (!c) return NULL;
    if (bucket < 1) {
        PyErr_Format(PyExc_ValueError, "bucket_bytes must be >= 1, got %zd", bucket);
        ok = 0;
    }
    size_t n = 0;
    view *v = ok ? views_from(items, NEED_WRITE | NEED_F32 | ALLOW_CUDA, &n) : NULL;
    float **bufs = v ? PyMem_Calloc(n ? n : 1, sizeof *bufs) : NULL;
    size_t *counts = v ? PyMem_Calloc(n ? n : 1, sizeof *counts) : NULL;
    if (v && (!bufs || !counts)) PyErr_NoMemory();
    const lk_device d = v ? views_device(v, n) : (lk_device){LK_DEVICE_CPU, 0};
    lk_stream *ls = NULL;
    PyObject *res = NULL;
    if (agree_local(c, bufs && counts && call_stream(d, stream, &ls) == 0) == 0) {
        for (size_t i = 0; i < n; i++) {
            bufs[i] = v[i].t.data;
            counts[i] = v[i].t.nbytes / sizeof(float);
        }
        const lk_lora_average_dev_opts o = {(size_t)bucket, ls, comm_takes(c, d)};
        lk_status s;
        size_t calls = 0;
        Py_BEGIN_ALLOW_THREADS
        s = lk_lora_average_dev(c, d, bufs, counts, n, &o, &calls);
        Py_END_ALLOW_THREADS
        res = s ? raise_lk(s, NULL) : PyLong_FromSize_t(calls);
    }
    lk_stream_free(ls);
    PyMem_Free(bufs);
    PyMem_Free(counts);
    views_free(v, n);
    return res;
}

/* check_replicas(comm, items) -> bool: every rank's tensors digest the
 * same (names, dtypes, shapes and bytes). */
static PyObject *py_check_replicas(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *co, *items, *stream = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &co, &items, &stream)) return NULL;
    lk_comm *c = comm_of(co);
    if (!c) return NULL;
    size_t n = 0;
    view *v = views_from(items, ALLOW_CUDA, &n);
    lk_tensor *t = v ? tensor_table(v, n) : NULL;
    lk_stream *ls = NULL;
    PyObject *res = NULL;
    if (agree_local(c, t != NULL && call_stream(views_device(v, n), stream, &ls) == 0) == 0) {
        char hex[LK_DIGEST_HEX] = {0};
        lk_comm_same same;
        lk_status s;
        Py_BEGIN_ALLOW_THREADS
        s = lk_comm_same_bytes(c, views_digest(t, n, ls, hex), hex, LK_DIGEST_HEX, 1, NULL, &same);
        Py_END_ALLOW_THREADS
        res = s ? raise_lk(s, NULL) : PyBool_FromLong(same.n_differ == 0);
    }
    lk_stream_free(ls);
    PyMem_Free(t);
    views_free(v, n);
    return res;
}

/* agree_error(comm, message): the Python layer failed while preparing a
 * collective call; this joins that call's first agreement as failed (the
 * other ranks raise LoraError "rank R: message") and returns None, for the
 * caller to raise its own exception. */
static PyObject *py_agree_error(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *co;
    const char *msg;
    if (!PyArg_ParseTuple(args, "Os", &co, &msg)) return NULL;
    lk_comm *c = comm_of(co);
    if (!c) return NULL;
    lk_status local = lk_error(LK_ERR_ARG, "%s", msg);
    Py_BEGIN_ALLOW_THREADS
    lk_comm_agree(c, local);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rand_uniform(n, seed, name, bound) -> bytes: n float32 values (native
 * order) of lk_lora_rand_uniform, the counter-based generator that seeds
 * LoRA A matrices from (seed, parameter name): the same values on every
 * rank and in `lorakit train`, with no broadcast. */
static PyObject *py_rand_uniform(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_ssize_t n;
    unsigned long long seed;
    const char *name;
    float bound;
    if (!PyArg_ParseTuple(args, "nKsf", &n, &seed, &name, &bound)) return NULL;
    if (n < 0 || (size_t)n > PY_SSIZE_T_MAX / sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "rand_uniform: n = %zd is out of range", n);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(float));
    if (!out) return NULL;
    lk_lora_rand_uniform((float *)PyBytes_AS_STRING(out), (size_t)n, (uint64_t)seed, name, bound);
    return out;
}

/* ---- Tracker ---- */

typedef struct {
    PyObject_HEAD
    PyObject *comm; /* CommObject */
    view *v;
    size_t n;
    lk_weights *w;
    lk_tracker *t;
    PyObject *loras; /* list of (path: str, strength: float) as applied */
    int busy;        /* a call is running with the GIL released */
    lk_cancel cancel; /* the tracker's lk_tracker_opts.cancel: set by SIGINT/SIGTERM during a call (guard_begin) */
    double timeout;  /* the comm's collective timeout during this tracker's calls */
} TrackerObject;

static void Tracker_clear(TrackerObject *self) {
    lk_tracker_free(self->t);
    self->t = NULL;
    lk_weights_free(self->w);
    self->w = NULL;
    views_free(self->v, self->n);
    self->v = NULL;
    self->n = 0;
    Py_CLEAR(self->loras);
    Py_CLEAR(self->comm);
}

static void Tracker_dealloc(TrackerObject *self) {
    Tracker_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Tracker(comm, items, bucket_bytes, no_lora_swap, threads, allow_nonfinite,
 * timeout, alpha_from, arch, maps[, convention[, tied]]): arch, maps and tied as fuse_'s (copied by the
 * tracker); timeout is the comm's collective timeout while the
 * tracker's own calls run (lk_comm_set_timeout; the comm's own setting is
 * put back after each, so other users of the comm keep theirs); alpha_from
 * is a valid name (checked collectively by the Python layer). */
static int Tracker_init(TrackerObject *self, PyObject *args, PyObject *kw) {
    (void)kw;
    PyObject *co, *items, *arch, *maps, *tied = NULL;
    Py_ssize_t bucket_bytes; /* from mib_bytes: >= 1 */
    int no_swap, threads, nonfinite, ok = 1;
    double timeout;
    const char *af, *cv = "lorakit";
    lk_alpha_from alpha_from;
    lk_convention conv;
    if (!PyArg_ParseTuple(args, "OOnpiidsOO|sO", &co, &items, &bucket_bytes, &no_swap, &threads, &nonfinite, &timeout,
                          &af, &arch, &maps, &cv, &tied))
        return -1;
    if (alpha_from_of(af, &alpha_from) < 0 || convention_of(cv, &conv) < 0) return -1;
    lk_comm *c = comm_of(co);
    if (!c) return -1;
    const double was = lk_comm_timeout(c);
    char range[64];
    if (!lk_knob_in_range(LK_KNOB_TIMEOUT_S, timeout) || lk_comm_set_timeout(c, timeout)) {
        char msg[160];
        snprintf(msg, sizeof msg, "timeout must be a finite number of seconds in %s (0 = none), got %g",
                 lk_knob_range(LK_KNOB_TIMEOUT_S, range, sizeof range), timeout);
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    lk_comm_set_timeout(c, was);
    self->timeout = timeout;
    if (self->comm) {
        PyErr_SetString(PyExc_RuntimeError, "Tracker already initialised");
        return -1;
    }
    Py_INCREF(co);
    self->comm = co;
    self->loras = PyList_New(0);
    if (!self->loras) return -1;
    if (ok && !threads_ok(threads)) ok = 0;
    if (ok && bucket_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "bucket_bytes must be >= 1, got %zd", bucket_bytes);
        ok = 0;
    }
    if (ok && !(self->v = views_from(items, NEED_WRITE | ALLOW_CUDA, &self->n))) ok = 0;
    lk_tensor *t = ok ? tensor_table(self->v, self->n) : NULL;
    if (ok && !t) ok = 0;
    lk_status s = LK_OK;
    if (t && (s = lk_weights_wrap(t, self->n, &self->w))) {
        raise_lk(s, NULL);
        ok = 0;
    }
    PyMem_Free(t);
    tables tb = {0}, tt = {0};
    if (ok && tables_from(arch, maps, &tb) < 0) ok = 0; /* a rank's failure is every rank's (agree_local) */
    if (ok && tied && tables_from(Py_None, tied, &tt) < 0) ok = 0;
    lk_comm_set_timeout(c, timeout);
    if (agree_local(c, ok) < 0) {
        tables_free(&tb);
        tables_free(&tt);
        lk_comm_set_timeout(c, was);
        return -1;
    }
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)bucket_bytes;
    o.no_lora_swap = no_swap;
    o.threads = threads;
    o.allow_nonfinite = nonfinite;
    o.alpha_from = alpha_from;
    o.convention = conv;
    o.arch = tables_arch(&tb);
    o.maps = tb.p;
    o.n_maps = tb.n;
    o.tied = tt.p;
    o.n_tied = tt.n / 2;
    o.cancel = &self->cancel;
    Py_BEGIN_ALLOW_THREADS
    s = lk_tracker_create(c, self->w, &o, &self->t);
    Py_END_ALLOW_THREADS
    tables_free(&tb);
    tables_free(&tt);
    lk_comm_set_timeout(c, was);
    if (s) {
        raise_lk(s, NULL);
        return -1;
    }
    return 0;
}

/* Calls release the GIL, so another thread could reach the same tracker
 * meanwhile: it is refused rather than run concurrently (or freed). */
static int tracker_ready(TrackerObject *self) {
    if (!self->t) {
        raise_lk(LK_ERR_STATE, "Tracker is closed or was not created");
        return 0;
    }
    if (self->busy) {
        raise_lk(LK_ERR_STATE, "Tracker is in use by another thread (calls are collective and not concurrent)");
        return 0;
    }
    return 1;
}

/* One collective call (apply when r is given, else reset), then the
 * group's report. */
static PyObject *tracker_call(TrackerObject *self, request *r, int ok, int digest, PyObject *new_loras,
                              PyObject *stream) {
    lk_comm *c = ((CommObject *)self->comm)->c;
    const double was = lk_comm_timeout(c);
    lk_comm_set_timeout(c, self->timeout); /* checked in Tracker_init */
    lk_stream *ls = NULL; /* torch's current stream: the call's device work is queued there */
    if (ok && call_stream(views_device(self->v, self->n), stream, &ls) < 0) ok = 0;
    lk_status ss = ok ? lk_tracker_set_stream(self->t, ls) : LK_OK;
    if (ss) ok = 0, raise_lk(ss, NULL);
    self->busy = 1;
    int agreed = agree_local(c, ok);
    self->busy = 0;
    if (agreed < 0) {
        lk_tracker_set_stream(self->t, NULL);
        lk_stream_free(ls);
        lk_comm_set_timeout(c, was);
        return NULL;
    }
    lk_tracker_stats st;
    memset(&st, 0, sizeof st);
    lk_status s, rs;
    char msg[2048] = "", *js = NULL;
    sig_guard g;
    if (guard_begin(&g, &self->cancel) < 0) {
        lk_tracker_set_stream(self->t, NULL);
        lk_stream_free(ls);
        lk_comm_set_timeout(c, was);
        return NULL;
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = r ? lk_tracker_apply_src(self->t, r->in, r->srcp, r->n, &st) : lk_tracker_reset(self->t, &st);
    if (s) snprintf(msg, sizeof msg, "%s", lk_last_error());
    /* every rank fails or succeeds together (the tracker agrees), so the
     * report, a collective, is made on success only */
    lk_tracker_summary sum;
    rs = s ? s : lk_tracker_summarize(c, self->w, &st, digest, &sum);
    if (!rs) rs = lk_tracker_summary_json(&sum, 0, LK_OK, NULL, &js);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    lk_tracker_set_stream(self->t, NULL);
    lk_stream_free(ls);
    lk_comm_set_timeout(c, was);
    lk_error(s, "%s", msg); /* guard_end names the reason */
    if (guard_end(&g, s, r ? "Tracker.apply" : "Tracker.reset") < 0) {
        lk_free(js);
        return NULL;
    }
    if (s) {
        lk_free(js);
        return raise_lk(s, msg);
    }
    if (rs) return raise_lk(rs, NULL);
    if (new_loras) {
        Py_INCREF(new_loras);
        Py_SETREF(self->loras, new_loras);
    } else if (!r) {
        PyObject *empty = PyList_New(0);
        if (!empty) {
            lk_free(js);
            return NULL;
        }
        Py_SETREF(self->loras, empty);
    }
    return json_result(LK_OK, js);
}

/* apply(loras, digest, applied[, stream]): applied is the list the loras
 * property shows after success; stream: torch's current stream's handle
 * (device weights: the call's device work is queued there). */
static PyObject *Tracker_apply(TrackerObject *self, PyObject *args) {
    PyObject *loras, *applied, *stream = Py_None;
    int digest, ok = 1;
    if (!PyArg_ParseTuple(args, "OpO|O", &loras, &digest, &applied, &stream)) return NULL;
    if (!tracker_ready(self)) return NULL;
    request r = {0};
    if (request_from(loras, &r) < 0) ok = 0;
    PyObject *res = tracker_call(self, &r, ok, digest, applied, stream);
    request_free(&r);
    return res;
}

/* reset(digest[, stream]) */
static PyObject *Tracker_reset(TrackerObject *self, PyObject *args) {
    PyObject *stream = Py_None;
    int digest;
    if (!PyArg_ParseTuple(args, "p|O", &digest, &stream)) return NULL;
    if (!tracker_ready(self)) return NULL;
    return tracker_call(self, NULL, 1, digest, NULL, stream);
}

static PyObject *Tracker_close(TrackerObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->busy) return raise_lk(LK_ERR_STATE, "Tracker is in use by another thread");
    Tracker_clear(self);
    Py_RETURN_NONE;
}

static PyObject *Tracker_loras(TrackerObject *self, void *closure) {
    (void)closure;
    return PySequence_List(self->loras ? self->loras : Py_None);
}

static PyObject *Tracker_staging_bytes(TrackerObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->t ? lk_tracker_staging_bytes(self->t) : 0);
}

static PyMethodDef Tracker_methods[] = {
    {"apply", (PyCFunction)Tracker_apply, METH_VARARGS, NULL},
    {"reset", (PyCFunction)Tracker_reset, METH_VARARGS, NULL},
    {"close", (PyCFunction)Tracker_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *Tracker_busy(TrackerObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->busy);
}

static PyGetSetDef Tracker_getset[] = {
    {"loras", (getter)Tracker_loras, NULL, NULL, NULL},
    {"busy", (getter)Tracker_busy, NULL, NULL, NULL},
    {"staging_bytes", (getter)Tracker_staging_bytes, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TrackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lorakit._lorakit.Tracker",
    .tp_basicsize = sizeof(TrackerObject),
    .tp_dealloc = (destructor)Tracker_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "the C hot-swap tracker over borrowed tensors (use lorakit.Tracker)",
    .tp_init = (initproc)Tracker_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = Tracker_methods,
    .tp_getset = Tracker_getset,
};

/* ---- logging: lorakit's lines to a Python callable ---- */

static PyObject *g_log_fn; /* callable(level: int, msg: str), or NULL */

static void py_log_sink(void *ctx, lk_log_level level, const char *msg) {
    (void)ctx;
    if (!Py_IsInitialized()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *fn = g_log_fn;
    if (fn) {
        Py_INCREF(fn);
        PyObject *r = PyObject_CallFunction(fn, "is", (int)level, msg);
        if (!r) PyErr_WriteUnraisable(fn); /* a logging handler failed: shown, never lost silently */
        Py_XDECREF(r);
        Py_DECREF(fn);
    }
    PyGILState_Release(g);
}

/* set_log_sink(fn or None): lorakit's log lines go to fn(level, msg)
 * instead of stderr. */
static PyObject *py_set_log_sink(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "O", &fn)) return NULL;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_log_sink: a callable or None");
        return NULL;
    }
    if (fn == Py_None) {
        lk_log_set_sink(NULL, NULL);
        Py_CLEAR(g_log_fn);
    } else {
        Py_INCREF(fn);
        Py_XSETREF(g_log_fn, fn);
        lk_log_set_sink(py_log_sink, NULL);
    }
    Py_RETURN_NONE;
}

/* log_level() / set_log_level(level): the C logger's threshold (0 error ..
 * 3 debug; LORAKIT_LOG sets it at start). */
static PyObject *py_log_level(PyObject *mod, PyObject *args) {
    (void)mod;
    int level = -1;
    if (!PyArg_ParseTuple(args, "|i", &level)) return NULL;
    if (level >= 0) lk_log_set_level((lk_log_level)(level > 3 ? 3 : level));
    return PyLong_FromLong((long)lk_log_get_level());
}

/* algebra(op, [(path, strength)], out, rank, err, fro, ratio, max_rank, conv_rank, format, dtype, threads[, base]):
 * lk_merge ("merge"), lk_resize ("resize") or lk_convert ("convert"); returns the report's JSON text. */
static PyObject *py_algebra(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *op, *fmt, *dt;
    PyObject *items, *out;
    lk_algebra_opts o = {0};
    if (!PyArg_ParseTuple(args, "sOO&idddiissi|z", &op, &items, PyUnicode_FSConverter, &out, &o.rank, &o.err, &o.fro,
                          &o.ratio, &o.max_rank, &o.conv_rank, &fmt, &dt, &o.threads, &o.base))
        return NULL;
    PyObject *seq = PySequence_Fast(items, "inputs must be a sequence of (path, strength)");
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0;
    lk_algebra_input *in = seq ? PyMem_Calloc((size_t)(n ? n : 1), sizeof *in) : NULL;
    PyObject **paths = seq ? PyMem_Calloc((size_t)(n ? n : 1), sizeof *paths) : NULL;
    int ok = in && paths;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "O&d", PyUnicode_FSConverter, &paths[i],
                              &in[i].strength);
    for (Py_ssize_t i = 0; ok && i < n; i++) in[i].path = PyBytes_AS_STRING(paths[i]);
    if (ok && lk_algebra_format_parse(fmt, &o.format)) ok = (raise_lk(LK_ERR_ARG, NULL), 0);
    if (ok && *dt && (o.dtype = lk_dtype_from_name(dt, strlen(dt))) == LK_DTYPE_INVALID)
        ok = (raise_lk(lk_error(LK_ERR_ARG, "dtype '%s': F32, F16 or BF16", dt), NULL), 0);
    char *report = NULL;
    lk_status s = LK_OK;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        const char *one = n == 1 ? in[0].path : NULL;
        s = !strcmp(op, "merge")     ? lk_merge(in, (size_t)n, PyBytes_AS_STRING(out), &o, &report)
            : !strcmp(op, "convert") ? lk_convert(one, PyBytes_AS_STRING(out), &o, &report)
                                     : lk_resize(one, PyBytes_AS_STRING(out), &o, &report);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; paths && i < n; i++) Py_XDECREF(paths[i]);
    PyMem_Free(paths);
    PyMem_Free(in);
    Py_XDECREF(seq);
    Py_DECREF(out);
    if (!ok) return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    if (s) return raise_lk(s, NULL);
    PyObject *r = PyUnicode_FromString(report);
    lk_free(report);
    return r;
}

/* extract(base, tuned, out, rank, err, max_rank, conv_rank, format, dtype, threads, seed, oversample,
 * power, exact_svd, [include], [exclude]): lk_extract; returns the report's JSON text. */
static PyObject *py_extract(PyObject *mod, PyObject *args) {
    (void)mod;
    const char *fmt, *dt;
    PyObject *base, *tuned, *out, *inc, *exc;
    unsigned long long seed;
    lk_extract_opts o = {0};
    if (!PyArg_ParseTuple(args, "O&O&O&idiissiKiipOO", PyUnicode_FSConverter, &base, PyUnicode_FSConverter, &tuned,
                          PyUnicode_FSConverter, &out, &o.alg.rank, &o.alg.err, &o.alg.max_rank, &o.alg.conv_rank,
                          &fmt, &dt, &o.alg.threads, &seed, &o.oversample, &o.power, &o.exact_svd, &inc, &exc))
        return NULL;
    o.seed = (uint64_t)seed;
    PyObject *si = PySequence_Fast(inc, "include must be a sequence of str");
    PyObject *se = si ? PySequence_Fast(exc, "exclude must be a sequence of str") : NULL;
    Py_ssize_t ni = si ? PySequence_Fast_GET_SIZE(si) : 0, ne = se ? PySequence_Fast_GET_SIZE(se) : 0;
    const char **pi = PyMem_Calloc((size_t)ni + 1, sizeof *pi), **pe = PyMem_Calloc((size_t)ne + 1, sizeof *pe);
    int ok = si && se && pi && pe;
    for (Py_ssize_t i = 0; ok && i < ni; i++) ok = (pi[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(si, i))) != NULL;
    for (Py_ssize_t i = 0; ok && i < ne; i++) ok = (pe[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(se, i))) != NULL;
    o.include = pi, o.n_include = (size_t)ni, o.exclude = pe, o.n_exclude = (size_t)ne;
    if (ok && lk_algebra_format_parse(fmt, &o.alg.format)) ok = (raise_lk(LK_ERR_ARG, NULL), 0);
    if (ok && *dt && (o.alg.dtype = lk_dtype_from_name(dt, strlen(dt))) == LK_DTYPE_INVALID)
        ok = (raise_lk(lk_error(LK_ERR_ARG, "dtype '%s': F32, F16 or BF16", dt), NULL), 0);
    char *report = NULL;
    lk_status s = LK_OK;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        s = lk_extract(PyBytes_AS_STRING(base), PyBytes_AS_STRING(tuned), PyBytes_AS_STRING(out), &o, &report);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(pi), PyMem_Free(pe);
    Py_XDECREF(si), Py_XDECREF(se);
    Py_DECREF(base), Py_DECREF(tuned), Py_DECREF(out);
    if (!ok) return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    if (s) return raise_lk(s, NULL);
    PyObject *r = PyUnicode_FromString(report);
    lk_free(report);
    return r;
}

/* ---- EmulTensor: TEST ONLY, a tensor in emul device memory ----
 *
 * EmulTensor(data: bytes, dtype: str, shape: tuple) copies data into a new
 * emul allocation (lk_device_alloc, an explicit host->device copy).
 * __dlpack_device__() is (kDLCUDA, 0) and __dlpack__() exports the emul
 * memory as such: with the test hook on (_test_emul_as_cuda), lorakit's
 * Python layer and this binding treat it exactly as a CUDA tensor. tobytes()
 * reads it back (an explicit device->host copy); the emul counters
 * (emul_counts) count both. */

typedef struct {
    PyObject_HEAD
    void *data;
    size_t nbytes;
    lk_dtype dtype;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
} EmulTensorObject;

static const lk_device k_emul = {LK_DEVICE_EMUL, 0};

static void EmulTensor_dealloc(EmulTensorObject *self) {
    lk_device_free(k_emul, self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int EmulTensor_init(EmulTensorObject *self, PyObject *args, PyObject *kw) {
    (void)kw;
    Py_buffer b;
    const char *dt;
    PyObject *shape;
    if (self->data) {
        PyErr_SetString(PyExc_RuntimeError, "EmulTensor already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "y*sO", &b, &dt, &shape)) return -1;
    int ok = 0;
    self->dtype = lk_dtype_from_name(dt, strlen(dt));
    PyObject *seq = PySequence_Fast(shape, "shape must be a sequence of ints");
    size_t numel = 1;
    if (seq && self->dtype != LK_DTYPE_INVALID && PySequence_Fast_GET_SIZE(seq) <= LK_MAX_DIMS) {
        self->ndim = (int)PySequence_Fast_GET_SIZE(seq);
        ok = 1;
        for (int i = 0; ok && i < self->ndim; i++) {
            self->shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
            ok = !PyErr_Occurred() && self->shape[i] >= 0;
            numel *= ok ? (size_t)self->shape[i] : 0;
        }
    }
    self->nbytes = numel * lk_dtype_size(self->dtype);
    if (ok && (size_t)b.len != self->nbytes) ok = 0;
    lk_status st = LK_OK;
    if (ok) st = lk_device_alloc(k_emul, self->nbytes, &self->data);
    if (ok && !st) st = lk_device_copy(k_emul, self->data, b.buf, self->nbytes, LK_COPY_H2D, NULL);
    Py_XDECREF(seq);
    PyBuffer_Release(&b);
    if (!ok && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "EmulTensor: %zd bytes for dtype %s and that shape (%zu bytes expected)",
                     b.len, dt, self->nbytes);
    if (!ok) return -1;
    if (st) return raise_lk(st, NULL), -1;
    return 0;
}

static PyObject *EmulTensor_dlpack(EmulTensorObject *self, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw; /* stream=: emul streams are synchronous */
    return dl_capsule(self->data, (DLDevice){kDLCUDA, 0}, dl_of_dtype(self->dtype), self->ndim, self->shape,
                      (PyObject *)self);
}

static PyObject *EmulTensor_dlpack_device(EmulTensorObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("(ii)", kDLCUDA, 0);
}

static PyObject *EmulTensor_tobytes(EmulTensorObject *self, PyObject *noargs) {
    (void)noargs;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)self->nbytes);
    if (!out) return NULL;
    lk_status st = lk_device_copy(k_emul, PyBytes_AS_STRING(out), self->data, self->nbytes, LK_COPY_D2H, NULL);
    if (st) {
        Py_DECREF(out);
        return raise_lk(st, NULL);
    }
    return out;
}

static PyObject *EmulTensor_shape(EmulTensorObject *self, void *closure) {
    (void)closure;
    PyObject *t = PyTuple_New(self->ndim);
    for (int i = 0; t && i < self->ndim; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(self->shape[i]));
    return t;
}

static PyObject *EmulTensor_dtype(EmulTensorObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(lk_dtype_name(self->dtype));
}

static PyObject *EmulTensor_ptr(EmulTensorObject *self, void *closure) {
    (void)closure;
    return PyLong_FromVoidPtr(self->data);
}

static PyMethodDef EmulTensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))EmulTensor_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)EmulTensor_dlpack_device, METH_NOARGS, NULL},
    {"tobytes", (PyCFunction)EmulTensor_tobytes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef EmulTensor_getset[] = {
    {"shape", (getter)EmulTensor_shape, NULL, NULL, NULL},
    {"dtype", (getter)EmulTensor_dtype, NULL, NULL, NULL},
    {"data_ptr", (getter)EmulTensor_ptr, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EmulTensorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lorakit._lorakit.EmulTensor",
    .tp_basicsize = sizeof(EmulTensorObject),
    .tp_dealloc = (destructor)EmulTensor_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "TEST ONLY: a tensor in lorakit's emul device memory that reports itself as CUDA (lorakit._testing)",
    .tp_init = (initproc)EmulTensor_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = EmulTensor_methods,
    .tp_getset = EmulTensor_getset,
};

/* _test_emul_as_cuda(flag) -> previous flag: TEST ONLY (g_emul_as_cuda). */
static PyObject *py_test_emul_as_cuda(PyObject *mod, PyObject *args) {
    (void)mod;
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    int was = g_emul_as_cuda;
    g_emul_as_cuda = flag;
    return PyBool_FromLong(was);
}

/* emul_counts() -> {h2d, d2h, d2d, h2d_bytes, d2h_bytes, d2d_bytes, launches,
 * on_default, on_stream, last_stream}: the emulated device's running totals
 * (lk_device_emul_counts); last_stream: the handle of the stream the latest
 * copy or launch on a given stream was queued on. */
static PyObject *py_emul_counts(PyObject *mod, PyObject *noargs) {
    (void)mod;
    (void)noargs;
    lk_device_counts k;
    lk_device_emul_counts(&k);
    return Py_BuildValue("{s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K}", "h2d", (unsigned long long)k.copies[LK_COPY_H2D],
                         "d2h", (unsigned long long)k.copies[LK_COPY_D2H], "d2d",
                         (unsigned long long)k.copies[LK_COPY_D2D], "h2d_bytes", (unsigned long long)k.bytes[LK_COPY_H2D],
                         "d2h_bytes", (unsigned long long)k.bytes[LK_COPY_D2H], "d2d_bytes",
                         (unsigned long long)k.bytes[LK_COPY_D2D], "launches", (unsigned long long)k.launches,
                         "on_default", (unsigned long long)k.on_default, "on_stream", (unsigned long long)k.on_stream,
                         "last_stream", (unsigned long long)k.last_tag);
}

static PyMethodDef methods[] = {
    {"set_log_sink", py_set_log_sink, METH_VARARGS, NULL},
    {"log_level", py_log_level, METH_VARARGS, NULL},
    {"strength_parse", py_strength_parse, METH_VARARGS, NULL},
    {"digest", py_digest, METH_VARARGS, NULL},
    {"knobs", py_knobs, METH_NOARGS, NULL},
    {"mib_bytes", py_mib_bytes, METH_VARARGS, NULL},
    {"digest_tensors", py_digest_tensors, METH_VARARGS, NULL},
    {"inspect", py_inspect, METH_VARARGS, NULL},
    {"adapter_check", py_adapter_check, METH_VARARGS, NULL},
    {"inspect_base", py_inspect_base, METH_VARARGS, NULL},
    {"conventions", py_conventions, METH_VARARGS, NULL},
    {"fuse", py_fuse, METH_VARARGS, NULL},
    {"fuse_", py_fuse_inplace, METH_VARARGS, NULL},
    {"sync_grads", py_sync_grads, METH_VARARGS, NULL},
    {"check_replicas", py_check_replicas, METH_VARARGS, NULL},
    {"agree_error", py_agree_error, METH_VARARGS, NULL},
    {"algebra", py_algebra, METH_VARARGS, NULL},
    {"extract", py_extract, METH_VARARGS, NULL},
    {"rand_uniform", py_rand_uniform, METH_VARARGS, NULL},
    {"_test_emul_as_cuda", py_test_emul_as_cuda, METH_VARARGS, NULL},
    {"emul_counts", py_emul_counts, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_lorakit", "lorakit's C layer (see the lorakit package)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lorakit(void) {
    if (PyType_Ready(&CommType) < 0 || PyType_Ready(&TrackerType) < 0 || PyType_Ready(&EmulTensorType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    LoraError = PyErr_NewExceptionWithDoc("lorakit.LoraError",
                                          "A lorakit failure; .status is the lk_status name (e.g. LK_ERR_UNMATCHED), "
                                          ".path the file and .key the tensor key it is about where the "
                                          "library knows them (None otherwise).",
                                          PyExc_RuntimeError, NULL);
    if (!LoraError || PyModule_AddObjectRef(m, "LoraError", LoraError) < 0 ||
        PyModule_AddObjectRef(m, "Comm", (PyObject *)&CommType) < 0 ||
        PyModule_AddObjectRef(m, "Tracker", (PyObject *)&TrackerType) < 0 ||
        PyModule_AddObjectRef(m, "EmulTensor", (PyObject *)&EmulTensorType) < 0 ||
        PyModule_AddStringConstant(m, "__version__", LK_PY_VERSION) < 0 ||
#ifdef LK_HAVE_MPI
        PyModule_AddIntConstant(m, "HAVE_MPI", 1) < 0
#else
        PyModule_AddIntConstant(m, "HAVE_MPI", 0) < 0
#endif
    ) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
