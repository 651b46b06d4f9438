/* comm_nccl.c — the `nccl` backend of lk_comm (lorakit/comm_nccl.h), built
 * with the CUDA backend when NCCL's header is found.
 *
 * Why it is built this way:
 * - NCCL (a 200 MiB library needing libstdc++) is loaded with dlopen when
 *   the first NCCL communicator is made, never linked: every lorakit
 *   program, test and sanitizer run would otherwise load it, and a lorakit
 *   built here would not start where it is missing. The function types
 *   come from nccl.h (__typeof__), so a changed signature does not compile.
 *   The CUDA runtime is the one the device layer links (statically).
 * - The lk_comm contract is unchanged: every operation is complete on
 *   return and honours the timeout. NCCL only enqueues work on a stream, so
 *   each operation is issued, then waited for by polling the stream
 *   (cudaStreamQuery) and the communicator's asynchronous error with the
 *   growing sleeps of lk_comm_wait; the communicator is non-blocking
 *   (blocking = 0), so an issue that NCCL has not finished returns
 *   ncclInProgress and is polled the same way. Past the timeout the
 *   communicator is aborted: that stops the GPU kernels, so the buffers are
 *   not written later (over MPI they may be).
 * - Host memory (lorakit's agreements, hashes, digests, a caller's host
 *   buffers) moves through one device staging buffer made with the
 *   communicator, in rounds of its size; device memory moves straight. A
 *   pointer's kind comes from cudaPointerGetAttributes, so callers pass
 *   either. Host rounds are waited for one by one (the copy back needs the
 *   bytes); device broadcasts of a vectored broadcast are queued together,
 *   small ones in NCCL groups, and the caller's idle work runs while they
 *   move. */
#include "lorakit/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/backend.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

/* ---- the libraries, loaded once ---- */

#define LK_NCCL_API(X)                                                                                         \
    X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommSplit) X(ncclCommFinalize) X(ncclCommDestroy)       \
    X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclGetErrorString) X(ncclGetLastError) X(ncclBroadcast)      \
    X(ncclAllReduce) X(ncclAllGather) X(ncclGroupStart) X(ncclGroupEnd) X(ncclCommCount) X(ncclCommUserRank)

#define LK_API_FIELD(f) __typeof__(&f) f;
typedef struct nccl_api {
    LK_NCCL_API(LK_API_FIELD)
} nccl_api;

static nccl_api g_api;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static lk_status g_status;
static char g_why[512];

#ifndef LK_NCCL_PATH
#define LK_NCCL_PATH "libnccl.so"
#endif

static void load(void) {
    void *nc = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL); /* by soname, then the file configure found */
    if (!nc) nc = dlopen(LK_NCCL_PATH, RTLD_NOW | RTLD_LOCAL);
    if (!nc) {
        g_status = LK_ERR_UNSUPPORTED;
        snprintf(g_why, sizeof g_why, "comm nccl: NCCL cannot be loaded (%s)", dlerror());
        return;
    }
    const char *missing = NULL;
