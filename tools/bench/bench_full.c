/* bench_full.c — the `full` baseline of `lorakit bench swap`: what the
 * reference's tracker (LTX) does for every change of adapter set, built from
 * the library's public calls. Every owned key is cloned when the tracker is
 * made, restored from its clone on every change and, where the new set
 * touches it, fused in place; then every key is broadcast, owner by owner,
 * after all of them are fused (no overlap). The bytes are the delta
 * tracker's (same plan, same kernel; bench swap checks the digests), the
 * work is all of it: the benchmark's swap_delta_over_full is the ratio.
 * Moved here from the library's tracker (issue 22 item 8), where it was a
 * mode nothing else used. */
#include "bench_full.h"

#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

struct lk_bench_full {
    lk_comm *c;
    lk_weights *w;
    lk_tracker *t;          /* ownership and the base check */
    lk_tracker_opts o;
    size_t n, *ord;         /* keys in byte-wise name order */
    void **clone;           /* per key: the clean bytes (owner only) */
    uint64_t backup_bytes;
    lk_comm_seg *segs;      /* one broadcast round */
};

void lk_bench_full_free(lk_bench_full *f) {
    if (!f) return;
    for (size_t i = 0; f->clone && i < f->n; i++) lk_free(f->clone[i]);
    lk_free(f->clone);
    lk_free(f->ord);
    lk_free(f->segs);
    lk_tracker_free(f->t);
    lk_free(f);
}

static const lk_weights *g_sort_w; /* qsort has no context argument */
static int by_name(const void *a, const void *b) {
    return strcmp(lk_weights_tensor(g_sort_w, *(const size_t *)a)->name,
                  lk_weights_tensor(g_sort_w, *(const size_t *)b)->name);
}

lk_status lk_bench_full_create(lk_comm *c, lk_weights *w, const lk_tracker_opts *opts, lk_bench_full **out) {
    *out = NULL;
    lk_bench_full *f = lk_calloc(1, sizeof *f);
    if (!f) return lk_error(LK_ERR_NOMEM, "bench full: out of memory");
    f->c = c;
    f->w = w;
    f->o = *opts;
    f->n = lk_weights_count(w);
    lk_status s = lk_tracker_create(c, w, opts, &f->t);
    lk_status local = LK_OK;
    if (!s) {
        f->ord = lk_calloc(f->n + 1, sizeof *f->ord);
        f->clone = lk_calloc(f->n + 1, sizeof *f->clone);
        f->segs = lk_calloc(f->n + 1, sizeof *f->segs);
        if (!f->ord || !f->clone || !f->segs) local = lk_error(LK_ERR_NOMEM, "bench full: out of memory");
    }
    for (size_t i = 0; !s && !local && i < f->n; i++) {
        f->ord[i] = i;
        const lk_tensor *x = lk_weights_tensor(w, i);
        if (lk_tracker_owner(f->t, i) != lk_comm_rank(c)) continue;
        if (!(f->clone[i] = lk_malloc(x->nbytes ? x->nbytes : 1))) {
            local = lk_error(LK_ERR_NOMEM, "bench full: out of memory cloning %s", x->name);
            break;
        }
        memcpy(f->clone[i], x->data, x->nbytes);
        f->backup_bytes += x->nbytes;
    }
    if (!s && !local) {
        g_sort_w = w;
        qsort(f->ord, f->n, sizeof *f->ord, by_name);
    }
    if (!s) s = lk_comm_agree(c, local);
    if (s) {
        lk_bench_full_free(f);
        return s;
    }
    *out = f;
    return LK_OK;
}

size_t lk_bench_full_staging_bytes(const lk_bench_full *f) { return lk_tracker_staging_bytes(f->t); }

/* Opens and resolves every adapter (every rank: each plans its own keys),
 * in lk_fuse_canonical_order as every fuse of a set does. */
static lk_status load(const lk_bench_full *f, const lk_fuse_input *in, size_t n, lk_adapter **ad, double *strength) {
    size_t *order = lk_calloc(n + 1, sizeof *order);
    if (!order) return lk_error(LK_ERR_NOMEM, "bench full: out of memory");
    lk_fuse_canonical_order(in, n, order);
    lk_status s = LK_OK;
    for (size_t k = 0; !s && k < n; k++) {
        const lk_fuse_input *e = &in[order[k]];
        lk_adapter_opts ao = {.format = e->format, .alpha_from = f->o.alpha_from, .convention = f->o.convention};
        lk_resolve_opts ro = {.arch = f->o.arch, .maps = f->o.maps, .n_maps = f->o.n_maps};
        s = lk_fuse_input_open(e, NULL, &ao, &ad[k]);
        if (!s) s = lk_adapter_resolve_opts(ad[k], lk_weights_tensors(f->w), f->n, &ro, NULL);
        strength[k] = e->strength;
    }
    lk_free(order);
    return s;
}

