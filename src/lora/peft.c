/* peft.c — saving the trained adapter as a PEFT folder, and loading it back.
 *
 * PEFT's layout is what PEFT, diffusers and `lorakit fuse` all read:
 * adapter_model.safetensors with "base_model.model.<m>.lora_A.weight"
 * (r x in) and ".lora_B.weight" (out x r), plus adapter_config.json. The
 * target_modules written are the exact wrapped module names: PEFT matches a
 * target by equality or ".<target>" suffix, so exact names select exactly
 * the layers we trained, whereas our substring targets (e.g. "to_out" for
 * "attn.to_out.0") would not match in PEFT. Tensors are F32 so a resume is
 * bit-identical. Both files are written to a temporary name and renamed. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "io/out_file.h"
#include "lorakit/alloc.h"
#include "lorakit/safetensors.h"
#include "lora/params.h"

#define PEFT_PREFIX "base_model.model."

static char *peft_key(const char *module, const char *ab) {
    size_t n = strlen(PEFT_PREFIX) + strlen(module) + 32;
    char *s = lk_malloc(n);
    if (s) snprintf(s, n, PEFT_PREFIX "%s.%s.weight", module, ab);
    return s;
}

/* adapter_config.json, whole or not at all (io/out_file.h) */
static lk_status write_json_atomic(const char *path, json_t *j) {
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (!text) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    size_t n = strlen(text);
    char *full = lk_malloc(n + 2);
    lk_status s = full ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    if (full) {
        memcpy(full, text, n);
        full[n] = '\n';
        s = lk_out_file_write(path, full, n + 1);
    }
    lk_free(full);
    free(text);
    return s;
}