#define LK_API_LOAD(f) \
    if (!missing && !(*(void **)&g_api.f = dlsym(nc, #f))) missing = #f;
    LK_NCCL_API(LK_API_LOAD)
    if (missing) {
        g_status = LK_ERR_UNSUPPORTED;
        snprintf(g_why, sizeof g_why, "comm nccl: %s is missing from the loaded NCCL library", missing);
    }
}

static lk_status api_ready(void) {
    pthread_once(&g_once, load);
    return g_status ? lk_error(g_status, "%s", g_why) : LK_OK;
}

/* A CUDA runtime error as lorakit says it: no driver or no device is said
 * plainly (the runtime's own words are "CUDA driver version is
 * insufficient for CUDA runtime version" when there is no driver). */
static lk_status cuda_fail(cudaError_t e, const char *what) {
    cudaGetLastError();
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || e == cudaErrorInvalidDevice)
        return lk_error(LK_ERR_UNSUPPORTED, "comm nccl: no CUDA device: %s (no usable CUDA driver or device is "
                        "available; CUDA runtime: %s)", what, cudaGetErrorString(e));
    return lk_error(e == cudaErrorMemoryAllocation ? LK_ERR_NOMEM : LK_ERR_COMM, "comm nccl: %s: %s", what,
                    cudaGetErrorString(e));
}

/* ---- the communicator ---- */

#define STAGE_BYTES ((size_t)1 << 20) /* device staging for host memory */
#define GROUP_MAX 32                  /* small broadcasts per NCCL group */
#define SMALL_SEG ((size_t)1 << 20)   /* a segment below this joins a group */

typedef struct nccl_impl {
    ncclComm_t comm;      /* NULL once aborted */
    int device;
    int owned;            /* made here: destroyed with the lk_comm */
    cudaStream_t own;     /* the stream made here (NULL: none) */
    cudaStream_t stream;  /* the stream operations go on */
    void *stage;          /* STAGE_BYTES of device memory */
} nccl_impl;

static nccl_impl *ni(const lk_comm *c) { return c->impl; }

static lk_status nccl_fail(const lk_comm *c, ncclResult_t r, const char *op) {
    const char *last = ni(c)->comm ? g_api.ncclGetLastError(ni(c)->comm) : NULL;
    return lk_error(LK_ERR_COMM, "comm nccl %s: %s%s%s", op, g_api.ncclGetErrorString(r), last && *last ? ": " : "",
                    last ? last : "");
}

/* Past the timeout: the communicator is aborted (its kernels stop) and the
 * timeout reported as every backend does. */
static lk_status expired(lk_comm *c, const lk_comm_wait *w) {
    nccl_impl *m = ni(c);
    if (m->comm) g_api.ncclCommAbort(m->comm);
    m->comm = NULL;
    return lk_comm_timeout_error(c, w, "; NCCL cannot tell which ranks were missing; the NCCL communicator was "
                                 "aborted (ncclCommAbort)");
}

/* Waits while NCCL has not finished taking a call (ncclInProgress in
 * non-blocking mode) or an init/split: polls the asynchronous state of
 * comm. */
static lk_status settle(lk_comm *c, ncclComm_t comm, ncclResult_t r, lk_comm_wait *w, const char *op) {
    while (r == ncclInProgress) {
        if (lk_comm_wait_expired(c, w)) {
            if (comm != ni(c)->comm) g_api.ncclCommAbort(comm); /* a communicator being made */
            return expired(c, w);
        }
        lk_comm_wait_pause(w);
        if (g_api.ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
    }
    return r == ncclSuccess ? LK_OK : nccl_fail(c, r, op);
}

/* Completes everything queued on the stream, running idle (may be NULL)
 * while it moves. */
static lk_status drain(lk_comm *c, lk_comm_wait *w, lk_comm_idle_fn idle, void *arg, const char *op) {
    nccl_impl *m = ni(c);
    for (;;) {
        cudaError_t e = cudaStreamQuery(m->stream);
        if (e == cudaSuccess) return LK_OK;
        if (e != cudaErrorNotReady) return cuda_fail(e, op);
        ncclResult_t r = ncclSuccess;
        if (g_api.ncclCommGetAsyncError(m->comm, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress)
            return nccl_fail(c, r, op);
        if (lk_comm_wait_expired(c, w)) return expired(c, w);
        if (idle && idle(arg)) continue;
        lk_comm_wait_pause(w);
    }
}

/* An issued NCCL call: taken (settle), then complete (drain). */
static lk_status complete(lk_comm *c, ncclResult_t r, const char *op) {
    lk_comm_wait w;
    lk_comm_wait_start(&w);
    lk_status s = settle(c, ni(c)->comm, r, &w, op);
    return s ? s : drain(c, &w, NULL, NULL, op);
}

static lk_status on_device(const lk_comm *c, const void *p, int *dev) {
    struct cudaPointerAttributes a;
    *dev = 0;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* not CUDA's: plain host memory */
        return LK_OK;
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return LK_OK;
    if (a.device != ni(c)->device)
        return lk_error(LK_ERR_ARG, "comm nccl: a buffer on cuda:%d given to a communicator on cuda:%d", a.device,
                        ni(c)->device);
    *dev = 1;
    return LK_OK;
}

static lk_status copy(const lk_comm *c, void *dst, const void *src, size_t n, const char *op) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, ni(c)->stream);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, op);
}