/* Every owned key restored from its clone, then fused in place where the
 * set touches it. */
static lk_status refuse(const lk_bench_full *f, lk_adapter *const *ad, const double *strength, size_t n,
                        lk_fuse_term *terms, lk_tracker_stats *st) {
    const lk_fuse_opts fo = {.threads = f->o.threads, .allow_nonfinite = f->o.allow_nonfinite, .fp8 = f->o.fp8,
                             .convention = f->o.convention};
    for (size_t c = 0; c < f->n; c++) {
        const size_t i = f->ord[c];
        const lk_tensor *x = lk_weights_tensor(f->w, i);
        if (!f->clone[i]) continue;
        memcpy(x->data, f->clone[i], x->nbytes);
        lk_fuse_key plan = {0};
        lk_status s = n ? lk_fuse_key_plan(ad, strength, n, x, terms, &plan) : LK_OK;
        if (!s && lk_fuse_key_touches(&plan)) {
            s = lk_fuse_key_apply(x->data, x->data, x, &plan, terms, &fo);
            st->keys_fused++;
        } else {
            st->keys_restored++;
        }
        if (s) return s;
    }
    return LK_OK;
}

/* Every key, owner by owner, in rounds of at most the staging size. */
static lk_status broadcast_all(const lk_bench_full *f, lk_tracker_stats *st) {
    const int size = lk_comm_size(f->c);
    const size_t cap = lk_tracker_staging_bytes(f->t);
    lk_status s = LK_OK;
    for (int o = 0; size > 1 && o < size && !s; o++) {
        size_t used = 0, ns = 0;
        for (size_t c = 0; c < f->n && !s; c++) {
            const size_t i = f->ord[c];
            if (lk_tracker_owner(f->t, i) != o) continue;
            const lk_tensor *x = lk_weights_tensor(f->w, i);
            for (size_t off = 0; off < x->nbytes && !s;) {
                const size_t take = x->nbytes - off < cap - used ? x->nbytes - off : cap - used;
                f->segs[ns++] = (lk_comm_seg){(char *)x->data + off, take};
                used += take;
                off += take;
                if (used == cap) {
                    s = lk_comm_bcastv(f->c, f->segs, ns, o);
                    st->bytes_broadcast += used;
                    used = ns = 0;
                }
            }
            st->keys_broadcast++;
        }
        if (!s && used) {
            s = lk_comm_bcastv(f->c, f->segs, ns, o);
            st->bytes_broadcast += used;
        }
    }
    return s;
}

lk_status lk_bench_full_apply(lk_bench_full *f, const lk_fuse_input *in, size_t n, lk_tracker_stats *st) {
    memset(st, 0, sizeof *st);
    const double t0 = lk_now_s();
    lk_adapter **ad = lk_calloc(n + 1, sizeof *ad);
    double *strength = lk_calloc(n + 1, sizeof *strength);
    const size_t max_terms = (n + 1) * LK_ADAPTER_MAX_SLICES;
    lk_fuse_term *terms = lk_calloc(max_terms, sizeof *terms);
    lk_status local = ad && strength && terms ? load(f, in, n, ad, strength)
                                              : lk_error(LK_ERR_NOMEM, "bench full: out of memory");
    const double t1 = lk_now_s();
    lk_status s = lk_comm_agree(f->c, local);
    const double t2 = lk_now_s();
    if (!s) s = lk_comm_agree(f->c, refuse(f, ad, strength, n, terms, st));
    const double t3 = lk_now_s();
    if (!s) s = broadcast_all(f, st);
    const double t4 = lk_now_s();
    for (size_t i = 0; ad && i < n; i++) lk_adapter_free(ad[i]);
    lk_free(ad);
    lk_free(strength);
    lk_free(terms);
    st->backup_bytes = f->backup_bytes;
    st->seconds_load = t1 - t0;
    st->seconds_agree = t2 - t1;
    st->seconds_fuse = t3 - t2;
    st->seconds_broadcast = t4 - t3;
    st->seconds = t4 - t0;
    return s;
}
