/* tracker.c — the distributed hot-swap tracker (see lorakit/tracker.h).
 *
 * Why it is built this way:
 * - Every decision that picks a collective (skip, reset, which keys to send,
 *   who sends them) is computed from data all ranks have agreed on: the
 *   request hash, then a hash of the per-key term signatures. So no rank can
 *   enter a collective the others skip, even when files differ between ranks.
 * - Each key carries the signature of the terms fused into it (0 = clean):
 *   each term's path, strength, format and the adapter's content hash. A key
 *   is recomputed and re-sent only when its signature changes, so adding an
 *   adapter that touches other keys leaves the rest alone, and ranks whose
 *   files differ (same path, other bytes) disagree and fail together.
 * - Transactional: validation and backups happen before the first
 *   agreement; fusion writes only owned keys. The owners' fuse overlaps
 *   the broadcast (fuse_job: non-blocking broadcasts with the next keys
 *   fused while the previous ones move), so a fuse can fail after
 *   receivers took new bytes: the ranks agree on the fuse's status after
 *   the broadcast, and on a failure every owner rolls back (clean bytes
 *   from the backup plus the old terms, with the old adapters still open)
 *   and every changed key is broadcast again from the restored owners.
 *   Failures are rare (the adapters are validated first), so the common
 *   case pays one agreement and the failing case one more broadcast.
 * - Keys are walked in byte-wise name order, never file order, so ranks
 *   that loaded differently ordered files still agree on every round.
 * - An FP8 weight's scale tensor (lk_fp8_scale_of) is its companion: owned
 *   by the weight's owner, given the weight's signature, backed up,
 *   restored and broadcast with it, and rewritten only by the weight's
 *   recompute (lk_fuse_fp8 rescales it), never on its own. */
#include "comm/comm.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/text.h"
#include "lorakit/tracker.h"
#include "serve/keymem.h"
#include "serve/tracker.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "lorakit/adapter.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

typedef struct key_state {
    int owner;
    void *backup;  /* clean bytes, owner only, once first touched */
    uint64_t sig;  /* signature of the terms fused in now; 0 = clean */
    long scale;    /* FP8 weight: index of its scale key, else -1 */
    long weight;   /* a scale key: index of its FP8 weight, else -1 */
    int fp8_bad;   /* FP8 weight whose scale siblings lk_fp8_scale_of refuses */
    int has_wrote; /* the tracker has written this key (every rank): wrote is checked before each call */
    uint64_t wrote; /* lk_keymem_hash of the bytes it last wrote */
    int pristine;  /* owner: the weight holds exactly its backup's bytes (backed up in this call, not
                      written since), so its first recompute needs no restore */
} key_state;

/* What an adapter's files looked like when they were read (issue 28: a
 * file rewritten at the same path is read again, never skipped): the
 * safetensors file, its adapter_config.json (absent: not stamped) and the
 * folder holding them (a config appearing beside the file changes it).
 * t0 is when the read began: a stamp whose mtime or ctime is not older
 * than t0 - LK_STAMP_RACY_NS may hide a later write in the same timestamp
 * tick, so it is read again (and compared by content) on the next call. */
typedef struct file_stamp {
    uint64_t dev, ino, size;
    int64_t mtime_ns, ctime_ns;
    int present;
} file_stamp;
typedef struct entry_stamp {
    file_stamp f[3];
    int64_t t0_ns;
} entry_stamp;
#define LK_STAMP_RACY_NS 2000000000LL /* 2 s: coarse file-system clocks (FAT keeps 2 s) */

/* A normalized request: strength-0 entries dropped, sorted, paths owned. */
typedef struct request {
    lk_fuse_input *e;
    double *s;     /* e[i].strength, for the per-key plan */
    uint64_t *id;  /* per-entry identity hash (path, strength, format) */
    lk_adapter **ad; /* opened adapters, once loaded */
    const lk_adapter_source **src; /* in-memory sources (NULL: a file), valid during the apply only */
    uint64_t *content; /* per-entry hash of the adapter's modules and bytes, once loaded */
    entry_stamp *stamp; /* per entry (a file): its files when read, once loaded */
    void *mem;     /* the one allocation e, s, id, ad, src, content and stamp are carved from */
    size_t n;
    uint64_t hash;
} request;

struct lk_tracker {
    lk_comm *comm;
    lk_weights *w;
    lk_tracker_opts o;  /* o.arch and o.maps point into arch / maps below (owned copies) */
    char *arch;
    char **maps;
    char **tied; /* 2 * o.n_tied owned strings */
    char *base_label;   /* o.base_label's copy, or NULL */
    int rank, size;
    size_t n;
    void *key_mem;      /* the one allocation the per-key arrays below are carved from (alloc_keys) */
    size_t *ord;        /* key indices in byte-wise name order */
    key_state *k;
    uint64_t *next;     /* scratch: each key's signature under the new set */
    lk_comm_seg *segs;  /* one broadcast round's pieces: at most one per key, plus one */
    size_t *seg_need;   /* per piece of segs: the fuse job's keys it waits for (prefix max of need) */
    size_t *seq;        /* one apply's keys to recompute on this rank, in broadcast order */
    size_t *need;       /* per key: 1 + its writer's position in seq, 0 when not this rank's */
    unsigned char *seq_done; /* per position of seq: recomputed (under the job's mutex) */
    int serial;         /* fuse everything, agree, then broadcast (no overlap) */
    int fuse_thread;    /* overlap with a worker thread too (spare_cores) */
    size_t staging_bytes; /* bytes per broadcast round (bucket_bytes, at most the model) */
    request cur;        /* the set fused in now (adapters kept open for rollback) */
    uint64_t backup_bytes;
    int broken;         /* a rollback failed: every later call fails */
    lk_keymem km;       /* where the keys' bytes live and move (serve/keymem.h) */
    size_t fused_on_host; /* keys fused through the host fallback, this call */
};


/* Agreement on success (lk_comm_agree) and on a value, in one collective:
 * on LK_OK, *same = 1 iff every rank passed h. */
static lk_status agree_hash(lk_comm *c, lk_status local, uint64_t h, int *same) {
    uint64_t v[2] = {h, ~h}; /* min of h and of ~h: equal everywhere iff min h == ~min ~h */
    lk_status s = lk_comm_agree_min(c, local, v, 2);
    *same = v[0] == ~v[1];
    return s;
}

/* ---- requests ---- */

static void request_clear(request *r) {
    for (size_t i = 0; i < r->n; i++) {
        if (r->ad) lk_adapter_free(r->ad[i]);
        lk_free((void *)r->e[i].path);
    }
    lk_free(r->mem);
    memset(r, 0, sizeof *r);
}

static int same_input(const lk_fuse_input *x, const lk_fuse_input *y) {
    return !strcmp(x->path, y->path) && x->strength == y->strength && x->format == y->format &&
           x->has_alpha == y->has_alpha && (!x->has_alpha || x->alpha == y->alpha);
}

static uint64_t entry_id(const lk_fuse_input *e) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    int32_t f = (int32_t)e->format;
    XXH3_64bits_update(&st, e->path, strlen(e->path) + 1);
    XXH3_64bits_update(&st, &e->strength, sizeof e->strength);
    XXH3_64bits_update(&st, &f, sizeof f);
    if (e->has_alpha) XXH3_64bits_update(&st, &e->alpha, sizeof e->alpha);
    return XXH3_64bits_digest(&st);
}

/* Validates and normalizes the caller's request (local; no collectives). */
static lk_status request_make(const lk_fuse_input *in, const lk_adapter_source *const *src, size_t n, request *r) {
    memset(r, 0, sizeof *r);
    if (n && !in) return lk_error(LK_ERR_ARG, "tracker apply: %zu adapters but a NULL list", n);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (!in[i].path || !*in[i].path) return lk_error(LK_ERR_ARG, "tracker apply: adapter %zu has no path", i);
        if (!isfinite(in[i].strength))
            return lk_error(LK_ERR_ARG, "tracker apply: %s: strength %g is not finite", in[i].path, in[i].strength);
        if ((int)in[i].format < 0 || in[i].format >= LK_FORMAT_COUNT)
            return lk_error(LK_ERR_ARG, "tracker apply: %s: unknown format %d", in[i].path, (int)in[i].format);
        if (in[i].has_alpha && !isfinite(in[i].alpha))
            return lk_error(LK_ERR_ARG, "tracker apply: %s: alpha %g is not finite", in[i].path, in[i].alpha);
        m += in[i].strength != 0.0;
    }
    if (!m) return LK_OK;
    /* one block: the request's arrays, then the scratch used only here (the
     * kept entries and their sources, and their canonical order) */
    lk_carve c = {0};
    const size_t o_e = LK_CARVE(&c, m, lk_fuse_input), o_s = LK_CARVE(&c, m, double),
                 o_id = LK_CARVE(&c, m, uint64_t), o_ad = LK_CARVE(&c, m, lk_adapter *),
                 o_src = LK_CARVE(&c, m, const lk_adapter_source *), o_content = LK_CARVE(&c, m, uint64_t),
                 o_stamp = LK_CARVE(&c, m, entry_stamp),
                 o_kept = LK_CARVE(&c, m, lk_fuse_input), o_kept_src = LK_CARVE(&c, m, const lk_adapter_source *),
                 o_order = LK_CARVE(&c, m, size_t);
    char *b = lk_carve_alloc(&c);
    if (!b) return lk_error(LK_ERR_NOMEM, "tracker apply: out of memory for the request");
    r->mem = b;
    r->e = (lk_fuse_input *)(b + o_e);
    r->s = (double *)(b + o_s);
    r->id = (uint64_t *)(b + o_id);
    r->ad = (lk_adapter **)(b + o_ad);
    r->src = (const lk_adapter_source **)(b + o_src);
    r->content = (uint64_t *)(b + o_content);
    r->stamp = (entry_stamp *)(b + o_stamp);
    lk_fuse_input *kept = (lk_fuse_input *)(b + o_kept);
    const lk_adapter_source **kept_src = (const lk_adapter_source **)(b + o_kept_src);
    size_t *order = (size_t *)(b + o_order), k = 0;
    for (size_t i = 0; i < n; i++)
        if (in[i].strength != 0.0) kept_src[k] = src ? src[i] : NULL, kept[k++] = in[i];
    /* the canonical order lk_fuse_file sums in, so the bytes agree with it */
    lk_fuse_canonical_order(kept, m, order);
    for (; r->n < m; r->n++) {
        r->src[r->n] = kept_src[order[r->n]];
        r->e[r->n] = kept[order[r->n]];
        r->e[r->n].path = lk_strdup(kept[order[r->n]].path);
        if (!r->e[r->n].path) {
            request_clear(r);
            return lk_error(LK_ERR_NOMEM, "tracker apply: out of memory for the request");
        }
    }
    for (size_t i = 0; i < r->n; i++) {
        r->id[i] = entry_id(&r->e[i]);
        r->s[i] = r->e[i].strength;
    }
    r->hash = XXH3_64bits_withSeed(r->id, r->n * sizeof *r->id, r->n);
    return LK_OK;
}

