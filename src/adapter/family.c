/* family.c — model-family name tables: parsing and finding them.
 *
 * A table is a small line-based text file (README "Model families and
 * layouts"), one per family under data/families/, installed with the
 * library, and the same format for a user's --map file:
 *
 *   lorakit-family 1
 *   family flux
 *   detect double_blocks.0.img_attn.qkv.weight img_in.weight !txt_in.individual_token_refiner.blocks.0.norm1.weight
 *   map double_blocks.#.img_attn.qkv transformer_blocks.#.attn.to_q 0/3:1/3 0/1:1/1
 *   map double_blocks.#.img_attn.proj transformer_blocks.#.attn.to_out.0
 *
 * `map ORIG DIFF [ORIG_ROWS DIFF_ROWS]`: the original (single-file) name and
 * the diffusers name of one weight, '.'-separated; a '#' component is a
 * decimal number (captured, substituted in order on the other side), a
 * '#last' component the highest number the checkpoint has there (its last
 * block; for a name it matches, the '#last' rules replace the '#' ones), a
 * final '*' the rest of the name. `alias ORIG NAME [ORIG_ROWS NAME_ROWS]`: the
 * same, for another spelling of rows the map lines name too (ComfyUI's
 * linear1_qkv, a trainer's names for the same weight): exempt from the
 * overlap check, which is about the table's own two namings. `detect K1 K2 !K3`: the table applies to
 * a checkpoint with K1 and K2 and without K3; detect lines are alternatives. With rows, rows ORIG_ROWS of the original weight
 * are rows DIFF_ROWS of the diffusers one, each a:b/c:d fraction of the
 * weight's rows (a fused q,k,v is three rules of thirds). Every line is
 * checked (length, tokens, fractions) and errors name the file, line and
 * key; two rules placing different names on overlapping rows of one weight
 * are an error, as is an unknown key. */
#include "adapter/layout.h"
#include "core/file.h"
#include "lorakit/alloc.h"

#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define LINE_MAX_BYTES 4096
#define MAX_CAPTURES 8
#define MAX_DEN 4096
#define MAX_TOKENS 9
#define TABLE_MAX_BYTES ((unsigned)LK_KNOB_FAMILY_TABLE_MAX_BYTES_DEFAULT) /* lorakit/knobs.h */

void lk_family_free(lk_family *f) {
    if (!f) return;
    lk_free(f->name);
    lk_free(f->file);
    for (size_t i = 0; i < f->n_detect; i++) lk_free(f->detect[i]);
    lk_free(f->detect);
    for (size_t i = 0; i < f->n_rules; i++) {
        lk_free(f->rules[i].orig);
        lk_free(f->rules[i].diff);
    }
    lk_free(f->rules);
    memset(f, 0, sizeof *f);
}

/* A pattern: '.'-separated non-empty components of [A-Za-z0-9_-], a '#'
 * component, at most one '#last' component, or a final '*'. *caps counts the
 * '#'s and '#last', *star the final '*', *last the capture index of '#last'
 * (-1: none). */
static int pattern_ok(const char *p, int *caps, int *star, int *last) {
    *caps = 0;
    *star = 0;
    *last = -1;
    const char *c = p;
    for (;;) {
        const char *e = strchr(c, '.');
        size_t n = e ? (size_t)(e - c) : strlen(c);
        if (!n) return 0;
        if ((n == 1 && *c == '#') || (n == 5 && !memcmp(c, "#last", 5))) {
            if (n == 5) {
                if (*last >= 0) return 0;
                *last = *caps;
            }
            if (++*caps > MAX_CAPTURES) return 0;
        } else if (n == 1 && *c == '*') {
            if (e) return 0;
            *star = 1;
        } else {
            for (size_t i = 0; i < n; i++) {
                char ch = c[i];
                if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                      ch == '-'))
                    return 0;
            }
        }
        if (!e) return 1;
        c = e + 1;
    }
}

static int parse_i64(const char *s, const char **end, int64_t *v) {
    int64_t x = 0;
    const char *p = s;
    if (*p < '0' || *p > '9') return 0;
    while (*p >= '0' && *p <= '9') {
        if (x > (INT64_MAX - 9) / 10) return 0;
        x = x * 10 + (*p++ - '0');
    }
    *end = p;
    *v = x;
    return 1;
}

static void reduce(int64_t *n, int64_t *d) {
    int64_t a = *n, b = *d;
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    *n /= a; /* a >= 1: *d >= 1 */
    *d /= a;
}

