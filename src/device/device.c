/* device.c — the device layer's names, its dispatch, and the cpu and emul
 * backends (lorakit/device.h says what each backend is).
 *
 * emul is built to catch, on a machine without a GPU, the mistakes a GPU
 * would punish: its allocations are registered (one mutex-guarded table:
 * the emulated device's memory is process state, as a GPU's is), so a copy
 * whose device side is host memory, or runs past an allocation, is an
 * error naming the pointer and the size instead of a silent memcpy; and
 * its kernels run only through lk_device_launch, the per-thread body over
 * the whole grid. cuda goes to device_cuda.c. */
#include "lorakit/device.h"
#include "lorakit/alloc.h"
#include "core/clock.h"
#include "device/backend.h"
#include "device/fingerprint.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EMUL_ALIGN 256u

/* ---- names ---- */

lk_status lk_device_parse(const char *text, lk_device *out) {
    if (!text || !out) return lk_error(LK_ERR_ARG, "device: NULL argument");
    if (!strcmp(text, "cpu")) {
        *out = (lk_device){LK_DEVICE_CPU, 0};
        return LK_OK;
    }
    if (!strcmp(text, "emul")) {
        *out = (lk_device){LK_DEVICE_EMUL, 0};
        return LK_OK;
    }
    if (!strcmp(text, "cuda")) {
        *out = (lk_device){LK_DEVICE_CUDA, 0};
        return LK_OK;
    }
    if (!strncmp(text, "cuda:", 5)) {
        const char *p = text + 5;
        int n = 0, digits = 0;
        for (; *p >= '0' && *p <= '9' && n <= 1023; p++, digits++) n = n * 10 + (*p - '0');
        if (digits && !*p && n <= 1023 && !(digits > 1 && text[5] == '0')) {
            *out = (lk_device){LK_DEVICE_CUDA, n};
            return LK_OK;
        }
    }
    return lk_error(LK_ERR_ARG, "device '%s': expected cpu, cuda, cuda:N (N = 0..1023) or emul", text);
}

const char *lk_device_str(lk_device d, char *buf) {
    switch (d.kind) {
    case LK_DEVICE_CPU: snprintf(buf, LK_DEVICE_STR_MAX, "cpu"); break;
    case LK_DEVICE_EMUL: snprintf(buf, LK_DEVICE_STR_MAX, "emul"); break;
    case LK_DEVICE_CUDA: snprintf(buf, LK_DEVICE_STR_MAX, "cuda:%d", d.index); break;
    default: snprintf(buf, LK_DEVICE_STR_MAX, "device?%d", (int)d.kind); break;
    }
    return buf;
}

int lk_device_equal(lk_device a, lk_device b) {
    return a.kind == b.kind && (a.kind != LK_DEVICE_CUDA || a.index == b.index);
}

int lk_device_cuda_built(void) { return lk_cuda_built(); }
int lk_device_cuda_count(void) { return lk_cuda_count(); }

static lk_status bad_kind(lk_device d, const char *what) {
    return lk_error(LK_ERR_ARG, "%s: unknown device kind %d", what, (int)d.kind);
}

lk_status lk_device_check(lk_device d) {
    switch (d.kind) {
    case LK_DEVICE_CPU:
    case LK_DEVICE_EMUL: return LK_OK;
    case LK_DEVICE_CUDA: return lk_cuda_check(d.index);
    }
    return bad_kind(d, "device check");
}

/* ---- the registry of device allocations ----
 * Every emul and cuda allocation made through lk_device_alloc, with its size:
 * emul needs it to know its own pointers (emul_owns) and what to free; both
 * kinds count bytes in use and the high-water mark per device
 * (lk_device_mem_stats: "GPU memory beyond the model" in bench swap). */

typedef struct dev_block {
    void *raw;           /* emul: what lk_malloc returned; cuda: NULL (cudaFree takes base) */
    unsigned char *base; /* the device pointer */
    size_t size;
    lk_device dev;
} dev_block;