static int request_equal(const request *a, const request *b) {
    if (a->n != b->n || a->hash != b->hash) return 0;
    for (size_t i = 0; i < a->n; i++)
        if (!same_input(&a->e[i], &b->e[i])) return 0;
    return 1;
}

static void request_describe(const request *r, char *buf, size_t cap) {
    size_t len = (size_t)snprintf(buf, cap, "%zu adapter%s", r->n, r->n == 1 ? "" : "s");
    for (size_t i = 0; i < r->n && len < cap; i++) {
        char sb[LK_NUM_STR_MAX];
        len += (size_t)snprintf(buf + len, cap - len, "%s%s@%s", i ? ", " : ": ", r->e[i].path,
                                lk_num_str(r->e[i].strength, sb));
        if (r->e[i].has_alpha && len < cap)
            len += (size_t)snprintf(buf + len, cap - len, " alpha %s", lk_num_str(r->e[i].alpha, sb));
    }
}

static void hash_tensor(XXH3_state_t *h, const lk_tensor *x) {
    int32_t hdr[2] = {(int32_t)x->dtype, x->ndim};
    XXH3_64bits_update(h, hdr, sizeof hdr);
    XXH3_64bits_update(h, x->shape, (size_t)x->ndim * sizeof x->shape[0]);
    XXH3_64bits_update(h, x->data, x->nbytes);
}

/* What an adapter contributes: every module's target, scale and factor
 * bytes. Ranks compare it, so a file that differs between ranks' reads
 * (same path, other bytes) is a mismatch, not silently different weights. */
static uint64_t adapter_content(const lk_adapter *a) {
    XXH3_state_t h;
    XXH3_64bits_reset(&h);
    for (size_t m = 0; m < lk_adapter_count(a); m++) {
        const lk_lora_module *mod = lk_adapter_module(a, m);
        const char *tgt = mod->target ? mod->target : "";
        XXH3_64bits_update(&h, tgt, strlen(tgt) + 1);
        XXH3_64bits_update(&h, &mod->scale, sizeof mod->scale);
        const lk_tensor *ts[LK_MODULE_MAX_TENSORS];
        size_t nts = lk_lora_module_tensors(mod, ts);
        const int32_t algo = (int32_t)mod->algo;
        XXH3_64bits_update(&h, &algo, sizeof algo);
        for (size_t k = 0; k < nts; k++) hash_tensor(&h, ts[k]); /* factors, cores, magnitudes, biases */
        if (mod->bias.data) {
            const char *bt = mod->bias_target ? mod->bias_target : "";
            XXH3_64bits_update(&h, bt, strlen(bt) + 1);
        }
    }
    for (size_t i = 0; i < lk_adapter_placement_count(a); i++) { /* where each module lands (row slices) */
        const lk_adapter_placement *p = lk_adapter_placement_at(a, i);
        int64_t rows[3] = {p->row0, p->b_row0, p->rows};
        XXH3_64bits_update(&h, p->target, strlen(p->target) + 1);
        XXH3_64bits_update(&h, rows, sizeof rows);
    }
    for (size_t i = 0; i < lk_adapter_replacement_count(a); i++) {
        const lk_adapter_tensor *r = lk_adapter_replacement(a, i);
        const char *tgt = r->target ? r->target : "";
        XXH3_64bits_update(&h, tgt, strlen(tgt) + 1);
        hash_tensor(&h, &r->t);
    }
    return XXH3_64bits_digest(&h);
}

static int64_t now_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* path's stamp (present = 0 when path is NULL or cannot be stat'ed). */
static file_stamp stamp_of(const char *path) {
    file_stamp f = {0};
    struct stat sb;
    if (!path || stat(path, &sb) != 0) return f;
    f = (file_stamp){(uint64_t)sb.st_dev, (uint64_t)sb.st_ino, (uint64_t)sb.st_size,
                     (int64_t)sb.st_mtim.tv_sec * 1000000000LL + sb.st_mtim.tv_nsec,
                     (int64_t)sb.st_ctim.tv_sec * 1000000000LL + sb.st_ctim.tv_nsec, 1};
    return f;
}

/* The stamps of adapter a's files (its file, config and their folder).
 * Allocates nothing (the folder's name in a PATH_MAX buffer; a longer one
 * is not stamped, the same way each time). */
static void stamp_files(const lk_adapter *a, int64_t t0, entry_stamp *out) {
    const char *file = lk_adapter_file(a), *slash = file ? strrchr(file, '/') : NULL;
    char dir[PATH_MAX];
    size_t dl = slash ? (size_t)(slash - file) : 0;
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (dl < sizeof dir) snprintf(dir, sizeof dir, "%.*s", dl ? (int)dl : 1, dl ? file : "/");
    out->f[0] = stamp_of(file);
    out->f[1] = stamp_of(lk_adapter_config_file(a));
    out->f[2] = dl < sizeof dir ? stamp_of(dir) : (file_stamp){0};
    out->t0_ns = t0;
}

/* 1 if a file entry of r (loaded) may have changed since it was read:
 * a stamp differs now, or was racy (newer than its read's start less
 * LK_STAMP_RACY_NS). Local. */
static int request_stale(const request *r) {
    for (size_t i = 0; i < r->n; i++) {
        if (r->src[i] || !r->ad || !r->ad[i]) continue; /* in memory: its label is a digest of its bytes */
        entry_stamp now;
        stamp_files(r->ad[i], r->stamp[i].t0_ns, &now);
        for (int k = 0; k < 3; k++) {
            const file_stamp *a = &r->stamp[i].f[k], *b = &now.f[k];
            const int64_t racy = r->stamp[i].t0_ns - LK_STAMP_RACY_NS;
            if (memcmp(a, b, sizeof *a) || (a->present && (a->mtime_ns >= racy || a->ctime_ns >= racy))) return 1;
        }
    }
    return 0;
}

/* Entries of r whose adapter (same entry of cur) now reads differently. */
static size_t request_changed(const request *r, const request *cur) {
    size_t n = 0;
    for (size_t i = 0; i < r->n; i++)
        for (size_t j = 0; j < cur->n; j++)
            if (r->id[i] == cur->id[j] && same_input(&r->e[i], &cur->e[j])) n += r->content[i] != cur->content[j];
    return n;
}

/* Opens and resolves every adapter of r against the model into r->ad,
 * r->content and r->stamp (local; request_clear frees the adapters). */
static lk_status request_load(lk_tracker *t, request *r) {
    for (size_t i = 0; i < r->n; i++) {
        lk_adapter_opts ao = {.format = r->e[i].format, .alpha_from = t->o.alpha_from,
                              .convention = t->o.convention};
        const int64_t t0 = now_realtime_ns();
        lk_status s = lk_cancel_check(t->o.cancel, "tracker apply");
        if (!s) s = lk_fuse_input_open(&r->e[i], r->src ? r->src[i] : NULL, &ao, &r->ad[i]);
        if (!s && !r->src[i]) stamp_files(r->ad[i], t0, &r->stamp[i]);
        /* the family table and --map files as lk_fuse_file's resolve: the same placements, the same bytes */
        lk_resolve_opts ro = {.arch = t->o.arch, .maps = t->o.maps, .n_maps = t->o.n_maps, .tied = t->o.tied,
                              .n_tied = t->o.n_tied};
        if (!s) s = lk_adapter_resolve_opts(r->ad[i], lk_weights_tensors(t->w), t->n, &ro, NULL);
        if (s) return s;
        r->content[i] = adapter_content(r->ad[i]);
        if (r->n > 1 && lk_adapter_dora(r->ad[i]))
            return lk_error(LK_ERR_ARG, "%s: a DoRA adapter must be the only adapter in its request (%zu given)",
                            r->e[i].path, r->n);
    }
    return LK_OK;
}

/* The plan of r for key i (lk_fuse_file's, so the bytes agree). */
static lk_status key_terms(const lk_tracker *t, const request *r, size_t i, lk_fuse_term *terms, lk_fuse_key *plan) {
    return lk_fuse_key_plan(r->ad, r->s, r->n, lk_weights_tensor(t->w, i), terms, plan);
}

static int touches(const lk_adapter *a, const char *name) {
    const lk_adapter_placement *pl;
    return lk_adapter_placements(a, name, &pl) || lk_adapter_find_replacement(a, name) ||
           lk_adapter_find_bias_target(a, name);
}

/* How messages name the tracker's weights. */
static const char *base_name(const lk_tracker *t) { return t->base_label ? t->base_label : "base weights"; }

/* Signature of the terms of r on every key into t->next; checks each
 * touched key's plan (two replacements, DoRA with anything else). */
