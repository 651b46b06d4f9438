/* config.c — adapter_config.json (PEFT's LoraConfig) and PEFT's pattern rules.
 *
 * Every LoraConfig field is either read (r, lora_alpha, use_rslora,
 * rank_pattern, alpha_pattern, target_modules, exclude_modules,
 * layers_to_transform, layers_pattern, modules_to_save, bias, lora_bias,
 * use_dora, fan_in_fan_out, peft_version), known not to change the merged weights (training
 * and bookkeeping fields), or refused by name when set, because lorakit does
 * not implement what it does to the merge (QA-LoRA, aLoRA,
 * layer_replication, target_parameters, trainable tokens, LoftQ, residual
 * initialisations such as PiSSA, the other LoRA variants). A field lorakit
 * does not know is logged as a warning, never silently trusted.
 *
 * Patterns are Python `re` patterns in PEFT; they are evaluated with PCRE2,
 * which reads that dialect (\d, (?:...), {m,n}, lookarounds), after a small
 * translation of the spots where Python and PCRE2 10.42 differ ({,n} and
 * \Z). PEFT wraps each key in a template (re.match(rf"(.*\.)?({key})$")
 * since 0.15); the same template text is compiled here, so a key with odd
 * parentheses means what it means to Python. Patterns come from downloaded
 * files, so every match runs under PCRE2's match, depth and heap limits: a
 * catastrophic pattern costs bounded time and memory and is reported by key
 * and module instead of hanging a fuse or a serving rank. All PCRE2 memory
 * goes through lk_malloc, so allocation-failure tests reach it too.
 *
 * The work is bounded in total too, not only per match. Plain names (the
 * target_modules / exclude_modules lists) and pattern keys that are runs of
 * one-character atoms (literal or escaped characters, '.', \d \w \s, simple
 * [...] sets: "layers\.3\.blk\d\.proj", the keys PEFT users write) are
 * looked up in hash tables (names.h): a module name costs one lookup per
 * suffix (or per shape of such keys), not one comparison or regex per key,
 * so 10,000 modules against 2,000 keys take milliseconds. Every other match
 * draws on a budget shared by all the configs of one adapter: each match
 * runs at match limits of 4, 64, then 4x that up to the per-match limit,
 * and is charged every limit it ran under (so the charge bounds the steps
 * PCRE2 took, within 4x); lookups are charged by the length they hash.
 * When the budget is spent the match fails naming the config key, pattern
 * and module; at about 60 ns a step here, LK_RE_BUDGET bounds an adapter's
 * matching to a few seconds. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "adapter/config.h"
#include "core/alloc.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

#include <jansson.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>

/* The largest rank a config may name (r, rank_pattern): larger ones are refused, not truncated. */
#define LK_PEFT_RANK_MAX 1000000000
#include <string.h>

/* Bounds for one match of a pattern against one module name. PEFT's
 * patterns need a few hundred steps; these stop (a+)+$ on a long name after
 * a million. */
#define LK_RE_MATCH_LIMIT 1000000u
#define LK_RE_DEPTH_LIMIT 10000u
#define LK_RE_HEAP_KIB 16384u
#define LK_RE_MAX_PATTERN 65536u
/* Total steps (and plain-key lookups, 2 units + 1 per 4 bytes hashed, about
 * their cost in PCRE2 steps) for
 * the patterns of one adapter: about 3 s of PCRE2 at the worst rate seen
 * here; PEFT's own patterns take under 64 steps a module, so this is
 * 780,000 such matches. */
#define LK_RE_BUDGET 50000000u

static void *re_malloc(PCRE2_SIZE n, void *ctx) {
    (void)ctx;
    return lk_malloc(n ? n : 1);
}
static void re_free(void *p, void *ctx) {
    (void)ctx;
    lk_free(p);
}

/* ---- Python -> PCRE2 ---- */

char *lk_py_regex_to_pcre2(const char *py) {
    size_t n = strlen(py);
    char *out = lk_malloc(2 * n + 1); /* each "{," gains one byte, "\Z" none */
    if (!out) return NULL;
    size_t o = 0;
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        char c = py[i];
        if (c == '\\' && i + 1 < n) {
            out[o++] = c;
            out[o++] = (!in_class && py[i + 1] == 'Z') ? 'z' : py[i + 1];
            i++;
            continue;
        }
        if (in_class) {
            if (c == ']') in_class = 0;
            out[o++] = c;
            continue;
        }
        if (c == '[') {
            in_class = 1;
            out[o++] = c;
            /* a ']' right after '[' or '[^' is literal */
            if (i + 1 < n && py[i + 1] == '^') out[o++] = py[++i];
            if (i + 1 < n && py[i + 1] == ']') out[o++] = py[++i];
            continue;
        }
        if (c == '{' && i + 1 < n && py[i + 1] == ',') {
            size_t j = i + 2;
            while (j < n && py[j] >= '0' && py[j] <= '9') j++;
            if (j < n && py[j] == '}') { /* Python's {,n} / {,} is {0,n} / {0,} */
                out[o++] = '{';
                out[o++] = '0';
                continue;
            }
        }
        out[o++] = c;
    }
    out[o] = '\0';
    return out;
}

/* ---- compiling ---- */

/* Compiles tmpl with %s replaced by the translated key (tmpl NULL: the key
 * alone, with `opts`). Errors name label, field, key and PCRE2's reason. */
static lk_status compile(const char *label, const char *field, const char *key, const char *tmpl, uint32_t opts,
                         void **out) {
    *out = NULL;
    char *tr = lk_py_regex_to_pcre2(key);
    if (!tr) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    char *src = tr;
    if (tmpl) {
        size_t n = strlen(tmpl) + strlen(tr) + 1;
        src = lk_malloc(n);
        if (!src) {
            lk_free(tr);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        }
        snprintf(src, n, tmpl, tr);
        lk_free(tr);
    }
    pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
    pcre2_compile_context *cc = g ? pcre2_compile_context_create(g) : NULL;
    if (!cc) {
        pcre2_general_context_free(g);
        lk_free(src);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    }
    pcre2_set_max_pattern_length(cc, LK_RE_MAX_PATTERN);
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | opts, &err, &off, cc);
    pcre2_compile_context_free(cc);
    pcre2_general_context_free(g);
    lk_free(src);
    if (!re) {
        if (err == PCRE2_ERROR_HEAP_FAILED || err == PCRE2_ERROR_NOMEMORY) return lk_error(LK_ERR_NOMEM, "%s: out of memory compiling %s", label, field);
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(err, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", err);
        return lk_error(LK_ERR_CONFIG, "%s: %s: \"%s\" is not a valid pattern (PCRE2: %s)", label, field, key,
                        (const char *)msg);
    }
    *out = re;
    return LK_OK;
}

static lk_re_budget *budget_of(const lk_peft_config *c) {
    return c->budget ? c->budget : (lk_re_budget *)&c->own; /* configs are heap objects, never const ones */
}

static lk_status budget_error(const lk_peft_config *c, const char *field, const char *key, const char *name) {
    lk_re_budget *b = budget_of(c);
    return lk_error(LK_ERR_CONFIG,
                    "%s: %s: pattern \"%s\" on module %s: this adapter's patterns have used lorakit's total "
                    "matching budget (%llu PCRE2 steps, after %llu matches); use plain module names or simpler "
                    "patterns",
                    c->label, field, key, name, (unsigned long long)b->limit, (unsigned long long)b->matches);
}

/* Charges n units of plain-key work; an error naming the field and key
 * once the budget is spent. */
static lk_status charge(const lk_peft_config *c, uint64_t n, const char *field, const char *key, const char *name) {
    lk_re_budget *b = budget_of(c);
    b->used += n;
    return b->used > b->limit ? budget_error(c, field, key, name) : LK_OK;
}

/* Matches re against name from its start (PEFT uses re.match / fullmatch);
 * *hit = 1 on a match; *idx (when not NULL) gets the named group "idx" as a
 * number (-1 if it is not a plain decimal). Limit errors name the pattern. */
