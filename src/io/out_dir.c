/* out_dir.c — writing a sharded checkpoint folder atomically (see
 * out_dir.h).
 *
 * Why a whole temporary folder and one rename: a sharded set is only
 * usable complete (the index names every shard), and renaming shards into
 * OUT_DIR one by one would leave a mixed set behind after a failure or a
 * crash half way. rename(2) of a folder onto a new name, or onto an empty
 * folder, is atomic, so OUT_DIR is either untouched or the whole new set. */
#include "io/out_dir.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "core/file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SMALL_MAX ((off_t)64 << 20)

struct lk_out_dir {
    char *out;    /* final folder */
    char *tmp;    /* temporary folder (exists while od lives) */
};

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !memcmp(s + a - b, suf, b);
}

int lk_ckpt_is_index_name(const char *n) {
    return ends_with(n, ".json") && strstr(n, ".safetensors.index.") != NULL;
}

int lk_out_is_file(const char *out) {
    struct stat sb;
    if (stat(out, &sb) == 0 && S_ISDIR(sb.st_mode)) return 0;
    return ends_with(out, ".safetensors");
}

char *lk_out_dir_file(const lk_out_dir *od, const char *name) { return lk_path_join(od->tmp, name); }

static void fsync_dir(const char *d) {
    int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

lk_status lk_out_dir_begin(const char *out, lk_out_dir **odp) {
    *odp = NULL;
    struct stat sb;
    if (stat(out, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode))
            return lk_error(LK_ERR_ARG, "%s: exists and is not a folder (a sharded output is a folder; name a "
                            "FILE.safetensors for one file)", out);
        DIR *d = opendir(out);
        if (!d) return lk_error(LK_ERR_IO, "%s: cannot open the folder: %s", out, strerror(errno));
        struct dirent *e;
        int empty = 1;
        while (empty && (e = readdir(d))) empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
        closedir(d);
        if (!empty) return lk_error(LK_ERR_ARG, "%s: the output folder exists and is not empty", out);
    }
    size_t l = strlen(out);
    while (l > 1 && out[l - 1] == '/') l--; /* "dir/" names dir */
    lk_out_dir *od = lk_calloc(1, sizeof *od);
    char *o = od ? lk_malloc(l + 1) : NULL;
    char *tmp = o ? lk_malloc(l + 64) : NULL;
    if (!tmp) {
        lk_free(o);
        lk_free(od);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
    }
    memcpy(o, out, l);
    o[l] = 0;
    /* mkdir (mode 0777 less the umask, like any new folder), not mkdtemp
     * (0700); a taken name is retried, O_EXCL-style. */
    const char *sl = strrchr(o, '/');
    static unsigned counter;
    int made = 0;
    for (int tries = 0; tries < 100 && !made; tries++) {
        unsigned tag = counter++ + (unsigned)tries * 7919u;
        if (sl) snprintf(tmp, l + 64, "%.*s/.%s.lorakit-tmp-%ld-%u", (int)(sl - o), o, sl + 1, (long)getpid(), tag);
        else snprintf(tmp, l + 64, ".%s.lorakit-tmp-%ld-%u", o, (long)getpid(), tag);
        made = mkdir(tmp, 0777) == 0;
        if (!made && errno != EEXIST) break;
    }
    if (!made) {
        lk_status s = lk_error(LK_ERR_IO, "%s: cannot create the temporary folder %s: %s", out, tmp, strerror(errno));
        lk_free(tmp);
        lk_free(o);
        lk_free(od);
        return s;
    }
    od->out = o;
    od->tmp = tmp;
    *odp = od;
    return LK_OK;
}

void lk_out_dir_abort(lk_out_dir *od) {
    if (!od) return;
    /* Only this process writes the folder mkdtemp made: remove what is there. */
    DIR *d = opendir(od->tmp);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p = lk_path_join(od->tmp, e->d_name);
            if (p) unlink(p);
            lk_free(p);
        }
        closedir(d);
    }
    rmdir(od->tmp);
    lk_free(od->tmp);
    lk_free(od->out);
    lk_free(od);
}

