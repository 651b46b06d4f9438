/* out_dir.c — writing a sharded checkpoint folder atomically (see
 * out_dir.h).
 *
 * Why a whole temporary folder and one rename: a sharded set is only
 * usable complete (the index names every shard), and renaming shards into
 * OUT_DIR one by one would leave a mixed set behind after a failure or a
 * crash half way. rename(2) of a folder onto a new name, or onto an empty
 * folder, is atomic, and so is renameat2(RENAME_EXCHANGE) of two folders,
 * so OUT_DIR is either untouched or the whole new set.
 *
 * Why the .lorakit-output record: replacing a folder means deleting what
 * was in it, and lorakit deletes only files it knows it wrote there. A
 * filesystem without RENAME_EXCHANGE (NFS) cannot replace a folder
 * atomically: there the old folder is left as it was and the error says
 * to remove it or name a new one. */
#include "io/out_dir.h"
#include "io/checkpoint.h"
#include "io/temp.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "core/file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SMALL_MAX ((off_t)64 << 20)
#define MARKER ".lorakit-output"
#define MARKER_MAX ((size_t)16 << 20)

typedef struct namelist {
    char **v;
    void **reg; /* registration of each name's path in tmp (io/temp.h) */
    size_t n, cap;
} namelist;

struct lk_out_dir {
    char *out;     /* final folder */
    char *tmp;     /* temporary folder (exists while od lives) */
    void *tmp_reg; /* its registration */
    namelist files; /* the files written into tmp: the output's files */
    namelist old;   /* replacing: the old folder's files (removed after the exchange) */
    int replace;    /* out is a non-empty folder lorakit wrote */
    int tree;       /* a folder tree (lk_out_dir_begin_tree): names are relative paths */
    namelist folders;     /* tree: the output's folders (relative paths, parents first) */
    namelist old_folders; /* tree, replacing: the old folder's folders (removed deepest first) */
};

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !memcmp(s + a - b, suf, b);
}

static int dot_or_dotdot(const char *n) { return n[0] == '.' && (!n[1] || (n[1] == '.' && !n[2])); }

int lk_out_is_file(const char *out) {
    struct stat sb;
    if (stat(out, &sb) == 0 && S_ISDIR(sb.st_mode)) return 0;
    return ends_with(out, ".safetensors");
}

static void namelist_free(namelist *l) {
    for (size_t i = 0; i < l->n; i++) {
        lk_temp_drop(l->reg[i]);
        lk_free(l->v[i]);
    }
    lk_free(l->v);
    lk_free(l->reg);
    memset(l, 0, sizeof *l);
}

/* Appends name; when dir is given, registers dir/name for removal on a
 * signal. 0 when out of memory. */
static int namelist_add(namelist *l, const char *name, const char *dir) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        char **v = lk_realloc(l->v, cap * sizeof *v);
        if (!v) return 0;
        l->v = v;
        void **r = lk_realloc(l->reg, cap * sizeof *r);
        if (!r) return 0;
        l->reg = r;
        l->cap = cap;
    }
    char *nm = lk_strdup(name), *p = dir ? lk_path_join(dir, name) : NULL;
    void *reg = NULL;
    int ok = nm && (!dir || (p && lk_temp_add(p, 0, &reg) == LK_OK));
    lk_free(p);
    if (!ok) {
        lk_free(nm);
        return 0;
    }
    l->v[l->n] = nm;
    l->reg[l->n++] = reg;
    return 1;
}

static int namelist_has(const namelist *l, const char *name) {
    for (size_t i = 0; i < l->n; i++)
        if (!strcmp(l->v[i], name)) return 1;
    return 0;
}

char *lk_out_dir_file(lk_out_dir *od, const char *name) {
    if (!namelist_has(&od->files, name) && !namelist_add(&od->files, name, od->tmp)) return NULL;
    return lk_path_join(od->tmp, name);
}

