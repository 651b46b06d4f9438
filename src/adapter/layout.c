/* layout.c — the names under which a model's weights can be found.
 *
 * For every "<k>.weight" of the model: the name with its wrapper prefix
 * (ComfyUI's "model.diffusion_model.", an SDXL file's
 * "conditioner.embedders.1.model.", a pipeline-style "text_encoder.", ...)
 * stripped, tagged with the component the prefix names (level 1); and, when
 * a family table applies, the other naming of the same weight (level 2):
 * diffusers names for an original (LDM/BFL) checkpoint and original names
 * for a diffusers one, with the row slices of fused projections. Both
 * spellings are indexed, dotted and kohya's underscores. A module name,
 * stripped of its own prefixes the same way, is looked up at the lowest
 * level that has it; the caller (resolve.c) turns the hits into row
 * placements and reports ambiguity naming both weights. The index is built
 * once per resolve, sorted, and searched by bisection. */
#include "adapter/layout.h"
#include "core/alloc.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const g_comp[LK_COMP_COUNT] = {"any", "unet/transformer", "text_encoder", "text_encoder_2",
                                                  "text_encoder_3"};
const char *lk_comp_name(int comp) { return comp >= 0 && comp < LK_COMP_COUNT ? g_comp[comp] : "?"; }

int lk_comp_from_name(const char *name) {
    static const struct {
        const char *name;
        int comp;
    } c[] = {{"unet", LK_COMP_DIFFUSION},         {"transformer", LK_COMP_DIFFUSION}, {"text_encoder", LK_COMP_TE1},
             {"text_encoder_2", LK_COMP_TE2}, {"text_encoder_3", LK_COMP_TE3}};
    for (size_t i = 0; name && i < sizeof c / sizeof c[0]; i++)
        if (!strcmp(name, c[i].name)) return c[i].comp;
    return LK_COMP_ANY;
}

typedef struct prefix {
    const char *p;
    int comp;
    const char *cname; /* the component as inspect names it, or NULL (a wrapper only) */
} prefix;

/* Model-side wrappers (single files, ComfyUI, pipeline-style files). */
static const prefix g_model_pre[] = {
    {"model.diffusion_model.", LK_COMP_DIFFUSION, "diffusion_model"},
    {"diffusion_model.", LK_COMP_DIFFUSION, "diffusion_model"},
    {"cond_stage_model.transformer.", LK_COMP_TE1, "text_encoder"},
    {"cond_stage_model.model.", LK_COMP_TE1, "text_encoder"},
    {"conditioner.embedders.0.transformer.", LK_COMP_TE1, "text_encoder"},
    {"conditioner.embedders.1.model.", LK_COMP_TE2, "text_encoder_2"},
    {"conditioner.embedders.0.model.", LK_COMP_TE1, "text_encoder"}, /* SDXL refiner: its one encoder, OpenCLIP G */
    {"text_encoders.clip_l.transformer.", LK_COMP_TE1, "text_encoder"},
    {"text_encoders.clip_g.transformer.", LK_COMP_TE2, "text_encoder_2"},
    {"text_encoders.t5xxl.transformer.", LK_COMP_TE3, "text_encoder_3"},
    {"text_encoders.hydit_clip.transformer.bert.", LK_COMP_TE1, "text_encoder"}, /* HunyuanDiT's BERT (lora_te1_) */
    {"text_encoder.", LK_COMP_TE1, "text_encoder"},
    {"text_encoder_2.", LK_COMP_TE2, "text_encoder_2"},
    {"text_encoder_3.", LK_COMP_TE3, "text_encoder_3"},
    {"transformer.", LK_COMP_DIFFUSION, "transformer"},
    {"unet.", LK_COMP_DIFFUSION, "unet"},
    {"base_model.model.", LK_COMP_ANY, NULL},
    {"model.", LK_COMP_ANY, NULL},
};

