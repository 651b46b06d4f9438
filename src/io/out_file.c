/* out_file.c — see out_file.h. */
#include "io/out_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "io/temp.h"
#include "lorakit/alloc.h"

struct lk_out_input {
    dev_t dev;
    ino_t ino;
    char *path;
    const char *what;
};

/* A device, FIFO, socket or folder at path is never replaced: rename(2)
 * would put a regular file in its place (as root, /dev/null itself). */
static lk_status check_kind(const char *path, struct stat *sb) {
    if (stat(path, sb) != 0) return LK_OK; /* new (or unreachable: the create says why) */
    if (S_ISREG(sb->st_mode)) return LK_OK;
    return lk_error(LK_ERR_ARG, "%s: exists and is %s; an output replaces only a regular file", path,
                    lk_file_kind((unsigned)sb->st_mode));
}

lk_status lk_out_check(const char *path, const lk_out_inputs *in) {
    struct stat sb;
    memset(&sb, 0, sizeof sb);
    lk_status s = check_kind(path, &sb);
    if (s || !S_ISREG(sb.st_mode) || !in) return s;
    for (size_t i = 0; i < in->n; i++)
        if (in->v[i].dev == sb.st_dev && in->v[i].ino == sb.st_ino)
            return lk_error(LK_ERR_ARG, "output %s is the same file as the %s %s (an output never replaces an input)",
                            path, in->v[i].what, in->v[i].path);
    return LK_OK;
}

lk_status lk_out_inputs_add(lk_out_inputs *in, const char *path, const char *what) {
    struct stat sb;
    if (stat(path, &sb) != 0) return LK_OK;
    if (in->n == in->cap) {
        size_t cap = in->cap ? 2 * in->cap : 8;
        struct lk_out_input *v = lk_realloc(in->v, cap * sizeof *v);
        if (!v) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
        in->v = v;
        in->cap = cap;
    }
    char *p = lk_strdup(path);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    in->v[in->n++] = (struct lk_out_input){sb.st_dev, sb.st_ino, p, what};
    return LK_OK;
}

void lk_out_inputs_free(lk_out_inputs *in) {
    for (size_t i = 0; i < in->n; i++) lk_free(in->v[i].path);
    lk_free(in->v);
    *in = (lk_out_inputs)LK_OUT_INPUTS_INIT;
}

lk_status lk_out_file_begin(lk_out_file *o, const char *path) {
    *o = (lk_out_file)LK_OUT_FILE_INIT;
    struct stat sb;
    lk_status s = check_kind(path, &sb);
    if (s) return s;
    if ((s = lk_temp_sweep(path))) return s;
    size_t l = strlen(path) + 64;
    char *tmp = lk_malloc(l);
    if (!tmp) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    static unsigned counter; /* uniqueness only; races are resolved by O_EXCL */
    for (int tries = 0; tries < 100; tries++) {
        snprintf(tmp, l, "%s.tmp.%ld.%u", path, (long)getpid(), counter++ + (unsigned)tries * 7919u);
        /* registered before it exists, so no moment has it on disk unregistered */
        if ((s = lk_temp_add(tmp, 0, &o->reg))) {
            lk_free(tmp);
            return s;
        }
        int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0) {
            o->tmp = tmp;
            o->fd = fd;
            return LK_OK;
        }
        int e = errno;
        lk_temp_drop(o->reg);
        o->reg = NULL;
        errno = e;
        if (errno != EEXIST) break;
    }
    s = lk_error(LK_ERR_IO, "%s: cannot create temporary file %s: %s", path, tmp, strerror(errno));
    lk_free(tmp);
    return s;
}

lk_status lk_out_file_commit(lk_out_file *o, const char *path) {
    if (!o->tmp) return lk_error(LK_ERR_STATE, "%s: no temporary file to commit", path);
    if (o->fd >= 0) {
        if (fsync(o->fd) != 0) return lk_error(LK_ERR_IO, "%s: fsync failed: %s", o->tmp, strerror(errno));
        int fd = o->fd;
        o->fd = -1;
        if (close(fd) != 0) return lk_error(LK_ERR_IO, "%s: close failed: %s", o->tmp, strerror(errno));
    }
    struct stat sb;
    lk_status s = check_kind(path, &sb); /* again: something may have appeared there meanwhile */
    if (s) return s;
    if (rename(o->tmp, path) != 0)
        return lk_error(LK_ERR_IO, "%s: cannot rename %s into place: %s", path, o->tmp, strerror(errno));
    lk_temp_drop(o->reg);
    o->reg = NULL;
    lk_free(o->tmp);
    o->tmp = NULL;
    /* make the rename durable: fsync the folder (best effort) */
    char *dir = NULL;
    if (lk_path_dir(path, &dir) == LK_OK) {
        int dfd = open(dir ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
        lk_free(dir);
    }
    return LK_OK;
}

void lk_out_file_abort(lk_out_file *o) {
    if (o->fd >= 0) close(o->fd);
    o->fd = -1;
    if (o->tmp) unlink(o->tmp);
    lk_temp_drop(o->reg);
    o->reg = NULL;
    lk_free(o->tmp);
    o->tmp = NULL;
}

lk_status lk_out_file_write(const char *path, const void *data, size_t n) {
    lk_out_file o;
    lk_status s = lk_out_file_begin(&o, path);
    const char *p = data;
    for (size_t done = 0; !s && done < n;) {
        ssize_t w = write(o.fd, p + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) s = lk_error(LK_ERR_IO, "%s: write failed: %s", o.tmp, w < 0 ? strerror(errno) : "no progress");
        else done += (size_t)w;
    }
    if (!s) s = lk_out_file_commit(&o, path);
    if (s) lk_out_file_abort(&o);
    return s;
}