static void fsync_dir(const char *d) {
    int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

/* The names out/.lorakit-output records, into *names (no registration),
 * and, when folders is given, its "folders" (a tree's). LK_ERR_ARG when
 * there is none or it is not lorakit's record. */
static lk_status read_marker(const char *out, namelist *names, namelist *folders) {
    char *p = lk_path_join(out, MARKER), *text = NULL;
    size_t len = 0;
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
    struct stat sb;
    lk_status s = LK_OK;
    if (lstat(p, &sb) != 0 || !S_ISREG(sb.st_mode))
        s = lk_error(LK_ERR_ARG, "%s: the output folder exists, is not empty and was not written by lorakit (it has no "
                     MARKER "); name a new or empty folder", out);
    else if (!(s = lk_read_file(p, MARKER_MAX, &text, &len)) && len > MARKER_MAX)
        s = lk_error(LK_ERR_ARG, "%s: larger than %zu bytes: not lorakit's record", p, MARKER_MAX);
    json_t *root = s ? NULL : json_loadb(text, len, JSON_REJECT_DUPLICATES, NULL);
    json_t *files = root ? json_object_get(root, "files") : NULL;
    if (!s && (!json_is_object(root) || !json_is_integer(json_object_get(root, "lorakit_output")) ||
               !json_is_array(files)))
        s = lk_error(LK_ERR_ARG, "%s: not lorakit's record of an output folder", p);
    for (size_t i = 0; !s && i < json_array_size(files); i++) {
        const char *n = json_string_value(json_array_get(files, i));
        if (!n) s = lk_error(LK_ERR_ARG, "%s: files[%zu] is not a string", p, i);
        else if (!namelist_add(names, n, NULL)) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", p);
    }
    json_t *dirs = folders && !s ? json_object_get(root, "folders") : NULL;
    if (dirs && !json_is_array(dirs)) s = lk_error(LK_ERR_ARG, "%s: \"folders\" is not a list", p);
    for (size_t i = 0; !s && i < json_array_size(dirs); i++) {
        const char *n = json_string_value(json_array_get(dirs, i));
        if (!n) s = lk_error(LK_ERR_ARG, "%s: folders[%zu] is not a string", p, i);
        else if (!namelist_add(folders, n, NULL)) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", p);
    }
    json_decref(root);
    lk_free(text);
    lk_free(p);
    return s;
}

/* The entries under root/rel (rel "" for root itself), recursively, as
 * paths relative to root: regular files into files, folders into folders
 * (parents before children). Anything else (a link, a device, ...) is
 * LK_ERR_ARG naming it, as is a tree deeper than 16. */
static lk_status list_tree(const char *root, const char *rel, int depth, namelist *files, namelist *folders) {
    if (depth > 16) return lk_error(LK_ERR_ARG, "%s/%s: folders nested too deep for an output folder", root, rel);
    char *dir = *rel ? lk_path_join(root, rel) : lk_strdup(root);
    if (!dir) return lk_error(LK_ERR_NOMEM, "%s: out of memory", root);
    DIR *d = opendir(dir);
    lk_status s = d ? LK_OK : lk_error(LK_ERR_IO, "%s: cannot open the folder: %s", dir, strerror(errno));
    for (struct dirent *e; !s && (e = readdir(d));) {
        if (dot_or_dotdot(e->d_name)) continue;
        char *r = *rel ? lk_path_join(rel, e->d_name) : lk_strdup(e->d_name), *p = r ? lk_path_join(root, r) : NULL;
        struct stat sb;
        if (!p) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", root);
        else if (lstat(p, &sb) != 0) s = lk_error(LK_ERR_IO, "%s: %s", p, strerror(errno));
        else if (S_ISREG(sb.st_mode)) s = namelist_add(files, r, NULL) ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", root);
        else if (!S_ISDIR(sb.st_mode))
            s = lk_error(LK_ERR_ARG, "%s: is %s, which lorakit never writes in an output folder", p,
                         lk_file_kind((unsigned)sb.st_mode));
        else if (!namelist_add(folders, r, NULL)) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", root);
        else s = list_tree(root, r, depth + 1, files, folders);
        lk_free(r);
        lk_free(p);
    }
    if (d) closedir(d);
    lk_free(dir);
    return s;
}

/* OUT exists: it must be a folder, empty or written by lorakit with no
 * input among its files; the files to remove after the exchange go to
 * od->old (this process's own listing of the folder, never the record's
 * names, so nothing outside the folder can be named). A tree (od->tree):
 * every file and folder under it, by relative path, and the record must
 * name each folder too (od->old_folders). */
static lk_status check_existing(lk_out_dir *od, const lk_out_inputs *in) {
    const char *out = od->out;
    struct stat sb;
    if (lstat(out, &sb) != 0) return LK_OK;
    if (S_ISLNK(sb.st_mode))
        return lk_error(LK_ERR_ARG, "%s: is a symbolic link; name the output folder itself", out);
    lk_status s = S_ISREG(sb.st_mode) ? lk_out_check(out, in) : LK_OK; /* an input: say so first */
    if (s) return s;
    if (!S_ISDIR(sb.st_mode))
        return lk_error(LK_ERR_ARG, "%s: exists and is %s, not a folder (%s)", out, lk_file_kind((unsigned)sb.st_mode),
                        od->tree ? "this output is a folder" : "a sharded output is a folder; name a FILE.safetensors "
                        "for one file");
    if (od->tree) {
        s = list_tree(out, "", 0, &od->old, &od->old_folders);
    } else {
        DIR *d = opendir(out);
        if (!d) return lk_error(LK_ERR_IO, "%s: cannot open the folder: %s", out, strerror(errno));
        for (struct dirent *e; !s && (e = readdir(d));)
            if (!dot_or_dotdot(e->d_name) && !namelist_add(&od->old, e->d_name, NULL))
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
        closedir(d);
    }
    if (s || (!od->old.n && !od->old_folders.n)) return s; /* empty: the rename goes onto it */
    namelist rec = {0}, recf = {0};
    s = read_marker(out, &rec, od->tree ? &recf : NULL);
    for (size_t i = 0; !s && i < od->old.n; i++) {
        const char *n = od->old.v[i];
        char *p = lk_path_join(out, n);
        if (!p) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
        else if (strcmp(n, MARKER) && !namelist_has(&rec, n))
            s = lk_error(LK_ERR_ARG, "%s: the output folder holds %s, which lorakit did not write there (it is not in "
                         "its " MARKER "); name a new or empty folder", out, n);
        else if (lstat(p, &sb) != 0 ? (sb.st_mode = 0, 1) : !S_ISREG(sb.st_mode))
            s = lk_error(LK_ERR_ARG, "%s: is %s, which lorakit never writes in an output folder", p,
                         lk_file_kind((unsigned)sb.st_mode));
        else s = lk_out_check(p, in);
        lk_free(p);
    }
    for (size_t i = 0; !s && i < od->old_folders.n; i++)
        if (!namelist_has(&recf, od->old_folders.v[i]))
            s = lk_error(LK_ERR_ARG, "%s: the output folder holds the folder %s, which lorakit did not make there (it "
                         "is not in its " MARKER "); name a new or empty folder", out, od->old_folders.v[i]);
    namelist_free(&rec);
    namelist_free(&recf);
    od->replace = 1;
    return s;
}

static lk_status out_dir_begin(const char *out, const lk_out_inputs *in, int tree, lk_out_dir **odp);

lk_status lk_out_dir_begin(const char *out, const lk_out_inputs *in, lk_out_dir **odp) {
    return out_dir_begin(out, in, 0, odp);
}

lk_status lk_out_dir_begin_tree(const char *out, const lk_out_inputs *in, lk_out_dir **odp) {
    return out_dir_begin(out, in, 1, odp);
}

const char *lk_out_dir_path(const lk_out_dir *od) { return od->tmp; }

static lk_status out_dir_begin(const char *out, const lk_out_inputs *in, int tree, lk_out_dir **odp) {
    *odp = NULL;
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
    od->out = o;
    od->tree = tree;
    lk_status s = check_existing(od, in);
    if (!s) s = lk_temp_sweep(o);
    if (s) {
        lk_free(tmp);
        lk_out_dir_abort(od);
        return s;
    }
    /* mkdir (mode 0777 less the umask, like any new folder), not mkdtemp
     * (0700); a taken name is retried, O_EXCL-style. */
    const char *sl = strrchr(o, '/');
    static unsigned counter;
    int made = 0;
    for (int tries = 0; tries < 100 && !made; tries++) {
        unsigned tag = counter++ + (unsigned)tries * 7919u;
        if (sl) snprintf(tmp, l + 64, "%.*s/.%s.lorakit-tmp-%ld-%u", (int)(sl - o), o, sl + 1, (long)getpid(), tag);
        else snprintf(tmp, l + 64, ".%s.lorakit-tmp-%ld-%u", o, (long)getpid(), tag);
        if ((s = lk_temp_add(tmp, 1, &od->tmp_reg))) break;
        made = mkdir(tmp, 0777) == 0;
        if (made) break;
        int e = errno;
        lk_temp_drop(od->tmp_reg);
        od->tmp_reg = NULL;
        errno = e;
        if (errno != EEXIST) break;
    }
    if (!made) {
        if (!s) s = lk_error(LK_ERR_IO, "%s: cannot create the temporary folder %s: %s", out, tmp, strerror(errno));
        lk_free(tmp);
        lk_out_dir_abort(od);
        return s;
    }
    od->tmp = tmp;
    *odp = od;
    return LK_OK;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)ftw;
    if (flag == FTW_DP) rmdir(p);
    else unlink(p);
    return 0;
}