/* Adapter-side prefixes, stripped repeatedly ("base_model.model.unet."). */
static const prefix g_mod_pre[] = {
    {"base_model.model.", LK_COMP_ANY, NULL},
    {"model.diffusion_model.", LK_COMP_DIFFUSION, "diffusion_model"},
    {"diffusion_model.", LK_COMP_DIFFUSION, "diffusion_model"},
    {"text_encoder_2.", LK_COMP_TE2, "text_encoder_2"},
    {"text_encoder_3.", LK_COMP_TE3, "text_encoder_3"},
    {"text_encoder.", LK_COMP_TE1, "text_encoder"},
    /* ComfyUI's generic text-encoder names ("text_encoders." + its own CLIP / T5 key) */
    {"text_encoders.clip_l.transformer.", LK_COMP_TE1, "text_encoder"},
    {"text_encoders.clip_h.transformer.", LK_COMP_TE1, "text_encoder"},
    {"text_encoders.clip_g.transformer.", LK_COMP_TE2, "text_encoder_2"},
    {"text_encoders.t5xxl.transformer.", LK_COMP_TE3, "text_encoder_3"},
    {"transformer.", LK_COMP_DIFFUSION, "transformer"},
    {"unet.", LK_COMP_DIFFUSION, "unet"},
    {"model.", LK_COMP_ANY, NULL},
};

/* kohya's (and LyCORIS's / SimpleTuner's) component prefixes. */
static const prefix g_kohya_pre[] = {
    {"lora_unet__", LK_COMP_DIFFUSION, "unet"}, /* Wan Fun (ComfyUI reads it as lora_unet_) */
    {"lora_unet_", LK_COMP_DIFFUSION, "unet"}, {"lora_transformer_", LK_COMP_DIFFUSION, "transformer"},
    {"lora_prior_unet_", LK_COMP_DIFFUSION, "unet"}, {"lora_prior_te_", LK_COMP_TE1, "text_encoder"}, /* Stable Cascade */
    {"lora_te1_", LK_COMP_TE1, "text_encoder"},        {"lora_te2_", LK_COMP_TE2, "text_encoder_2"},
    {"lora_te3_", LK_COMP_TE3, "text_encoder_3"},      {"lora_te_", LK_COMP_TE1, "text_encoder"},
    {"lycoris_", LK_COMP_ANY, NULL},
};

#define NPRE(a) (sizeof a / sizeof a[0])

/* A CLIP text model's own "text_model." (transformers < 5 and the SD single
 * files have it, transformers 5 does not): dropped on both sides. */
static const char *strip_inner(const char *name, int kohya) {
    const char *p = kohya ? "text_model_" : "text_model.";
    return !strncmp(name, p, 11) && name[11] ? name + 11 : name;
}

/* ComfyUI's single Llama-style text encoder, "text_encoders.<te>.transformer.model." (Z-Image's qwen3_4b,
 * Qwen-Image's qwen25_7b, Anima's qwen3_06b: model_lora_keys_clip's lora_te_<name>, and its generic
 * text_encoders.<key>): the length of that prefix of name, or 0. */
static size_t llama_te_prefix(const char *name) {
    static const char head[] = "text_encoders.", tail[] = ".transformer.model.";
    if (strncmp(name, head, sizeof head - 1)) return 0;
    const char *te = name + sizeof head - 1, *dot = strchr(te, '.');
    if (!dot || dot == te || strncmp(dot, tail, sizeof tail - 1) || !dot[sizeof tail - 1]) return 0;
    return (size_t)(dot - name) + sizeof tail - 1;
}

/* lk_layout_strip_module; *cname (may be NULL) gets the component name of
 * the first prefix that names one, or NULL. */