#define MEM_SLOTS 17 /* [0] emul, [1 + i] cuda:i for i < 16 (higher indices are not counted) */

static pthread_mutex_t g_emul_mu = PTHREAD_MUTEX_INITIALIZER;
static dev_block *g_emul;
static size_t g_emul_n, g_emul_cap;
static uint64_t g_in_use[MEM_SLOTS], g_peak[MEM_SLOTS];

static int mem_slot(lk_device d) {
    if (d.kind == LK_DEVICE_EMUL) return 0;
    return d.kind == LK_DEVICE_CUDA && d.index >= 0 && d.index < MEM_SLOTS - 1 ? 1 + d.index : -1;
}

/* Records a block (under the lock); LK_ERR_NOMEM if the table cannot grow. */
static lk_status reg_add(lk_device d, void *raw, void *base, size_t bytes) {
    pthread_mutex_lock(&g_emul_mu);
    if (g_emul_n == g_emul_cap) {
        size_t cap = g_emul_cap ? 2 * g_emul_cap : 64;
        dev_block *nb = cap <= SIZE_MAX / sizeof *nb ? lk_realloc(g_emul, cap * sizeof *nb) : NULL;
        if (!nb) {
            pthread_mutex_unlock(&g_emul_mu);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory for the allocation table",
                            d.kind == LK_DEVICE_EMUL ? "emul" : "cuda");
        }
        g_emul = nb;
        g_emul_cap = cap;
    }
    g_emul[g_emul_n++] = (dev_block){raw, base, bytes, d};
    int k = mem_slot(d);
    if (k >= 0) {
        g_in_use[k] += bytes;
        if (g_in_use[k] > g_peak[k]) g_peak[k] = g_in_use[k];
    }
    pthread_mutex_unlock(&g_emul_mu);
    return LK_OK;
}

/* Forgets the block at base on device d: 1 and its raw pointer if it was
 * recorded, else 0. */
static int reg_remove(lk_device d, const void *base, void **raw) {
    int found = 0;
    pthread_mutex_lock(&g_emul_mu);
    for (size_t i = 0; i < g_emul_n; i++)
        if (g_emul[i].base == base && lk_device_equal(g_emul[i].dev, d)) {
            *raw = g_emul[i].raw;
            int k = mem_slot(d);
            if (k >= 0) g_in_use[k] -= g_emul[i].size;
            g_emul[i] = g_emul[--g_emul_n];
            found = 1;
            break;
        }
    if (!g_emul_n) { /* the table goes with the last block: nothing is left behind */
        lk_free(g_emul);
        g_emul = NULL;
        g_emul_cap = 0;
    }
    pthread_mutex_unlock(&g_emul_mu);
    return found;
}

void lk_device_mem_stats(lk_device d, uint64_t *in_use, uint64_t *peak) {
    int k = mem_slot(d);
    pthread_mutex_lock(&g_emul_mu);
    if (in_use) *in_use = k >= 0 ? g_in_use[k] : 0;
    if (peak) *peak = k >= 0 ? g_peak[k] : 0;
    pthread_mutex_unlock(&g_emul_mu);
}

void lk_device_mem_peak_reset(lk_device d) {
    int k = mem_slot(d);
    pthread_mutex_lock(&g_emul_mu);
    if (k >= 0) g_peak[k] = g_in_use[k];
    pthread_mutex_unlock(&g_emul_mu);
}

#define EMUL_DEV ((lk_device){LK_DEVICE_EMUL, 0})

static lk_status emul_alloc(size_t bytes, void **ptr) {
    if (bytes > SIZE_MAX - EMUL_ALIGN) return lk_error(LK_ERR_NOMEM, "emul: cannot allocate %zu bytes", bytes);
    void *raw = lk_malloc(bytes + EMUL_ALIGN);
    if (!raw) return lk_error(LK_ERR_NOMEM, "emul: out of memory for %zu bytes of device memory", bytes);
    unsigned char *base = (unsigned char *)raw + (EMUL_ALIGN - ((uintptr_t)raw & (EMUL_ALIGN - 1)));
    lk_status s = reg_add(EMUL_DEV, raw, base, bytes);
    if (s) {
        lk_free(raw);
        return s;
    }
    *ptr = base;
    return LK_OK;
}

