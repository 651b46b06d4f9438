/* testutil.c — see testutil.h. */
#include "testutil.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

char *tu_mkdtemp(void) {
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    char *p = malloc(strlen(base) + 32);
    sprintf(p, "%s/lktest.XXXXXX", base);
    if (!mkdtemp(p)) {
        free(p);
        return NULL;
    }
    return p;
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

void tu_rmtree(const char *dir) {
    if (dir) nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

char *tu_path(const char *dir, const char *name) {
    char *p = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(p, "%s/%s", dir, name);
    return p;
}

int tu_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = n ? fwrite(data, 1, n, f) : 0;
    int rc = fclose(f);
    return (w == n && rc == 0) ? 0 : -1;
}

void *tu_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while ((r = fread(buf + len, 1, cap - len, f)) > 0) {
        len += r;
        if (len == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
    }
    fclose(f);
    buf[len] = '\0';
    if (n) *n = len;
    return buf;
}

int tu_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

uint64_t tu_next(tu_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float tu_uniform(tu_rng *r, float lo, float hi) {
    double u = (double)(tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(lo + (hi - lo) * u);
}

int tu_run_cli(char **out, char **err, const char *fmt, ...) {
    const char *bin = getenv("LORAKIT_BIN");
    if (!bin) bin = LK_TEST_BIN_DIR "/lorakit";
    char args[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    char *dir = tu_mkdtemp();
    char *o = tu_path(dir, "out"), *e = tu_path(dir, "err");
    size_t cmdlen = strlen(bin) + strlen(args) + strlen(o) + strlen(e) + 32;
    char *cmd = malloc(cmdlen);
    snprintf(cmd, cmdlen, "'%s' %s >'%s' 2>'%s' </dev/null", bin, args, o, e);
    int st = system(cmd);
    int rc = (st >= 0 && WIFEXITED(st)) ? WEXITSTATUS(st) : -1;
    if (out) *out = tu_read_file(o, NULL);
    if (err) *err = tu_read_file(e, NULL);
    free(cmd); free(o); free(e);
    tu_rmtree(dir);
    free(dir);
    return rc;
}

void tu_cli_expect(int want, const char *in_out, const char *in_err, const char *absent, const char *fmt, ...) {
    char args[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    char *so = NULL, *se = NULL;
    int rc = tu_run_cli(&so, &se, "%s", args);
    if (rc != want) fail_msg("lorakit %s: exit %d, expected %d: %s", args, rc, want, se ? se : "");
    if (in_out) tu_assert_contains(so, in_out);
    if (in_err) tu_assert_contains(se, in_err);
    if (absent && se && strstr(se, absent)) fail_msg("lorakit %s: stderr holds '%s': %s", args, absent, se);
    free(so);
    free(se);
}

void tu_assert_contains_(const char *hay, const char *needle, const char *file, int line) {
    if (!hay || !strstr(hay, needle)) {
        print_error("%s:%d: expected to find \"%s\" in \"%s\"\n", file, line, needle, hay ? hay : "(null)");
        _fail(file, line);
    }
}

lk_status tu_file_digest(const char *path, char hex[LK_DIGEST_HEX]) {
    lk_st *st = NULL;
    lk_status s = lk_st_open(path, &st);
    if (s == LK_OK) s = lk_digest_st(st, hex);
    lk_st_close(st);
    return s;
}