static const char *strip_module(const char *name, int kohya, int *comp, const char **cname) {
    *comp = LK_COMP_ANY;
    const char *cn = NULL;
    if (kohya) {
        for (size_t i = 0; i < NPRE(g_kohya_pre); i++) {
            size_t pl = strlen(g_kohya_pre[i].p);
            if (!strncmp(name, g_kohya_pre[i].p, pl) && name[pl]) {
                *comp = g_kohya_pre[i].comp;
                if (cname) *cname = g_kohya_pre[i].cname;
                return strip_inner(name + pl, 1);
            }
        }
        if (cname) *cname = NULL;
        return strip_inner(name, 1);
    }
    size_t lp = llama_te_prefix(name);
    if (lp) {
        *comp = LK_COMP_TE1;
        if (cname) *cname = "text_encoder";
        return name + lp;
    }
    for (int round = 0; round < 4; round++) {
        size_t i = 0;
        for (; i < NPRE(g_mod_pre); i++) {
            size_t pl = strlen(g_mod_pre[i].p);
            if (!strncmp(name, g_mod_pre[i].p, pl) && name[pl]) {
                if (*comp == LK_COMP_ANY) *comp = g_mod_pre[i].comp;
                if (!cn) cn = g_mod_pre[i].cname;
                name += pl;
                break;
            }
        }
        if (i == NPRE(g_mod_pre)) break;
    }
    if (cname) *cname = cn;
    return strip_inner(name, 0);
}

const char *lk_layout_strip_module(const char *name, int kohya, int *comp) {
    return strip_module(name, kohya, comp, NULL);
}

static const char *strip_model(const char *name, int *comp, const char **cname) {
    *comp = LK_COMP_ANY;
    size_t lp = llama_te_prefix(name);
    if (lp) {
        *comp = LK_COMP_TE1;
        if (cname) *cname = "text_encoder";
        return name + lp;
    }
    for (size_t i = 0; i < NPRE(g_model_pre); i++) {
        size_t pl = strlen(g_model_pre[i].p);
        if (!strncmp(name, g_model_pre[i].p, pl) && name[pl]) {
            *comp = g_model_pre[i].comp;
            if (cname) *cname = g_model_pre[i].cname;
            return name + pl;
        }
    }
    if (cname) *cname = NULL;
    return name;
}

const char *lk_layout_component(const char *module, int kohya, const char *key) {
    int comp;
    const char *cn = NULL;
    if (module) strip_module(module, kohya, &comp, &cn);
    if (!cn && key) strip_model(key, &comp, &cn);
    return cn ? cn : "any";
}

/* ---- patterns ---- */

typedef struct caps {
    const char *s[9];
    size_t len[9];
    int n;
} caps;

static int is_last(const char *c, size_t n) { return n == 5 && !memcmp(c, "#last", 5); }

/* The number a digit component of at most 9 digits spells, or -1. */
static long comp_number(const char *q, size_t qn) {
    if (!qn || qn > 9) return -1;
    long v = 0;
    for (size_t i = 0; i < qn; i++) {
        if (q[i] < '0' || q[i] > '9') return -1;
        v = v * 10 + (q[i] - '0');
    }
    return v;
}

/* Matches pattern p against name; captures '#' numbers and the final '*';
 * a '#last' component matches the number `last` only (-1: nothing). */
static int pat_match(const char *p, const char *name, long last, caps *c) {
    c->n = 0;
    const char *q = name;
    for (;;) {
        const char *pe = strchr(p, '.');
        size_t pn = pe ? (size_t)(pe - p) : strlen(p);
        if (pn == 1 && *p == '*') { /* the rest: at least one component */
            if (!*q) return 0;
            c->s[c->n] = q;
            c->len[c->n++] = strlen(q);
            return 1;
        }
        const char *qe = strchr(q, '.');
        size_t qn = qe ? (size_t)(qe - q) : strlen(q);
        if (!qn) return 0;
        if ((pn == 1 && *p == '#') || is_last(p, pn)) {
            long v = comp_number(q, qn);
            if (v < 0 || (pn == 5 && v != last)) return 0;
            c->s[c->n] = q;
            c->len[c->n++] = qn;
        } else if (pn != qn || memcmp(p, q, pn)) {
            return 0;
        }
        if (!pe || !qe) return !pe && !qe;
        p = pe + 1;
        q = qe + 1;
    }
}

/* The other side's name for captures c; NULL when out of memory. */
static char *pat_expand(const char *p, const caps *c) {
    size_t n = strlen(p) + 1;
    for (int i = 0; i < c->n; i++) n += c->len[i];
    char *out = lk_malloc(n), *o = out;
    if (!out) return NULL;
    int k = 0;
    for (const char *s = p; *s; s++) {
        int at = s == p || s[-1] == '.', lst = at && is_last(s, strcspn(s, "."));
        if (((*s == '#' || *s == '*') && at && (s[1] == '.' || !s[1]) && k < c->n) || (lst && k < c->n)) {
            memcpy(o, c->s[k], c->len[k]);
            o += c->len[k++];
            s += lst ? 4 : 0;
        } else {
            *o++ = *s;
        }
    }
    *o = '\0';
    return out;
}