static lk_status key_signatures(lk_tracker *t, const request *r, lk_fuse_term *terms) {
    for (size_t i = 0; i < t->n; i++) {
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        uint64_t s = 0;
        size_t first = SIZE_MAX; /* the first adapter touching the key */
        for (size_t j = 0; j < r->n; j++)
            if (touches(r->ad[j], w->name)) {
                const uint64_t who[2] = {r->id[j], r->content[j]}; /* same name, new bytes: recompute */
                s = XXH3_64bits_withSeed(who, sizeof who, s + 1);
                if (first == SIZE_MAX) first = j;
            }
        if (first != SIZE_MAX && w->frozen)
            return lk_error(LK_ERR_ARG, "%s: %s: the adapter writes it, but %s", r->e[first].path, w->name, w->frozen);
        if (first != SIZE_MAX) {
            lk_fuse_key plan;
            lk_status st = key_terms(t, r, i, terms, &plan);
            if (st) return st;
            if (lk_dtype_is_fp8(w->dtype) && (plan.replace || plan.dora))
                return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s on an FP8 weight is not supported (LoRA terms only)",
                                r->e[first].path, w->name, plan.dora ? "DoRA" : "a replacement (modules_to_save, bias)");
            /* a bad scale is the base's: named under the base, not the adapter that touches the weight */
            if (lk_dtype_is_fp8(w->dtype) && t->k[i].fp8_bad) {
                long sc;
                lk_status bad = lk_fp8_scale_of(lk_weights_tensors(t->w), t->n, i, &sc);
                return lk_error_prefix(bad ? bad : LK_ERR_UNSUPPORTED, "%s (applying %s)", base_name(t),
                                       r->e[first].path);
            }
            if (lk_dtype_is_fp8(w->dtype) && t->k[i].scale >= 0) { /* NaN, Inf, 0, < 0: refused before any write */
                const lk_tensor *sc = lk_weights_tensor(t->w, (size_t)t->k[i].scale);
                const void *v = t->k[t->k[i].scale].backup ? t->k[t->k[i].scale].backup : sc->data; /* clean values */
                lk_status bad = t->km.backup_device || !t->k[t->k[i].scale].backup
                                    ? lk_keymem_host_view(&t->km, v, sc->nbytes, t->km.scratch_scale_off, &v)
                                    : LK_OK;
                if (!bad) bad = lk_fp8_scale_values_check(sc->name, v, sc->dtype, (int64_t)lk_tensor_numel(sc));
                if (bad) return lk_error_prefix(bad, "%s (applying %s)", base_name(t), r->e[first].path);
            }
        }
        t->next[i] = (first != SIZE_MAX && !s) ? 1 : s; /* 0 is reserved for clean */
    }
    /* a scale follows its weight */
    for (size_t i = 0; i < t->n; i++) {
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        if (t->k[i].weight >= 0) t->next[i] = t->next[t->k[i].weight];
        if (t->k[i].weight >= 0 && t->next[i] && w->frozen) /* (a frozen weight it touches returned above) */
            return lk_error(LK_ERR_ARG, "%s: an FP8 scale written with its fused weight %s, but %s", w->name,
                            lk_weights_tensor(t->w, (size_t)t->k[i].weight)->name, w->frozen);
    }
    return LK_OK;
}

/* ---- per-key work on the owner ---- */

static int changed(const lk_tracker *t, size_t i) { return t->next[i] != t->k[i].sig; }

/* Key i's clean bytes back into the weight from its backup (none: no
 * backup, or the weight holds them already). */
static lk_status restore_key(lk_tracker *t, size_t i) {
    if (!t->k[i].backup || t->k[i].pristine) return LK_OK;
    return lk_keymem_restore(&t->km, lk_weights_tensor(t->w, i), t->k[i].backup);
}

/* An FP8 weight (with its scale, if any) from clean + terms: restored from
 * the backups, then fused in place (lk_fuse_fp8 rewrites the scale). */
static lk_status recompute_fp8(lk_tracker *t, size_t i, const lk_fuse_term *terms, size_t nt, const lk_cancel *cn) {
    const lk_tensor *w = lk_weights_tensor(t->w, i);
    const lk_tensor *sc = t->k[i].scale >= 0 ? lk_weights_tensor(t->w, (size_t)t->k[i].scale) : NULL;
    lk_status s = restore_key(t, i);
    if (!s && sc) s = restore_key(t, (size_t)t->k[i].scale);
    if (s || !nt) return s;
    t->k[i].pristine = 0; /* written from here on (a failure part-way included) */
    if (sc) t->k[t->k[i].scale].pristine = 0;
    lk_fuse_opts fo = {.threads = t->o.threads, .allow_nonfinite = t->o.allow_nonfinite, .fp8 = t->o.fp8,
                       .convention = t->o.convention, .cancel = cn};
    if (t->km.on_device) return lk_keymem_fuse_fp8(&t->km, w, sc, terms, nt, &fo, &t->fused_on_host);
    return lk_fuse_fp8(w->data, w->dtype, w->shape[0], (int64_t)(lk_tensor_numel(w) / (size_t)w->shape[0]), sc ? sc->data : NULL,
                       sc ? sc->dtype : LK_DTYPE_F32, sc ? (int64_t)lk_tensor_numel(sc) : 0, terms, nt, &fo, w->name);
}

/* Makes key i hold clean + terms of r (or clean when r has none for it).
 * cn: the call's cancel flag (the forward fuse; the kernel may stop part-way,
 * the rollback redoes the key), NULL for the rollback itself. */
static lk_status recompute(lk_tracker *t, const request *r, size_t i, lk_fuse_term *terms, int *fused,
                           const lk_cancel *cn) {
    const lk_tensor *w = lk_weights_tensor(t->w, i);
    const void *clean = t->k[i].backup ? t->k[i].backup : w->data; /* no_lora_swap: in place */
    lk_fuse_key plan = {0};
    if (r->ad) {
        lk_status s = key_terms(t, r, i, terms, &plan);
        if (s) return s;
    }
    int nt = lk_fuse_key_touches(&plan);
    *fused = nt;
    if (lk_dtype_is_fp8(w->dtype)) return recompute_fp8(t, i, terms, nt ? plan.n_terms : 0, cn);
    if (t->k[i].pristine) clean = w->data; /* it holds its backup's bytes: nothing to restore */
    if (t->km.on_device && clean != w->data) { /* the device fuses in place: restore first */
        lk_status s = lk_keymem_restore(&t->km, w, clean);
        if (s) return s;
        clean = w->data;
    }
    if (!nt) {
        if (clean != w->data) memcpy(w->data, clean, w->nbytes);
        return LK_OK;
    }
    t->k[i].pristine = 0; /* written from here on (a failure part-way included) */
    lk_fuse_opts fo = {.threads = t->o.threads, .allow_nonfinite = t->o.allow_nonfinite, .fp8 = t->o.fp8,
                       .convention = t->o.convention, .cancel = cn};
    if (t->km.on_device) return lk_keymem_fuse(&t->km, w, &plan, terms, &fo, &t->fused_on_host);
    return lk_fuse_key_apply(w->data, clean, w, &plan, terms, &fo);
}

/* ---- the owners' fuse, overlapped with the broadcast ---- */

/* One apply's recomputation on this rank: its changed keys (scales go with
 * their FP8 weight) in the order the broadcast sends them, which is name
 * order within an owner, taken from the front one at a time (job_step).
 * Unless the tracker is serial, the broadcast takes them as it goes
 * (lk_comm_bcastv_ready): before each transport operation the root fuses
 * the keys that operation reads (wait_ready), and while operations are in
 * flight (MPI_Ibcast) every rank fuses its next key (idle_step). So a
 * sender fuses its next keys while the previous ones move (Open MPI's
 * receivers pull large messages themselves) and a receiver fuses its own
 * keys between receives, on one thread. Where a rank has a spare core
 * (spare_cores), a worker thread takes keys from the same list too; the
 * main thread sleeps only when every key it needs is in the worker's
 * hands. The worker calls no lk_comm function (MPI stays on the caller's
 * thread) and writes only this rank's own keys, which no broadcast writes
 * into. */
typedef struct fuse_job {
    lk_tracker *t;
    const request *r;
    lk_fuse_term *terms[2]; /* scratch: [0] the main thread's, [1] the worker's */
    size_t n_seq;           /* t->seq[0..n_seq): the keys to recompute */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t next;            /* the first key not yet taken (under mu) */
    size_t done;            /* keys [0, done) are final (under mu) */
    int failed;             /* a key failed: no more are taken (under mu) */
    const lk_cancel *cancel; /* checked before each key (NULL under no_lora_swap: in place, no rollback) */
    lk_status status;       /* the first failure, its message in msg */
    char msg[2048];
    size_t fused, restored;
    double t0, t_end;       /* start, and when the last key finished */
} fuse_job;

/* Lists this rank's keys to recompute into t->seq, and into t->need for
 * every key it sends, 1 + the position in seq of the key whose recompute
 * writes it (0: none of this rank's). */
static void job_init(fuse_job *j, lk_tracker *t, const request *r, lk_fuse_term *terms, lk_fuse_term *terms2) {
    memset(j, 0, sizeof *j);
    j->t = t;
    j->r = r;
    j->terms[0] = terms;
    j->terms[1] = terms2;
    j->cancel = t->o.no_lora_swap ? NULL : t->o.cancel;
    for (size_t c = 0; c < t->n; c++) {
        size_t i = t->ord[c];
        t->need[i] = 0;
        t->seq_done[c] = 0;
        if (t->k[i].owner != t->rank || !changed(t, i) || t->k[i].weight >= 0) continue;
        t->seq[j->n_seq++] = i;
        t->need[i] = j->n_seq;
    }
    for (size_t i = 0; i < t->n; i++) /* a scale is written by its weight's recompute */
        if (t->k[i].weight >= 0) t->need[i] = t->need[t->k[i].weight];
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->t0 = j->t_end = lk_now_s();
}

static void job_destroy(fuse_job *j) {
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
}

/* Takes the next key and recomputes it (who: 0 main thread, 1 worker).
 * Returns 0 when none is left to take or a key failed. */
