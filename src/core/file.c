/* file.c — see file.h. One reader for every small file lorakit parses, so
 * the limit, sizing and error messages are the same everywhere. */
#include "core/file.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "lorakit/alloc.h"

lk_status lk_read_file(const char *path, size_t max, char **buf, size_t *len) {
    *buf = NULL;
    *len = 0;
    if (max == (size_t)-1) max--; /* room for the one extra byte */
    FILE *f = fopen(path, "rb");
    if (!f) return lk_error(LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    size_t cap = 4096; /* growth start for pipes and other unsized files */
    if (fstat(fileno(f), &sb) == 0 && S_ISREG(sb.st_mode))
        cap = (uint64_t)sb.st_size < (uint64_t)max ? (size_t)sb.st_size + 1 : max + 1;
    if (cap > max + 1) cap = max + 1;
    char *b = lk_malloc(cap + 1);
    size_t n = 0;
    lk_status s = b ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory reading the file", path);
    while (s == LK_OK) {
        if (n == cap) {
            if (cap == max + 1) break; /* read max + 1 bytes: past the limit */
            size_t nc = cap > (max + 1) / 2 ? max + 1 : cap * 2;
            char *nb = lk_realloc(b, nc + 1);
            if (!nb) {
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory reading the file", path);
                break;
            }
            b = nb;
            cap = nc;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) s = lk_error(LK_ERR_IO, "%s: read error: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (s != LK_OK) {
        lk_free(b);
        return s;
    }
    b[n] = '\0';
    *buf = b;
    *len = n;
    return LK_OK;
}

lk_status lk_read_config(const char *path, char **buf, size_t *len) {
    lk_status s = lk_read_file(path, LK_CONFIG_MAX_BYTES, buf, len);
    if (s == LK_OK && *len > LK_CONFIG_MAX_BYTES) {
        lk_free(*buf);
        *buf = NULL;
        *len = 0;
        return lk_error(LK_ERR_CONFIG, "%s: larger than the %u-byte limit for a config file", path,
                        LK_CONFIG_MAX_BYTES);
    }
    return s;
}

char *lk_path_join(const char *dir, const char *name) {
    size_t dl = (dir && name[0] != '/') ? strlen(dir) : 0, nl = strlen(name);
    char *p = lk_malloc(dl + nl + 2);
    if (!p) return NULL;
    size_t o = 0;
    if (dl) {
        memcpy(p, dir, dl);
        p[dl] = '/';
        o = dl + 1;
    }
    memcpy(p + o, name, nl + 1);
    return p;
}

lk_status lk_path_dir(const char *path, char **dir) {
    *dir = NULL;
    const char *slash = strrchr(path, '/');
    if (!slash) return LK_OK;
    size_t dl = slash == path ? 1 : (size_t)(slash - path);
    char *d = lk_malloc(dl + 1);
    if (!d) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    memcpy(d, path, dl);
    d[dl] = '\0';
    *dir = d;
    return LK_OK;
}