lk_status lk_lora_save_peft(const lk_lora_model *cm, const char *dir) {
    lk_lora_model *m = (lk_lora_model *)cm; /* only read below */
    if (!m || !dir || !*dir) return lk_error(LK_ERR_ARG, "lk_lora_save_peft: missing model or folder");
    int alpha;
    int rank = lk_lora_model_rank_alpha(m, &alpha);
    if (rank <= 0) return lk_error(LK_ERR_STATE, "%s: LoRA is not enabled on this model", dir);
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return lk_error(LK_ERR_IO, "%s: cannot create folder: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return lk_error(LK_ERR_IO, "%s: not a folder", dir);

    size_t nl = lk_lora_model_layer_count(m), nw = 0;
    for (size_t i = 0; i < nl; i++) nw += (size_t)lk_lora_layer_wrapped(lk_lora_model_layer(m, i));
    lk_tensor *t = lk_calloc(2 * nw, sizeof *t);
    json_t *cfg = json_object(), *targets = json_array();
    char *st_path = lk_path_join(dir, "adapter_model.safetensors");
    char *js_path = lk_path_join(dir, "adapter_config.json");
    lk_status s = (t && cfg && targets && st_path && js_path) ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    size_t k = 0;
    for (size_t i = 0; s == LK_OK && i < nl; i++) {
        lk_lora_layer *l = lk_lora_model_layer(m, i);
        if (!lk_lora_layer_wrapped(l)) continue;
        for (int ab = 0; ab < 2; ab++) {
            lk_tensor *v = &t[k];
            v->name = peft_key(lk_lora_layer_name(l), ab ? "lora_B" : "lora_A");
            if (!v->name) {
                s = lk_error(LK_ERR_NOMEM, "out of memory");
                break;
            }
            v->dtype = LK_DTYPE_F32;
            v->ndim = 2;
            v->shape[0] = ab ? lk_lora_layer_out(l) : lk_lora_layer_rank(l);
            v->shape[1] = ab ? lk_lora_layer_rank(l) : lk_lora_layer_in(l);
            v->nbytes = (size_t)(v->shape[0] * v->shape[1]) * sizeof(float);
            v->data = ab ? lk_lora_layer_B(l) : lk_lora_layer_A(l);
            k++;
        }
        if (s == LK_OK && json_array_append_new(targets, json_string(lk_lora_layer_name(l))) != 0)
            s = lk_error(LK_ERR_NOMEM, "out of memory");
    }
    if (s == LK_OK) {
        int bad = 0;
        bad |= json_object_set_new(cfg, "peft_type", json_string("LORA"));
        bad |= json_object_set_new(cfg, "r", json_integer(rank));
        bad |= json_object_set_new(cfg, "lora_alpha", json_integer(alpha));
        bad |= json_object_set(cfg, "target_modules", targets);
        bad |= json_object_set_new(cfg, "use_rslora", json_false());
        bad |= json_object_set_new(cfg, "bias", json_string("none"));
        bad |= json_object_set_new(cfg, "fan_in_fan_out", json_false());
        bad |= json_object_set_new(cfg, "lora_dropout", json_real(0.0));
        bad |= json_object_set_new(cfg, "inference_mode", json_true());
        bad |= json_object_set_new(cfg, "init_lora_weights", json_true());
        if (bad) s = lk_error(LK_ERR_NOMEM, "out of memory");
    }
    const char *kv[] = {"format", "pt", "lorakit.rank", NULL, "lorakit.alpha", NULL};
    char rs[16], as[16];
    snprintf(rs, sizeof rs, "%d", rank);
    snprintf(as, sizeof as, "%d", alpha);
    kv[3] = rs;
    kv[5] = as;
    if (s == LK_OK) s = lk_st_save(st_path, t, k, kv, 3);
    if (s == LK_OK) s = write_json_atomic(js_path, cfg);
    for (size_t i = 0; t && i < 2 * nw; i++) lk_free((char *)t[i].name);
    lk_free(t);
    json_decref(cfg);
    json_decref(targets);
    lk_free(st_path);
    lk_free(js_path);
    return s;
}

/* Reads r and lora_alpha from adapter_config.json and checks the type. */
static lk_status read_peft_config(const char *path, int *r, int *alpha) {
    json_error_t je;
    char *text;
    size_t len;
    lk_status rd = lk_read_config(path, &text, &len); /* bounded, like every config */
    if (rd) return rd;
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    lk_free(text);
    if (!j) return lk_error(LK_ERR_FORMAT, "%s:%d: %s", path, je.line, je.text);
    lk_status s = LK_OK;
    json_t *pt = json_object_get(j, "peft_type"), *jr = json_object_get(j, "r");
    json_t *ja = json_object_get(j, "lora_alpha"), *rs = json_object_get(j, "use_rslora");
    if (!json_is_object(j) || (pt && (!json_is_string(pt) || strcmp(json_string_value(pt), "LORA"))))
        s = lk_error(LK_ERR_FORMAT, "%s: peft_type is not LORA", path);
    else if (!json_is_integer(jr) || json_integer_value(jr) <= 0 || json_integer_value(jr) > 1 << 24)
        s = lk_error(LK_ERR_FORMAT, "%s: r must be a positive integer", path);
    else if (ja && !json_is_number(ja))
        s = lk_error(LK_ERR_FORMAT, "%s: lora_alpha must be a number", path);
    else if (rs && json_is_true(rs))
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: use_rslora adapters cannot resume a plain LoRA run", path);
    if (s == LK_OK) {
        *r = (int)json_integer_value(jr);
        double a = ja ? json_number_value(ja) : (double)*r;
        *alpha = (int)a;
        if ((double)*alpha != a)
            s = lk_error(LK_ERR_FORMAT, "%s: lora_alpha %g is not an integer", path, a);
    }
    json_decref(j);
    return s;
}

/* One lk_lora_load_peft: the folder's two paths, the open checkpoint, and
 * per wrapped layer i the checkpoint's index of its lora_A (idx[2i]) and
 * lora_B (idx[2i + 1]). Everything here is freed by peft_load_free. */
typedef struct peft_load {
    lk_lora_model *m;
    char *st_path, *js_path;
    lk_st *st;
    long *idx;
    size_t nl, nw; /* layers, wrapped layers */
} peft_load;

/* Reads adapter_config.json, checks its r and lora_alpha against the
 * model's, then opens the checkpoint into p->st. */
static lk_status peft_open(peft_load *p, int rank, int alpha) {
    int fr = 0, fa = 0;
    lk_status s = read_peft_config(p->js_path, &fr, &fa);
    if (s == LK_OK && (fr != rank || fa != alpha))
        s = lk_error(LK_ERR_CONFIG, "%s: r=%d lora_alpha=%d but the model was enabled with rank=%d alpha=%d",
                     p->js_path, fr, fa, rank, alpha);
    if (s == LK_OK) s = lk_st_open(p->st_path, &p->st);
    return s;
}

/* Finds wrapped layer l's lora_A (ab 0) or lora_B (ab 1) in the checkpoint
 * into *ti and checks its dtype and shape. */
static lk_status peft_match_one(const peft_load *p, lk_lora_layer *l, int ab, long *ti) {
    char *key = peft_key(lk_lora_layer_name(l), ab ? "lora_B" : "lora_A");
    if (!key) return lk_error(LK_ERR_NOMEM, "out of memory");
    lk_status s = LK_OK;
    *ti = lk_st_find(p->st, key);
    int64_t want0 = ab ? lk_lora_layer_out(l) : lk_lora_layer_rank(l), want1 = ab ? lk_lora_layer_rank(l) : lk_lora_layer_in(l);
    if (*ti < 0) {
        s = lk_error(LK_ERR_FORMAT, "%s: missing '%s' for the wrapped layer %s", p->st_path, key, lk_lora_layer_name(l));
    } else {
        const lk_tensor *t = lk_st_tensor(p->st, (size_t)*ti);
        if (!lk_dtype_is_fusable(t->dtype))
            s = lk_error(LK_ERR_DTYPE, "%s: %s: dtype %s", p->st_path, key, lk_dtype_name(t->dtype));
        else if (t->ndim != 2 || t->shape[0] != want0 || t->shape[1] != want1) {
            char have[96];
            lk_shape_str(t, have, sizeof have);
            s = lk_error(LK_ERR_SHAPE, "%s: %s: %s is %s but the model expects [%lld, %lld]", p->st_path,
                         lk_lora_layer_name(l), ab ? "lora_B" : "lora_A", have, (long long)want0, (long long)want1);
        }
    }
    lk_free(key);
    return s;
}

/* Matches every wrapped layer's two tensors (p->idx, p->nw), then checks the
 * checkpoint holds nothing else, naming one tensor that belongs to no
 * wrapped layer. Reads no tensor data. */
static lk_status peft_match(peft_load *p) {
    p->idx = lk_calloc(2 * p->nl + 1, sizeof *p->idx);
    if (!p->idx) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < p->nl; i++) {
        lk_lora_layer *l = lk_lora_model_layer(p->m, i);
        if (!lk_lora_layer_wrapped(l)) continue;
        for (int ab = 0; ab < 2; ab++) {
            lk_status s = peft_match_one(p, l, ab, &p->idx[2 * i + ab]);
            if (s) return s;
        }
        p->nw++;
    }
    if (lk_st_count(p->st) == 2 * p->nw) return LK_OK;
    const char *extra = "?";
    for (size_t j = 0; j < lk_st_count(p->st); j++) {
        int found = 0;
        for (size_t i = 0; i < 2 * p->nl && !found; i++) {
            lk_lora_layer *l = lk_lora_model_layer(p->m, i / 2);
            found = lk_lora_layer_wrapped(l) && p->idx[i] == (long)j;
        }
        if (!found) {
            extra = lk_st_tensor(p->st, j)->name;
            break;
        }
    }
    return lk_error(LK_ERR_UNMATCHED, "%s: %zu tensors but the model has %zu adapter tensors; '%s' "
                    "matches no wrapped layer", p->st_path, lk_st_count(p->st), 2 * p->nw, extra);
}