static int job_step(fuse_job *j, int who) {
    pthread_mutex_lock(&j->mu);
    size_t p = j->next;
    int go = p < j->n_seq && !j->failed;
    if (go) j->next++;
    pthread_mutex_unlock(&j->mu);
    if (!go) return 0;
    int fused = 0;
    lk_status s = lk_cancel_check(j->cancel, lk_weights_tensor(j->t->w, j->t->seq[p])->name);
    if (!s) s = recompute(j->t, j->r, j->t->seq[p], j->terms[who], &fused, j->cancel);
    pthread_mutex_lock(&j->mu);
    if (s) {
        if (!j->failed) { /* lk_last_error is per thread: carry the message */
            j->status = s;
            snprintf(j->msg, sizeof j->msg, "%s", lk_last_error());
        }
        j->failed = 1;
    } else {
        j->t->seq_done[p] = 1;
        while (j->done < j->n_seq && j->t->seq_done[j->done]) j->done++;
        if (fused) j->fused++;
        else j->restored++;
        j->t_end = lk_now_s();
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return !s;
}

static void *job_main(void *arg) {
    while (job_step(arg, 1)) {
    }
    return NULL;
}

/* Returns once keys [0, want) are final or a key failed; the caller (the
 * main thread) recomputes untaken keys itself meanwhile. */
static void job_wait(fuse_job *j, size_t want) {
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int ok = j->done >= want || j->failed;
        pthread_mutex_unlock(&j->mu);
        if (ok || !job_step(j, 0)) break;
    }
    pthread_mutex_lock(&j->mu);
    while (j->done < want && !j->failed) pthread_cond_wait(&j->cv, &j->mu);
    pthread_mutex_unlock(&j->mu);
}

/* The job's status on this thread (LK_OK, or its error re-raised here). */
static lk_status job_status(const fuse_job *j) { return j->status ? lk_error(j->status, "%s", j->msg) : LK_OK; }

/* What this rank says at the agreement on the fuse: the job's status, or
 * a cancel requested meanwhile (during the broadcast too): the last
 * cancellation point before the commit. */
static lk_status job_verdict(const fuse_job *j) {
    lk_status s = job_status(j);
    return s ? s : lk_cancel_check(j->cancel, "tracker apply");
}

/* Keys of seq the job may have written: the taken ones. */
static size_t job_taken(const fuse_job *j) { return j->next < j->n_seq ? j->next : j->n_seq; }

typedef struct bcast_wait {
    lk_tracker *t;
    fuse_job *job;
} bcast_wait;

/* lk_comm_ready_fn: the root's segments [0, upto) are final once the keys
 * they hold are recomputed, or a key failed (the bytes sent then are
 * undone by the rollback's second broadcast). */
static void wait_ready(void *arg, size_t upto) {
    bcast_wait *b = arg;
    if (upto) job_wait(b->job, b->t->seg_need[upto - 1]);
}

/* lk_comm_idle_fn: while broadcasts are in flight, the next untaken key. */
static int idle_step(void *arg) { return job_step(((bcast_wait *)arg)->job, 0); }

/* ---- broadcast ---- */

/* A copy of a staged round failed on this rank: with a job, a failure of
 * the fuse (the ranks agree on it after the broadcast and roll back);
 * without one, the call's error. The collective goes on either way: the
 * other ranks are in it. */
static lk_status copy_failed(fuse_job *job, lk_status s) {
    if (!job) return s;
    pthread_mutex_lock(&job->mu);
    if (!job->failed) {
        job->status = s;
        snprintf(job->msg, sizeof job->msg, "%s", lk_last_error());
    }
    job->failed = 1;
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
    return LK_OK;
}

/* One round of ns pieces from root: straight between the weights, or, when
 * the communicator cannot take device memory (km.staged: emul, cuda over
 * MPI or a host-memory transport), through the pinned stage: the root
 * copies the pieces in once they are final, the stage goes as one
 * segment (the fuse of the next keys running meanwhile, as idle work),
 * every receiver copies the pieces out. */
static lk_status send_round(lk_tracker *t, size_t ns, int root, lk_comm_ready_fn ready, lk_comm_idle_fn idle,
                            bcast_wait *bw) {
    if (!t->km.staged) return lk_comm_bcastv_ready(t->comm, t->segs, ns, root, ready, idle, bw);
    lk_status local = LK_OK;
    size_t used = 0;
    if (t->rank == root && ready) ready(bw, ns);
    for (size_t q = 0; q < ns; used += t->segs[q++].n)
        if (t->rank == root && !local) local = lk_keymem_read(&t->km, t->km.stage + used, t->segs[q].p, t->segs[q].n);
    lk_comm_seg one = {t->km.stage, used};
    lk_status s = lk_comm_bcastv_ready(t->comm, &one, 1, root, NULL, idle, bw);
    used = 0;
    for (size_t q = 0; !s && q < ns; used += t->segs[q++].n)
        if (t->rank != root && !local) local = lk_keymem_write(&t->km, t->segs[q].p, t->km.stage + used, t->segs[q].n);
    return s ? s : local ? copy_failed(bw->job, local) : LK_OK;
}

/* Sends every changed key of every owner in rounds of at most
 * staging_bytes (bucket_bytes), in name order, a large key split across
 * rounds. A round is a list of pieces of the weights themselves, moved by
 * one vectored broadcast (lk_comm_bcastv) straight from the owner's
 * weights into every receiver's: no staging copy on either side. The
 * pieces' lengths come from sizes all ranks agreed on in lk_tracker_create,
 * so every rank builds the same rounds. With a job (its worker running),
 * the root waits for each piece's key before sending it (wait_ready). */
static lk_status broadcast(lk_tracker *t, lk_tracker_stats *st, fuse_job *job) {
    if (t->size == 1) return LK_OK;
    const size_t cap = t->staging_bytes;
    bcast_wait bw = {t, job};
    lk_comm_ready_fn ready = job ? wait_ready : NULL;
    lk_comm_idle_fn idle = job ? idle_step : NULL;
    lk_status s = LK_OK;
    for (int o = 0; o < t->size && !s; o++) {
        size_t used = 0, ns = 0;
        for (size_t c = 0; c < t->n && !s; c++) {
            size_t i = t->ord[c];
            if (t->k[i].owner != o || !changed(t, i)) continue;
            const lk_tensor *w = lk_weights_tensor(t->w, i);
            for (size_t off = 0; off < w->nbytes && !s;) {
                size_t take = w->nbytes - off < cap - used ? w->nbytes - off : cap - used;
                size_t before = ns ? t->seg_need[ns - 1] : 0;
                t->seg_need[ns] = t->need[i] > before ? t->need[i] : before;
                t->segs[ns++] = (lk_comm_seg){(char *)w->data + off, take};
                used += take;
                off += take;
                if (used == cap) {
                    s = send_round(t, ns, o, ready, idle, &bw);
                    st->bytes_broadcast += used;
                    used = ns = 0;
                }
            }
            st->keys_broadcast++;
        }
        if (!s && used) {
            s = send_round(t, ns, o, ready, idle, &bw);
            st->bytes_broadcast += used;
        }
    }
    return s;
}

/* ---- create / free ---- */

static lk_status backup_key(lk_tracker *t, size_t i) {
    const lk_tensor *w = lk_weights_tensor(t->w, i);
    lk_status s = lk_keymem_backup(&t->km, w, &t->k[i].backup);
    if (s) return s;
    t->k[i].pristine = t->km.on_device; /* device weights only: a restore there crosses PCIe */
    t->backup_bytes += w->nbytes;
    return LK_OK;
}

static void drop_backup(lk_tracker *t, size_t i) {
    if (!t->k[i].backup) return;
    lk_keymem_drop(&t->km, lk_weights_tensor(t->w, i), t->k[i].backup);
    t->k[i].backup = NULL;
    t->k[i].pristine = 0;
    t->backup_bytes -= lk_weights_tensor(t->w, i)->nbytes;
}

/* After an agreed failure s (its message in lk_last_error): every owner
 * restores the keys its job wrote (clean bytes from the backup plus the
 * old terms, whose adapters are still open) and drops the backups this
 * call made. With resend (receivers may hold new bytes already), every
 * changed key is then broadcast again from the restored owners, the same
 * rounds as before, so every rank ends with the bytes it had. Returns s
 * with its message, or the transport's error if the resend failed. */
static lk_status rollback(lk_tracker *t, lk_status s, const fuse_job *j, lk_tracker_stats *st, const size_t *fresh,
                          size_t n_fresh, int resend) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", lk_last_error());
    for (size_t p = 0; p < job_taken(j); p++) {
        size_t i = t->seq[p];
        int fused;
        if (!t->k[i].backup || recompute(t, &t->cur, i, j->terms[0], &fused, NULL)) {
            t->broken = 1;
            lk_log(LK_LOG_ERROR, "tracker: %s could not be rolled back; the tracker is now unusable",
                   lk_weights_tensor(t->w, i)->name);
        }
    }
    lk_status c = resend ? broadcast(t, st, NULL) : LK_OK;
    for (size_t k = 0; k < n_fresh; k++) drop_backup(t, fresh[k]);
    if (c) {
        t->broken = 1;
        return lk_error_prefix(c, "tracker: sending the rolled-back keys again after \"%s\"", msg);
    }
    return lk_error(s, "%s", msg);
}

typedef struct key_rank {
    const char *name;
    size_t nbytes, i;
} key_rank;

static int cmp_by_name(const void *a, const void *b) {
    return strcmp(((const key_rank *)a)->name, ((const key_rank *)b)->name);
}