/* Starts an operation: this thread on the communicator's device, and the
 * communicator not aborted. */
static lk_status begin(const lk_comm *c, const char *op) {
    if (!ni(c)->comm) return lk_error(LK_ERR_COMM, "comm nccl %s: the communicator was aborted", op);
    cudaError_t e = cudaSetDevice(ni(c)->device);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, op);
}

static lk_status nc_bcast(lk_comm *c, void *buf, size_t n, int root) {
    nccl_impl *m = ni(c);
    int dev;
    lk_status s = begin(c, "bcast");
    if (!s) s = on_device(c, buf, &dev);
    if (s) return s;
    if (dev) return complete(c, g_api.ncclBroadcast(buf, buf, n, ncclUint8, root, m->comm, m->stream), "bcast");
    for (size_t off = 0; off < n && !s; off += STAGE_BYTES) {
        size_t k = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
        if (c->rank == root) s = copy(c, m->stage, (char *)buf + off, k, "bcast");
        if (!s) s = complete(c, g_api.ncclBroadcast(m->stage, m->stage, k, ncclUint8, root, m->comm, m->stream), "bcast");
        if (!s) s = copy(c, (char *)buf + off, m->stage, k, "bcast");
        if (!s) s = complete(c, ncclSuccess, "bcast"); /* the copy back */
    }
    return s;
}

static lk_status nc_reduce(lk_comm *c, void *buf, size_t n, size_t esize, ncclDataType_t t, ncclRedOp_t op,
                           const char *name) {
    nccl_impl *m = ni(c);
    int dev;
    lk_status s = begin(c, name);
    if (!s) s = on_device(c, buf, &dev);
    if (s) return s;
    if (dev) return complete(c, g_api.ncclAllReduce(buf, buf, n, t, op, m->comm, m->stream), name);
    const size_t step = STAGE_BYTES / esize;
    for (size_t off = 0; off < n && !s; off += step) {
        size_t k = n - off < step ? n - off : step;
        s = copy(c, m->stage, (char *)buf + off * esize, k * esize, name);
        if (!s) s = complete(c, g_api.ncclAllReduce(m->stage, m->stage, k, t, op, m->comm, m->stream), name);
        if (!s) s = copy(c, (char *)buf + off * esize, m->stage, k * esize, name);
        if (!s) s = complete(c, ncclSuccess, name);
    }
    return s;
}

static lk_status nc_sum(lk_comm *c, float *buf, size_t n) {
    return nc_reduce(c, buf, n, sizeof(float), ncclFloat32, ncclSum, "allreduce_f32_sum");
}

static lk_status nc_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op) {
    ncclRedOp_t o = op == LK_REDUCE_SUM ? ncclSum : op == LK_REDUCE_MIN ? ncclMin : ncclMax;
    return nc_reduce(c, buf, n, sizeof(uint64_t), ncclUint64, o, "allreduce_u64");
}

static lk_status nc_barrier(lk_comm *c) {
    uint64_t one = 1;
    return nc_reduce(c, &one, 1, sizeof one, ncclUint64, ncclSum, "barrier");
}