static lk_status match(const lk_peft_config *c, void *re_v, const char *field, const char *key, const char *name,
                       int *hit, long *idx) {
    pcre2_code *re = re_v;
    *hit = 0;
    pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
    pcre2_match_data *md = g ? pcre2_match_data_create_from_pattern(re, g) : NULL;
    pcre2_general_context_free(g);
    if (!md) return lk_error(LK_ERR_NOMEM, "%s: out of memory matching %s", c->label, field);
    lk_re_budget *b = budget_of(c);
    int rc = 0, spent = 0;
    /* rungs of 4, 64, then 4x up to the per-match limit: a match is charged
     * the limits it ran under, so one PCRE2 ends at once (a missing required
     * character) costs 4, a typical PEFT key (30-40 steps) 68, and a charge
     * is never more than 4x the steps taken plus 4 */
    for (uint32_t lim = 4;; lim = lim == 4 ? 64 : lim > LK_RE_MATCH_LIMIT / 4 ? LK_RE_MATCH_LIMIT : lim * 4) {
        uint64_t left = b->limit > b->used ? b->limit - b->used : 0;
        uint32_t use = left < lim ? (uint32_t)left : lim;
        if (!use) {
            spent = 1;
            break;
        }
        pcre2_set_match_limit(c->mctx, use);
        rc = pcre2_match(re, (PCRE2_SPTR)name, strlen(name), 0, PCRE2_ANCHORED, md, c->mctx);
        b->used += use;
        if (rc != PCRE2_ERROR_MATCHLIMIT) break;
        if (use < lim) {
            spent = 1;
            break;
        }
        if (lim >= LK_RE_MATCH_LIMIT) break;
    }
    b->matches++;
    if (spent) {
        pcre2_match_data_free(md);
        return budget_error(c, field, key, name);
    }
    lk_status s = LK_OK;
    if (rc >= 0) {
        *hit = 1;
        if (idx) {
            PCRE2_UCHAR buf[24];
            PCRE2_SIZE bl = sizeof buf;
            *idx = -1;
            if (pcre2_substring_copy_byname(md, (PCRE2_SPTR) "idx", buf, &bl) == 0 && bl > 0 && bl < 19) {
                long v = 0;
                size_t k = 0;
                for (; k < bl && buf[k] >= '0' && buf[k] <= '9'; k++) v = v * 10 + (buf[k] - '0');
                if (k == bl) *idx = v;
            }
        }
    } else if (rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(rc, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", rc);
        if (rc == PCRE2_ERROR_NOMEMORY)
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory matching %s \"%s\"", c->label, field, key);
        else
            s = lk_error(LK_ERR_CONFIG,
                         "%s: %s: pattern \"%s\" could not be matched against module %s within lorakit's limits "
                         "(PCRE2: %s); simplify the pattern",
                         c->label, field, key, name, (const char *)msg);
    }
    pcre2_match_data_free(md);
    return s;
}

/* ---- PEFT's templates ---- */

/* PEFT's templates: rank/alpha_pattern since 0.15 and before, modules_to_save. */
#define CUR_TMPL "(.*\\.)?(%s)$"
#define OLD_TMPL ".*\\.%s$"
#define TO_SAVE_TMPL "(^|.*\\.)%s($|\\..*)"

/* An atom-run key's regex, compiled the first time a name that is not
 * plain (name_is_plain) needs it: a config of many such keys compiles none. */
static lk_status lazy_re(const lk_peft_config *c, void **re, const char *field, const char *key, const char *tmpl) {
    return *re ? LK_OK : compile(c->label, field, key, tmpl, 0, re);
}

/* ---- keys that are runs of one-character atoms ---- */

/* Bitmaps over ASCII of the characters an atom matches in a plain name
 * (name_is_plain: printable ASCII, so Python's and PCRE2's Unicode classes
 * reduce to these). */
typedef uint64_t lk_cset[2];

static void cset_add(lk_cset b, unsigned lo, unsigned hi) {
    for (unsigned ch = lo; ch <= hi; ch++) b[ch >> 6] |= UINT64_C(1) << (ch & 63);
}

static int cset_has(const lk_cset b, unsigned char ch) { return ch < 128 && (b[ch >> 6] >> (ch & 63) & 1); }

/* \d \w \s (and the capitals, negated) as sets of printable characters;
 * 0 when e is no such letter. */
static int class_escape(char e, lk_cset b) {
    lk_cset t = {0, 0};
    switch (e | 0x20) {
    case 'd': cset_add(t, '0', '9'); break;
    case 'w': cset_add(t, '0', '9'), cset_add(t, 'A', 'Z'), cset_add(t, 'a', 'z'), cset_add(t, '_', '_'); break;
    case 's': cset_add(t, ' ', ' '); break; /* the only printable whitespace */
    default: return 0;
    }
    if (e >= 'A' && e <= 'Z') { /* \D \W \S: the other printable characters */
        lk_cset all = {0, 0};
        cset_add(all, 0x20, 0x7e);
        t[0] = all[0] & ~t[0], t[1] = all[1] & ~t[1];
    }
    b[0] |= t[0], b[1] |= t[1];
    return 1;
}

/* An escape Python and PCRE2 both read as the character itself: a
 * backslash before printable ASCII punctuation. */
static int literal_escape(char e) { return e > 0x20 && e < 0x7f && !(e >= '0' && e <= '9') && !((e | 0x20) >= 'a' && (e | 0x20) <= 'z'); }

/* One item of a [...] set at k[*i] into b; a literal character also into
 * *lit (else -1). 0 when it is not one lorakit reads without PCRE2. */
static int set_item(const char *k, size_t *i, lk_cset b, int *lit) {
    char c = k[*i];
    *lit = -1;
    if (c == '\\') {
        char e = k[*i + 1];
        *i += 2;
        if (class_escape(e, b)) return 1;
        if (!literal_escape(e)) return 0;
        *lit = (unsigned char)e;
    } else {
        if (c < 0x20 || c > 0x7e || c == '[') return 0; /* '[' (nested sets, POSIX classes): PCRE2 */
        *lit = (unsigned char)c;
        (*i)++;
    }
    cset_add(b, (unsigned)*lit, (unsigned)*lit);
    return 1;
}

/* The set k[*i] = '[' opens, parsed as Python does (a ']' first is
 * literal, ranges a-b of literal characters, '-' first or last literal);
 * *i past its ']'. 0 when it is not one lorakit reads without PCRE2. */
static int parse_set(const char *k, size_t *i, lk_cset out) {
    lk_cset b = {0, 0};
    size_t j = *i + 1;
    int neg = k[j] == '^';
    if (neg) j++;
    int first = 1;
    for (;; first = 0) {
        if (!k[j]) return 0;
        if (k[j] == ']' && !first) break;
        int lo, hi;
        if (k[j] == ']') { /* "[]...]": a literal ']' */
            cset_add(b, ']', ']');
            j++;
            continue;
        }
        if (!set_item(k, &j, b, &lo)) return 0;
        if (k[j] == '-' && k[j + 1] && k[j + 1] != ']') { /* a range */
            j++;
            lk_cset end = {0, 0};
            if (lo < 0 || !set_item(k, &j, end, &hi) || hi < 0 || hi < lo) return 0; /* Python refuses these */
            cset_add(b, (unsigned)lo, (unsigned)hi);
        }
    }
    *i = j + 1;
    if (neg) {
        lk_cset all = {0, 0};
        cset_add(all, 0x20, 0x7e);
        b[0] = all[0] & ~b[0], b[1] = all[1] & ~b[1];
    }
    out[0] = b[0], out[1] = b[1];
    return 1;
}

/* Reads key k as a run of one-character atoms: a printable ASCII character
 * other than \ ^ $ * + ? { } [ ] | ( ), a backslash before punctuation,
 * '.', \d \w \s \D \W \S, or a [...] set. Returns the number of atoms (0:
 * k is something else, matched by PCRE2); when sets is not NULL, sets[a] is
 * atom a's set over printable ASCII. */
static size_t key_atoms(const char *k, lk_cset *sets) {
    size_t n = 0;
    for (size_t i = 0; k[i];) {
        lk_cset b = {0, 0};
        char c = k[i];
        if (c == '\\') {
            char e = k[i + 1];
            if (!class_escape(e, b)) {
                if (!literal_escape(e)) return 0;
                cset_add(b, (unsigned char)e, (unsigned char)e);
            }
            i += 2;
        } else if (c == '[') {
            if (!parse_set(k, &i, b)) return 0;
        } else if (c == '.') {
            cset_add(b, 0x20, 0x7e); /* any character but a newline */
            i++;
        } else {
            if (c < 0x20 || c > 0x7e || strchr("^$*+?{}[]|()", c)) return 0;
            cset_add(b, (unsigned char)c, (unsigned char)c);
            i++;
        }
        if (sets) sets[n][0] = b[0], sets[n][1] = b[1];
        n++;
    }
    return n;
}