static int cmp_by_size(const void *a, const void *b) {
    const key_rank *x = a, *y = b;
    if (x->nbytes != y->nbytes) return x->nbytes > y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Pairs every FP8 weight with its scale key (lk_fp8_scale_of); a weight
 * whose siblings are refused is marked, and refused only if an adapter
 * touches it. Local and deterministic from the names. */
static void find_scales(lk_tracker *t) {
    for (size_t i = 0; i < t->n; i++) t->k[i].scale = t->k[i].weight = -1;
    for (size_t i = 0; i < t->n; i++) {
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        if (!lk_dtype_is_fp8(w->dtype) || w->ndim < 2) continue;
        long sc = -1;
        if (lk_fp8_scale_of(lk_weights_tensors(t->w), t->n, i, &sc) != LK_OK) {
            t->k[i].fp8_bad = 1;
            continue;
        }
        t->k[i].scale = sc;
        if (sc >= 0) t->k[sc].weight = (long)i;
    }
    lk_error_clear();
}

/* Name order, ownership (largest first onto the least-loaded rank) and the
 * structure hash every rank must share. Local. */
static lk_status plan_keys(lk_tracker *t, uint64_t *shape_hash, int mode) {
    key_rank *kr = lk_calloc(t->n ? t->n : 1, sizeof *kr);
    uint64_t *load = lk_calloc((size_t)t->size, sizeof *load);
    if (!kr || !load) {
        lk_free(kr);
        lk_free(load);
        return lk_error(LK_ERR_NOMEM, "tracker: out of memory planning %zu keys", t->n);
    }
    for (size_t i = 0; i < t->n; i++) {
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        kr[i] = (key_rank){w->name, w->nbytes, i};
    }
    qsort(kr, t->n, sizeof *kr, cmp_by_name);
    XXH3_state_t hs;
    XXH3_64bits_reset(&hs);
    for (size_t c = 0; c < t->n; c++) {
        const lk_tensor *w = lk_weights_tensor(t->w, kr[c].i);
        int32_t hdr[3] = {(int32_t)w->dtype, w->ndim, (int32_t)w->axes}; /* axes: how a PEFT LoRA lands */
        t->ord[c] = kr[c].i;
        XXH3_64bits_update(&hs, w->name, strlen(w->name) + 1);
        XXH3_64bits_update(&hs, hdr, sizeof hdr);
        XXH3_64bits_update(&hs, w->shape, (size_t)w->ndim * sizeof w->shape[0]);
    }
    /* the mode: serial or not changes where the agreement on the fuse
     * sits among the collectives (the automatic choice is agreed apart) */
    uint64_t opts[10] = {t->o.bucket_bytes, t->o.no_lora_swap != 0, t->o.allow_nonfinite != 0,
                         (uint64_t)t->o.fp8.rounding, t->o.fp8.seed, (uint64_t)t->o.fp8.scale, t->o.fp8.saturate != 0,
                         (uint64_t)mode, (uint64_t)t->o.alpha_from, (uint64_t)t->o.convention};
    XXH3_64bits_update(&hs, opts, sizeof opts);
    /* the name tables: the same family and --map paths on every rank (their contents are
     * compared through where each adapter lands, adapter_content) */
    XXH3_64bits_update(&hs, t->o.arch ? t->o.arch : "", t->o.arch ? strlen(t->o.arch) + 1 : 1);
    for (size_t i = 0; i < t->o.n_maps; i++) XXH3_64bits_update(&hs, t->o.maps[i], strlen(t->o.maps[i]) + 1);
    XXH3_64bits_update(&hs, &t->o.n_maps, sizeof t->o.n_maps);
    for (size_t i = 0; i < 2 * t->o.n_tied; i++) XXH3_64bits_update(&hs, t->o.tied[i], strlen(t->o.tied[i]) + 1);
    XXH3_64bits_update(&hs, &t->o.n_tied, sizeof t->o.n_tied);
    *shape_hash = XXH3_64bits_digest(&hs);
    qsort(kr, t->n, sizeof *kr, cmp_by_size);
    for (size_t c = 0; c < t->n; c++) {
        int best = 0;
        for (int r = 1; r < t->size; r++)
            if (load[r] < load[best]) best = r;
        t->k[kr[c].i].owner = best;
        load[best] += kr[c].nbytes;
    }
    for (size_t i = 0; i < t->n; i++) /* a scale goes with its FP8 weight */
        if (t->k[i].weight >= 0) t->k[i].owner = t->k[t->k[i].weight].owner;
    lk_free(kr);
    lk_free(load);
    return LK_OK;
}

/* Whether a fuse worker thread gets a core of its own on this rank: at
 * least two CPUs in this process's affinity mask per rank on this host
 * (ranks counted by host name in hosts[], one hash per rank). Without
 * one, the worker takes turns with the ranks' MPI progress, and a
 * shared-memory broadcast, which needs both ends on a CPU, slows down more
 * than the fuse it hides (README, swap: 2 and 4 ranks on 2 vCPUs). */
static int spare_cores(const uint64_t *hosts, int size, int rank) {
    int local = 0;
    for (int r = 0; r < size; r++) local += hosts[r] == hosts[rank];
    long cpus = 0;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = CPU_COUNT(&set);
    if (cpus <= 0) cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus >= 2L * local;
}

/* Each distinct value of hv[r * stride] (r < size) with the ranks holding
 * it, in order of first appearance, into msg: "rank 0 holds XXH3-64 ...;
 * ranks 1, 2 hold XXH3-64 ..." (kind: the hash's name; at most 8 values
 * and 16 ranks each). */
static void rank_groups(const uint64_t *hv, size_t stride, int size, const char *kind, char *msg, size_t cap) {
    size_t len = 0;
    int groups = 0;
    for (int r = 0; r < size; r++) {
        const uint64_t v = hv[(size_t)r * stride];
        int seen = 0, count = 0, listed = 0;
        for (int q = 0; q < r && !seen; q++) seen = hv[(size_t)q * stride] == v;
        if (seen) continue;
        if (groups++ == 8) {
            lk_appendf(msg, cap, &len, "; ...");
            break;
        }
        for (int q = r; q < size; q++) count += hv[(size_t)q * stride] == v;
        lk_appendf(msg, cap, &len, "%s%s", groups > 1 ? "; " : "", count > 1 ? "ranks " : "rank ");
        for (int q = r; q < size && listed < 16; q++)
            if (hv[(size_t)q * stride] == v) lk_appendf(msg, cap, &len, "%s%d", listed++ ? ", " : "", q);
        lk_appendf(msg, cap, &len, "%s hold%s %s %016llx", count > listed ? ", ..." : "", count > 1 ? "" : "s", kind,
                   (unsigned long long)v);
    }
}

/* After the ranks' hashes of their base weights disagreed: every rank's
 * per-key hashes h[0..n) (name order) gathered by lk_comm_same_bytes_all
 * into one allocation, then the error, the same on every rank, naming how
 * many keys differ, the first of them and which ranks hold which bytes of
 * it. Collective. */
static lk_status base_differs(lk_tracker *t, const uint64_t *h) {
    const size_t n = t->n;
    size_t bytes = 0;
    uint64_t *hv = lk_checked_mul(n, (size_t)t->size * sizeof *hv, &bytes) ? lk_malloc(bytes) : NULL;
    lk_status local = hv ? LK_OK : lk_error(LK_ERR_NOMEM, "tracker: out of memory comparing %zu tensors", n);
    lk_comm_same same;
    lk_status s = lk_comm_same_bytes_all(t->comm, local, h, sizeof *h, n, hv, &same);
    if (!s && same.first == n) s = lk_error(LK_ERR_MISMATCH, "tracker: the ranks' base weights hash differently, yet no "
                                                             "single tensor differs (a hash collision?)");
    if (!s) {
        char msg[1536] = "";
        rank_groups(hv + same.first, n, t->size, lk_keymem_hash_name(&t->km), msg, sizeof msg);
        s = lk_error(LK_ERR_MISMATCH, "tracker: the ranks hold different base weights: %zu of %zu tensors differ; the "
                     "first in byte-wise name order is %s: %s (every rank must load the same base bytes)",
                     same.n_differ, n, lk_weights_tensor(t->w, t->ord[same.first])->name, msg);
    }
    lk_free(hv);
    return s;
}

/* Every rank must hold the same base bytes: each fuses into its own copy
 * and receives the owners' keys, so ranks that loaded different bytes
 * would serve different weights (every step's digests disagreeing). Each
 * rank hashes every tensor (lk_keymem_hash: XXH3-64 on the host, the
 * device fingerprint on a device, the same kind on every rank since the
 * ranks agreed on the device kind; byte-wise name order) and the ranks
 * compare a hash of those hashes (one small agreement); only on a
 * difference do they gather every key's hash from every rank
 * (base_differs), so the error, the same on every rank, names the first
 * differing key and which ranks hold which bytes of it.
 * Collective; local is this rank's status so far (agreed on first). */
static lk_status check_base(lk_tracker *t, lk_status local) {
    const size_t n = t->n;
    uint64_t *h = local ? NULL : lk_malloc((n ? n : 1) * sizeof *h), all = 0;
    if (!local && !h) local = lk_error(LK_ERR_NOMEM, "tracker: out of memory hashing %zu tensors", n);
    const double t0 = lk_now_s();
    if (!local) {
        for (size_t c = 0; c < n && !local; c++) {
            const lk_tensor *w = lk_weights_tensor(t->w, t->ord[c]);
            local = lk_keymem_hash(&t->km, w->data, w->nbytes, &h[c]);
        }
        all = XXH3_64bits(h, n * sizeof *h);
    }
    const double t1 = lk_now_s();
    int same = 1;
    lk_status s = agree_hash(t->comm, local, all, &same);
    lk_log(LK_LOG_DEBUG, "tracker: base check: hashed %zu tensors (%.1f MiB) in %.3f s, agreed in %.3f s", n,
           (double)lk_weights_nbytes(t->w) / 1048576.0, t1 - t0, lk_now_s() - t1);
    if (!s && !same) s = base_differs(t, h);
    lk_free(h);
    return s;
}

void lk_tracker_free(lk_tracker *t) {
    if (!t) return;
    for (size_t i = 0; t->k && i < t->n; i++) lk_keymem_drop(&t->km, lk_weights_tensor(t->w, i), t->k[i].backup);
    lk_keymem_free(&t->km);
    request_clear(&t->cur);
    lk_free(t->key_mem);
    for (size_t i = 0; t->maps && i < t->o.n_maps; i++) lk_free(t->maps[i]);
    lk_free(t->maps);
    for (size_t i = 0; t->tied && i < 2 * t->o.n_tied; i++) lk_free(t->tied[i]);
    lk_free(t->tied);
    lk_free(t->arch);
    lk_free(t->base_label);
    lk_free(t);
}

/* The per-key arrays carved from one zeroed allocation, t->key_mem (freed
 * by lk_tracker_free): ord, k, next, seq, need and seq_done (one entry per
 * key, at least one) and, with more than one rank, the broadcast's segs and
 * seg_need (one per key, plus one). Local. */
static lk_status alloc_keys(lk_tracker *t) {
    const size_t n = t->n ? t->n : 1, nseg = t->size > 1 ? t->n + 1 : 0;
    lk_carve c = {0};
    const size_t o_ord = LK_CARVE(&c, n, size_t), o_k = LK_CARVE(&c, n, key_state),
                 o_next = LK_CARVE(&c, n, uint64_t), o_seq = LK_CARVE(&c, n, size_t),
                 o_need = LK_CARVE(&c, n, size_t), o_segs = LK_CARVE(&c, nseg, lk_comm_seg),
                 o_seg_need = LK_CARVE(&c, nseg, size_t), o_seq_done = LK_CARVE(&c, n, unsigned char);
    char *b = lk_carve_alloc(&c);
    if (!b) return lk_error(LK_ERR_NOMEM, "tracker: out of memory for %zu keys", t->n);
    t->key_mem = b;
    t->ord = (size_t *)(b + o_ord);
    t->k = (key_state *)(b + o_k);
    t->next = (uint64_t *)(b + o_next);
    t->seq = (size_t *)(b + o_seq);
    t->need = (size_t *)(b + o_need);
    t->seq_done = (unsigned char *)(b + o_seq_done);
    if (nseg) {
        t->segs = (lk_comm_seg *)(b + o_segs);
        t->seg_need = (size_t *)(b + o_seg_need);
    }
    return LK_OK;
}

/* Owned copies of opts' arch and maps into t (t->o points at them), then
 * the tables read and checked against the weights' names. Local. */
static lk_status copy_tables(lk_tracker *t, const lk_tracker_opts *opts) {
    t->o.arch = NULL;
    t->o.maps = NULL;
    t->o.n_maps = 0;
    if (opts->n_maps && !opts->maps) return lk_error(LK_ERR_ARG, "tracker: n_maps is %zu but maps is NULL", opts->n_maps);
    if (opts->arch && !(t->o.arch = t->arch = lk_strdup(opts->arch)))
        return lk_error(LK_ERR_NOMEM, "tracker: out of memory");
    if (opts->n_maps) {
        if (!(t->maps = lk_calloc(opts->n_maps, sizeof *t->maps))) return lk_error(LK_ERR_NOMEM, "tracker: out of memory");
        t->o.maps = (const char *const *)t->maps;
        for (; t->o.n_maps < opts->n_maps; t->o.n_maps++) {
            const char *m = opts->maps[t->o.n_maps];
            if (!m) return lk_error(LK_ERR_ARG, "tracker: maps[%zu] is NULL", t->o.n_maps);
            if (!(t->maps[t->o.n_maps] = lk_strdup(m))) return lk_error(LK_ERR_NOMEM, "tracker: out of memory");
        }
    }
    t->o.tied = NULL;
    t->o.n_tied = 0;
    if (opts->n_tied && !opts->tied) return lk_error(LK_ERR_ARG, "tracker: n_tied is %zu but tied is NULL", opts->n_tied);
    if (opts->n_tied) {
        if (opts->n_tied > SIZE_MAX / 2 || !(t->tied = lk_calloc(2 * opts->n_tied, sizeof *t->tied)))
            return lk_error(LK_ERR_NOMEM, "tracker: out of memory");
        t->o.tied = (const char *const *)t->tied;
        for (; t->o.n_tied < opts->n_tied; t->o.n_tied++) {
            for (size_t h = 0; h < 2; h++) {
                const char *m = opts->tied[2 * t->o.n_tied + h];
                char *d = m ? lk_strdup(m) : NULL;
                if (!d) { /* the pair's first string is not yet counted by n_tied */
                    lk_free(t->tied[2 * t->o.n_tied]);
                    t->tied[2 * t->o.n_tied] = NULL;
                    return m ? lk_error(LK_ERR_NOMEM, "tracker: out of memory")
                             : lk_error(LK_ERR_ARG, "tracker: tied[%zu] is NULL", 2 * t->o.n_tied + h);
                }
                t->tied[2 * t->o.n_tied + h] = d;
            }
        }
    }
    lk_resolve_opts ro = {.arch = t->o.arch, .maps = t->o.maps, .n_maps = t->o.n_maps, .tied = t->o.tied,
                              .n_tied = t->o.n_tied};
    return lk_resolve_tables_check(lk_weights_tensors(t->w), t->n, &ro, "tracker");
}

/* Weights on a device: the device usable, where backups go, whether the
 * broadcast goes through a host stage (a communicator that cannot take
 * device memory), and the key memory (serve/keymem.h). *sig gets what the
 * ranks must share (it decides the rounds' shape). Local. */
static lk_status setup_device(lk_tracker *t, uint64_t sig[3]) {
    const lk_device dev = lk_weights_device(t->w);
    const int staged = !(dev.kind == LK_DEVICE_CUDA && lk_comm_takes_cuda(t->comm));
    sig[0] = (uint64_t)dev.kind;
    sig[1] = (uint64_t)staged;
    sig[2] = (uint64_t)t->o.backup;
    if (dev.kind == LK_DEVICE_CPU) return lk_keymem_init(&t->km, dev, 0, 0, 0, 0, 0);
    lk_status s = lk_device_check(dev);
    if (s) return lk_error_prefix(s, "tracker");
    size_t max_key = 0, max_scale = 0;
    for (size_t i = 0; i < t->n; i++) {
        size_t nb = lk_weights_tensor(t->w, i)->nbytes;
        if (t->k[i].weight >= 0) max_scale = nb > max_scale ? nb : max_scale;
        else max_key = nb > max_key ? nb : max_key;
    }
    t->fuse_thread = 0; /* one scratch: the host fallback runs on the calling thread */
    return lk_keymem_init(&t->km, dev, t->o.backup == LK_TRACKER_BACKUP_DEVICE, staged, max_key, max_scale,
                          t->size > 1 ? t->staging_bytes : 0);
}

lk_status lk_tracker_create(lk_comm *group, lk_weights *weights, const lk_tracker_opts *opts, lk_tracker **out) {
    return lk_tracker_create_ex(group, weights, opts, 0, out);
}

lk_status lk_tracker_create_ex(lk_comm *group, lk_weights *weights, const lk_tracker_opts *opts, int mode,
                               lk_tracker **out) {
    uint64_t *hosts = NULL; /* one host-name hash per rank (spare_cores) */
    if (!group || !out) return lk_error(LK_ERR_ARG, "lk_tracker_create: NULL group or output");
    *out = NULL;
    lk_status local = LK_OK;
    lk_tracker *t = lk_calloc(1, sizeof *t);
    uint64_t shape_hash = 0;
    if (!t) local = lk_error(LK_ERR_NOMEM, "tracker: out of memory");
    else if (!weights || !opts) local = lk_error(LK_ERR_ARG, "lk_tracker_create: NULL weights or options");
    else if (opts->threads < 0) local = lk_error(LK_ERR_ARG, "tracker: threads must be >= 0 (got %d)", opts->threads);
    else if ((int)opts->alpha_from < 0 || opts->alpha_from >= LK_ALPHA_COUNT)
        local = lk_error(LK_ERR_ARG, "tracker: invalid alpha source %d", (int)opts->alpha_from);
    else if ((int)opts->convention < 0 || opts->convention >= LK_CONVENTION_COUNT)
        local = lk_error(LK_ERR_ARG, "tracker: invalid convention %d", (int)opts->convention);
    else if (mode & ~(LK_TRACKER_SERIAL | LK_TRACKER_OVERLAP))
        local = lk_error(LK_ERR_ARG, "tracker: unknown mode bits in %d", mode);
    else if ((mode & LK_TRACKER_SERIAL) && (mode & LK_TRACKER_OVERLAP))
        local = lk_error(LK_ERR_ARG, "tracker: mode %d asks for both serial and overlap", mode);
    else if ((unsigned)opts->backup > LK_TRACKER_BACKUP_DEVICE)
        local = lk_error(LK_ERR_ARG, "tracker: invalid backup place %d (host or device)", (int)opts->backup);
    if (!local) {
        t->comm = group;
        t->w = weights;
        t->o = *opts;
        t->o.base_label = NULL;
        if (opts->base_label && !(t->base_label = lk_strdup(opts->base_label)))
            local = lk_error(LK_ERR_NOMEM, "tracker: out of memory");
        if (!t->o.bucket_bytes) t->o.bucket_bytes = LK_TRACKER_BUCKET_DEFAULT;
        t->serial = (mode & LK_TRACKER_SERIAL) != 0;
        t->rank = lk_comm_rank(group);
        t->size = lk_comm_size(group);
        t->n = lk_weights_count(weights);
        if (!local) local = alloc_keys(t);
    }
    if (!local) local = copy_tables(t, opts);
    if (!local) find_scales(t);
    if (!local) local = plan_keys(t, &shape_hash, mode);
    if (!local && !(hosts = lk_calloc((size_t)t->size, sizeof *hosts)))
        local = lk_error(LK_ERR_NOMEM, "tracker: out of memory for %d ranks", t->size);
    if (!local && t->size > 1) {
        size_t total = lk_weights_nbytes(weights);
        size_t cap = t->o.bucket_bytes;
        t->staging_bytes = cap < total ? cap : (total ? total : 1);
    }
    uint64_t dev_sig[3] = {0, 0, 0};
    if (!local) local = setup_device(t, dev_sig);
    shape_hash = XXH3_64bits_withSeed(dev_sig, sizeof dev_sig, shape_hash);
    int same = 1;
    lk_status s = agree_hash(group, local, shape_hash, &same);
    if (!s && !same)
        s = lk_error(LK_ERR_MISMATCH, "tracker: ranks hold different weights (names, dtypes, shapes) or options "
                                      "(bucket_bytes %zu, no_lora_swap %d, mode %d, allow_nonfinite %d, convention %s, arch %s, "
                                      "%zu --map files, device kind %d, %s broadcast, backup %d on rank %d)",
                     t->o.bucket_bytes, opts->no_lora_swap, mode, opts->allow_nonfinite,
                     lk_convention_name(opts->convention), t->o.arch ? t->o.arch : "(auto)", t->o.n_maps,
                     (int)dev_sig[0], dev_sig[1] ? "staged" : "direct", (int)dev_sig[2], t->rank);
    if (!s && t->size > 1) s = check_base(t, LK_OK);
    if (!s && t->size > 1 && !(mode & LK_TRACKER_SERIAL)) {
        /* a fuse worker thread when forced, else where this rank has a spare core */
        char host[256] = {0};
        gethostname(host, sizeof host - 1);
        uint64_t h = XXH3_64bits(host, strlen(host));
        s = lk_comm_allgather(group, &h, sizeof h, hosts);
        /* local: the worker thread changes no collective */
        t->fuse_thread = !t->km.on_device && ((mode & LK_TRACKER_OVERLAP) || (!s && spare_cores(hosts, t->size, t->rank)));
    }
    lk_free(hosts);
    if (s) {
        lk_tracker_free(t);
        return s == LK_ERR_TIMEOUT ? lk_error_prefix(s, "tracker create") : s;
    }
    *out = t;
    return LK_OK;
}

/* ---- apply ---- */

lk_status lk_tracker_apply(lk_tracker *t, const lk_fuse_input *loras, size_t n, lk_tracker_stats *stats) {
    return lk_tracker_apply_src(t, loras, NULL, n, stats);
}

/* One apply's state, shared by its steps. The scratch is one allocation
 * (apply_scratch): both threads' term lists and the keys this call backs
 * up. The apply frees the scratch and the request (unless the tracker took
 * it: apply_change's commit). */
typedef struct apply_op {
    lk_tracker *t;
    lk_tracker_stats *st;
    request req;
    void *scratch;          /* the one allocation terms and fresh are carved from */
    lk_fuse_term *terms;    /* 2 * max_terms: the main thread's, then the worker's */
    size_t max_terms;
    size_t *fresh, n_fresh; /* keys this call backed up: dropped again on a failure */
    const char *phase;      /* names a collective that times out */
    double t0;
    int stale;              /* some rank found a file of the current set changed (or racy) since it was read */
} apply_op;

/* Every key the tracker wrote still holds the bytes it last wrote (their
 * lk_keymem_hash, kept at each apply): else the caller changed the weights
 * behind its back (load_state_dict into the same memory), and restoring
 * or fusing from the backup would mix two bases. Local; cost: hashing the
 * touched keys once (on a device where they are: 8 bytes per key copied). */
static lk_status weights_check(const lk_tracker *t) {
    for (size_t c = 0; c < t->n; c++) {
        const size_t i = t->ord[c];
        if (!t->k[i].has_wrote) continue;
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        uint64_t h;
        lk_status s = lk_keymem_hash(&t->km, w->data, w->nbytes, &h); /* host or device memory */
        if (s) return s;
        if (h != t->k[i].wrote)
            return lk_error(LK_ERR_STATE, "the model's weights were changed outside the tracker: make a new Tracker "
                            "(%s: %s holds %s %016llx, the tracker last wrote %016llx)", base_name(t), w->name,
                            lk_keymem_hash_name(&t->km), (unsigned long long)h, (unsigned long long)t->k[i].wrote);
    }
    return LK_OK;
}

/* The ranks' requests differ (every rank knows it): every rank's error
 * names rank 0's request and the first rank's whose request hash differs
 * from rank 0's, with what each asked for (two broadcasts of the
 * descriptions: the failure path only). A collective that fails on the way
 * is the error instead. */
static lk_status request_mismatch(const lk_tracker *t, const request *req) {
    enum { DESC = 512 };
    const int size = lk_comm_size(t->comm);
    uint64_t *h = lk_malloc((size_t)size * sizeof *h);
    char *d = lk_malloc(2 * DESC);
    lk_status s = h && d ? lk_comm_allgather(t->comm, &req->hash, sizeof req->hash, h)
                         : lk_error(LK_ERR_NOMEM, "tracker: out of memory naming the ranks' requests");
    int other = 1;
    while (!s && other < size - 1 && h[other] == h[0]) other++;
    if (!s) { /* rank 0's and the first differing rank's descriptions, on every rank */
        request_describe(req, d + (t->rank == 0 ? 0 : DESC), DESC);
        if (!(s = lk_comm_bcast(t->comm, d, DESC, 0))) s = lk_comm_bcast(t->comm, d + DESC, DESC, other);
    }
    if (!s) {
        d[DESC - 1] = d[2 * DESC - 1] = '\0';
        s = lk_error(LK_ERR_MISMATCH, "ranks disagree on the adapter request: rank 0 asked for %s; rank %d asked for "
                     "%s (this is rank %d)", d, other, d + DESC, t->rank);
    }
    lk_free(h);
    lk_free(d);
    return s;
}

/* Step 1: makes the request (local), checks the weights are as the
 * tracker left them, and agrees on both (and on whether a file of the
 * current set changed: a->stale): a rank whose request differs is every
 * rank's error, naming this rank's request. */
static lk_status apply_agree_request(apply_op *a, const lk_fuse_input *loras, const lk_adapter_source *const *sources,
                                     size_t n) {
    lk_tracker *t = a->t;
    lk_status local = t->broken ? lk_error(LK_ERR_STATE, "tracker is unusable after a failed rollback, "
                                                      "transport or timeout")
                                : request_make(loras, sources, n, &a->req);
    if (!local) local = lk_cancel_check(t->o.cancel, "tracker apply");
    if (!local) local = weights_check(t);
    /* a file of the current set rewritten since it was read: read again, never skipped */
    const int stale = !local && request_equal(&a->req, &t->cur) && request_stale(&t->cur);
    uint64_t v[3] = {a->req.hash, ~a->req.hash, !stale}; /* agree_hash's pair, and min(!stale): 0 if any rank's */
    lk_status s = lk_comm_agree_min(t->comm, local, v, 3);
    const int same = v[0] == ~v[1];
    a->stale = v[2] == 0;
    if (!s && !same) s = request_mismatch(t, &a->req);
    a->st->backup_bytes = t->backup_bytes;
    a->st->seconds_agree = lk_now_s() - a->t0;
    return s;
}

/* The apply's scratch from one zeroed allocation (a->scratch): both
 * threads' term lists (max_terms each: row slices of the larger of the new
 * and the current request, whose terms a rollback recomputes) and fresh
 * (one entry per key). */
static lk_status apply_scratch(apply_op *a) {
    const size_t n_ad = a->req.n > a->t->cur.n ? a->req.n : a->t->cur.n;
    a->max_terms = (n_ad + 1) * LK_ADAPTER_MAX_SLICES; /* row slices */
    lk_carve c = {0};
    const size_t o_terms = LK_CARVE(&c, 2 * a->max_terms, lk_fuse_term),
                 o_fresh = LK_CARVE(&c, a->t->n ? a->t->n : 1, size_t);
    char *b = lk_carve_alloc(&c);
    if (!b) return lk_error(LK_ERR_NOMEM, "tracker apply: out of memory");
    a->scratch = b;
    a->terms = (lk_fuse_term *)(b + o_terms);
    a->fresh = (size_t *)(b + o_fresh);
    return LK_OK;
}

/* no_lora_swap has no backup to roll back to: each owned changed key is
 * fused once into scratch first, so a failing term is found before
 * anything is written. The scratch is one allocation: room for the largest
 * such key, then for the largest FP8 scale (an FP8 weight is tried with its
 * scale). Local; writes no weight. */
static lk_status trial_fuse(lk_tracker *t, const request *r, lk_fuse_term *terms) {
    size_t big = 0, big_scale = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (t->k[i].owner != t->rank || !t->next[i]) continue;
        size_t nb = lk_weights_tensor(t->w, i)->nbytes, sb = 0;
        if (t->k[i].weight < 0 && t->k[i].scale >= 0) sb = lk_weights_tensor(t->w, (size_t)t->k[i].scale)->nbytes;
        big = nb > big ? nb : big;
        big_scale = sb > big_scale ? sb : big_scale;
    }
    lk_carve c = {0};
    lk_carve_part(&c, big, 1, 1); /* the key, at offset 0 */
    const size_t o_scale = lk_carve_part(&c, big_scale, 1, _Alignof(max_align_t));
    unsigned char *scratch = big ? (unsigned char *)lk_carve_alloc(&c) : NULL;
    if (big && !scratch) return lk_error(LK_ERR_NOMEM, "tracker apply: out of memory (%zu bytes)", c.bytes);
    lk_status local = LK_OK;
    for (size_t i = 0; !local && i < t->n; i++) {
        if (t->k[i].owner != t->rank || !t->next[i]) continue;
        if (t->k[i].weight >= 0) continue; /* a scale: tried with its weight */
        const lk_tensor *w = lk_weights_tensor(t->w, i);
        lk_fuse_opts fo = {.threads = t->o.threads, .allow_nonfinite = t->o.allow_nonfinite, .fp8 = t->o.fp8,
                       .convention = t->o.convention, .cancel = t->o.cancel}; /* scratch only: cancellable */
        lk_fuse_key plan;
        local = key_terms(t, r, i, terms, &plan);
        if (!local && lk_dtype_is_fp8(w->dtype)) {
            const lk_tensor *sc = t->k[i].scale >= 0 ? lk_weights_tensor(t->w, (size_t)t->k[i].scale) : NULL;
            unsigned char *sbuf = sc ? scratch + o_scale : NULL;
            local = lk_keymem_read(&t->km, scratch, w->data, w->nbytes);
            if (!local && sc) local = lk_keymem_read(&t->km, sbuf, sc->data, sc->nbytes);
            if (!local) local = lk_fuse_fp8(scratch, w->dtype, w->shape[0], (int64_t)(lk_tensor_numel(w) / (size_t)w->shape[0]), sbuf,
                                sc ? sc->dtype : LK_DTYPE_F32, sc ? (int64_t)lk_tensor_numel(sc) : 0, terms, plan.n_terms,
                                &fo, w->name);
        } else if (!local && t->km.on_device) { /* the device's bytes read to the host, fused there */
            lk_tensor h = *w;
            h.data = scratch;
            h.device = (lk_device){LK_DEVICE_CPU, 0};
            local = lk_keymem_read(&t->km, scratch, w->data, w->nbytes);
            if (!local) local = lk_fuse_key_apply(scratch, scratch, &h, &plan, terms, &fo);
        } else if (!local)
            local = lk_fuse_key_apply(scratch, w->data, w, &plan, terms, &fo);
    }
    lk_free(scratch);
    return local;
}

