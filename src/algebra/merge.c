/* merge.c — lk_merge / lk_resize: open the inputs, put them in a canonical
 * order (by content digest, then strength), gather each output module's
 * terms, run the modules over threads (each module wholly on one thread,
 * so the bytes do not depend on the thread count), write the output
 * (write.c) and the report. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "algebra/algebra_int.h"
#include "core/clock.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/digest.h"
#include "lorakit/log.h"
#include "lorakit/safetensors.h"

/* The digest that orders an input: its tensors' content digest, and its
 * adapter_config.json's bytes (a PEFT folder's alpha lives there). */
lk_status lk_alg_input_digest(const lk_adapter *a, char *hex, size_t cap) {
    lk_st *st = NULL;
    char d[LK_DIGEST_HEX];
    lk_status s = lk_st_open(lk_adapter_file(a), &st);
    if (!s) s = lk_digest_st(st, d);
    lk_st_close(st);
    if (s) return s;
    unsigned long long ch = 0;
    const char *cp = lk_adapter_config_file(a);
    if (cp) {
        char *buf = NULL;
        size_t n = 0;
        if ((s = lk_read_config(cp, &buf, &n))) return s;
        ch = (unsigned long long)XXH3_64bits(buf, n);
        lk_free(buf);
    }
    snprintf(hex, cap, cp ? "%s-%016llx" : "%s", d, ch);
    return LK_OK;
}

static int input_cmp(const void *pa, const void *pb) {
    const lk_alg_input *a = pa, *b = pb;
    int c = strcmp(a->digest, b->digest);
    if (c) return c;
    return a->strength < b->strength ? -1 : a->strength > b->strength;
}

/* A module reference: (name, input, index) for the union. */
typedef struct mref {
    const char *name;
    size_t input, idx;
} mref;

static int mref_cmp(const void *pa, const void *pb) {
    const mref *a = pa, *b = pb;
    int c = strcmp(a->name, b->name);
    if (c) return c;
    return a->input < b->input ? -1 : a->input > b->input;
}

/* The delta's trailing dims of m: [in, kh, kw] when the file shows them, else [N]. */
static void delta_tail(const lk_lora_module *m, int64_t *tail, int *nt) {
    const lk_tensor *src = NULL, *kern = NULL;
    int64_t lead = 1;
    if (m->algo == LK_ALGO_LORA) src = m->mid.data ? &m->A : &m->A, kern = m->mid.data ? &m->mid : NULL;
    else if (m->algo == LK_ALGO_LOHA) src = &m->w1b, kern = m->t1.data ? &m->t1 : NULL;
    else if (m->algo == LK_ALGO_LOKR) {
        lead = m->w1.data ? m->w1.shape[1] : m->w1b.shape[1];
        src = m->w2.data ? &m->w2 : &m->w2b;
        kern = m->t2.data ? &m->t2 : NULL;
        if (m->w2.data) { /* w2 [c, d, kh, kw]: its dims after the first */
            tail[0] = lead * (src->ndim > 1 ? src->shape[1] : 1);
            *nt = 1;
            for (int d = 2; d < src->ndim; d++) tail[(*nt)++] = src->shape[d];
            if (src->ndim < 2) tail[0] = m->in, *nt = 1;
            return;
        }
    }
    if (kern) {
        tail[0] = lead * src->shape[1];
        *nt = 1;
        for (int d = 2; d < kern->ndim; d++) tail[(*nt)++] = kern->shape[d];
        return;
    }
    *nt = 1;
    tail[0] = lead * (src && src->ndim > 1 ? src->shape[1] : m->in);
    for (int d = 2; src && d < src->ndim; d++) tail[(*nt)++] = src->shape[d];
    int64_t p = 1;
    for (int d = 0; d < *nt; d++) p *= tail[d];
    if (p != m->in) tail[0] = m->in, *nt = 1;
}