/* ---- the index ---- */

typedef struct builder {
    lk_layout *l;
    size_t cap;
    const char *label;
} builder;

static lk_status add_alias(builder *b, char *name, size_t key, int comp, int level, const char *rule, lk_frac w,
                           lk_frac m) {
    if (!name) return lk_error(LK_ERR_NOMEM, "%s: out of memory", b->label);
    const char *in = strip_inner(name, 0);
    if (in != name) memmove(name, in, strlen(in) + 1);
    lk_layout *l = b->l;
    if (l->n == b->cap) {
        size_t nc = b->cap ? 2 * b->cap : 256;
        lk_alias *na = lk_realloc(l->al, nc * sizeof *na);
        if (!na) {
            lk_free(name);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", b->label);
        }
        l->al = na;
        b->cap = nc;
    }
    char *u = lk_strdup(name);
    if (!u) {
        lk_free(name);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", b->label);
    }
    for (char *c = u; *c; c++)
        if (*c == '.') *c = '_';
    l->al[l->n++] = (lk_alias){name, u, key, comp, level, rule, w, m};
    return LK_OK;
}

static int name_cmp(const void *pa, const void *pb, void *ctx) {
    const lk_layout *l = ctx;
    const lk_alias *a = &l->al[*(const size_t *)pa], *b = &l->al[*(const size_t *)pb];
    int c = strcmp(a->name, b->name);
    return c ? c : (a->key > b->key) - (a->key < b->key);
}

static int uname_cmp(const void *pa, const void *pb, void *ctx) {
    const lk_layout *l = ctx;
    const lk_alias *a = &l->al[*(const size_t *)pa], *b = &l->al[*(const size_t *)pb];
    int c = strcmp(a->uname, b->uname);
    return c ? c : (a->key > b->key) - (a->key < b->key);
}

static int str_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

void lk_layout_free(lk_layout *l) {
    if (!l) return;
    for (size_t i = 0; i < l->n; i++) {
        lk_free(l->al[i].name);
        lk_free(l->al[i].uname);
    }
    lk_free(l->al);
    lk_free(l->by_name);
    lk_free(l->by_uname);
    for (size_t i = 0; i < l->n_rules; i++) lk_free(l->rules[i]);
    lk_free(l->rules);
    lk_free(l->family);
    memset(l, 0, sizeof *l);
}

static int has_suffix(const char *s, const char *suf) {
    size_t n = strlen(s), m = strlen(suf);
    return n > m && !strcmp(s + n - m, suf);
}

/* Whether the model's stripped key names satisfy a detect line of f: every
 * key of the line present, every '!' key absent. */
static int detects(const lk_family *f, char *const *names, size_t n) {
    char key[4097];
    for (size_t i = 0; i < f->n_detect; i++) {
        const char *p = f->detect[i];
        int all = 1;
        while (all && *p) {
            size_t kl = strcspn(p, " ");
            int absent = *p == '!';
            if (kl - absent >= sizeof key) return 0; /* longer than a table line: cannot be */
            memcpy(key, p + absent, kl - absent);
            key[kl - absent] = '\0';
            const char *k = key;
            all = (bsearch(&k, names, n, sizeof *names, str_cmp) == NULL) == absent;
            p += kl + (p[kl] == ' ');
        }
        if (all) return 1;
    }
    return 0;
}

#define MAX_FAMILIES 8

/* Picks the family tables: --arch by name, else every table (in file name
 * order) one of whose detect lines the model's keys satisfy: a single file holds a UNet and
 * its text encoders, each with its own table. */