/* Step 3 (local, no collective): the scratch, the adapters opened and
 * resolved, every key's new signature (t->next), a backup of each owned
 * key the request touches first (listed in fresh), and under no_lora_swap
 * a trial fuse. Returns this rank's status, for apply_agree_loaded. */
static lk_status apply_prepare(apply_op *a) {
    lk_tracker *t = a->t;
    lk_status local = apply_scratch(a);
    if (!local) local = request_load(t, &a->req);
    if (!local) local = key_signatures(t, &a->req, a->terms);
    if (!local) local = lk_cancel_check(t->o.cancel, "tracker apply");
    for (size_t i = 0; !local && i < t->n; i++) {
        if (t->k[i].owner != t->rank || !t->next[i] || t->k[i].backup || t->o.no_lora_swap) continue;
        local = backup_key(t, i);
        if (!local) a->fresh[a->n_fresh++] = i;
    }
    if (!local && t->o.no_lora_swap) local = trial_fuse(t, &a->req, a->terms);
    return local;
}

/* Step 3's agreement: every rank's status, and the keys' new signatures in
 * name order (file order may differ between ranks); on a failure the
 * backups this call made are dropped. Fills the load and agreement times. */
static lk_status apply_agree_loaded(apply_op *a, lk_status local) {
    lk_tracker *t = a->t;
    const double t1 = lk_now_s();
    a->phase = "agreeing on the adapters loaded";
    XXH3_state_t hs;
    XXH3_64bits_reset(&hs);
    for (size_t c = 0; c < t->n; c++) XXH3_64bits_update(&hs, &t->next[t->ord[c]], sizeof t->next[0]);
    int same = 1;
    lk_status s = agree_hash(t->comm, local, XXH3_64bits_digest(&hs), &same);
    if (!s && !same)
        s = lk_error(LK_ERR_MISMATCH, "ranks read different adapter contents or resolved them onto "
                                      "different weights (do the adapter files differ between ranks?)");
    a->st->seconds_load = t1 - a->t0 - a->st->seconds_agree;
    a->st->seconds_agree += lk_now_s() - t1;
    for (size_t j = 0; s && j < a->n_fresh; j++) drop_backup(t, a->fresh[j]);
    return s;
}