/* The one character of set b, or -1 when it has none or several. */
static int cset_single(const lk_cset b) {
    int ch = -1;
    for (unsigned w = 0; w < 2; w++) {
        if (!b[w]) continue;
        if (ch >= 0 || (b[w] & (b[w] - 1))) return -1;
        ch = (int)(w * 64 + (unsigned)__builtin_ctzll(b[w]));
    }
    return ch;
}

/* A name the atom path can match: printable ASCII (one byte is one
 * character, and no newline for '$' to stop before). Other names run every
 * key as a regex. */
static int name_is_plain(const char *n) {
    for (; *n; n++)
        if ((unsigned char)*n < 0x20 || (unsigned char)*n > 0x7e) return 0;
    return 1;
}

static void lit_free(lk_lit_index *x) {
    for (size_t i = 0; i < x->n_shape; i++) lk_names_free(&x->shape[i].keys);
    lk_free(x->shape);
    lk_free(x->arena);
    lk_free(x->re_keys);
    lk_free(x->next);
    lk_free(x->set_of);
    lk_free(x->sets);
    lk_names_free(&x->all);
    lk_names_free(&x->grams);
    lk_free(x->gram_arena);
    lk_free(x->gram_next);
    lk_free(x->always);
    lk_free(x->mark);
    memset(x, 0, sizeof *x);
}

static int shape_cmp(const void *a, const void *b) {
    const lk_lit_shape *x = a, *y = b;
    return x->len < y->len ? -1 : x->len > y->len;
}

/* The index of set b in x->sets (added when new); -1 when out of memory. */
static long set_id(lk_lit_index *x, const lk_cset b, size_t *cap) {
    for (size_t i = 0; i < x->n_sets; i++)
        if (x->sets[i][0] == b[0] && x->sets[i][1] == b[1]) return (long)i;
    if (x->n_sets == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        uint64_t(*ns)[2] = lk_realloc(x->sets, nc * sizeof *ns);
        if (!ns) return -1;
        x->sets = ns;
        *cap = nc;
    }
    x->sets[x->n_sets][0] = b[0], x->sets[x->n_sets][1] = b[1];
    return (long)x->n_sets++;
}

static lk_status gram_build(const lk_peft_config *c, char *const *keys, size_t n, lk_lit_index *x);

/* Indexes keys[0..n) (borrowed: they outlive the index). Its scratch, the
 * atom sets of one key and each key's chain tail, is one allocation. */
static lk_status lit_build(const lk_peft_config *c, char *const *keys, size_t n, lk_lit_index *x) {
    memset(x, 0, sizeof *x);
    lk_names sigs = {0};
    lk_cset *sets = NULL;
    size_t *tail = NULL, total = 1, longest = 1, set_cap = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = key_atoms(keys[i], NULL), sl = strlen(keys[i]);
        if (len) total += 3 * len + 2;
        if (sl > longest) longest = sl; /* key_atoms writes up to one set per byte before it may refuse */
    }
    /* the scratch, one allocation: sets (longest), then tail (n) */
    lk_carve sc = {0};
    const size_t o_sets = LK_CARVE(&sc, longest, lk_cset), o_tail = LK_CARVE(&sc, n ? n : 1, size_t);
    char *scratch = NULL;
    if (lk_names_init(&x->all, n) || lk_names_init(&sigs, n) ||
        !(x->shape = lk_calloc(n ? n : 1, sizeof *x->shape)) || !(x->re_keys = lk_calloc(n ? n : 1, sizeof *x->re_keys)) ||
        !(x->next = lk_malloc((n ? n : 1) * sizeof *x->next)) || !(x->set_of = lk_calloc(n ? n : 1, sizeof *x->set_of)) ||
        !(scratch = lk_carve_alloc(&sc)) || !(x->arena = lk_malloc(total)))
        goto nomem;
    sets = (lk_cset *)(void *)(scratch + o_sets);
    tail = (size_t *)(void *)(scratch + o_tail);
    char *ap = x->arena;
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(keys[i]), sh, first;
        x->next[i] = SIZE_MAX;
        if (lk_names_add(&x->all, keys[i], len, i, NULL)) goto nomem;
        if (!(len = key_atoms(keys[i], sets))) {
            x->re_keys[x->n_re_keys++] = i;
            continue;
        }
        char *sig = ap, *lit = ap + len + 1;
        unsigned char *ids = (unsigned char *)lit + len + 1;
        for (size_t k = 0; k < len; k++) {
            int ch = cset_single(sets[k]);
            long id = ch >= 0 ? -1 : set_id(x, sets[k], &set_cap);
            if (ch < 0 && id < 0) goto nomem;
            sig[k] = ch >= 0 ? 'x' : '.';
            lit[k] = ch >= 0 ? (char)ch : LK_LIT_WILD;
            ids[k] = 0;
            if (ch < 0 && id < 255) ids[k] = (unsigned char)(id + 1);
            else if (ch < 0) { /* over 254 distinct sets in one config: the rest go to PCRE2 */
                x->re_keys[x->n_re_keys++] = i;
                len = 0;
                break;
            }
        }
        if (!len) continue;
        sig[len] = lit[len] = '\0';
        ap = (char *)ids + len;
        x->set_of[i] = ids;
        if (lk_names_add(&sigs, sig, len, x->n_shape, &sh)) goto nomem;
        if (sh == x->n_shape) {
            lk_lit_shape *ns = &x->shape[x->n_shape];
            ns->sig = sig;
            ns->example = keys[i];
            ns->len = len;
            if (lk_names_init(&ns->keys, 1)) goto nomem;
            x->n_shape++;
        }
        /* keys with equal literal bytes in one shape: chained in key order */
        if (lk_names_add(&x->shape[sh].keys, lit, len, i, &first)) goto nomem;
        if (first != i) {
            x->next[tail[first]] = i;
            tail[first] = i;
        } else {
            tail[i] = i;
        }
    }
    lk_free(scratch);
    lk_names_free(&sigs);
    qsort(x->shape, x->n_shape, sizeof *x->shape, shape_cmp);
    lk_status gs = gram_build(c, keys, n, x);
    if (gs) lit_free(x);
    return gs;
nomem:
    lk_free(scratch);
    lk_names_free(&sigs);
    lit_free(x);
    return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
}

/* ---- the regex keys' prefilter ---- */

/* The end of the [...] set at k[i] = '[' (past its ']'), or 0 when it is
 * not one read here (nested '[', an escape at the end). */
static size_t set_end(const char *k, size_t i) {
    size_t j = i + 1;
    if (k[j] == '^') j++;
    if (k[j] == ']') j++;
    while (k[j] && k[j] != ']') {
        if (k[j] == '[') return 0;
        if (k[j] == '\\' && !k[++j]) return 0;
        j++;
    }
    return k[j] ? j + 1 : 0;
}

/* The runs of characters every match of Python pattern k must hold, read
 * conservatively, into out (strlen(k) + 1 bytes) each followed by
 * LK_LIT_WILD; their total length with the separators, 0 when none is sure: a top-level '|', inline flags, '{', escapes other
 * than punctuation and \d \w \s \b \A \Z (and capitals), a group's content
 * (skipped whole), anything not printable ASCII. An atom quantified by ?
 * or * drops out of its run; one quantified by + ends it. A key takes the
 * rarest gram of any of its runs. run: strlen(k) + 1 bytes of scratch. */