void lk_out_dir_abort(lk_out_dir *od) {
    if (!od) return;
    /* Only this process writes the folder it made: remove what is there
     * (a tree: everything under it, links not followed). */
    if (od->tree && od->tmp) nftw(od->tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    DIR *d = od->tmp ? opendir(od->tmp) : NULL;
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (dot_or_dotdot(e->d_name)) continue;
            char *p = lk_path_join(od->tmp, e->d_name);
            if (p) unlink(p);
            lk_free(p);
        }
        closedir(d);
    }
    if (od->tmp) rmdir(od->tmp);
    namelist_free(&od->files);
    namelist_free(&od->old);
    namelist_free(&od->folders);
    namelist_free(&od->old_folders);
    lk_temp_drop(od->tmp_reg);
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
    char *p = lk_out_dir_file(od, name);
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
        char *src = lk_path_join(dir, n), *dst = NULL;
        struct stat sb;
        if (!src) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
        else if (stat(src, &sb) == 0 && S_ISREG(sb.st_mode)) {
            if (sb.st_size > SMALL_MAX)
                lk_log(LK_LOG_WARN, "%s: not copied to %s: %lld bytes is more than a small file", src, od->out,
                       (long long)sb.st_size);
            else if (!(dst = lk_out_dir_file(od, n))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
            else s = copy_file(src, dst, sb.st_size);
        }
        lk_free(src);
        lk_free(dst);
    }
    closedir(d);
    return s;
}