/* Steps 4-5, serial (or one rank): every changed key fused, the ranks
 * agree, then one broadcast; a failed fuse rolls back before anything was
 * sent. A failed broadcast leaves the tracker broken. */
static lk_status fuse_then_send(apply_op *a, fuse_job *job, double t1) {
    lk_tracker *t = a->t;
    job_wait(job, job->n_seq);
    a->st->seconds_fuse = lk_now_s() - t1;
    a->phase = "agreeing on the fuse";
    lk_status s = lk_comm_agree(t->comm, job_verdict(job));
    if (s) return rollback(t, s, job, a->st, a->fresh, a->n_fresh, 0);
    const double t2 = lk_now_s();
    a->phase = "broadcasting the changed keys";
    s = broadcast(t, a->st, NULL);
    a->st->seconds_broadcast = lk_now_s() - t2;
    if (s) t->broken = 1;
    return s;
}

/* Steps 4-5, overlapped: the broadcast takes each key as its owner fuses it
 * (a worker thread helps where this rank has a spare core), then the ranks
 * agree on the fuse. Receivers may already hold new bytes: on a failure
 * every owner rolls back and every changed key is sent again. A failed
 * transport leaves the tracker broken (receivers hold what they got). */
static lk_status fuse_while_sending(apply_op *a, fuse_job *job, double t1) {
    lk_tracker *t = a->t;
    pthread_t tid;
    int threaded = t->fuse_thread && job->n_seq > 1 && pthread_create(&tid, NULL, job_main, job) == 0;
    a->phase = "broadcasting the changed keys";
    lk_status s = broadcast(t, a->st, job); /* no thread: the main thread fuses each key when it is due */
    if (threaded) pthread_join(tid, NULL);
    job_wait(job, job->n_seq); /* keys no piece waited for (0 bytes) */
    a->st->seconds_fuse = job->t_end - job->t0;
    a->st->seconds_broadcast = lk_now_s() - t1;
    if (s) {
        t->broken = 1;
        return s;
    }
    a->phase = "agreeing on the fuse";
    s = lk_comm_agree(t->comm, job_verdict(job));
    if (s && s != LK_ERR_TIMEOUT) s = rollback(t, s, job, a->st, a->fresh, a->n_fresh, 1); /* a timeout: no group to resend over */
    return s;
}