static lk_status nc_allgather(lk_comm *c, const void *send, size_t n, void *recv) {
    nccl_impl *m = ni(c);
    int ds = 0, dr = 0;
    lk_status s = begin(c, "allgather");
    if (!s) s = on_device(c, send, &ds);
    if (!s) s = on_device(c, recv, &dr);
    if (s || !n) return s;
    if (ds && dr) return complete(c, g_api.ncclAllGather(send, recv, n, ncclUint8, m->comm, m->stream), "allgather");
    /* through the stage: each rank's block in pieces of k bytes */
    const size_t size = (size_t)c->size, k0 = STAGE_BYTES / size;
    for (size_t off = 0; off < n && !s; off += k0) {
        const size_t k = n - off < k0 ? n - off : k0;
        char *mine = (char *)m->stage + (size_t)c->rank * k;
        s = copy(c, mine, (const char *)send + off, k, "allgather");
        if (!s) s = complete(c, g_api.ncclAllGather(mine, m->stage, k, ncclUint8, m->comm, m->stream), "allgather");
        for (size_t r = 0; r < size && !s; r++)
            s = copy(c, (char *)recv + r * n + off, (char *)m->stage + r * k, k, "allgather");
        if (!s) s = complete(c, ncclSuccess, "allgather");
    }
    return s;
}

/* A run of device segments [i, j) of a vectored broadcast, queued (small
 * ones GROUP_MAX to a group); the root's ready is called first with the
 * segments they read. */
static lk_status queue_run(lk_comm *c, const lk_comm_seg *seg, size_t i, size_t j, int root, lk_comm_ready_fn ready,
                           void *arg, lk_comm_wait *w) {
    nccl_impl *m = ni(c);
    lk_status s = LK_OK;
    while (i < j && !s) {
        size_t e = i + 1;
        while (e < j && e - i < GROUP_MAX && seg[i].n < SMALL_SEG && seg[e].n < SMALL_SEG) e++;
        if (ready) ready(arg, e);
        ncclResult_t r = e - i > 1 ? g_api.ncclGroupStart() : ncclSuccess;
        for (size_t q = i; q < e && r == ncclSuccess; q++)
            r = g_api.ncclBroadcast(seg[q].p, seg[q].p, seg[q].n, ncclUint8, root, m->comm, m->stream);
        if (e - i > 1) {
            ncclResult_t r2 = g_api.ncclGroupEnd();
            if (r == ncclSuccess) r = r2;
        }
        s = settle(c, m->comm, r, w, "bcastv");
        i = e;
    }
    return s;
}

static lk_status nc_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                           lk_comm_idle_fn idle, void *arg) {
    lk_status s = begin(c, "bcastv");
    size_t i = 0;
    while (i < nseg && !s) {
        int dev = 0;
        size_t j = i;
        while (j < nseg && !s && !(s = on_device(c, seg[j].p, &dev)) && dev) j++;
        if (s) break;
        if (j > i) { /* device segments [i, j): queued, then waited for with the caller's idle work */
            lk_comm_wait w;
            lk_comm_wait_start(&w);
            s = queue_run(c, seg, i, j, root, ready, arg, &w);
            if (!s) s = drain(c, &w, idle, arg, "bcastv");
        }
        if (!s && j < nseg) { /* a host segment: staged rounds */
            if (ready) ready(arg, j + 1);
            s = nc_bcast(c, seg[j].p, seg[j].n, root);
        }
        i = j + 1;
    }
    return s;
}

/* The stream and stage (the NCCL communicator is the caller's). */
static void impl_free(nccl_impl *m) {
    if (m->stage) cudaFree(m->stage);
    if (m->own) cudaStreamDestroy(m->own);
    lk_free(m);
}

static void nc_destroy(lk_comm *c) {
    nccl_impl *m = ni(c);
    cudaSetDevice(m->device);
    if (m->comm && m->owned) {
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        ncclResult_t r = g_api.ncclCommFinalize(m->comm);
        while (r == ncclInProgress && !lk_comm_wait_expired(c, &w)) {
            lk_comm_wait_pause(&w);
            if (g_api.ncclCommGetAsyncError(m->comm, &r) != ncclSuccess) r = ncclInternalError;
        }
        if (r == ncclSuccess) g_api.ncclCommDestroy(m->comm);
        else g_api.ncclCommAbort(m->comm);
    }
    impl_free(m);
}