/* .lorakit-output in the temporary folder: the names of the files in it. */
static lk_status write_marker(lk_out_dir *od) {
    if (od->tree) { /* the tree as written into the temporary folder (all of it this process's) */
        namelist_free(&od->files);
        namelist_free(&od->folders);
        lk_status s = list_tree(od->tmp, "", 0, &od->files, &od->folders);
        if (s) return s;
    }
    json_t *root = json_object(), *files = json_array(), *folders = od->tree ? json_array() : NULL;
    int bad = !root || !files || (od->tree && !folders);
    for (size_t i = 0; !bad && i < od->files.n; i++) bad |= json_array_append_new(files, json_string(od->files.v[i]));
    for (size_t i = 0; !bad && od->tree && i < od->folders.n; i++)
        bad |= json_array_append_new(folders, json_string(od->folders.v[i]));
    if (!bad) bad |= json_object_set_new(root, "lorakit_output", json_integer(1));
    if (!bad) bad |= json_object_set(root, "files", files);
    if (!bad && folders) bad |= json_object_set(root, "folders", folders);
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(1));
    json_decref(files);
    json_decref(folders);
    json_decref(root);
    char *p = text ? lk_out_dir_file(od, MARKER) : NULL;
    lk_status s = p ? write_file(p, text, strlen(text)) : lk_error(LK_ERR_NOMEM, "%s: out of memory", od->out);
    free(text);
    lk_free(p);
    return s;
}

lk_status lk_out_dir_commit(lk_out_dir *od) {
    lk_status s = write_marker(od);
    if (s) return s;
    fsync_dir(od->tmp);
    if (!od->replace) {
        if (rename(od->tmp, od->out) != 0)
            return lk_error(LK_ERR_IO, "%s: cannot rename %s into place: %s", od->out, od->tmp, strerror(errno));
    } else {
        /* after the exchange the temporary name holds the old files:
         * registered first, so a signal from then on removes them too */
        for (size_t i = 0; i < od->old.n; i++) {
            char *p = lk_path_join(od->tmp, od->old.v[i]);
            s = p ? lk_temp_add(p, 0, &od->old.reg[i]) : lk_error(LK_ERR_NOMEM, "%s: out of memory", od->out);
            lk_free(p);
            if (s) return s;
        }
        if (renameat2(AT_FDCWD, od->tmp, AT_FDCWD, od->out, RENAME_EXCHANGE) != 0)
            return lk_error(LK_ERR_IO, "%s: cannot replace the folder with %s: %s%s", od->out, od->tmp,
                            strerror(errno), errno == EINVAL || errno == ENOSYS ?
                            " (this filesystem cannot swap two folders atomically; remove the old folder or name a "
                            "new one)" : "");
        for (size_t i = 0; i < od->old.n; i++) {
            char *p = lk_path_join(od->tmp, od->old.v[i]);
            if (p) unlink(p);
            lk_free(p);
        }
        for (size_t i = od->old_folders.n; i-- > 0;) { /* children were listed after their parents */
            char *p = lk_path_join(od->tmp, od->old_folders.v[i]);
            if (p) rmdir(p);
            lk_free(p);
        }
        if (rmdir(od->tmp) != 0)
            lk_log(LK_LOG_WARN, "%s: replaced; the old folder, now %s, could not be removed: %s", od->out, od->tmp,
                   strerror(errno));
    }
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
    namelist_free(&od->files);
    namelist_free(&od->old);
    namelist_free(&od->folders);
    namelist_free(&od->old_folders);
    lk_temp_drop(od->tmp_reg);
    lk_free(od->tmp);
    lk_free(od->out);
    lk_free(od);
    return LK_OK;
}