static size_t required_literal(const char *k, char *out, char *run) {
    size_t total = 0, cur = 0, i = 0, n = strlen(k);
    int last_lit = 0;
#define END_RUN()                                                                                                      \
    do {                                                                                                               \
        if (cur) memcpy(out + total, run, cur), total += cur, out[total++] = LK_LIT_WILD;                              \
        cur = 0, last_lit = 0;                                                                                         \
    } while (0)
    while (i < n) {
        char c = k[i];
        if (c == '\\') {
            char e = k[i + 1];
            i += 2;
            if (literal_escape(e)) {
                run[cur++] = e, last_lit = 1;
                continue;
            }
            if (!e || !strchr("dwsDWSbBAZz", e)) goto none;
            END_RUN();
        } else if (c == '[') {
            if (!(i = set_end(k, i))) goto none;
            END_RUN();
        } else if (c == '(') {
            if (k[i + 1] == '?' && k[i + 2] && strchr("aiLmsux-", k[i + 2])) goto none; /* inline flags */
            size_t depth = 0;
            for (;;) { /* past the group's ')' */
                if (!k[i]) goto none;
                if (k[i] == '\\') {
                    if (!k[i + 1]) goto none;
                    i += 2;
                } else if (k[i] == '[') {
                    if (!(i = set_end(k, i))) goto none;
                } else {
                    depth += k[i] == '(';
                    if (k[i] == ')' && --depth == 0) {
                        i++;
                        break;
                    }
                    i++;
                }
            }
            END_RUN();
        } else if (c == '|' || c == ')' || c == '{') {
            goto none;
        } else if (c == '*' || c == '?') {
            if (last_lit) cur--; /* the atom before may be absent */
            END_RUN();
            i++;
        } else if (c == '+') {
            END_RUN();
            i++;
        } else if (c == '.' || c == '^' || c == '$' || (unsigned char)c < 0x20 || (unsigned char)c > 0x7e) {
            END_RUN();
            i++;
        } else {
            run[cur++] = c, last_lit = 1;
            i++;
        }
    }
    END_RUN();
#undef END_RUN
    return total;
none:
    return 0;
}

/* The prefilter over the regex keys x->re_keys of keys[0..n). Its scratch
 * is one allocation, all size_t then bytes: per regex key j the offset
 * (pos) and length (ll) of its required literal, per key the tail of its
 * gram's chain, then the literals' text and required_literal's run buffer. */
static lk_status gram_build(const lk_peft_config *c, char *const *keys, size_t n, lk_lit_index *x) {
    const size_t G = LK_GRAM_LEN, m = x->n_re_keys;
    size_t *pos, *ll, *tail, *count = NULL, windows = 0, longest = 1;
    char *scratch = NULL;
    lk_names cnt = {0};
    lk_status s = LK_OK;
    lk_carve sc = {0};
    const size_t o_pos = LK_CARVE(&sc, m, size_t), o_ll = LK_CARVE(&sc, m, size_t),
                 o_tail = LK_CARVE(&sc, n ? n : 1, size_t), o_txt = LK_CARVE(&sc, 0, char);
    for (size_t j = 0; j < m; j++) { /* the literals' text from o_txt: each key's bytes and NUL */
        size_t l = strlen(keys[x->re_keys[j]]) + 1;
        lk_carve_part(&sc, l, 1, 1);
        if (l > longest) longest = l;
    }
    const size_t o_run = lk_carve_part(&sc, longest, 1, 1);
    if (!(scratch = lk_carve_alloc(&sc)) || !(x->always = lk_calloc(n ? n : 1, 1)) ||
        !(x->mark = lk_calloc(n ? n : 1, sizeof *x->mark)) ||
        !(x->gram_next = lk_malloc((n ? n : 1) * sizeof *x->gram_next)) || !(x->gram_arena = lk_malloc(m * G + 1)) ||
        lk_names_init(&x->grams, m))
        goto nomem;
    pos = (size_t *)(void *)(scratch + o_pos);
    ll = (size_t *)(void *)(scratch + o_ll);
    tail = (size_t *)(void *)(scratch + o_tail);
    char *txt = scratch + o_txt, *run = scratch + o_run;
    for (size_t i = 0; i < n; i++) x->gram_next[i] = SIZE_MAX;
    x->n_keys = n;
    for (size_t j = 0, at = 0; j < m; j++) {
        pos[j] = at;
        at += strlen(keys[x->re_keys[j]]) + 1;
        ll[j] = required_literal(keys[x->re_keys[j]], txt + pos[j], run);
        if (ll[j] >= G) windows += ll[j] - G + 1;
    }
    /* how many windows each gram is, over all keys: a key takes its rarest */
    if (lk_names_init(&cnt, windows) || !(count = lk_calloc(windows ? windows : 1, sizeof *count))) goto nomem;
    size_t ids = 0;
    for (size_t j = 0; j < m; j++)
        for (size_t w = 0; ll[j] >= G && w + G <= ll[j]; w++) {
            size_t first;
            if (memchr(txt + pos[j] + w, LK_LIT_WILD, G)) continue; /* across two runs */
            if (lk_names_add(&cnt, txt + pos[j] + w, G, ids, &first)) goto nomem;
            if (first == ids) ids++;
            count[first]++;
        }
    char *ap = x->gram_arena;
    for (size_t j = 0; j < m; j++) {
        const char *lit = txt + pos[j];
        size_t k = x->re_keys[j], pick = SIZE_MAX, least = SIZE_MAX;
        for (size_t w = 0; ll[j] >= G && w + G <= ll[j]; w++) {
            if (memchr(lit + w, LK_LIT_WILD, G)) continue;
            size_t t = count[lk_names_get(&cnt, lit + w, G)];
            if (t < least) least = t, pick = w;
        }
        if (pick == SIZE_MAX) {
            x->always[k] = 1;
            continue;
        }
        memcpy(ap, lit + pick, G);
        size_t first;
        if (lk_names_add(&x->grams, ap, G, k, &first)) goto nomem;
        if (first == k) {
            ap += G;
            tail[k] = k;
        } else {
            x->gram_next[tail[first]] = k;
            tail[first] = k;
        }
    }
    goto out;
nomem:
    s = lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
out:
    lk_free(scratch);
    lk_free(count);
    lk_names_free(&cnt);
    return s;
}

/* Marks the regex keys that plain name may match (their gram is in it);
 * the others are skipped by gram_skip. */
static lk_status gram_mark(const lk_peft_config *c, const lk_lit_index *cx, const char *field, const char *name) {
    lk_lit_index *x = (lk_lit_index *)cx; /* indexes live in heap configs, never const ones */
    if (!x->n_re_keys) return LK_OK;
    if (++x->epoch == 0) { /* wrapped: no stale mark may equal the new epoch */
        memset(x->mark, 0, x->n_keys * sizeof *x->mark);
        x->epoch = 1;
    }
    size_t nl = strlen(name);
    lk_status s = charge(c, 1 + nl / 4, field, "<any>", name);
    if (s) return s;
    for (size_t i = 0; i + LK_GRAM_LEN <= nl; i++)
        for (size_t k = lk_names_get(&x->grams, name + i, LK_GRAM_LEN); k != SIZE_MAX; k = x->gram_next[k])
            x->mark[k] = x->epoch;
    return LK_OK;
}

/* Whether regex key k cannot match the name last marked. */
static int gram_skip(const lk_lit_index *x, size_t k) { return !x->always[k] && x->mark[k] != x->epoch; }

/* The smallest key index whose shape has length len and which matches
 * w[0..len) atom by atom; charged to the budget. buf: len bytes of
 * scratch. */
static lk_status lit_probe(const lk_peft_config *c, const lk_lit_index *x, const char *field, const char *name,
                           const char *w, size_t len, char *buf, size_t *best) {
    size_t lo = 0, hi = x->n_shape;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (x->shape[mid].len < len) lo = mid + 1;
        else hi = mid;
    }
    for (; lo < x->n_shape && x->shape[lo].len == len; lo++) {
        const lk_lit_shape *sh = &x->shape[lo];
        lk_status s = charge(c, 2 + len / 4, field, sh->example, name);
        if (s) return s;
        for (size_t k = 0; k < len; k++) buf[k] = sh->sig[k] == '.' ? LK_LIT_WILD : w[k];
        for (size_t id = lk_names_get(&sh->keys, buf, len); id != SIZE_MAX && id < *best; id = x->next[id]) {
            const unsigned char *ids = x->set_of[id];
            size_t k = 0;
            while (k < len && (!ids[k] || cset_has(x->sets[ids[k] - 1], (unsigned char)w[k]))) k++;
            if (k == len) {
                *best = id;
                break;
            }
            if ((s = charge(c, 1 + len / 4, field, sh->example, name))) return s;
        }
    }
    return LK_OK;
}

enum { LIT_SUFFIX, LIT_DOT_SUFFIX, LIT_WINDOW };

