/* file.c — see file.h. One reader for every small file lorakit parses, so
 * the limit, sizing and error messages are the same everywhere. */
#include "core/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lorakit/alloc.h"

const char *lk_file_kind(unsigned mode) {
    switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a folder";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "not a regular file";
    }
}

/* The target of symbolic link path, whole (lk_malloc'd), or NULL. */
static char *link_target(const char *path) {
    for (size_t cap = 256; cap <= ((size_t)1 << 20); cap *= 4) {
        char *t = lk_malloc(cap);
        if (!t) return NULL;
        ssize_t n = readlink(path, t, cap);
        if (n >= 0 && (size_t)n < cap) {
            t[n] = '\0';
            return t;
        }
        lk_free(t);
        if (n < 0) return NULL;
    }
    return NULL;
}

lk_status lk_input_check(const char *path, int *absent) {
    struct stat lsb, sb;
    *absent = 0;
    if (lstat(path, &lsb) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) {
            *absent = 1;
            return LK_OK;
        }
        return lk_error(LK_ERR_IO, "%s: cannot look at it: %s", path, strerror(errno));
    }
    if (stat(path, &sb) != 0) { /* a link that does not resolve */
        int e = errno;
        char *to = link_target(path);
        lk_status s;
        if (e == ENOENT)
            s = lk_error(LK_ERR_IO, "%s is a symbolic link to '%s', which does not exist (a dangling link, e.g. a "
                         "Hugging Face cache snapshot whose blob is missing)", path, to ? to : "?");
        else if (e == ELOOP)
            s = lk_error(LK_ERR_IO, "%s is a symbolic link to '%s' that cannot be followed: a link loop (too many "
                         "levels of symbolic links)", path, to ? to : "?");
        else
            s = lk_error(LK_ERR_IO, "%s is a symbolic link to '%s' that cannot be followed: %s", path, to ? to : "?",
                         strerror(e));
        lk_free(to);
        return s;
    }
    if (!S_ISREG(sb.st_mode))
        return lk_error(LK_ERR_IO, "%s: is %s, not a regular file", path, lk_file_kind((unsigned)sb.st_mode));
    return LK_OK;
}

lk_status lk_open_input(const char *path, int *fd) {
    *fd = -1;
    struct stat sb;
    /* stat first: opening a device may act on it (a tape rewinds), a FIFO
     * blocks until a writer comes */
    if (stat(path, &sb) != 0) return lk_error(LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return lk_error(LK_ERR_IO, "%s: is %s, not a regular file", path, lk_file_kind((unsigned)sb.st_mode));
    /* O_NONBLOCK: the path may have been replaced by a FIFO since the stat */
    int f = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (f < 0) return lk_error(LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    lk_status s = LK_OK;
    int fl;
    if (fstat(f, &sb) != 0 || (fl = fcntl(f, F_GETFL)) < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0)
        s = lk_error(LK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        s = lk_error(LK_ERR_IO, "%s: is %s, not a regular file", path, lk_file_kind((unsigned)sb.st_mode));
    if (s) {
        close(f);
        return s;
    }
    *fd = f;
    return LK_OK;
}

lk_status lk_read_file(const char *path, size_t max, char **buf, size_t *len) {
    *buf = NULL;
    *len = 0;
    if (max == (size_t)-1) max--; /* room for the one extra byte */
    int fd;
    lk_status s = lk_open_input(path, &fd);
    if (s) return s;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        s = lk_error(LK_ERR_NOMEM, "%s: cannot open: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    struct stat sb;
    size_t cap = 4096; /* growth start if the size cannot be read */
    if (fstat(fd, &sb) == 0)
        cap = (uint64_t)sb.st_size < (uint64_t)max ? (size_t)sb.st_size + 1 : max + 1;
    if (cap > max + 1) cap = max + 1;
    char *b = lk_malloc(cap + 1);
    size_t n = 0;
    s = b ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory reading the file", path);
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
