/* swap_fixture.c — see swap_fixture.h. */
#include "swap_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/tracker.h"
#include "testutil.h"

static const char *const g_lin[SWAP_LINEARS] = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                "ff.net.0.proj", "ff.net.2"};

int swap_is_attn(int j) { return j < 4; }

void swap_linear(const swap_model *m, int b, int j, char *name, size_t cap, int64_t *out, int64_t *in) {
    snprintf(name, cap, "blocks.%d.%s", b, g_lin[j]);
    *out = j == 4 ? m->hidden : m->dim;
    *in = j == 5 ? m->hidden : m->dim;
}

static void fill(lk_tensor *t, tu_rng *r, float mag) {
    size_t n = lk_tensor_numel(t);
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = tu_uniform(r, -mag, mag);
    t->data = malloc(t->nbytes ? t->nbytes : 1);
    lk_from_f32(t->data, f, t->dtype, n);
    free(f);
}

static void set_shape(lk_tensor *t, lk_dtype d, int ndim, int64_t a, int64_t b) {
    memset(t, 0, sizeof *t);
    t->dtype = d;
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->nbytes = lk_dtype_size(d) * (size_t)a * (size_t)(ndim == 2 ? b : 1);
}

static int save_and_free(const char *path, lk_tensor *t, size_t n) {
    lk_status s = lk_st_save(path, t, n, NULL, 0);
    if (s) fprintf(stderr, "swap fixture: %s\n", lk_last_error());
    for (size_t i = 0; i < n; i++) {
        free((void *)t[i].name);
        free(t[i].data);
    }
    free(t);
    return s ? -1 : 0;
}

int swap_write_base(const char *path, const swap_model *m, uint64_t seed) {
    static const lk_dtype cyc[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    size_t n = (size_t)m->blocks * (SWAP_LINEARS + 1) + 1, k = 0;
    lk_tensor *t = calloc(n, sizeof *t);
    tu_rng r = {seed};
    char name[128];
    for (int b = 0; b < m->blocks; b++) {
        for (int j = 0; j < SWAP_LINEARS; j++) {
            int64_t out, in;
            swap_linear(m, b, j, name, sizeof name, &out, &in);
            strcat(name, ".weight");
            set_shape(&t[k], m->mixed ? cyc[k % 3] : LK_DTYPE_BF16, 2, out, in);
            t[k].name = strdup(name);
            fill(&t[k++], &r, 0.5f);
        }
        snprintf(name, sizeof name, "blocks.%d.norm.weight", b);
        set_shape(&t[k], LK_DTYPE_F32, 1, m->dim, 0);
        t[k].name = strdup(name);
        fill(&t[k++], &r, 1.0f);
    }
    set_shape(&t[k], LK_DTYPE_I64, 1, 4, 0);
    t[k].name = strdup("pos_ids");
    t[k].data = calloc(1, t[k].nbytes);
    for (int i = 0; i < 4; i++) ((int64_t *)t[k].data)[i] = 1000 + i;
    return save_and_free(path, t, n);
}

int swap_write_adapter(const char *path, const swap_model *m, int which, int rank, float alpha, float mag,
                       int in_delta, uint64_t seed) {
    size_t n = (size_t)m->blocks * SWAP_LINEARS * 3, k = 0;
    lk_tensor *t = calloc(n, sizeof *t);
    tu_rng r = {seed};
    char mod[128], name[192];
    int first = 1;
    for (int b = 0; b < m->blocks; b++)
        for (int j = 0; j < SWAP_LINEARS; j++) {
            if (!((swap_is_attn(j) ? SWAP_ATTN : SWAP_FF) & which)) continue;
            int64_t out, in;
            swap_linear(m, b, j, mod, sizeof mod, &out, &in);
            if (first) in += in_delta;
            first = 0;
            snprintf(name, sizeof name, "transformer.%s.lora_A.weight", mod);
            set_shape(&t[k], LK_DTYPE_F32, 2, rank, in);
            t[k].name = strdup(name);
            fill(&t[k++], &r, mag);
            snprintf(name, sizeof name, "transformer.%s.lora_B.weight", mod);
            set_shape(&t[k], LK_DTYPE_F32, 2, out, rank);
            t[k].name = strdup(name);
            fill(&t[k++], &r, mag);
            snprintf(name, sizeof name, "transformer.%s.alpha", mod);
            set_shape(&t[k], LK_DTYPE_F32, 0, 0, 0);
            t[k].nbytes = 4;
            t[k].name = strdup(name);
            t[k].data = malloc(4);
            memcpy(t[k++].data, &alpha, 4);
        }
    return save_and_free(path, t, k);
}

size_t swap_touched_bytes(const lk_weights *w, int which, const lk_tracker *tr, int rank) {
    size_t sum = 0;
    for (size_t i = 0; i < lk_weights_count(w); i++) {
        const lk_tensor *t = lk_weights_tensor(w, i);
        int attn = strstr(t->name, ".attn.") != NULL, ff = strstr(t->name, ".ff.") != NULL;
        if (!((attn && (which & SWAP_ATTN)) || (ff && (which & SWAP_FF)))) continue;
        if (tr && lk_tracker_owner(tr, i) != rank) continue;
        sum += t->nbytes;
    }
    return sum;
}

int swap_offline_digest(const char *base, const lk_fuse_input *in, size_t n, const char *scratch,
                        char hex[LK_DIGEST_HEX]) {
    return swap_offline_digest_opts(base, in, n, NULL, scratch, hex);
}

int swap_offline_digest_opts(const char *base, const lk_fuse_input *in, size_t n, const lk_fuse_file_opts *opts,
                             const char *scratch, char hex[LK_DIGEST_HEX]) {
    int rc = lk_fuse_file(base, in, n, scratch, opts, NULL) || tu_file_digest(scratch, hex) ? -1 : 0;
    remove(scratch);
    return rc;
}