/* The smallest index of an atom-run key matching name as PEFT's template
 * places it: LIT_SUFFIX, (.*\.)?(key)$ (a suffix of name starting at 0 or
 * after a '.'); LIT_DOT_SUFFIX, .*\.key$ (after a '.'); LIT_WINDOW,
 * (^|.*\.)key($|\..*) (a run between dots or ends). SIZE_MAX: none. name
 * must be name_is_plain. */
static lk_status lit_find(const lk_peft_config *c, const lk_lit_index *x, const char *field, const char *name, int mode,
                          size_t *best) {
    *best = SIZE_MAX;
    if (!x->n_shape) return LK_OK;
    size_t nl = strlen(name);
    char *buf = lk_malloc(nl + 1);
    if (!buf) return lk_error(LK_ERR_NOMEM, "%s: out of memory matching %s", c->label, field);
    lk_status s = LK_OK;
    for (size_t i = 0; i <= nl && !s; i++) {
        if (i == 0 ? mode == LIT_DOT_SUFFIX : name[i - 1] != '.') continue;
        if (mode != LIT_WINDOW) {
            s = lit_probe(c, x, field, name, name + i, nl - i, buf, best);
            continue;
        }
        for (size_t j = i; j <= nl && !s; j++) {
            if (j < nl && name[j] != '.') continue;
            if (!(s = charge(c, 1, field, x->shape[0].example, name))) s = lit_probe(c, x, field, name, name + i, j - i, buf, best);
        }
    }
    lk_free(buf);
    return s;
}

/* Whether name equals an entry of set or ends with '.' + an entry (PEFT's
 * target_modules / exclude_modules list rule): one rolling hash over name. */
static int set_hit(const lk_names *set, const char *name) {
    size_t nl = strlen(name);
    uint64_t h = 0, pw = 1;
    for (size_t i = nl + 1; i-- > 0;) { /* the suffix name[i..nl) */
        if (i < nl) lk_names_roll(set, &h, &pw, (unsigned char)name[i]);
        if ((i == 0 || name[i - 1] == '.') && lk_names_get_h(set, h, name + i, nl - i) != SIZE_MAX) return 1;
    }
    return 0;
}

static lk_status list_set(const lk_peft_config *c, char *const *list, size_t n, lk_names *set) {
    if (lk_names_init(set, n)) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t i = 0; i < n; i++)
        if (lk_names_add(set, list[i], strlen(list[i]), i, NULL)) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    return LK_OK;
}

/* ---- freeing ---- */

static void free_patterns(lk_pattern *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        pcre2_code_free(p[i].re);
        lk_free(p[i].key);
    }
    lk_free(p);
}

static void free_strs(char **s, size_t n) {
    for (size_t i = 0; s && i < n; i++) lk_free(s[i]);
    lk_free(s);
}

static void free_codes(void **r, size_t n) {
    for (size_t i = 0; r && i < n; i++) pcre2_code_free(r[i]);
    lk_free(r);
}

static void free_match(lk_peft_match *m) {
    lk_names_free(&m->set);
    free_strs(m->list, m->n);
    lk_free(m->str);
    pcre2_code_free(m->re);
}

void lk_peft_config_free(lk_peft_config *c) {
    if (!c) return;
    lit_free(&c->rank_lit);
    lit_free(&c->alpha_lit);
    lit_free(&c->to_save_lit);
    lk_names_free(&c->to_save_set);
    free_patterns(c->rank_pat, c->n_rank_pat);
    free_patterns(c->alpha_pat, c->n_alpha_pat);
    free_match(&c->target);
    free_match(&c->exclude);
    lk_free(c->layers);
    free_codes(c->layers_re, c->n_layers_re);
    free_strs(c->layers_pats, c->layers_pats ? c->n_layers_re : 0);
    free_strs(c->to_save, c->n_to_save);
    free_codes(c->to_save_re, c->n_to_save);
    pcre2_match_context_free(c->mctx);
    lk_free(c->label);
    memset(c, 0, sizeof *c);
}

void lk_peft_config_share_budget(lk_peft_config *c, lk_re_budget *b) {
    if (!b->limit) b->limit = LK_RE_BUDGET;
    c->budget = b;
}

/* ---- parsing ---- */

static lk_status parse_patterns(lk_peft_config *c, json_t *obj, const char *field, int is_rank, lk_pattern **out,
                                size_t *n_out, lk_lit_index *lit) {
    const char *label = c->label;
    if (!obj || json_is_null(obj)) return LK_OK;
    if (!json_is_object(obj)) return lk_error(LK_ERR_CONFIG, "%s: %s must be an object", label, field);
    size_t n = json_object_size(obj);
    if (n == 0) return LK_OK;
    lk_pattern *p = lk_calloc(n, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    /* PEFT's rule since 0.15 vs the older one (see lk_peft_rule) */
    const char *tmpl = c->rule == LK_PEFT_RULE_CURRENT ? CUR_TMPL : OLD_TMPL;
    size_t i = 0;
    const char *k;
    json_t *v;
    lk_status s = LK_OK;
    json_object_foreach(obj, k, v) { /* jansson keeps the file's key order */
        if (!json_is_number(v)) {
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] must be a number", label, field, k);
            break;
        }
        double d = json_number_value(v);
        if (!isfinite(d)) {
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] = %g is not finite", label, field, k, d);
            break;
        }
        if (is_rank && (d <= 0 || d != floor(d) || d > LK_PEFT_RANK_MAX)) {
            char vb[LK_NUM_STR_MAX];
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] = %s: a rank must be a whole number from 1 to %d", label,
                         field, k, lk_num_str(d, vb), LK_PEFT_RANK_MAX);
            break;
        }
        p[i].key = lk_strdup(k);
        if (!p[i].key) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
            break;
        }
        p[i].value = d;
        /* an atom-run key is matched by lookup; its regex is compiled only if a name needs it (lazy_re) */
        if ((!key_atoms(k, NULL) || strlen(k) > LK_RE_MAX_PATTERN / 2) && (s = compile(label, field, k, tmpl, 0, &p[i].re))) {
            lk_free(p[i].key);
            break;
        }
        i++;
    }
    char **keys = s ? NULL : lk_calloc(i ? i : 1, sizeof *keys);
    if (!s && !keys) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t k = 0; !s && k < i; k++) keys[k] = p[k].key;
    if (!s) s = lit_build(c, keys, i, lit);
    lk_free(keys);
    if (s) {
        free_patterns(p, i);
        return s;
    }
    *out = p;
    *n_out = i;
    return LK_OK;
}

static lk_status str_list(json_t *v, const char *label, const char *field, char ***out, size_t *n_out) {
    size_t n = json_array_size(v);
    char **l = lk_calloc(n ? n : 1, sizeof *l);
    if (!l) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_string(e)) {
            free_strs(l, i);
            return lk_error(LK_ERR_CONFIG, "%s: %s[%zu] must be a string", label, field, i);
        }
        if (!(l[i] = lk_strdup(json_string_value(e)))) {
            free_strs(l, i);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        }
    }
    *out = l;
    *n_out = n;
    return LK_OK;
}

/* target_modules / exclude_modules: a list, or one string matched with
 * re.fullmatch ("all-linear" is a keyword for target_modules). */