static void emul_free(void *ptr) {
    void *raw = NULL;
    if (ptr && reg_remove(EMUL_DEV, ptr, &raw)) lk_free(raw);
    /* not one of ours: nothing is freed (as cudaFree refuses a host pointer) */
}

static int emul_owns(const void *ptr, size_t bytes) {
    const unsigned char *p = ptr;
    int ok = 0;
    pthread_mutex_lock(&g_emul_mu);
    for (size_t i = 0; i < g_emul_n && !ok; i++)
        ok = g_emul[i].dev.kind == LK_DEVICE_EMUL && p >= g_emul[i].base && p <= g_emul[i].base + g_emul[i].size &&
             bytes <= (size_t)(g_emul[i].base + g_emul[i].size - p);
    pthread_mutex_unlock(&g_emul_mu);
    return ok;
}

/* cuda: the runtime's allocation, recorded (freed again if the table cannot grow). */
static lk_status cuda_alloc(lk_device d, size_t bytes, void **ptr) {
    lk_status s = lk_cuda_alloc(d.index, bytes, ptr);
    if (!s && (s = reg_add(d, NULL, *ptr, bytes))) {
        lk_cuda_free(d.index, *ptr);
        *ptr = NULL;
    }
    return s;
}

static void cuda_free(lk_device d, void *ptr) {
    void *raw;
    reg_remove(d, ptr, &raw); /* a pointer not recorded here is still the runtime's to refuse */
    lk_cuda_free(d.index, ptr);
}

/* ---- memory ---- */

lk_status lk_device_alloc(lk_device d, size_t bytes, void **ptr) {
    if (!ptr) return lk_error(LK_ERR_ARG, "device alloc: NULL pointer");
    *ptr = NULL;
    if (!bytes) return LK_OK;
    switch (d.kind) {
    case LK_DEVICE_CPU:
        if (!(*ptr = lk_malloc(bytes))) return lk_error(LK_ERR_NOMEM, "cpu: out of memory for %zu bytes", bytes);
        return LK_OK;
    case LK_DEVICE_EMUL: return emul_alloc(bytes, ptr);
    case LK_DEVICE_CUDA: return cuda_alloc(d, bytes, ptr);
    }
    return bad_kind(d, "device alloc");
}

void lk_device_free(lk_device d, void *ptr) {
    if (!ptr) return;
    if (d.kind == LK_DEVICE_CPU) lk_free(ptr);
    else if (d.kind == LK_DEVICE_EMUL) emul_free(ptr);
    else if (d.kind == LK_DEVICE_CUDA) cuda_free(d, ptr);
}

lk_status lk_device_host_alloc(lk_device d, size_t bytes, void **ptr) {
    if (!ptr) return lk_error(LK_ERR_ARG, "host alloc: NULL pointer");
    *ptr = NULL;
    if (!bytes) return LK_OK;
    if (d.kind == LK_DEVICE_CUDA) return lk_cuda_host_alloc(d.index, bytes, ptr);
    if (!(*ptr = lk_malloc(bytes))) return lk_error(LK_ERR_NOMEM, "out of memory for %zu bytes of staging", bytes);
    return LK_OK;
}

void lk_device_host_free(lk_device d, void *ptr) {
    if (!ptr) return;
    if (d.kind == LK_DEVICE_CUDA) lk_cuda_host_free(ptr);
    else lk_free(ptr);
}

int lk_device_owns(lk_device d, const void *ptr, size_t bytes) {
    if (d.kind == LK_DEVICE_CPU) return 1;
    if (d.kind == LK_DEVICE_EMUL) return emul_owns(ptr, bytes);
    if (d.kind == LK_DEVICE_CUDA) return lk_cuda_owns(d.index, ptr, bytes);
    return 0;
}