/* Opens the inputs (in canonical order into ctx->in). */
static lk_status open_inputs(lk_alg_ctx *ctx, const lk_algebra_input *in, size_t n) {
    ctx->in = lk_calloc(n, sizeof *ctx->in);
    if (!ctx->in) return lk_error(LK_ERR_NOMEM, "out of memory");
    ctx->n_in = n;
    for (size_t i = 0; i < n; i++) {
        lk_alg_input *x = &ctx->in[i];
        if (!in[i].path || !isfinite(in[i].strength))
            return lk_error(LK_ERR_ARG, "input %zu: a path and a finite strength are needed", i + 1);
        x->path = in[i].path;
        x->strength = in[i].strength;
        lk_status s = lk_adapter_open_opts(in[i].path, &ctx->o->read, &x->a);
        if (!s) s = lk_alg_input_digest(x->a, x->digest, sizeof x->digest);
        if (s) return s;
        if (lk_adapter_replacement_count(x->a))
            return lk_error(LK_ERR_UNSUPPORTED, "%s: replaces %zu tensor(s) whole (modules_to_save or saved biases, "
                            "first '%s'); a low-rank output cannot carry them", x->path,
                            lk_adapter_replacement_count(x->a), lk_adapter_replacement(x->a, 0)->key);
    }
    qsort(ctx->in, n, sizeof *ctx->in, input_cmp);
    return LK_OK;
}

/* One output module from the references r[0..k) of one name. */
static lk_status gather_one(lk_alg_ctx *ctx, const mref *r, size_t k, lk_alg_module *x) {
    x->name = r[0].name;
    x->terms = lk_calloc(k, sizeof *x->terms);
    if (!x->terms) return lk_error(LK_ERR_NOMEM, "out of memory");
    x->n_terms = k;
    for (size_t j = 0; j < k; j++) {
        const lk_alg_input *in = &ctx->in[r[j].input];
        const lk_lora_module *m = lk_adapter_module(in->a, r[j].idx);
        const char *why;
        if (!lk_alg_lowrank_supported(m, &why))
            return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s module %s", in->path, m->module, lk_algo_name(m->algo), why);
        if (j && ((size_t)m->out != x->out || (size_t)m->in != x->N))
            return lk_error(LK_ERR_SHAPE, "%s: %s: delta is %lld x %lld but %s gives %zu x %zu", in->path, m->module,
                            (long long)m->out, (long long)m->in, ctx->in[r[0].input].path, x->out, x->N);
        x->out = (size_t)m->out;
        x->N = (size_t)m->in;
        int64_t tail[LK_MAX_DIMS];
        int nt;
        delta_tail(m, tail, &nt);
        if (!j || (x->ntail == 1 && nt > 1)) {
            memcpy(x->tail, tail, sizeof tail);
            x->ntail = nt;
        }
        x->terms[j] = (lk_alg_term){m, in->strength * m->scale, r[j].input};
        if (!j) x->stem = lk_adapter_module_stem(in->a, r[j].idx);
    }
    x->conv = x->ntail > 1 && (int64_t)x->N != x->tail[0];
    return LK_OK;
}