/* Writes n bytes to a new file at path, fsynced. */
static lk_status write_file(const char *path, const char *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return lk_error(LK_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            lk_status s = lk_error(LK_ERR_IO, "%s: write failed: %s", path, w < 0 ? strerror(errno) : "no progress");
            close(fd);
            return s;
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        lk_status s = lk_error(LK_ERR_IO, "%s: fsync failed: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    return close(fd) == 0 ? LK_OK : lk_error(LK_ERR_IO, "%s: close failed: %s", path, strerror(errno));
}

lk_status lk_out_dir_index(lk_out_dir *od, const lk_ckpt *ck, const char *key, const char *value) {
    const char *name = lk_ckpt_index_name(ck);
    json_t *meta = json_loads(lk_ckpt_index_metadata(ck), 0, NULL);
    json_t *root = json_object(), *wm = json_object();
    int bad = !meta || !root || !wm;
    if (!bad) {
        bad |= json_object_set_new(meta, "total_size", json_integer((json_int_t)lk_ckpt_total_size(ck)));
        bad |= json_object_set_new(meta, key, json_string(value));
        for (size_t i = 0; i < lk_ckpt_count(ck) && !bad; i++)
            bad |= json_object_set_new(wm, lk_ckpt_tensor(ck, i)->name,
                                       json_string(lk_ckpt_shard_name(ck, lk_ckpt_tensor_shard(ck, i))));
        bad |= json_object_set(root, "metadata", meta);
        bad |= json_object_set(root, "weight_map", wm);
    }
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    json_decref(meta);
    json_decref(wm);
    json_decref(root);
    if (!text) return lk_error(LK_ERR_NOMEM, "%s: out of memory writing the index %s", od->out, name);
    char *p = lk_path_join(od->tmp, name);
    lk_status s = p ? write_file(p, text, strlen(text)) : lk_error(LK_ERR_NOMEM, "%s: out of memory", od->out);
    free(text);
    lk_free(p);
    return s;
}

static lk_status copy_file(const char *src, const char *dst, off_t size) {
    int fd;
    lk_status s = lk_open_input(src, &fd);
    if (s) return s;
    char *buf = lk_malloc(size ? (size_t)size : 1);
    if (!buf) {
        close(fd);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory copying it", src);
    }
    size_t got = 0;
    while (got < (size_t)size) {
        ssize_t r = read(fd, buf + got, (size_t)size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            s = lk_error(LK_ERR_IO, "%s: %s while copying it", src, r < 0 ? strerror(errno) : "changed on disk");
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (!s) s = write_file(dst, buf, got);
    lk_free(buf);
    return s;
}

lk_status lk_out_dir_copy_small(lk_out_dir *od, const lk_ckpt *ck) {
    const char *dir = lk_ckpt_dir(ck);
    DIR *d = opendir(dir);
    if (!d) return lk_error(LK_ERR_IO, "%s: cannot open the folder: %s", dir, strerror(errno));
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        const char *n = e->d_name;
        if (n[0] == '.' || ends_with(n, ".safetensors") || lk_ckpt_is_index_name(n)) continue;
        char *src = lk_path_join(dir, n), *dst = lk_path_join(od->tmp, n);
        struct stat sb;
        if (!src || !dst) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
        else if (stat(src, &sb) == 0 && S_ISREG(sb.st_mode)) {
            if (sb.st_size > SMALL_MAX)
                lk_log(LK_LOG_WARN, "%s: not copied to %s: %lld bytes is more than a small file", src, od->out,
                       (long long)sb.st_size);
            else s = copy_file(src, dst, sb.st_size);
        }
        lk_free(src);
        lk_free(dst);
    }
    closedir(d);
    return s;
}

lk_status lk_out_dir_commit(lk_out_dir *od) {
    fsync_dir(od->tmp);
    if (rename(od->tmp, od->out) != 0)
        return lk_error(LK_ERR_IO, "%s: cannot rename %s into place: %s", od->out, od->tmp, strerror(errno));
    char *parent = lk_strdup(od->out);
    if (parent) {
        char *sl = strrchr(parent, '/');
        if (sl == parent) fsync_dir("/");
        else if (sl) {
            *sl = 0;
            fsync_dir(parent);
        } else {
            fsync_dir(".");
        }
    }
    lk_free(parent);
    lk_free(od->tmp);
    lk_free(od->out);
    lk_free(od);
    return LK_OK;
}