/* ---- streams and events ---- */

static lk_status stream_new(lk_device d, void *native, int owned, lk_stream **out) {
    lk_stream *s = lk_calloc(1, sizeof *s);
    if (!s) {
        if (owned) lk_cuda_stream_destroy(native);
        return lk_error(LK_ERR_NOMEM, "out of memory for a stream");
    }
    *s = (lk_stream){.dev = d, .native = native, .owned = owned};
    *out = s;
    return LK_OK;
}

lk_status lk_stream_create(lk_device d, lk_stream **out) {
    if (!out) return lk_error(LK_ERR_ARG, "stream create: NULL pointer");
    *out = NULL;
    void *native = NULL;
    if (d.kind == LK_DEVICE_CUDA) {
        lk_status st = lk_cuda_stream_create(d.index, &native);
        if (st) return st;
    } else if (d.kind != LK_DEVICE_CPU && d.kind != LK_DEVICE_EMUL) {
        return bad_kind(d, "stream create");
    }
    return stream_new(d, native, d.kind == LK_DEVICE_CUDA, out);
}

lk_status lk_stream_wrap(lk_device d, void *native, lk_stream **out) {
    if (!out) return lk_error(LK_ERR_ARG, "stream wrap: NULL pointer");
    *out = NULL;
    if (d.kind == LK_DEVICE_CUDA) {
        lk_status st = lk_cuda_check(d.index);
        if (st) return st;
    }
    lk_status st = stream_new(d, d.kind == LK_DEVICE_CUDA ? native : NULL, 0, out);
    if (!st && d.kind == LK_DEVICE_EMUL) (*out)->tag = (uintptr_t)native;
    return st;
}

void lk_stream_free(lk_stream *s) {
    if (!s) return;
    if (s->owned) lk_cuda_stream_destroy(s->native);
    lk_free(s);
}

void *lk_stream_native(const lk_stream *s) { return s ? s->native : NULL; }
lk_device lk_stream_device(const lk_stream *s) { return s ? s->dev : (lk_device){LK_DEVICE_CPU, 0}; }

/* A stream given for device d must be one of d's (NULL is d's default). */
static lk_status stream_on(lk_device d, const lk_stream *s, const char *what) {
    if (!s || lk_device_equal(s->dev, d)) return LK_OK;
    char a[LK_DEVICE_STR_MAX], b[LK_DEVICE_STR_MAX];
    return lk_error(LK_ERR_ARG, "%s on %s: the stream belongs to %s", what, lk_device_str(d, a),
                    lk_device_str(s->dev, b));
}

lk_status lk_stream_sync(lk_device d, lk_stream *s) {
    lk_status st = stream_on(d, s, "stream sync");
    if (st) return st;
    return d.kind == LK_DEVICE_CUDA ? lk_cuda_stream_sync(d.index, s ? s->native : NULL) : LK_OK;
}

lk_status lk_event_create(lk_device d, lk_event **out) {
    if (!out) return lk_error(LK_ERR_ARG, "event create: NULL pointer");
    *out = NULL;
    void *native = NULL;
    if (d.kind == LK_DEVICE_CUDA) {
        lk_status st = lk_cuda_event_create(d.index, &native);
        if (st) return st;
    }
    lk_event *e = lk_calloc(1, sizeof *e);
    if (!e) {
        if (native) lk_cuda_event_destroy(native);
        return lk_error(LK_ERR_NOMEM, "out of memory for an event");
    }
    *e = (lk_event){.dev = d, .native = native};
    *out = e;
    return LK_OK;
}

void lk_event_free(lk_event *e) {
    if (!e) return;
    if (e->native) lk_cuda_event_destroy(e->native);
    lk_free(e);
}