/* Commit (cannot fail): every matched tensor converted into the model's F32 A and B. */
static void peft_commit(const peft_load *p) {
    for (size_t i = 0; i < p->nl; i++) {
        lk_lora_layer *l = lk_lora_model_layer(p->m, i);
        if (!lk_lora_layer_wrapped(l)) continue;
        for (int ab = 0; ab < 2; ab++) {
            const lk_tensor *t = lk_st_tensor(p->st, (size_t)p->idx[2 * i + ab]);
            lk_to_f32(ab ? lk_lora_layer_B(l) : lk_lora_layer_A(l), t->data, t->dtype, lk_tensor_numel(t));
        }
    }
}

static void peft_load_free(peft_load *p) {
    lk_free(p->idx);
    lk_st_close(p->st);
    lk_free(p->st_path);
    lk_free(p->js_path);
}

lk_status lk_lora_load_peft(lk_lora_model *m, const char *dir) {
    if (!m || !dir) return lk_error(LK_ERR_ARG, "lk_lora_load_peft: missing model or folder");
    int alpha, rank = lk_lora_model_rank_alpha(m, &alpha);
    if (rank <= 0) return lk_error(LK_ERR_STATE, "%s: LoRA is not enabled on this model", dir);
    peft_load p = {.m = m, .nl = lk_lora_model_layer_count(m)};
    p.st_path = lk_path_join(dir, "adapter_model.safetensors");
    p.js_path = lk_path_join(dir, "adapter_config.json");
    lk_status s = p.st_path && p.js_path ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    if (s == LK_OK) s = peft_open(&p, rank, alpha);
    if (s == LK_OK) s = peft_match(&p);
    if (s == LK_OK) peft_commit(&p);
    peft_load_free(&p);
    return s;
}
