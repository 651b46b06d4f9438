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