static lk_status parse_match(lk_peft_config *c, json_t *v, const char *field, lk_peft_match *m) {
    if (!v || json_is_null(v)) return LK_OK;
    if (json_is_string(v)) {
        const char *t = json_string_value(v);
        if (!(m->str = lk_strdup(t))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
        if (!strcmp(field, "target_modules") && !strcmp(t, "all-linear")) return LK_OK;
        return compile(c->label, field, t, NULL, PCRE2_ANCHORED | PCRE2_ENDANCHORED, &m->re);
    }
    if (!json_is_array(v)) return lk_error(LK_ERR_CONFIG, "%s: %s must be a list or a string", c->label, field);
    m->has_list = 1;
    lk_status s = str_list(v, c->label, field, &m->list, &m->n);
    return s ? s : list_set(c, m->list, m->n, &m->set);
}

static lk_status parse_layers(lk_peft_config *c, json_t *root) {
    json_t *v = json_object_get(root, "layers_to_transform");
    if (v && !json_is_null(v)) {
        size_t n = json_is_array(v) ? json_array_size(v) : 1;
        if (!json_is_array(v) && !json_is_integer(v))
            return lk_error(LK_ERR_CONFIG, "%s: layers_to_transform must be an integer or a list of integers", c->label);
        if (n) { /* an empty list means every layer, as in PEFT */
            if (!(c->layers = lk_calloc(n, sizeof *c->layers))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
            for (size_t i = 0; i < n; i++) {
                json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
                if (!json_is_integer(e))
                    return lk_error(LK_ERR_CONFIG, "%s: layers_to_transform[%zu] must be an integer", c->label, i);
                c->layers[i] = (long)json_integer_value(e);
            }
            c->n_layers = n;
        }
    }
    if (!c->n_layers) return LK_OK;
    /* PEFT's layer-index rule: the first numbered segment after a layers_pattern
     * name (or after any name when there is none); lazy since PEFT 0.15, greedy
     * (the last such segment) before. */
    int cur = c->rule == LK_PEFT_RULE_CURRENT;
    json_t *p = json_object_get(root, "layers_pattern");
    char **pats = NULL;
    size_t np = 0;
    lk_status s = LK_OK;
    if (p && json_is_string(p) && json_string_length(p)) {
        if (!(pats = lk_calloc(1, sizeof *pats)) || !(pats[0] = lk_strdup(json_string_value(p)))) {
            lk_free(pats);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
        }
        np = 1;
    } else if (p && json_is_array(p)) {
        if ((s = str_list(p, c->label, "layers_pattern", &pats, &np))) return s;
    } else if (p && !json_is_null(p) && !json_is_string(p)) {
        return lk_error(LK_ERR_CONFIG, "%s: layers_pattern must be a string or a list of strings", c->label);
    }
    size_t nre = np ? np : 1;
    if (!(c->layers_re = lk_calloc(nre, sizeof *c->layers_re))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t i = 0; !s && i < nre; i++) {
        if (np)
            s = compile(c->label, "layers_pattern", pats[i],
                        cur ? "(?:^|.*?\\.)%s\\.(?P<idx>\\d+)\\." : ".*\\.%s\\.(?P<idx>\\d+)\\.", 0, &c->layers_re[i]);
        else
            s = compile(c->label, "layers_to_transform", "", cur ? ".*?\\.[^.]*\\.(?P<idx>\\d+)\\.%s" : ".*\\.[^.]*\\.(?P<idx>\\d+)\\.%s",
                        0, &c->layers_re[i]);
        if (!s) c->n_layers_re = i + 1;
    }
    if (!s && np) { /* kept for messages: a limit names the entry as written */
        c->layers_pats = pats;
        return s;
    }
    free_strs(pats, np);
    return s;
}

static lk_status parse_to_save(lk_peft_config *c, json_t *v) {
    if (!v || json_is_null(v)) return LK_OK;
    if (!json_is_array(v)) return lk_error(LK_ERR_CONFIG, "%s: modules_to_save must be a list of strings", c->label);
    lk_status s = str_list(v, c->label, "modules_to_save", &c->to_save, &c->n_to_save);
    if (s) return s;
    if (!(c->to_save_re = lk_calloc(c->n_to_save ? c->n_to_save : 1, sizeof *c->to_save_re)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t i = 0; i < c->n_to_save && !s; i++) {
        if (!key_atoms(c->to_save[i], NULL) || strlen(c->to_save[i]) > LK_RE_MAX_PATTERN / 2)
            s = compile(c->label, "modules_to_save", c->to_save[i], TO_SAVE_TMPL, 0, &c->to_save_re[i]);
        size_t l = strlen(c->to_save[i]);
        if (l > c->to_save_max) c->to_save_max = l;
    }
    if (!s) s = lit_build(c, c->to_save, c->n_to_save, &c->to_save_lit);
    if (!s) s = list_set(c, c->to_save, c->n_to_save, &c->to_save_set);
    return s;
}

static int is_set(json_t *v) {
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    if (json_is_object(v)) return json_object_size(v) > 0;
    if (json_is_array(v)) return json_array_size(v) > 0;
    if (json_is_string(v)) return json_string_length(v) > 0;
    return 1;
}

static void value_text(json_t *v, char *buf, size_t cap) {
    char *js = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    snprintf(buf, cap, "%.60s%s", js ? js : "?", js && strlen(js) > 60 ? "..." : "");
    free(js);
}

/* Fields that change the merge in a way lorakit does not implement. */
static const struct {
    const char *key, *why;
} g_refused[] = {
    {"use_qalora", "QA-LoRA merges through quantization groups, which lorakit does not implement"},
    {"alora_invocation_tokens", "an activated LoRA (aLoRA) applies only after its invocation tokens and cannot be merged"},
    {"layer_replication", "layer replication changes the model's structure"},
    {"target_parameters", "LoRA on nn.Parameter targets (e.g. MoE experts) is not supported"},
    {"trainable_token_indices", "trainable tokens (token-level embedding deltas) are not supported"},
    {"megatron_config", "Megatron tensor-parallel LoRA layers are not supported"},
    {"loftq_config", "LoftQ adapters go with a quantized residual base, not the original weights"},
    {"velora_config", "the VeLoRA variant is not supported"},
    {"monteclora_config", "the MonteCLoRA variant is not supported"},
    {"arrow_config", "Arrow routing between adapters cannot be merged into one weight"},
    {"kasa_config", "the KaSA variant is not supported"},
    {"use_bdlora", "block-diagonal LoRA (BD-LoRA) is not supported"},
};

/* Fields that do not change the merged weights (or are read above). */
static const char *const g_known[] = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "bias",
    "use_rslora", "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "megatron_core", "eva_config", "corda_config", "lora_ga_config",
    "use_dora", "qalora_group_size", "runtime_config", "lora_bias", "ensure_weight_tying",
    "target_modules_to_tie", "fan_in_fan_out",
};

static lk_status check_fields(lk_peft_config *c, json_t *root) {
    const char *label = c->label;
    char val[96];
    json_t *v;
    for (size_t i = 0; i < sizeof g_refused / sizeof g_refused[0]; i++)
        if (is_set(v = json_object_get(root, g_refused[i].key))) {
            value_text(v, val, sizeof val);
            return lk_error(LK_ERR_UNSUPPORTED, "%s: %s = %s: %s", label, g_refused[i].key, val, g_refused[i].why);
        }
    if ((v = json_object_get(root, "init_lora_weights")) && json_is_string(v)) {
        const char *s = json_string_value(v);
        static const char *const residual[] = {"pissa", "olora", "corda", "loftq", "lora_ga", "mica"};
        for (size_t i = 0; i < sizeof residual / sizeof residual[0]; i++)
            if (!strncmp(s, residual[i], strlen(residual[i])))
                return lk_error(LK_ERR_UNSUPPORTED,
                                "%s: init_lora_weights = \"%s\": this initialisation changes the base weights (or the "
                                "merge), so the adapter does not apply to the original model; convert it with PEFT's "
                                "save_pretrained(path_initial_model_for_weight_conversion=...) first",
                                label, s);
    }
    const char *k;
    json_object_foreach(root, k, v) {
        int known = 0;
        for (size_t i = 0; i < sizeof g_known / sizeof g_known[0] && !known; i++) known = !strcmp(k, g_known[i]);
        for (size_t i = 0; i < sizeof g_refused / sizeof g_refused[0] && !known; i++) known = !strcmp(k, g_refused[i].key);
        if (!known && is_set(v)) {
            value_text(v, val, sizeof val);
            lk_log(LK_LOG_WARN, "%s: unknown field %s = %s ignored (lorakit follows PEFT up to 0.21)", label, k, val);
        }
    }
    return LK_OK;
}

static lk_peft_rule rule_of(const char *version) {
    unsigned maj = 0, min = 0;
    if (!version[0] || sscanf(version, "%u.%u", &maj, &min) != 2 || maj > 0) return LK_PEFT_RULE_CURRENT;
    if (min <= 13) return LK_PEFT_RULE_013;
    if (min == 14) return LK_PEFT_RULE_014;
    return LK_PEFT_RULE_CURRENT;
}

/* The PCRE2 match context every match of config c runs under (its
 * memory through lk_malloc; match, depth and heap limits), owned by c, and
 * c's own matching budget. */
static lk_status match_context(lk_peft_config *c) {
    pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
    c->mctx = g ? pcre2_match_context_create(g) : NULL;
    pcre2_general_context_free(g);
    if (!c->mctx) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    pcre2_set_match_limit(c->mctx, LK_RE_MATCH_LIMIT);
    pcre2_set_depth_limit(c->mctx, LK_RE_DEPTH_LIMIT);
    pcre2_set_heap_limit(c->mctx, LK_RE_HEAP_KIB);
    c->own.limit = LK_RE_BUDGET;
    return LK_OK;
}

/* r (a whole number from 1 to LK_PEFT_RANK_MAX) and lora_alpha (a finite
 * number) of root into c, when given. */
static lk_status parse_rank_alpha(lk_peft_config *c, json_t *root) {
    const char *label = c->label;
    json_t *v;
    if ((v = json_object_get(root, "r")) && !json_is_null(v)) {
        if (!json_is_number(v)) return lk_error(LK_ERR_CONFIG, "%s: r must be a number", label);
        double d = json_number_value(v);
        if (d != floor(d) || d <= 0 || d > LK_PEFT_RANK_MAX) {
            char vb[LK_NUM_STR_MAX];
            return lk_error(LK_ERR_CONFIG, "%s: r = %s: the rank must be a whole number from 1 to %d", label,
                            lk_num_str(d, vb), LK_PEFT_RANK_MAX);
        }
        c->r = (long)d;
    }
    if ((v = json_object_get(root, "lora_alpha")) && !json_is_null(v)) {
        if (!json_is_number(v) || !isfinite(json_number_value(v)))
            return lk_error(LK_ERR_CONFIG, "%s: lora_alpha must be a finite number", label);
        c->alpha = json_number_value(v);
    }
    return LK_OK;
}

/* OFTConfig's fields (peft_type "OFT"): the ones its merge reads into
 * c->oft_opts; r / oft_block_size are checked per module against
 * oft_R.weight's shape (adapter.c); fields that change the merge in a way
 * lorakit does not implement are refused by name. */
static const char *const g_oft_known[] = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "oft_block_size", "module_dropout", "target_modules", "exclude_modules", "bias",
    "init_weights", "layers_to_transform", "layers_pattern", "modules_to_save", "coft", "eps", "block_share",
    "use_cayley_neumann", "num_cayley_neumann_terms", "fan_in_fan_out",
    "boft_block_size", "boft_block_num", "boft_n_butterfly_factor", "boft_dropout", /* BOFTConfig */
};

static lk_status parse_oft(lk_peft_config *c, json_t *root, int boft) {
    const char *label = c->label, *k;
    char val[96];
    json_t *v;
    c->oft = 1;
    c->oft_opts = (lk_oft_peft){.coft = 0, .eps = 6e-5, .neumann_terms = boft ? 0 : 5, .block_share = 0, .boft = boft};
    json_object_foreach(root, k, v) {
        int known = 0;
        for (size_t i = 0; i < sizeof g_oft_known / sizeof g_oft_known[0] && !known; i++)
            known = !strcmp(k, g_oft_known[i]);
        if (!known && is_set(v)) {
            value_text(v, val, sizeof val);
            lk_log(LK_LOG_WARN, "%s: unknown OFT field %s = %s ignored (lorakit follows PEFT up to 0.21)", label, k,
                   val);
        }
    }
    if ((v = json_object_get(root, "peft_version")) && json_is_string(v)) {
        snprintf(c->version, sizeof c->version, "%s", json_string_value(v));
        c->rule = rule_of(c->version);
    }
    if (json_is_true(json_object_get(root, "fan_in_fan_out")))
        return lk_error(LK_ERR_UNSUPPORTED, "%s: fan_in_fan_out = true: PEFT's OFT merge on Conv1D-style [in, out] "
                        "weights is not supported", label);
    if ((v = json_object_get(root, "bias")) && !json_is_null(v) &&
        (!json_is_string(v) || strcmp(json_string_value(v), "none"))) {
        value_text(v, val, sizeof val);
        return lk_error(LK_ERR_UNSUPPORTED, "%s: bias = %s: OFT adapters with trained biases are not supported "
                        "(only \"none\")", label, val);
    }
    if (boft) { /* the exact Cayley, no coft, no sharing: BOFTConfig has none of those */
        c->r = 0;
        c->alpha = 0.0;
        return LK_OK;
    }
    c->oft_opts.coft = json_is_true(json_object_get(root, "coft"));
    c->oft_opts.block_share = json_is_true(json_object_get(root, "block_share"));
    if ((v = json_object_get(root, "eps")) && !json_is_null(v)) {
        if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0)
            return lk_error(LK_ERR_CONFIG, "%s: eps must be a finite number >= 0", label);
        c->oft_opts.eps = json_number_value(v);
    }
    if ((v = json_object_get(root, "use_cayley_neumann")) && json_is_false(v)) c->oft_opts.neumann_terms = 0;
    if (c->oft_opts.neumann_terms && (v = json_object_get(root, "num_cayley_neumann_terms")) && !json_is_null(v)) {
        double d = json_is_number(v) ? json_number_value(v) : NAN;
        if (!(d == floor(d)) || d > 64) {
            value_text(v, val, sizeof val);
            return lk_error(LK_ERR_UNSUPPORTED, "%s: num_cayley_neumann_terms = %s: a whole number up to 64 is "
                            "supported", label, val);
        }
        c->oft_opts.neumann_terms = d < 1 ? 1 : (int)d; /* PEFT: 1 or fewer terms give R = I */
    }
    c->r = 0;
    c->alpha = 0.0;
    return LK_OK; /* target_modules, exclude_modules, the layer rule, modules_to_save: parse_rules */
}