static lk_status pick_family(const char *label, const char *arch, char *const *names, size_t n, lk_family *out,
                             int *found) {
    *found = 0;
    if (arch && !strcmp(arch, "none")) return LK_OK;
    char *dir;
    lk_status ds = lk_family_dir(&dir);
    if (ds) return ds;
    if (!dir) {
        if (arch) return lk_error(LK_ERR_ARG, "--arch %s: no family tables found (set LORAKIT_FAMILIES_DIR)", arch);
        lk_log(LK_LOG_DEBUG, "%s: no family tables found", label);
        return LK_OK;
    }
    DIR *d = opendir(dir);
    if (!d) { /* a folder named or found but unreadable (no such folder, no permission, no memory or handles):
                 an error, never a quiet resolve without the tables */
        const int e = errno;
        lk_status s = arch ? lk_error(LK_ERR_IO, "--arch %s: cannot read the family tables in %s: %s", arch, dir,
                                      strerror(e))
                           : lk_error(LK_ERR_IO, "%s: cannot read the family tables in %s: %s", label, dir, strerror(e));
        lk_free(dir);
        return s;
    }
    char **files = NULL;
    size_t nf = 0;
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        if (!has_suffix(e->d_name, ".lkmap")) continue;
        char **nv = lk_realloc(files, (nf + 1) * sizeof *nv);
        if (!nv || !(nv[nf] = lk_strdup(e->d_name))) {
            if (nv) files = nv;
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
            break;
        }
        files = nv;
        nf++;
    }
    closedir(d);
    if (!s && nf) qsort(files, nf, sizeof *files, str_cmp);
    for (size_t i = 0; i < nf && !s && *found < MAX_FAMILIES && !(arch && *found); i++) {
        size_t fl = strlen(files[i]) - 6;
        if (arch && (strlen(arch) != fl || strncmp(files[i], arch, fl))) continue;
        char *p = lk_path_join(dir, files[i]);
        if (!p) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
            break;
        }
        lk_family f;
        s = lk_family_load(p, 1, &f);
        lk_free(p);
        if (s) break;
        if (arch || detects(&f, names, n)) {
            out[(*found)++] = f;
        } else {
            lk_family_free(&f);
        }
    }
    if (!s && arch && !*found) {
        char avail[1024] = "";
        size_t o = 0;
        for (size_t i = 0; i < nf && o < sizeof avail; i++)
            o += (size_t)snprintf(avail + o, sizeof avail - o, "%s%.*s", i ? ", " : "", (int)(strlen(files[i]) - 6),
                                  files[i]);
        s = lk_error(LK_ERR_ARG, "--arch %s: no such family table in %s (available: %s)", arch, dir,
                     nf ? avail : "none");
    }
    for (size_t i = 0; i < nf; i++) lk_free(files[i]);
    lk_free(files);
    lk_free(dir);
    return s;
}

/* The highest number the model's stripped names (sorted, n) have at the
 * '#last' component of pattern p (the components before it matching), or -1. */
static long last_number(const char *p, char *const *names, size_t n) {
    long best = -1;
    for (size_t i = 0; i < n; i++) {
        const char *pc = p, *q = names[i];
        for (;;) {
            size_t pn = strcspn(pc, "."), qn = strcspn(q, ".");
            if (is_last(pc, pn)) {
                long v = comp_number(q, qn);
                if (v > best) best = v;
                break;
            }
            if (pn == 1 && *pc == '#' ? comp_number(q, qn) < 0 : pn != qn || memcmp(pc, q, pn)) break;
            if (!pc[pn] || !q[qn]) break;
            pc += pn + 1;
            q += qn + 1;
        }
    }
    return best;
}

/* last[2r], last[2r + 1]: the number '#last' stands for in rule r's original
 * and diffusers pattern on this model (-1: none or no '#last'); last holds
 * 2 * f->n_rules entries. */
static void last_numbers(const lk_family *f, char *const *names, size_t n, long *last) {
    for (size_t r = 0; r < f->n_rules; r++) {
        int has = f->rules[r].last >= 0;
        last[2 * r] = has ? last_number(f->rules[r].orig, names, n) : -1;
        last[2 * r + 1] = has ? last_number(f->rules[r].diff, names, n) : -1;
    }
}