/* The union of the inputs' modules, by name, each with its terms in input order. */
static lk_status gather(lk_alg_ctx *ctx) {
    size_t total = 0;
    for (size_t i = 0; i < ctx->n_in; i++) total += lk_adapter_count(ctx->in[i].a);
    if (!total) return lk_error(LK_ERR_FORMAT, "%s: no adapter modules", ctx->in[0].path);
    mref *r = lk_calloc(total, sizeof *r);
    ctx->mods = lk_calloc(total, sizeof *ctx->mods);
    if (!r || !ctx->mods) {
        lk_free(r);
        return lk_error(LK_ERR_NOMEM, "out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < ctx->n_in; i++)
        for (size_t j = 0; j < lk_adapter_count(ctx->in[i].a); j++)
            r[k++] = (mref){lk_adapter_module(ctx->in[i].a, j)->module, i, j};
    qsort(r, total, sizeof *r, mref_cmp);
    lk_status s = LK_OK;
    for (size_t a = 0; a < total && !s;) {
        size_t b = a + 1;
        while (b < total && !strcmp(r[b].name, r[a].name)) b++;
        for (size_t c = a + 1; c < b && !s; c++)
            if (r[c].input == r[c - 1].input)
                s = lk_error(LK_ERR_FORMAT, "%s: module '%s' appears twice", ctx->in[r[c].input].path, r[c].name);
        if (!s) s = gather_one(ctx, r + a, b - a, &ctx->mods[ctx->n_mods++]);
        a = b;
    }
    lk_free(r);
    return s;
}

/* The output dtype (the widest input factor unless given) and the one
 * alpha of the file: --rank K, else --max-rank, else the largest stacked
 * rank (every module of that rank then has scale 1). */
static lk_status settle(lk_alg_ctx *ctx) {
    const lk_algebra_opts *o = ctx->o;
    lk_alg_run *run = &ctx->run;
    run->o = o;
    run->exact = !(o->rank > 0 || o->err > 0 || o->fro > 0 || o->ratio > 0 || o->conv_rank > 0);
    if (o->dtype != LK_DTYPE_INVALID && o->dtype != LK_DTYPE_F32 && o->dtype != LK_DTYPE_F16 &&
        o->dtype != LK_DTYPE_BF16)
        return lk_error(LK_ERR_ARG, "output dtype %s: F32, F16 or BF16", lk_dtype_name(o->dtype));
    lk_dtype d = o->dtype;
    size_t rmax = 0;
    for (size_t i = 0; i < ctx->n_mods; i++) {
        size_t R = 0;
        for (size_t t = 0; t < ctx->mods[i].n_terms; t++) {
            const lk_lora_module *m = ctx->mods[i].terms[t].m;
            R += lk_alg_lowrank_rank(m);
            const lk_tensor *f[LK_MODULE_MAX_TENSORS];
            size_t nf = lk_lora_module_tensors(m, f);
            for (size_t q = 0; q < nf && o->dtype == LK_DTYPE_INVALID; q++) {
                lk_dtype fd = f[q]->dtype;
                if (d == LK_DTYPE_INVALID) d = fd;
                else if (fd != d) d = LK_DTYPE_F32;
            }
        }
        if (R > rmax) rmax = R;
    }
    run->dtype = d == LK_DTYPE_INVALID ? LK_DTYPE_F32 : d;
    if (!run->exact && o->rank > 0) run->alpha = o->rank;
    else if (!run->exact && o->max_rank > 0) run->alpha = o->max_rank;
    else if (!run->exact && o->conv_rank > 0) run->alpha = o->conv_rank;
    else run->alpha = (double)rmax;
    return LK_OK;
}

static lk_status module_one(void *ctx, size_t i) {
    lk_alg_ctx *c = ctx;
    return lk_alg_module_run(&c->run, &c->mods[i]);
}

static lk_status run_modules(lk_alg_ctx *ctx) { return lk_alg_pool(ctx->n_mods, ctx->o, module_one, ctx); }

static void ctx_free(lk_alg_ctx *ctx) {
    for (size_t i = 0; i < ctx->n_mods; i++) {
        lk_alg_module_free(&ctx->mods[i]);
        lk_free(ctx->mods[i].terms);
    }
    lk_free(ctx->mods);
    for (size_t i = 0; ctx->in && i < ctx->n_in; i++) lk_adapter_free(ctx->in[i].a);
    lk_free(ctx->in);
}

static lk_status algebra_run(const char *op, const lk_algebra_input *in, size_t n, const char *out,
                             const lk_algebra_opts *opts, char **report) {
    lk_algebra_opts zero = {0};
    lk_alg_ctx ctx = {0};
    ctx.o = opts ? opts : &zero;
    ctx.op = op;
    ctx.out = out;
    if (report) *report = NULL;
    if (!in || !n || !out || !*out) return lk_error(LK_ERR_ARG, "%s: at least one input and an output are needed", op);
    const lk_algebra_opts *o = ctx.o;
    if (o->rank < 0 || o->err < 0 || o->fro < 0 || o->fro > 1 || o->ratio < 0 || o->ratio > 1 || o->max_rank < 0 ||
        o->conv_rank < 0 || !isfinite(o->err) || !isfinite(o->fro) || !isfinite(o->ratio))
        return lk_error(LK_ERR_ARG, "%s: rank options: --rank, --max-rank, --conv-rank >= 0; --err >= 0; --fro and "
                        "--ratio in [0, 1]", op);
    if ((o->err > 0) + (o->fro > 0) + (o->ratio > 0) + (o->rank > 0) > 1)
        return lk_error(LK_ERR_ARG, "%s: give one of --rank, --err, --fro, --ratio", op);
    double t0 = lk_now_s();
    lk_status s = open_inputs(&ctx, in, n);
    if (!s) s = gather(&ctx);
    if (!s) s = settle(&ctx);
    if (!s) s = run_modules(&ctx);
    ctx.seconds = lk_now_s() - t0;
    if (!s) s = lk_alg_write(&ctx);
    if (!s && report) s = lk_alg_report(&ctx, report);
    ctx_free(&ctx);
    return s;
}

lk_status lk_merge(const lk_algebra_input *in, size_t n, const char *out, const lk_algebra_opts *o, char **report) {
    return algebra_run("merge", in, n, out, o, report);
}

lk_status lk_resize(const char *in, const char *out, const lk_algebra_opts *o, char **report) {
    lk_algebra_input one = {in, 1.0};
    return algebra_run("resize", &one, 1, out, o, report);
}