/* The scalar fields of root into c, in order: peft_type (LORA only), the
 * refused and unknown fields (check_fields), peft_version (the rule), r,
 * lora_alpha, the flags, bias. */
static lk_status parse_scalars(lk_peft_config *c, json_t *root) {
    const char *label = c->label;
    char val[96];
    lk_status s;
    json_t *v;
    if ((v = json_object_get(root, "peft_type")) && !json_is_null(v) &&
        (!json_is_string(v) || (strcmp(json_string_value(v), "LORA") && strcmp(json_string_value(v), "OFT") &&
                                  strcmp(json_string_value(v), "BOFT")))) {
        value_text(v, val, sizeof val);
        return lk_error(LK_ERR_UNSUPPORTED, "%s: peft_type = %s; only LORA, OFT and BOFT adapters can be fused", label,
                        val);
    }
    if (v && json_is_string(v) && strcmp(json_string_value(v), "LORA"))
        return parse_oft(c, root, !strcmp(json_string_value(v), "BOFT"));
    if ((s = check_fields(c, root))) return s;
    if ((v = json_object_get(root, "peft_version")) && json_is_string(v)) {
        snprintf(c->version, sizeof c->version, "%s", json_string_value(v));
        c->rule = rule_of(c->version);
    }
    if ((s = parse_rank_alpha(c, root))) return s;
    c->rslora = json_is_true(json_object_get(root, "use_rslora"));
    c->use_dora = json_is_true(json_object_get(root, "use_dora"));
    c->lora_bias = json_is_true(json_object_get(root, "lora_bias"));
    c->fan_in_fan_out = json_is_true(json_object_get(root, "fan_in_fan_out"));
    if ((v = json_object_get(root, "bias")) && !json_is_null(v)) {
        const char *b = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(b, "none")) c->bias = LK_PEFT_BIAS_NONE;
        else if (!strcmp(b, "all")) c->bias = LK_PEFT_BIAS_ALL;
        else if (!strcmp(b, "lora_only")) c->bias = LK_PEFT_BIAS_LORA_ONLY;
        else {
            value_text(v, val, sizeof val);
            return lk_error(LK_ERR_UNSUPPORTED, "%s: bias = %s (PEFT's values: \"none\", \"all\", \"lora_only\")", label,
                            val);
        }
    }
    return LK_OK;
}

/* The matching rules of root into c, in order: rank_pattern,
 * alpha_pattern, target_modules, exclude_modules, the layer rule,
 * modules_to_save (c->rule, from the scalars, picks PEFT's templates). */