lk_status lk_event_record(lk_event *e, lk_stream *s) {
    if (!e) return lk_error(LK_ERR_ARG, "event record: NULL event");
    lk_status st = stream_on(e->dev, s, "event record");
    if (st) return st;
    if (e->dev.kind == LK_DEVICE_CUDA && (st = lk_cuda_event_record(e->dev.index, e->native, s ? s->native : NULL)))
        return st;
    e->at = lk_now_s(); /* cpu/emul: everything before it is done */
    e->recorded = 1;
    return LK_OK;
}

lk_status lk_event_sync(lk_event *e) {
    if (!e || !e->recorded) return lk_error(LK_ERR_STATE, "event sync: the event was never recorded");
    return e->dev.kind == LK_DEVICE_CUDA ? lk_cuda_event_sync(e->native) : LK_OK;
}

lk_status lk_stream_wait_event(lk_stream *s, lk_event *e) {
    if (!e || !e->recorded) return lk_error(LK_ERR_STATE, "stream wait: the event was never recorded");
    lk_status st = stream_on(e->dev, s, "stream wait");
    if (st) return st;
    return e->dev.kind == LK_DEVICE_CUDA ? lk_cuda_stream_wait(e->dev.index, s ? s->native : NULL, e->native) : LK_OK;
}

lk_status lk_event_elapsed(const lk_event *a, const lk_event *b, double *seconds) {
    if (!a || !b || !a->recorded || !b->recorded || !seconds)
        return lk_error(LK_ERR_STATE, "event elapsed: both events must be recorded");
    if (a->dev.kind == LK_DEVICE_CUDA) return lk_cuda_event_elapsed(a->native, b->native, seconds);
    *seconds = b->at - a->at;
    return LK_OK;
}

/* ---- copies ---- */

static const char *const g_copy_names[] = {"host->device", "device->host", "device->device"};

static lk_device_counts g_counts[MEM_SLOTS]; /* per device slot (mem_slot), updated with atomics */

static void counts_load(const lk_device_counts *c, lk_device_counts *out) {
    for (int k = 0; k < 3; k++) {
        out->copies[k] = __atomic_load_n(&c->copies[k], __ATOMIC_RELAXED);
        out->bytes[k] = __atomic_load_n(&c->bytes[k], __ATOMIC_RELAXED);
    }
    out->launches = __atomic_load_n(&c->launches, __ATOMIC_RELAXED);
    out->on_default = __atomic_load_n(&c->on_default, __ATOMIC_RELAXED);
    out->on_stream = __atomic_load_n(&c->on_stream, __ATOMIC_RELAXED);
    out->last_tag = __atomic_load_n(&c->last_tag, __ATOMIC_RELAXED);
}

void lk_device_emul_counts(lk_device_counts *out) {
    if (out) counts_load(&g_counts[0], out);
}

void lk_device_counts_of(lk_device d, lk_device_counts *out) {
    if (!out) return;
    const int k = mem_slot(d);
    if (k < 0) memset(out, 0, sizeof *out);
    else counts_load(&g_counts[k], out);
}

/* A copy (kind) or launch (kind < 0) of d queued on s, counted: on the
 * default stream (s NULL) or on a given one, whose wrapped handle is
 * remembered. */
static void count_work(lk_device d, int kind, size_t bytes, const lk_stream *s) {
    const int k = mem_slot(d);
    if (k < 0) return;
    lk_device_counts *c = &g_counts[k];
    if (kind >= 0) {
        __atomic_fetch_add(&c->copies[kind], 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c->bytes[kind], (uint64_t)bytes, __ATOMIC_RELAXED);
    } else {
        __atomic_fetch_add(&c->launches, 1, __ATOMIC_RELAXED);
    }
    if (!s) {
        __atomic_fetch_add(&c->on_default, 1, __ATOMIC_RELAXED);
        return;
    }
    __atomic_fetch_add(&c->on_stream, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&c->last_tag, (uint64_t)s->tag, __ATOMIC_RELAXED);
}