/* "a/b:c/d" with 0 <= a/b < c/d <= 1 and denominators in 1..MAX_DEN. */
static int frac_parse(const char *s, lk_frac *f) {
    const char *p = s;
    if (!parse_i64(p, &p, &f->n0) || *p++ != '/' || !parse_i64(p, &p, &f->d0) || *p++ != ':' ||
        !parse_i64(p, &p, &f->n1) || *p++ != '/' || !parse_i64(p, &p, &f->d1) || *p)
        return 0;
    if (f->d0 < 1 || f->d1 < 1 || f->d0 > MAX_DEN || f->d1 > MAX_DEN) return 0;
    if (f->n0 > f->d0 || f->n1 > f->d1) return 0;
    if (f->n0 * f->d1 >= f->n1 * f->d0) return 0; /* empty */
    reduce(&f->n0, &f->d0); /* in lowest terms: 0/3 and 0/1, 1/3 and 2/6 are one row, compared bytewise */
    reduce(&f->n1, &f->d1);
    return 1;
}

static int frac_overlap(const lk_frac *a, const lk_frac *b) {
    /* a0 < b1 && b0 < a1, cross-multiplied (denominators <= MAX_DEN) */
    return a->n0 * b->d1 < b->n1 * a->d0 && b->n0 * a->d1 < a->n1 * b->d0;
}

static const lk_frac g_all = {0, 1, 1, 1};

/* Splits line (NUL-terminated, modified) into at most cap whitespace tokens;
 * returns the count, or cap + 1 when there are more. */
static size_t tokens(char *line, char **tok, size_t cap) {
    size_t n = 0;
    char *p = line;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\r') p++;
        if (!*p || *p == '#') return n; /* '#' starts a comment only at a token's start */
        if (n == cap) return cap + 1;
        tok[n++] = p;
        while (*p && *p != ' ' && *p != '\t' && *p != '\r') p++;
        if (*p) *p++ = '\0';
    }
}

