/* out_file.c — see out_file.h. */
#include "io/out_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "lorakit/alloc.h"

lk_status lk_out_file_begin(lk_out_file *o, const char *path) {
    o->tmp = NULL;
    o->fd = -1;
    size_t l = strlen(path) + 64;
    char *tmp = lk_malloc(l);
    if (!tmp) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    static unsigned counter; /* uniqueness only; races are resolved by O_EXCL */
    for (int tries = 0; tries < 100; tries++) {
        snprintf(tmp, l, "%s.tmp.%ld.%u", path, (long)getpid(), counter++ + (unsigned)tries * 7919u);
        int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0) {
            o->tmp = tmp;
            o->fd = fd;
            return LK_OK;
        }
        if (errno != EEXIST) break;
    }
    lk_status s = lk_error(LK_ERR_IO, "%s: cannot create temporary file %s: %s", path, tmp, strerror(errno));
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
    if (rename(o->tmp, path) != 0)
        return lk_error(LK_ERR_IO, "%s: cannot rename %s into place: %s", path, o->tmp, strerror(errno));
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