/* Steps 4-5: the owners recompute the changed keys and every rank gets
 * them (fuse_then_send or fuse_while_sending); on a failure anywhere,
 * every owner has rolled back (rollback). Fills the fuse figures. */
static lk_status apply_fuse_send(apply_op *a) {
    lk_tracker *t = a->t;
    const double t1 = lk_now_s();
    fuse_job job;
    job_init(&job, t, &a->req, a->terms, a->terms + a->max_terms);
    lk_status s = t->serial || t->size == 1 ? fuse_then_send(a, &job, t1) : fuse_while_sending(a, &job, t1);
    a->st->keys_fused = s ? 0 : job.fused;
    a->st->keys_restored = s ? 0 : job.restored;
    job_destroy(&job);
    return s;
}

/* A changed request: steps 3 to 5, then the commit (cannot fail): the
 * keys' new signatures, and the tracker takes the request (a->req emptied;
 * the old set's adapters, kept open for a rollback, are closed). */
static lk_status apply_change(apply_op *a) {
    lk_status s = apply_agree_loaded(a, apply_prepare(a));
    lk_tracker *t = a->t;
    size_t moved = 0; /* keys whose terms change (agreed: the signatures are) */
    for (size_t i = 0; !s && i < t->n; i++) moved += changed(t, i);
    if (!s && moved && t->o.no_lora_swap && t->cur.n) /* a file of the set rewritten: no backup to redo it from */
        s = lk_error(LK_ERR_STATE, "no_lora_swap tracker cannot change its adapters (a file of its set changed "
                                   "since it was read): it has no backup of the clean weights");
    if (!s) s = apply_fuse_send(a);
    if (s) return s;
    a->st->adapters_changed = request_changed(&a->req, &t->cur);
    a->st->skipped = !moved && request_equal(&a->req, &t->cur); /* read again, the same content */
    for (size_t i = 0; i < t->n; i++) {
        if (changed(t, i)) { /* what every rank holds now: checked before the next call */
            const lk_tensor *w = lk_weights_tensor(t->w, i);
            t->k[i].has_wrote = lk_keymem_hash(&t->km, w->data, w->nbytes, &t->k[i].wrote) == LK_OK;
            if (!t->k[i].has_wrote) /* a device copy failed: this key goes unchecked, said */
                lk_log(LK_LOG_WARN, "tracker: %s: %s: not hashed (%s); a change behind the tracker will not be "
                       "noticed on it", base_name(t), w->name, lk_last_error());
        }
        t->k[i].sig = t->next[i];
        t->k[i].pristine = 0; /* "backed up in this call" only */
    }
    request_clear(&t->cur);
    t->cur = a->req;
    memset(&a->req, 0, sizeof a->req);
    return LK_OK;
}

lk_status lk_tracker_apply_src(lk_tracker *t, const lk_fuse_input *loras, const lk_adapter_source *const *sources,
                               size_t n, lk_tracker_stats *stats) {
    lk_tracker_stats st_local;
    lk_tracker_stats *st = stats ? stats : &st_local;
    memset(st, 0, sizeof *st);
    if (!t) return lk_error(LK_ERR_ARG, "lk_tracker_apply: NULL tracker");
    apply_op a = {.t = t, .st = st, .phase = "agreeing on the request", .t0 = lk_now_s()};
    t->fused_on_host = 0;
    lk_status s = apply_agree_request(&a, loras, sources, n);
    /* 2. skip an unchanged set; no_lora_swap refuses any change */
    if (!s && request_equal(&a.req, &t->cur) && !a.stale)
        st->skipped = 1;
    else if (!s && t->o.no_lora_swap && t->cur.n && !a.stale)
        s = lk_error(LK_ERR_STATE, "no_lora_swap tracker cannot %s: it has no backup of the clean weights",
                     a.req.n ? "change its adapters" : "reset");
    else if (!s)
        s = apply_change(&a);
    lk_free(a.scratch);
    request_clear(&a.req);
    st->backup_bytes = t->backup_bytes;
    st->device_bytes = lk_keymem_device_bytes(&t->km);
    st->pinned_bytes = t->km.pinned_bytes;
    st->keys_fused_on_host = t->fused_on_host;
    st->seconds = lk_now_s() - a.t0;
    if (s == LK_ERR_TIMEOUT) { /* the group is gone (comm.h) */
        t->broken = 1;
        lk_error_prefix(s, "tracker apply: %s", a.phase);
    }
    return s;
}

lk_status lk_tracker_set_stream(lk_tracker *t, lk_stream *s) {
    if (!t) return lk_error(LK_ERR_ARG, "tracker set stream: NULL tracker");
    if (s && t->km.on_device && !lk_device_equal(lk_stream_device(s), t->km.dev)) {
        char a[LK_DEVICE_STR_MAX], b[LK_DEVICE_STR_MAX];
        return lk_error(LK_ERR_ARG, "tracker: the stream belongs to %s, the weights are on %s",
                        lk_device_str(lk_stream_device(s), a), lk_device_str(t->km.dev, b));
    }
    t->km.stream = t->km.on_device ? s : NULL;
    return LK_OK;
}

lk_status lk_tracker_reset(lk_tracker *t, lk_tracker_stats *stats) { return lk_tracker_apply(t, NULL, 0, stats); }

int lk_tracker_owner(const lk_tracker *t, size_t i) { return (t && i < t->n) ? t->k[i].owner : -1; }

size_t lk_tracker_applied(const lk_tracker *t) { return t ? t->cur.n : 0; }

size_t lk_tracker_staging_bytes(const lk_tracker *t) { return t ? t->staging_bytes : 0; }

int lk_tracker_overlaps(const lk_tracker *t) { return !t || t->size == 1 || t->serial ? 0 : 1 + t->fuse_thread; }