/* Level-2 aliases of model key k (stripped name nm) from table f (last:
 * last_numbers'). On each side, a name a '#last' rule matches takes only the
 * '#last' rules: the last block's own mapping replaces the '#' one. */
static lk_status table_aliases(builder *b, const lk_family *f, char **rule_str, const long *last, const char *nm,
                               size_t k, int comp) {
    caps c;
    int only_last[2] = {0, 0};
    for (size_t r = 0; r < f->n_rules; r++)
        for (int side = 0; side < 2 && f->rules[r].last >= 0; side++)
            if (pat_match(side ? f->rules[r].diff : f->rules[r].orig, nm, last[2 * r + side], &c)) only_last[side] = 1;
    for (size_t r = 0; r < f->n_rules; r++) {
        const lk_fam_rule *ru = &f->rules[r];
        int lr = ru->last >= 0;
        lk_status s = LK_OK;
        if ((lr || !only_last[0]) && pat_match(ru->orig, nm, last[2 * r], &c))
            s = add_alias(b, pat_expand(ru->diff, &c), k, comp, 2, rule_str[r], ru->orig_rows, ru->diff_rows);
        if (!s && (lr || !only_last[1]) && pat_match(ru->diff, nm, last[2 * r + 1], &c))
            s = add_alias(b, pat_expand(ru->orig, &c), k, comp, 2, rule_str[r], ru->diff_rows, ru->orig_rows);
        if (s) return s;
    }
    return LK_OK;
}

/* The rule strings of table f, appended to l->rules from index *first (an
 * index: l->rules moves as it grows). */
static lk_status rule_strings(lk_layout *l, const lk_family *f, const char *what, size_t *first, const char *label) {
    char **v = lk_realloc(l->rules, (l->n_rules + f->n_rules) * sizeof *v);
    if (!v) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    l->rules = v;
    *first = l->n_rules;
    for (size_t r = 0; r < f->n_rules; r++) {
        size_t n = strlen(what) + strlen(f->name ? f->name : "") + strlen(f->file) + 48;
        char *s = lk_malloc(n);
        if (!s) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        snprintf(s, n, "%s%s%s (%s:%d)", what, f->name ? " " : "", f->name ? f->name : "", f->file, f->rules[r].line);
        v[l->n_rules++] = s;
    }
    return LK_OK;
}

static const lk_frac g_all = {0, 1, 1, 1};

#define MAX_MAPS 16

/* The tables one build applies: the families picked, then the --map
 * files; per table, the index of its first rule string in the layout's
 * rules and its '#last' numbers (last_numbers'), all tables' in one
 * allocation. Freed by tables_free. */
typedef struct tables {
    lk_family fam[MAX_FAMILIES];
    int n_fam;
    lk_family *maps;
    size_t n_maps;
    size_t first_rule[MAX_FAMILIES + MAX_MAPS];
    long *last_of[MAX_FAMILIES + MAX_MAPS];
    long *last;
} tables;

/* Table i of t: the families first, then the maps. */
static lk_family *table_at(tables *t, size_t i) {
    return i < (size_t)t->n_fam ? &t->fam[i] : &t->maps[i - (size_t)t->n_fam];
}

static void tables_free(tables *t) {
    for (int f = 0; f < t->n_fam; f++) lk_family_free(&t->fam[f]);
    for (size_t i = 0; i < t->n_maps; i++) lk_family_free(&t->maps[i]);
    lk_free(t->maps);
    lk_free(t->last);
}

/* The model's "<k>.weight" names with their wrapper prefixes stripped,
 * sorted, for detecting families (pointers into the model's names; *names
 * allocated here, the caller frees it, on failure too). */