static lk_status emul_side(const void *p, size_t bytes, const char *side, lk_copy_kind kind) {
    if (emul_owns(p, bytes)) return LK_OK;
    return lk_error(LK_ERR_ARG, "emul: %s copy of %zu bytes: the %s %p is not inside an emul allocation", g_copy_names[kind],
                    bytes, side, p);
}

lk_status lk_device_copy(lk_device d, void *dst, const void *src, size_t bytes, lk_copy_kind kind, lk_stream *s) {
    if (kind < LK_COPY_H2D || kind > LK_COPY_D2D) return lk_error(LK_ERR_ARG, "device copy: unknown kind %d", (int)kind);
    lk_status st = stream_on(d, s, "device copy");
    if (st || !bytes) return st;
    if (!dst || !src) return lk_error(LK_ERR_ARG, "%s copy of %zu bytes: NULL pointer", g_copy_names[kind], bytes);
    if (kind == LK_COPY_D2D) {
        const unsigned char *a = dst, *b = src;
        if (a < b + bytes && b < a + bytes)
            return lk_error(LK_ERR_ARG, "device->device copy of %zu bytes: the ranges overlap", bytes);
    }
    switch (d.kind) {
    case LK_DEVICE_CPU: memmove(dst, src, bytes); return LK_OK;
    case LK_DEVICE_EMUL:
        if (kind != LK_COPY_D2H && (st = emul_side(dst, bytes, "destination", kind))) return st;
        if (kind != LK_COPY_H2D && (st = emul_side(src, bytes, "source", kind))) return st;
        memcpy(dst, src, bytes);
        count_work(d, (int)kind, bytes, s);
        return LK_OK;
    case LK_DEVICE_CUDA:
        st = lk_cuda_copy(d.index, dst, src, bytes, kind, s ? s->native : NULL);
        if (!st) count_work(d, (int)kind, bytes, s);
        return st;
    }
    return bad_kind(d, "device copy");
}

lk_status lk_device_memset(lk_device d, void *dst, int value, size_t bytes, lk_stream *s) {
    lk_status st = stream_on(d, s, "device memset");
    if (st || !bytes) return st;
    if (!dst) return lk_error(LK_ERR_ARG, "device memset of %zu bytes: NULL pointer", bytes);
    switch (d.kind) {
    case LK_DEVICE_CPU: memset(dst, value, bytes); return LK_OK;
    case LK_DEVICE_EMUL:
        if (!emul_owns(dst, bytes))
            return lk_error(LK_ERR_ARG, "emul: memset of %zu bytes: %p is not inside an emul allocation", bytes, dst);
        memset(dst, value, bytes);
        return LK_OK;
    case LK_DEVICE_CUDA: return lk_cuda_memset(d.index, dst, value, bytes, s ? s->native : NULL);
    }
    return bad_kind(d, "device memset");
}

lk_status lk_tensor_copy(lk_tensor *dst, const lk_tensor *src, lk_stream *s) {
    if (!dst || !src) return lk_error(LK_ERR_ARG, "tensor copy: NULL tensor");
    const char *name = src->name ? src->name : "(tensor)";
    int same = dst->dtype == src->dtype && dst->ndim == src->ndim && dst->nbytes == src->nbytes;
    for (int i = 0; same && i < src->ndim; i++) same = dst->shape[i] == src->shape[i];
    if (!same) {
        char a[96], b[96];
        lk_shape_str(src, a, sizeof a);
        lk_shape_str(dst, b, sizeof b);
        return lk_error(LK_ERR_SHAPE, "%s: copy from %s %s into %s %s", name, lk_dtype_name(src->dtype), a,
                        lk_dtype_name(dst->dtype), b);
    }
    const int sh = lk_tensor_on_host(src), dh = lk_tensor_on_host(dst);
    if (!sh && !dh && !lk_device_equal(src->device, dst->device)) {
        char a[LK_DEVICE_STR_MAX], b[LK_DEVICE_STR_MAX];
        return lk_error(LK_ERR_ARG, "%s: copy from %s to %s: copies between two devices go through the host", name,
                        lk_device_str(src->device, a), lk_device_str(dst->device, b));
    }
    const lk_copy_kind kind = sh ? LK_COPY_H2D : dh ? LK_COPY_D2H : LK_COPY_D2D;
    const lk_device d = sh ? dst->device : src->device;
    lk_status st = lk_device_copy(d, dst->data, src->data, src->nbytes, kind, s);
    return st ? lk_error_prefix(st, "%s", name) : LK_OK;
}