static lk_status parse_rules(lk_peft_config *c, json_t *root) {
    lk_status s;
    if ((s = parse_patterns(c, json_object_get(root, "rank_pattern"), "rank_pattern", 1, &c->rank_pat, &c->n_rank_pat,
                            &c->rank_lit)) ||
        (s = parse_patterns(c, json_object_get(root, "alpha_pattern"), "alpha_pattern", 0, &c->alpha_pat,
                            &c->n_alpha_pat, &c->alpha_lit)) ||
        (s = parse_match(c, json_object_get(root, "target_modules"), "target_modules", &c->target)) ||
        (s = parse_match(c, json_object_get(root, "exclude_modules"), "exclude_modules", &c->exclude)) ||
        (s = parse_layers(c, root)))
        return s;
    return parse_to_save(c, json_object_get(root, "modules_to_save"));
}

/* In steps: the JSON text (an object), the match context, the scalar
 * fields, the matching rules. On failure everything parsed is freed and
 * *out is untouched. */
lk_status lk_peft_config_parse(const char *text, size_t len, const char *label, lk_peft_config *out) {
    lk_peft_config c;
    memset(&c, 0, sizeof c);
    c.r = 8;
    c.alpha = 8;
    if (!(c.label = lk_strdup(label))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    lk_status s = LK_OK;
    if (!root)
        s = lk_error(LK_ERR_CONFIG, "%s: invalid JSON at line %d column %d: %s", label, je.line, je.column, je.text);
    else if (!json_is_object(root))
        s = lk_error(LK_ERR_CONFIG, "%s: not a JSON object", label);
    if (!s) s = match_context(&c);
    if (!s) s = parse_scalars(&c, root);
    if (!s) s = parse_rules(&c, root);
    json_decref(root);
    if (s) {
        lk_peft_config_free(&c);
        return s;
    }
    *out = c;
    return LK_OK;
}

lk_status lk_peft_config_load(const char *path, lk_peft_config *out) {
    char *buf;
    size_t len;
    lk_status s = lk_read_config(path, &buf, &len);
    if (s) return s;
    s = lk_peft_config_parse(buf, len, path, out);
    lk_free(buf);
    return s;
}

/* ---- the rules ---- */

/* The first key (in the config's order) of rank_pattern (l = 0) or
 * alpha_pattern (1) whose PEFT pattern matches name: *out its index, or
 * SIZE_MAX. Plain keys by lookup, the others by PCRE2 up to the first
 * plain hit. */
static lk_status first_hit(const lk_peft_config *c, int l, const char *name, size_t *out) {
    const lk_pattern *p = l ? c->alpha_pat : c->rank_pat;
    const lk_lit_index *x = l ? &c->alpha_lit : &c->rank_lit;
    const char *field = l ? "alpha_pattern" : "rank_pattern";
    size_t n = l ? c->n_alpha_pat : c->n_rank_pat, best = SIZE_MAX;
    int plain = name_is_plain(name);
    lk_status s;
    *out = SIZE_MAX;
    if (plain && (s = lit_find(c, x, field, name, c->rule == LK_PEFT_RULE_CURRENT ? LIT_SUFFIX : LIT_DOT_SUFFIX, &best)))
        return s;
    if (plain && (s = gram_mark(c, x, field, name))) return s;
    size_t m = plain ? x->n_re_keys : n;
    for (size_t k = 0; k < m; k++) {
        size_t i = plain ? x->re_keys[k] : k;
        if (i >= best) break;
        if (plain && gram_skip(x, i)) continue; /* its required text is not in name */
        int hit;
        void **re = (void **)&p[i].re; /* configs are heap objects, never const ones */
        if ((s = lazy_re(c, re, field, p[i].key, c->rule == LK_PEFT_RULE_CURRENT ? CUR_TMPL : OLD_TMPL))) return s;
        if ((s = match(c, *re, field, p[i].key, name, &hit, NULL))) return s;
        if (hit) {
            best = i;
            break;
        }
    }
    *out = best;
    return LK_OK;
}

lk_status lk_peft_pattern_find(const lk_peft_config *c, int which, const char *name, const lk_pattern **out) {
    *out = NULL;
    /* PEFT <= 0.13 chained rank_pattern's keys and alpha_pattern's keys and took
     * the first that matched for both lookups. */
    const lk_pattern *lists[2] = {c->rank_pat, c->alpha_pat};
    const lk_lit_index *idx[2] = {&c->rank_lit, &c->alpha_lit};
    int from = which, to = which;
    if (c->rule == LK_PEFT_RULE_013) from = 0, to = 1;
    for (int l = from; l <= to; l++) {
        size_t i;
        lk_status s = first_hit(c, l, name, &i);
        if (s) return s;
        if (i == SIZE_MAX) continue;
        if (l != which) { /* 0.13: the key found names no entry of this dict, unless both have it */
            const char *k = lists[l][i].key;
            size_t j = lk_names_get(&idx[which]->all, k, strlen(k));
            if (j != SIZE_MAX) *out = &lists[which][j];
            return LK_OK;
        }
        *out = &lists[l][i];
        return LK_OK;
    }
    /* No pattern matched: PEFT then looks the module's own name up. */
    size_t j = lk_names_get(&idx[which]->all, name, strlen(name));
    if (j != SIZE_MAX) *out = &lists[which][j];
    return LK_OK;
}

lk_status lk_peft_targets(const lk_peft_config *c, const char *name, int *hit) {
    lk_status s;
    int h = 0;
    *hit = 0;
    if (c->exclude.re) {
        if ((s = match(c, c->exclude.re, "exclude_modules", c->exclude.str, name, &h, NULL))) return s;
        if (h) return LK_OK;
    } else if (c->exclude.has_list && set_hit(&c->exclude.set, name)) {
        return LK_OK;
    }
    if (c->n_to_save) { /* plain entries by lookup, the others by PCRE2 */
        int plain = name_is_plain(name);
        size_t best;
        if (plain && (s = lit_find(c, &c->to_save_lit, "modules_to_save", name, LIT_WINDOW, &best))) return s;
        if (plain && best != SIZE_MAX) return LK_OK;
        if (plain && (s = gram_mark(c, &c->to_save_lit, "modules_to_save", name))) return s;
        size_t m = plain ? c->to_save_lit.n_re_keys : c->n_to_save;
        for (size_t k = 0; k < m; k++) {
            size_t i = plain ? c->to_save_lit.re_keys[k] : k;
            if (plain && gram_skip(&c->to_save_lit, i)) continue;
            if ((s = lazy_re(c, &c->to_save_re[i], "modules_to_save", c->to_save[i], TO_SAVE_TMPL))) return s;
            if ((s = match(c, c->to_save_re[i], "modules_to_save", c->to_save[i], name, &h, NULL))) return s;
            if (h) return LK_OK;
        }
    }
    if (c->target.re) return match(c, c->target.re, "target_modules", c->target.str, name, hit, NULL);
    if (!c->target.has_list) { /* absent, or "all-linear" */
        *hit = 1;
        return LK_OK;
    }
    if (!strcmp(name, "") || !set_hit(&c->target.set, name)) return LK_OK;
    /* layers_to_transform applies to the list form only, and not to an exact name */
    int exact = lk_names_get(&c->target.set, name, strlen(name)) != SIZE_MAX;
    if (!c->n_layers || exact) {
        *hit = 1;
        return LK_OK;
    }
    for (size_t i = 0; i < c->n_layers_re; i++) {
        long idx = -1;
        s = c->layers_pats ? match(c, c->layers_re[i], "layers_pattern", c->layers_pats[i], name, &h, &idx)
                           : match(c, c->layers_re[i], "layers_to_transform", "<any layer name>.<index>.", name, &h, &idx);
        if (s) return s;
        if (!h) continue;
        for (size_t j = 0; j < c->n_layers; j++)
            if (idx >= 0 && idx == c->layers[j]) *hit = 1;
        return LK_OK;
    }
    return LK_OK;
}

int lk_peft_saved_module(const lk_peft_config *c, const char *name) {
    size_t nl = strlen(name);
    const lk_names *t = &c->to_save_set;
    for (size_t end = 1; end <= nl; end++) {
        if (end < nl && name[end] != '.') continue;
        /* every non-empty suffix of name[0..end) up to the longest entry: one rolling hash */
        uint64_t h = 0, pw = 1;
        for (size_t i = end; i-- > 0 && end - i <= c->to_save_max;) {
            lk_names_roll(t, &h, &pw, (unsigned char)name[i]);
            if (lk_names_get_h(t, h, name + i, end - i) != SIZE_MAX) return 1;
        }
    }
    return 0;
}