static lk_status nc_split(lk_comm *c, int color, int key, lk_comm **out);

static const lk_comm_ops g_nccl_ops = {
    .name = "nccl",
    .destroy = nc_destroy,
    .barrier = nc_barrier,
    .bcast = nc_bcast,
    .bcastv = nc_bcastv,
    .allreduce_f32_sum = nc_sum,
    .allreduce_u64 = nc_u64,
    .allgather = nc_allgather,
    .split = nc_split,
};

/* The state of a communicator on `device` (its stream and stage; comm
 * set by the caller). */
static lk_status impl_new(int device, void *stream, nccl_impl **out) {
    *out = NULL;
    nccl_impl *m = lk_calloc(1, sizeof *m);
    if (!m) return lk_error(LK_ERR_NOMEM, "comm nccl: out of memory");
    m->device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess && !stream) e = cudaStreamCreateWithFlags(&m->own, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMalloc(&m->stage, STAGE_BYTES);
    if (e != cudaSuccess) {
        char what[64];
        snprintf(what, sizeof what, "setting up cuda:%d", device);
        lk_status s = cuda_fail(e, what);
        impl_free(m);
        return s;
    }
    m->stream = stream ? (cudaStream_t)stream : m->own;
    *out = m;
    return LK_OK;
}

static lk_status wrap(nccl_impl *m, int rank, int size, double timeout, lk_comm **out) {
    lk_status s = lk_comm_new(&g_nccl_ops, rank, size, m, out);
    if (s) return s;
    (*out)->cuda_buffers = 1;
    (*out)->timeout = timeout;
    return LK_OK;
}

static lk_status nc_split(lk_comm *c, int color, int key, lk_comm **out) {
    nccl_impl *m = ni(c), *nm = NULL;
    lk_status s = begin(c, "split");
    if (s) return s;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nc = NULL;
    lk_comm_wait w;
    lk_comm_wait_start(&w);
    ncclResult_t r = g_api.ncclCommSplit(m->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg);
    s = settle(c, m->comm, r, &w, "split");
    if (!s && nc) s = settle(c, nc, ncclInProgress, &w, "split");
    if (s || !nc) return s;
    int rank = 0, size = 0;
    if (g_api.ncclCommCount(nc, &size) != ncclSuccess || g_api.ncclCommUserRank(nc, &rank) != ncclSuccess)
        s = lk_error(LK_ERR_COMM, "comm nccl split: the new communicator does not know its rank");
    if (!s) s = impl_new(m->device, NULL, &nm);
    if (!s) {
        nm->comm = nc;
        nm->owned = 1;
        if (!(s = wrap(nm, rank, size, c->timeout, out))) return LK_OK;
        nm->comm = NULL;
        impl_free(nm);
    }
    g_api.ncclCommAbort(nc);
    return s;
}

/* ---- making communicators ---- */

int lk_comm_nccl_built(void) { return 1; }

int lk_comm_nccl_local_device(int n_devices) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                                       "LOCAL_RANK", NULL};
    int local = 0;
    for (int i = 0; vars[i]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) {
            local = atoi(v);
            break;
        }
    }
    return n_devices > 0 && local >= 0 ? local % n_devices : 0;
}

/* The device this rank uses (device < 0: its local one), checked. */
static lk_status pick_device(int *device) {
    lk_status s = api_ready();
    if (s) return s;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return cuda_fail(e, "counting the CUDA devices");
    if (n <= 0) return lk_error(LK_ERR_UNSUPPORTED, "comm nccl: no CUDA device (the CUDA runtime sees none)");
    if (*device < 0) *device = lk_comm_nccl_local_device(n);
    if (*device >= n)
        return lk_error(LK_ERR_ARG, "comm nccl: cuda:%d asked for, but %d CUDA device%s visible", *device, n,
                        n == 1 ? " is" : "s are");
    return LK_OK;
}