/* ---- kernels ---- */

static lk_status emul_launch(const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args) {
    if (!k->emul) return lk_error(LK_ERR_ARG, "emul: kernel %s has no per-thread body", k->name);
    lk_thread_idx t = {.grid_dim = grid, .block_dim = block};
    for (t.block_idx.z = 0; t.block_idx.z < grid.z; t.block_idx.z++)
        for (t.block_idx.y = 0; t.block_idx.y < grid.y; t.block_idx.y++)
            for (t.block_idx.x = 0; t.block_idx.x < grid.x; t.block_idx.x++)
                for (t.thread_idx.z = 0; t.thread_idx.z < block.z; t.thread_idx.z++)
                    for (t.thread_idx.y = 0; t.thread_idx.y < block.y; t.thread_idx.y++)
                        for (t.thread_idx.x = 0; t.thread_idx.x < block.x; t.thread_idx.x++) k->emul(args, &t);
    return LK_OK;
}

lk_status lk_device_launch(lk_device d, const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args,
                           size_t args_size, lk_stream *s) {
    if (!k || !args || !args_size) return lk_error(LK_ERR_ARG, "launch: NULL kernel or arguments");
    lk_status st = stream_on(d, s, "launch");
    if (st) return st;
    const uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || !nthreads || nthreads > 1024 || grid.y > 65535 || grid.z > 65535 ||
        grid.x > 0x7fffffffu)
        return lk_error(LK_ERR_ARG, "launch %s: grid %ux%ux%u of blocks %ux%ux%u is outside CUDA's limits", k->name,
                        grid.x, grid.y, grid.z, block.x, block.y, block.z);
    switch (d.kind) {
    case LK_DEVICE_CPU: return lk_error(LK_ERR_ARG, "launch %s: kernels run on a device (cuda, emul), not cpu", k->name);
    case LK_DEVICE_EMUL:
        count_work(d, -1, 0, s);
        return emul_launch(k, grid, block, args);
    case LK_DEVICE_CUDA:
        st = lk_cuda_launch(d.index, k, grid, block, args, s ? s->native : NULL);
        if (!st) count_work(d, -1, 0, s);
        return st;
    }
    return bad_kind(d, "launch");
}

lk_status lk_device_sync(lk_device d) { return d.kind == LK_DEVICE_CUDA ? lk_cuda_sync(d.index) : LK_OK; }

/* ---- fingerprints (device/fingerprint.h: the bodies, the arithmetic) ---- */

#ifdef LK_HAVE_CUDA
const void *lk_fp_cuda_kernel(int which); /* fingerprint_cuda.cu */
#define FP_CUDA(which) lk_fp_cuda_kernel(which)
#else
#define FP_CUDA(which) NULL
#endif

static void fp_words_emul(const void *args, const lk_thread_idx *t) {
    lk_fp_words_thread(args, (uint64_t)t->block_idx.x * t->block_dim.x + t->thread_idx.x,
                       (uint64_t)t->grid_dim.x * t->block_dim.x);
}
static void fp_sum_emul(const void *args, const lk_thread_idx *t) {
    lk_fp_sum_thread(args, t->thread_idx.x, t->block_dim.x);
}

/* Pass 1's blocks for n bytes: LK_FP_MIN_WORDS words per thread at least,
 * LK_FP_MAX_BLOCKS at most. */