static lk_status model_names(const lk_tensor *model, size_t n_model, const char *label, char ***names, size_t *nn) {
    *nn = 0;
    if (!(*names = lk_calloc(n_model ? n_model : 1, sizeof **names)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < n_model; i++) {
        int comp;
        const char *k = model[i].name;
        if (k) (*names)[(*nn)++] = (char *)strip_model(k, &comp, NULL);
    }
    qsort(*names, *nn, sizeof **names, str_cmp);
    return LK_OK;
}

/* The tables to apply (into t, owned by it): the families (--arch, or
 * those the model's names satisfy), named in out->family ("sdxl,openclip")
 * and logged, then the --map files (at most MAX_MAPS). */
static lk_status pick_tables(lk_layout *out, const lk_layout_opts *o, const char *label, char *const *names,
                             size_t nn, tables *t) {
    lk_status s = pick_family(label, o ? o->arch : NULL, names, nn, t->fam, &t->n_fam);
    for (int f = 0; !s && f < t->n_fam; f++) {
        size_t ol = out->family ? strlen(out->family) : 0, nl = strlen(t->fam[f].name);
        char *nf = lk_realloc(out->family, ol + nl + 2);
        if (!nf) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        snprintf(nf + ol, nl + 2, "%s%s", ol ? "," : "", t->fam[f].name);
        out->family = nf;
        lk_log(LK_LOG_INFO, "%s: model family %s (%s)", label, t->fam[f].name, t->fam[f].file);
    }
    if (!s && o && o->n_maps) {
        if (!(t->maps = lk_calloc(o->n_maps, sizeof *t->maps))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        for (size_t i = 0; !s && i < o->n_maps; i++) {
            s = lk_family_load(o->maps[i], 0, &t->maps[i]);
            if (!s) t->n_maps++;
        }
    }
    if (!s && t->n_maps > MAX_MAPS) s = lk_error(LK_ERR_ARG, "%s: at most 16 --map files", label);
    return s;
}

/* Each table's rule strings (appended to out->rules) and '#last' numbers
 * on this model (into t->last, one allocation for all tables). */
static lk_status table_rules(lk_layout *out, tables *t, char *const *names, size_t nn, const char *label) {
    size_t nt = (size_t)t->n_fam + t->n_maps, at[MAX_FAMILIES + MAX_MAPS];
    lk_status s = LK_OK;
    for (size_t i = 0; i < nt && !s; i++)
        s = rule_strings(out, table_at(t, i), i < (size_t)t->n_fam ? "family" : "--map", &t->first_rule[i], label);
    if (s || !nt) return s;
    lk_carve c = {0}; /* each table's two numbers per rule */
    for (size_t i = 0; i < nt; i++) at[i] = lk_carve_part(&c, table_at(t, i)->n_rules, 2 * sizeof(long), _Alignof(long));
    if (!(t->last = lk_carve_alloc(&c))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < nt; i++) {
        t->last_of[i] = (long *)(void *)((char *)t->last + at[i]);
        last_numbers(table_at(t, i), names, nn, t->last_of[i]);
    }
    return LK_OK;
}

/* The aliases of model key k ("<m>.weight", or OpenCLIP's fused
 * "<attn>.in_proj_weight" as module "<attn>.in_proj"): each table's
 * (level 2), then the name with its prefix stripped (level 1). Other keys
 * have none. */
static lk_status key_aliases(builder *b, tables *t, const lk_tensor *model, size_t k) {
    const char *key = model[k].name;
    int inproj = key && has_suffix(key, ".in_proj_weight");
    if (!key || (!has_suffix(key, ".weight") && !inproj)) return LK_OK;
    int comp;
    const char *st = strip_model(key, &comp, NULL);
    size_t sl = strlen(st) - 7, nt = (size_t)t->n_fam + t->n_maps;
    char *nm = lk_malloc(sl + 1);
    if (!nm) return lk_error(LK_ERR_NOMEM, "%s: out of memory", b->label);
    memcpy(nm, st, sl);
    nm[sl] = '\0';
    lk_status s = LK_OK;
    for (size_t i = 0; !s && i < nt; i++)
        s = table_aliases(b, table_at(t, i), b->l->rules + t->first_rule[i], t->last_of[i], nm, k, comp);
    if (s) {
        lk_free(nm);
        return s;
    }
    return add_alias(b, nm, k, comp, 1, "prefix", g_all, g_all);
}

/* The aliases' two sorted orders, by name and by kohya name (owned by out). */
static lk_status sort_aliases(lk_layout *out, const char *label) {
    out->by_name = lk_malloc((out->n ? out->n : 1) * sizeof *out->by_name);
    out->by_uname = lk_malloc((out->n ? out->n : 1) * sizeof *out->by_uname);
    if (!out->by_name || !out->by_uname) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < out->n; i++) out->by_name[i] = out->by_uname[i] = i;
    qsort_r(out->by_name, out->n, sizeof *out->by_name, name_cmp, out);
    qsort_r(out->by_uname, out->n, sizeof *out->by_uname, uname_cmp, out);
    return LK_OK;
}

/* ComfyUI numbers a single file's T5 after the CLIPs it has (model_lora_keys_clip: lora_te{1 + [CLIP-L] + [CLIP-G]}_,
 * and also lora_te2_ beside CLIP-L alone, OneTrainer's Flux): lorakit's T5 is component 3 (text_encoders.t5xxl.), so
 * component 2 also reaches it when there is CLIP-L but no CLIP-G, and component 1 when it is the only encoder. */
static void t5_numbering(lk_layout *l) {
    size_t n[LK_COMP_COUNT] = {0};
    for (int c = 0; c < LK_COMP_COUNT; c++) l->also[c] = c;
    for (size_t i = 0; i < l->n; i++) n[l->al[i].comp]++;
    if (!n[LK_COMP_TE3] || n[LK_COMP_TE2]) return;
    l->also[n[LK_COMP_TE1] ? LK_COMP_TE2 : LK_COMP_TE1] = LK_COMP_TE3;
}

/* In steps: the model's names, the tables to apply, their rules, every
 * key's aliases, the sorted orders. The names and tables are this build's
 * scratch; on failure out is freed (and zeroed). */
lk_status lk_layout_build(const lk_tensor *model, size_t n_model, const lk_layout_opts *o, const char *label,
                          lk_layout *out) {
    memset(out, 0, sizeof *out);
    builder b = {out, 0, label};
    tables t = {.n_fam = 0};
    char **names = NULL;
    size_t nn = 0;
    lk_status s = model_names(model, n_model, label, &names, &nn);
    if (!s) s = pick_tables(out, o, label, names, nn, &t);
    if (!s) s = table_rules(out, &t, names, nn, label);
    for (size_t k = 0; k < n_model && !s; k++) s = key_aliases(&b, &t, model, k);
    if (!s) s = sort_aliases(out, label);
    if (!s) t5_numbering(out);
    tables_free(&t);
    lk_free(names);
    if (s) lk_layout_free(out);
    return s;
}

size_t lk_layout_find(const lk_layout *l, const char *name, int kohya, int comp, size_t *hits, size_t cap) {
    const size_t *ord = kohya ? l->by_uname : l->by_name;
    size_t lo = 0, hi = l->n;
    while (lo < hi) { /* first entry >= name */
        size_t mid = lo + (hi - lo) / 2;
        const lk_alias *a = &l->al[ord[mid]];
        if (strcmp(kohya ? a->uname : a->name, name) < 0) lo = mid + 1;
        else hi = mid;
    }
    int best = 3;
    size_t n = 0;
    for (size_t i = lo; i < l->n; i++) {
        const lk_alias *a = &l->al[ord[i]];
        if (strcmp(kohya ? a->uname : a->name, name)) break;
        if (comp != LK_COMP_ANY && a->comp != LK_COMP_ANY && a->comp != comp && a->comp != l->also[comp]) continue;
        if (a->level > best) continue;
        if (a->level < best) {
            best = a->level;
            n = 0;
        }
        if (n < cap) hits[n] = ord[i];
        n++;
    }
    return n;
}

lk_status lk_resolve_tables_check(const lk_tensor *model, size_t n_model, const lk_resolve_opts *o, const char *label) {
    if (!o || (!o->arch && !o->n_maps)) return LK_OK;
    if ((n_model && !model) || (o->n_maps && !o->maps))
        return lk_error(LK_ERR_ARG, "lk_resolve_tables_check: NULL argument");
    lk_layout_opts lo = {o->arch, o->maps, o->n_maps};
    lk_layout lay;
    lk_status s = lk_layout_build(model, n_model, &lo, label ? label : "(tables)", &lay);
    if (!s) lk_layout_free(&lay);
    return s;
}