static lk_status push_str(char ***v, size_t *n, const char *s, const char *file) {
    char **nv = lk_realloc(*v, (*n + 1) * sizeof *nv);
    if (!nv) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    *v = nv;
    if (!(nv[*n] = lk_strdup(s))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    (*n)++;
    return LK_OK;
}

static lk_status parse_line(lk_family *f, char *line, int ln, const char *file, int *header) {
    char *tok[MAX_TOKENS + 1];
    size_t nt = tokens(line, tok, MAX_TOKENS);
    if (nt == 0) return LK_OK;
    if (nt > MAX_TOKENS) return lk_error(LK_ERR_CONFIG, "%s:%d: more than %d fields", file, ln, MAX_TOKENS);
    if (!*header) {
        if (strcmp(tok[0], "lorakit-family") || nt != 2 || strcmp(tok[1], "1"))
            return lk_error(LK_ERR_CONFIG, "%s:%d: a family table starts with 'lorakit-family 1'", file, ln);
        *header = 1;
        return LK_OK;
    }
    if (!strcmp(tok[0], "family")) {
        if (nt != 2) return lk_error(LK_ERR_CONFIG, "%s:%d: 'family' takes one name", file, ln);
        if (f->name) return lk_error(LK_ERR_CONFIG, "%s:%d: a second 'family' line", file, ln);
        for (const char *c = tok[1]; *c; c++)
            if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-'))
                return lk_error(LK_ERR_CONFIG, "%s:%d: family name '%s': use a-z, 0-9, '_' and '-'", file, ln, tok[1]);
        if (!(f->name = lk_strdup(tok[1]))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
        return LK_OK;
    }
    if (!strcmp(tok[0], "detect")) {
        /* one line: keys that must all be there, a '!KEY' one that must not; lines are alternatives */
        char buf[LINE_MAX_BYTES + 1];
        size_t o = 0, present = 0;
        if (nt < 2) return lk_error(LK_ERR_CONFIG, "%s:%d: 'detect' takes key names", file, ln);
        for (size_t i = 1; i < nt; i++) {
            int caps, star, last;
            const char *k = tok[i] + (tok[i][0] == '!');
            if (!pattern_ok(k, &caps, &star, &last) || caps || star)
                return lk_error(LK_ERR_CONFIG, "%s:%d: detect key '%s': a key name (no '#' or '*'), '!' before one that must be absent",
                                file, ln, tok[i]);
            present += k == tok[i];
            o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s", i > 1 ? " " : "", tok[i]); /* fits: from one line */
        }
        if (!present)
            return lk_error(LK_ERR_CONFIG, "%s:%d: 'detect' needs a key that must be present, not only '!' ones", file, ln);
        return push_str(&f->detect, &f->n_detect, buf, file);
    }
    if (!strcmp(tok[0], "map") || !strcmp(tok[0], "alias")) {
        if (nt != 3 && nt != 5)
            return lk_error(LK_ERR_CONFIG, "%s:%d: '%s' takes ORIG DIFF [ORIG_ROWS DIFF_ROWS]", file, ln, tok[0]);
        int c1, s1, l1, c2, s2, l2;
        if (!pattern_ok(tok[1], &c1, &s1, &l1))
            return lk_error(LK_ERR_CONFIG, "%s:%d: '%s' is not a name pattern", file, ln, tok[1]);
        if (!pattern_ok(tok[2], &c2, &s2, &l2))
            return lk_error(LK_ERR_CONFIG, "%s:%d: '%s' is not a name pattern", file, ln, tok[2]);
        if (c1 != c2 || s1 != s2 || l1 != l2)
            return lk_error(LK_ERR_CONFIG, "%s:%d: '%s' and '%s' have different '#' / '#last' / '*' parts", file, ln,
                            tok[1], tok[2]);
        lk_fam_rule r = {.orig_rows = g_all, .diff_rows = g_all, .line = ln, .last = l1, .alias = tok[0][0] == 'a'};
        if (nt == 5 && (!frac_parse(tok[3], &r.orig_rows) || !frac_parse(tok[4], &r.diff_rows)))
            return lk_error(LK_ERR_CONFIG, "%s:%d: rows '%s' '%s': expected a/b:c/d with 0 <= a/b < c/d <= 1", file,
                            ln, tok[3], tok[4]);
        lk_fam_rule *nr = lk_realloc(f->rules, (f->n_rules + 1) * sizeof *nr);
        if (!nr) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
        f->rules = nr;
        r.orig = lk_strdup(tok[1]);
        r.diff = lk_strdup(tok[2]);
        if (!r.orig || !r.diff) {
            lk_free(r.orig);
            lk_free(r.diff);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
        }
        f->rules[f->n_rules++] = r;
        return LK_OK;
    }
    return lk_error(LK_ERR_CONFIG, "%s:%d: unknown key '%s' (valid: lorakit-family, family, detect, map, alias)", file, ln,
                    tok[0]);
}

/* Two rules putting different names on overlapping rows of one weight. */
static lk_status check_overlaps(const lk_family *f, const char *file) {
    for (size_t i = 0; i < f->n_rules; i++)
        for (size_t j = i + 1; j < f->n_rules; j++) {
            const lk_fam_rule *a = &f->rules[i], *b = &f->rules[j];
            int so = !strcmp(a->orig, b->orig), sd = !strcmp(a->diff, b->diff);
            if (so && sd && frac_overlap(&a->orig_rows, &b->orig_rows))
                return lk_error(LK_ERR_CONFIG, "%s:%d: rule repeats line %d (%s %s)", file, b->line, a->line, a->orig,
                                a->diff);
            if (a->alias || b->alias) continue; /* an alias spells rows that map lines name too */
            if (so && !sd && frac_overlap(&a->orig_rows, &b->orig_rows))
                return lk_error(LK_ERR_CONFIG, "%s:%d: %s and %s (line %d) both land on overlapping rows of %s", file,
                                b->line, b->diff, a->diff, a->line, a->orig);
            if (sd && !so && frac_overlap(&a->diff_rows, &b->diff_rows))
                return lk_error(LK_ERR_CONFIG, "%s:%d: %s and %s (line %d) both land on overlapping rows of %s", file,
                                b->line, b->orig, a->orig, a->line, a->diff);
        }
    return LK_OK;
}

lk_status lk_family_parse(const char *text, size_t len, const char *file, int require_name, lk_family *out) {
    memset(out, 0, sizeof *out);
    lk_family f = {0};
    lk_status s = LK_OK;
    char *line = lk_malloc(LINE_MAX_BYTES + 1);
    if (!line || !(f.file = lk_strdup(file))) {
        lk_free(line);
        lk_free(f.file);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    }
    int header = 0, ln = 0;
    size_t i = 0;
    while (i < len && !s) {
        size_t e = i;
        while (e < len && text[e] != '\n') e++;
        ln++;
        if (e - i > LINE_MAX_BYTES) {
            s = lk_error(LK_ERR_CONFIG, "%s:%d: line longer than %d bytes", file, ln, LINE_MAX_BYTES);
            break;
        }
        if (memchr(text + i, '\0', e - i)) {
            s = lk_error(LK_ERR_CONFIG, "%s:%d: NUL byte in a table", file, ln);
            break;
        }
        memcpy(line, text + i, e - i);
        line[e - i] = '\0';
        s = parse_line(&f, line, ln, file, &header);
        i = e + 1;
    }
    lk_free(line);
    if (!s && !header) s = lk_error(LK_ERR_CONFIG, "%s: empty: a family table starts with 'lorakit-family 1'", file);
    if (!s && require_name && !f.name) s = lk_error(LK_ERR_CONFIG, "%s: no 'family NAME' line", file);
    if (!s && !f.n_rules) s = lk_error(LK_ERR_CONFIG, "%s: no 'map' lines", file);
    if (!s) s = check_overlaps(&f, file);
    if (s) {
        lk_family_free(&f);
        return s;
    }
    *out = f;
    return LK_OK;
}

lk_status lk_family_load(const char *path, int require_name, lk_family *out) {
    char *buf;
    size_t len;
    lk_status s = lk_read_file(path, TABLE_MAX_BYTES, &buf, &len);
    if (s) return s;
    if (len > TABLE_MAX_BYTES) {
        lk_free(buf);
        return lk_error(LK_ERR_CONFIG, "%s: larger than the %u-byte limit for a family table", path, TABLE_MAX_BYTES);
    }
    s = lk_family_parse(buf, len, path, require_name, out);
    lk_free(buf);
    return s;
}

#if defined(LK_FAMILIES_REL_LIB) || defined(LK_FAMILIES_SRC_DIR)
static int is_dir(const char *p) {
    struct stat sb;
    return p && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}
#endif

/* The installed tables: <folder of this library or executable>/LK_FAMILIES_REL
 * (relative path from the lib/bin folder to <datadir>/lorakit/families,
 * computed by CMake), then <that folder>/lorakit-families (the Python
 * package: the extension module and the CLI it ships sit beside the tables,
 * so a wheel finds them wherever it is unpacked); then the source tree's
 * data/families. Out of memory is an error, never a quiet fall to the next
 * place or to "none". */
static lk_status found_dir(const char *d, char **out) {
    *out = lk_strdup(d);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory for the family tables' folder %s", d);
}

#ifdef LK_FAMILIES_REL_LIB
/* The file holding this code: dladdr's name, which for a symbol of the main
 * program is argv[0] ("lorakit" when run from PATH: no folder), so then
 * /proc/self/exe. *out NULL when neither names a folder. */
static lk_status own_file(char **out) {
    *out = NULL;
    Dl_info di;
    if (dladdr((void *)lk_family_dir, &di) && di.dli_fname && strchr(di.dli_fname, '/'))
        return found_dir(di.dli_fname, out);
    char *exe = realpath("/proc/self/exe", NULL);
    if (!exe) return LK_OK;
    lk_status s = found_dir(exe, out);
    free(exe);
    return s;
}

/* <folder of file>/rel made absolute, when it is a folder (*out NULL if not). */
static lk_status dir_beside(const char *file, const char *rel, char **out) {
    *out = NULL;
    char *d = NULL;
    lk_status s = lk_path_dir(file, &d);
    if (s || !d) return s;
    char *p = lk_path_join(d, rel);
    lk_free(d);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    char *real = is_dir(p) ? realpath(p, NULL) : NULL; /* ".../bin/../share/..." said plainly */
    lk_free(p);
    if (!real) return LK_OK;
    s = found_dir(real, out);
    free(real);
    return s;
}
#endif

lk_status lk_family_dir(char **out) {
    *out = NULL;
    const char *env = getenv("LORAKIT_FAMILIES_DIR");
    if (env && *env) return found_dir(env, out);
#ifdef LK_FAMILIES_REL_LIB
    char *self = NULL;
    lk_status s = own_file(&self);
    if (s) return s;
    static const char *const rel[] = {LK_FAMILIES_REL_LIB, LK_FAMILIES_REL_BIN, "lorakit-families"};
    for (size_t i = 0; self && i < sizeof rel / sizeof rel[0] && !*out; i++) {
        s = dir_beside(self, rel[i], out);
        if (s) break;
    }
    lk_free(self);
    if (s || *out) return s;
#endif
#ifdef LK_FAMILIES_SRC_DIR
    if (is_dir(LK_FAMILIES_SRC_DIR)) return found_dir(LK_FAMILIES_SRC_DIR, out);
#endif
    return LK_OK;
}