static unsigned fp_blocks(size_t n) {
    const uint64_t nw = ((uint64_t)n + 7) / 8, per_block = (uint64_t)LK_FP_BLOCK * LK_FP_MIN_WORDS;
    const uint64_t b = (nw + per_block - 1) / per_block;
    return b < 1 ? 1u : b > LK_FP_MAX_BLOCKS ? LK_FP_MAX_BLOCKS : (unsigned)b;
}

size_t lk_device_fingerprint_scratch(size_t n) { return (size_t)fp_blocks(n) * LK_FP_BLOCK * sizeof(uint64_t); }

lk_status lk_device_fingerprint_grid(lk_device d, const void *p, size_t n, unsigned blocks, void *scratch, lk_stream *s,
                                     uint64_t *h) {
    if (!h || (n && !p)) return lk_error(LK_ERR_ARG, "device fingerprint: NULL argument");
    if (!blocks || blocks > 0x7fffffffu / LK_FP_BLOCK)
        return lk_error(LK_ERR_ARG, "device fingerprint: %u blocks (1 .. %u)", blocks, 0x7fffffffu / LK_FP_BLOCK);
    lk_status st = stream_on(d, s, "device fingerprint");
    if (st) return st;
    const uint64_t T = (uint64_t)blocks * LK_FP_BLOCK;
    if (d.kind == LK_DEVICE_CPU) { /* the bodies on the host, one thread */
        unsigned long long part = 0;
        lk_fp_args a = {p, (unsigned long long)n, &part, 1};
        lk_fp_words_thread(&a, 0, 1);
        *h = lk_fp_final(part, n);
        return LK_OK;
    }
    if (d.kind != LK_DEVICE_EMUL && d.kind != LK_DEVICE_CUDA) return bad_kind(d, "device fingerprint");
    if (d.kind == LK_DEVICE_EMUL && n && !emul_owns(p, n))
        return lk_error(LK_ERR_ARG, "emul: fingerprint of %zu bytes: %p is not inside an emul allocation", n, p);
    if (d.kind == LK_DEVICE_EMUL && scratch && !emul_owns(scratch, (size_t)T * sizeof(uint64_t)))
        return lk_error(LK_ERR_ARG, "emul: fingerprint: the scratch %p does not hold %llu partial sums in an emul "
                        "allocation", scratch, (unsigned long long)T);
    void *own = NULL;
    if (!scratch) {
        if ((st = lk_device_alloc(d, (size_t)T * sizeof(uint64_t), &own))) return lk_error_prefix(st, "device fingerprint");
        scratch = own;
    }
    lk_fp_args a = {p, (unsigned long long)n, scratch, T};
    const lk_kernel kw = {"lk_fp_words", FP_CUDA(0), fp_words_emul}, ks = {"lk_fp_sum", FP_CUDA(1), fp_sum_emul};
    const unsigned X = T < LK_FP_BLOCK ? (unsigned)T : LK_FP_BLOCK;
    st = lk_device_launch(d, &kw, (lk_dim3){blocks, 1, 1}, (lk_dim3){LK_FP_BLOCK, 1, 1}, &a, sizeof a, s);
    if (!st) st = lk_device_launch(d, &ks, (lk_dim3){1, 1, 1}, (lk_dim3){X, 1, 1}, &a, sizeof a, s);
    a.n_part = X;
    if (!st) st = lk_device_launch(d, &ks, (lk_dim3){1, 1, 1}, (lk_dim3){1, 1, 1}, &a, sizeof a, s);
    uint64_t S = 0;
    if (!st) st = lk_device_copy(d, &S, scratch, sizeof S, LK_COPY_D2H, s);
    if (!st) st = lk_stream_sync(d, s);
    lk_device_free(d, own);
    if (st) return lk_error_prefix(st, "device fingerprint of %zu bytes", n);
    *h = lk_fp_final(S, n);
    return LK_OK;
}

lk_status lk_device_fingerprint(lk_device d, const void *p, size_t n, void *scratch, lk_stream *s, uint64_t *h) {
    return lk_device_fingerprint_grid(d, p, n, fp_blocks(n), scratch, s, h);
}