/* Joins the NCCL communicator of id as c's rank (non-blocking init, waited
 * for with c's timeout). */
static lk_status init_rank(lk_comm *c, ncclUniqueId id) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t comm = NULL;
    lk_comm_wait w;
    lk_comm_wait_start(&w);
    c->op = "init";
    ncclResult_t r = g_api.ncclCommInitRankConfig(&comm, c->size, id, c->rank, &cfg);
    lk_status s = comm ? settle(c, comm, r, &w, "init")
                       : lk_error(LK_ERR_COMM, "comm nccl init: %s", g_api.ncclGetErrorString(r));
    c->op = NULL;
    if (!s) ni(c)->comm = comm;
    else if (comm && r != ncclInProgress) g_api.ncclCommAbort(comm); /* settle aborted the in-progress one */
    return s;
}

lk_status lk_comm_nccl_create(lk_comm *boot, int device, lk_comm **out) {
    if (!boot || !out) return lk_error(LK_ERR_ARG, "comm nccl: NULL %s", boot ? "output" : "bootstrap communicator");
    *out = NULL;
    const int rank = lk_comm_rank(boot), size = lk_comm_size(boot);
    nccl_impl *m = NULL;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    lk_status local = pick_device(&device);
    if (!local) local = impl_new(device, NULL, &m);
    if (!local && rank == 0) {
        ncclResult_t r = g_api.ncclGetUniqueId(&id);
        if (r != ncclSuccess) local = lk_error(LK_ERR_COMM, "comm nccl: ncclGetUniqueId: %s", g_api.ncclGetErrorString(r));
    }
    lk_status s = lk_comm_agree(boot, local);
    if (!s) s = lk_comm_bcast(boot, &id, sizeof id, 0);
    lk_comm *c = NULL;
    if (s) {
        if (m) impl_free(m);
        return s;
    }
    local = wrap(m, rank, size, lk_comm_timeout(boot), &c);
    if (local) impl_free(m);
    else m->owned = 1;
    if (!local) local = init_rank(c, id);
    s = lk_comm_agree(boot, local);
    if (s) {
        lk_comm_free(c);
        return s;
    }
    *out = c;
    return LK_OK;
}

lk_status lk_comm_from_nccl(struct ncclComm *comm, int device, void *stream, lk_comm **out) {
    if (!comm || !out) return lk_error(LK_ERR_ARG, "comm nccl: NULL %s", comm ? "output" : "ncclComm_t");
    *out = NULL;
    lk_status s = api_ready();
    if (s) return s;
    int rank = 0, size = 0;
    if (g_api.ncclCommCount(comm, &size) != ncclSuccess || g_api.ncclCommUserRank(comm, &rank) != ncclSuccess)
        return lk_error(LK_ERR_ARG, "comm nccl: the ncclComm_t does not know its rank and size (not initialized?)");
    nccl_impl *m = NULL;
    if ((s = impl_new(device, stream, &m))) return s;
    m->comm = comm;
    if ((s = wrap(m, rank, size, LK_COMM_TIMEOUT_DEFAULT, out))) impl_free(m);
    return s;
}

lk_status lk_comm_nccl_set_stream(lk_comm *c, void *stream) {
    if (!c || c->ops != &g_nccl_ops)
        return lk_error(LK_ERR_ARG, "comm nccl set_stream: not an NCCL communicator (%s)", lk_comm_backend(c));
    nccl_impl *m = ni(c);
    m->stream = stream ? (cudaStream_t)stream : m->own;
    if (!m->stream) { /* handed in with a stream, now asked for its own */
        cudaSetDevice(m->device);
        cudaError_t e = cudaStreamCreateWithFlags(&m->own, cudaStreamNonBlocking);
        if (e != cudaSuccess) return cuda_fail(e, "making a stream");
        m->stream = m->own;
    }
    return LK_OK;
}

int lk_comm_nccl_device(const lk_comm *c) { return c && c->ops == &g_nccl_ops ? ni(c)->device : -1; }
