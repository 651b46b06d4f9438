/* pipeline.c — a diffusers pipeline folder (model_index.json) as a fuse
 * base: one adapter's modules routed to the component folders they belong
 * to (lorakit/fuse.h, lk_fuse_pipeline).
 *
 * Every adapter is first resolved against every component with a checkpoint
 * (lk_resolve_opts.component keeps other components' prefixed modules out),
 * so a module that lands nowhere, or in two components, is refused before
 * anything is written. Then the output is built in a temporary folder beside
 * OUT (io/out_dir.h, tree mode): each component with modules is fused by
 * lk_fuse_checkpoint (which keeps its file or shard layout), everything else is
 * copied, and the folder is renamed onto OUT in one step; any failure
 * removes the temporary folder, and OUT is as it was. OUT may be new, an
 * empty folder, or a folder lorakit wrote (its .lorakit-output names every
 * file and folder in it), replaced whole; never the base folder, a folder
 * holding it, or one inside it. */
#include "lorakit/fuse.h"
#include "core/file.h"
#include "io/out_dir.h"
#include "io/checkpoint.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/log.h"
#include "fuse/fuse.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const g_components[] = {"unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"};
#define N_COMP (sizeof g_components / sizeof g_components[0])

/* lk_fuse_file's entry: a pipeline folder (below), or one checkpoint
 * (lk_fuse_checkpoint, fuse_file.c, which calls nothing here; it checks the
 * arguments). */
lk_status lk_fuse_file(const char *base, const lk_fuse_input *inputs, size_t n, const char *out,
                       const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    return lk_fuse_file_src(base, inputs, NULL, n, out, opts, stats);
}

lk_status lk_fuse_file_src(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                           size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    if (base && out && (!n || inputs) && !(opts && opts->component) && lk_fuse_is_pipeline(base))
        return lk_fuse_pipeline(base, inputs, sources, n, out, opts, stats);
    return lk_fuse_checkpoint(base, inputs, sources, n, out, opts, stats);
}

int lk_fuse_is_pipeline(const char *base) {
    struct stat sb;
    if (!base || stat(base, &sb) || !S_ISDIR(sb.st_mode)) return 0;
    char p[4096]; /* no allocation: a check that cannot fail (a longer path is no folder lorakit opens) */
    if ((size_t)snprintf(p, sizeof p, "%s/model_index.json", base) >= sizeof p) return 0;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static lk_status copy_file(const char *from, const char *to) {
    int in = open(from, O_RDONLY | O_CLOEXEC), o = -1;
    lk_status s = LK_OK;
    char *buf = lk_malloc(1 << 20);
    if (in < 0) s = lk_error(LK_ERR_IO, "%s: cannot open: %s", from, strerror(errno));
    else if ((o = open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0)
        s = lk_error(LK_ERR_IO, "%s: cannot create: %s", to, strerror(errno));
    else if (!buf) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", from);
    while (!s) {
        ssize_t r = read(in, buf, 1 << 20);
        if (r < 0) s = lk_error(LK_ERR_IO, "%s: read: %s", from, strerror(errno));
        if (r <= 0) break;
        for (ssize_t w = 0; !s && w < r;) {
            ssize_t k = write(o, buf + w, (size_t)(r - w));
            if (k < 0) s = lk_error(LK_ERR_IO, "%s: write: %s", to, strerror(errno));
            else w += k;
        }
    }
    if (!s && o >= 0 && fsync(o)) s = lk_error(LK_ERR_IO, "%s: fsync: %s", to, strerror(errno));
    if (o >= 0 && close(o) && !s) s = lk_error(LK_ERR_IO, "%s: close: %s", to, strerror(errno));
    if (in >= 0) close(in);
    lk_free(buf);
    return s;
}

/* Copies folder `from` into the new folder `to` (regular files and folders;
 * anything else, a symlink included, is refused by name). skip: a name in
 * `from` not to copy (the checkpoint a fuse writes), or NULL. */
static lk_status copy_tree(const char *from, const char *to, const char *skip, int depth) {
    if (depth > 16) return lk_error(LK_ERR_FORMAT, "%s: folders nested too deep", from);
    if (mkdir(to, 0755) && errno != EEXIST) return lk_error(LK_ERR_IO, "%s: cannot create: %s", to, strerror(errno));
    DIR *d = opendir(from);
    if (!d) return lk_error(LK_ERR_IO, "%s: cannot read: %s", from, strerror(errno));
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || (skip && !strcmp(e->d_name, skip))) continue;
        char *a = lk_path_join(from, e->d_name), *b = lk_path_join(to, e->d_name);
        struct stat sb;
        if (!a || !b) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", from);
        else if (lstat(a, &sb)) s = lk_error(LK_ERR_IO, "%s: %s", a, strerror(errno));
        else if (S_ISDIR(sb.st_mode)) s = copy_tree(a, b, NULL, depth + 1);
        else if (S_ISREG(sb.st_mode)) s = copy_file(a, b);
        else s = lk_error(LK_ERR_UNSUPPORTED, "%s: not a regular file or folder; a pipeline folder is copied as files", a);
        lk_free(a);
        lk_free(b);
    }
    closedir(d);
    return s;
}

/* realpath(p), or, for a path that does not exist yet, realpath of its
 * folder + its last name (malloc'd; NULL with errno set). */
static char *real_or_new(const char *p) {
    char *r = realpath(p, NULL);
    if (r || errno != ENOENT) return r;
    size_t l = strlen(p);
    while (l > 1 && p[l - 1] == '/') l--;
    const char *sl = memrchr(p, '/', l);
    char *dir = sl ? strndup(p, sl == p ? 1 : (size_t)(sl - p)) : strdup(".");
    char *rd = dir ? realpath(dir, NULL) : NULL;
    const char *name = sl ? sl + 1 : p;
    size_t nl = l - (size_t)(name - p);
    char *out = rd ? malloc(strlen(rd) + nl + 2) : NULL;
    if (out) sprintf(out, "%s%s%.*s", rd, strcmp(rd, "/") ? "/" : "", (int)nl, name);
    free(dir);
    free(rd);
    return out;
}

/* 1 when folder a is b or holds it (by real paths). */
static int holds(const char *a, const char *b) {
    size_t n = strlen(a);
    return !strncmp(a, b, n) && (b[n] == '\0' || b[n] == '/' || (n == 1 && a[0] == '/'));
}

/* OUT may not be the base folder, hold it (replacing OUT would remove it)
 * or sit inside it (the copy of the base would hold itself). */
static lk_status check_out_vs_base(const char *base, const char *out) {
    char *rb = realpath(base, NULL), *ro = rb ? real_or_new(out) : NULL;
    lk_status s = LK_OK;
    if (!rb) s = lk_error(LK_ERR_IO, "%s: %s", base, strerror(errno));
    else if (!ro) s = lk_error(LK_ERR_IO, "%s: cannot resolve the output path: %s", out, strerror(errno));
    else if (!strcmp(rb, ro))
        s = lk_error(LK_ERR_ARG, "%s: is the input pipeline folder %s; a fused pipeline is written to another folder",
                     out, base);
    else if (holds(ro, rb))
        s = lk_error(LK_ERR_ARG, "%s: holds the input pipeline folder %s; name an output folder outside it", out, base);
    else if (holds(rb, ro))
        s = lk_error(LK_ERR_ARG, "%s: is inside the input pipeline folder %s (the copy of the folder would hold "
                     "itself); name an output folder outside it", out, base);
    free(rb);
    free(ro);
    return s;
}

typedef struct comp {
    const char *name;
    char *dir;
    lk_ckpt *ck;    /* NULL: no checkpoint (copied) */
    size_t hits;    /* modules landing here, over all adapters */
} comp;

lk_status lk_fuse_pipeline(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                           size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    static const lk_fuse_file_opts defaults;
    if (!opts) opts = &defaults;
    comp c[N_COMP];
    memset(c, 0, sizeof c);
    lk_status s = LK_OK;
    lk_out_dir *od = NULL;
    lk_out_inputs oin = LK_OUT_INPUTS_INIT; /* adapters and component checkpoints: never an old file of OUT */
    const char *tmp = NULL;
    lk_fuse_stats total = {0};
    for (size_t k = 0; k < N_COMP && !s; k++) {
        c[k].name = g_components[k];
        if (!(c[k].dir = lk_path_join(base, c[k].name))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
        struct stat sb;
        if (!s && stat(c[k].dir, &sb) == 0 && S_ISDIR(sb.st_mode) && lk_ckpt_open(c[k].dir, &c[k].ck)) {
            lk_log(LK_LOG_DEBUG, "%s: %s has no checkpoint (%s): copied", base, c[k].name, lk_last_error());
            c[k].ck = NULL;
        }
        if (!s && c[k].ck) s = lk_out_inputs_add_ckpt(&oin, c[k].ck);
    }
    /* every module of every adapter lands in exactly one component */
    for (size_t i = 0; i < n && !s; i++) {
        lk_adapter *a = NULL;
        lk_adapter_opts ao = {inputs[i].format, opts->alpha_from};
        if ((s = lk_fuse_input_open(&inputs[i], sources ? sources[i] : NULL, &ao, &a))) break;
        if (!sources || !sources[i]) s = lk_out_inputs_add(&oin, lk_adapter_file(a), "adapter");
        if (!s && lk_adapter_config_file(a)) s = lk_out_inputs_add(&oin, lk_adapter_config_file(a), "adapter config");
        if (s) {
            lk_adapter_free(a);
            break;
        }
        size_t nm = lk_adapter_count(a);
        int *where = lk_malloc((nm ? nm : 1) * sizeof *where);
        if (!where) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", inputs[i].path);
        for (size_t m = 0; where && m < nm; m++) where[m] = -1;
        for (size_t k = 0; k < N_COMP && !s; k++) {
            if (!c[k].ck) continue;
            size_t nt = lk_ckpt_count(c[k].ck);
            lk_tensor *t = lk_malloc((nt ? nt : 1) * sizeof *t);
            if (!t) {
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
                break;
            }
            for (size_t j = 0; j < nt; j++) t[j] = *lk_ckpt_tensor(c[k].ck, j);
            lk_resolve_opts ro = {.allow_unmatched = LK_RESOLVE_LIST_ALL, .arch = opts->arch, .maps = opts->maps, .n_maps = opts->n_maps,
                                  .component = c[k].name};
            s = lk_adapter_resolve_opts(a, t, nt, &ro, NULL);
            lk_free(t);
            for (size_t m = 0; m < nm && !s; m++) {
                if (!lk_adapter_module(a, m)->target) continue;
                if (where[m] >= 0)
                    s = lk_error(LK_ERR_FORMAT, "%s: %s lands in both %s and %s of %s", inputs[i].path,
                                 lk_adapter_module(a, m)->module, c[where[m]].name, c[k].name, base);
                where[m] = (int)k;
                c[k].hits++;
            }
        }
        size_t un = 0, first = SIZE_MAX;
        for (size_t m = 0; m < nm && !s; m++)
            if (where[m] < 0 && un++ == 0) first = m;
        if (!s && nm && un == nm) /* as for one file: --allow-unmatched skips some modules, never all */
            s = lk_error(LK_ERR_UNMATCHED, "%s: none of its %zu modules matches a weight in any component of %s "
                         "(first: %s), so it would change nothing", inputs[i].path, nm, base,
                         lk_adapter_module(a, first)->module);
        if (!s && un && !opts->allow_unmatched)
            s = lk_error(LK_ERR_UNMATCHED, "%s: %s matches no weight in any component of %s (unet, transformer, "
                         "text_encoder[_2|_3])%s", inputs[i].path, lk_adapter_module(a, first)->module, base,
                         un > 1 ? " (and more modules; --allow-unmatched skips them)" : "");
        if (!s && un) lk_log(LK_LOG_WARN, "%s: %zu of %zu modules match no weight in %s and are skipped (first: %s)",
                             inputs[i].path, un, nm, base, lk_adapter_module(a, first)->module);
        total.modules_unmatched += un;
        lk_free(where);
        lk_adapter_free(a);
    }
    /* OUT: new, empty, or a pipeline lorakit wrote (replaced whole); never the base */
    struct stat sb;
    if (!s) s = check_out_vs_base(base, out);
    if (!s && !(s = lk_out_dir_begin_tree(out, &oin, &od))) tmp = lk_out_dir_path(od);
    /* the fused components, then everything else copied */
    for (size_t k = 0; k < N_COMP && !s; k++) {
        if (!c[k].ck || !c[k].hits) continue;
        char *od = lk_path_join(tmp, c[k].name), *of = NULL;
        const char *ckfile = NULL;
        if (!od) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
            break;
        }
        if (!lk_ckpt_sharded(c[k].ck)) { /* the folder's other files, then the one fused file */
            const char *p = lk_ckpt_path(c[k].ck), *sl = strrchr(p, '/');
            ckfile = sl ? sl + 1 : p;
            s = copy_tree(c[k].dir, od, ckfile, 0);
            if (!s && !(of = lk_path_join(od, ckfile))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
        }
        lk_fuse_file_opts fo = *opts;
        fo.component = c[k].name;
        fo.allow_unmatched = 1; /* checked above over all components */
        lk_fuse_stats st = {0};
        if (!s) s = lk_fuse_checkpoint(c[k].dir, inputs, sources, n, of ? of : od, &fo, &st);
        total.tensors_total += st.tensors_total;
        total.tensors_fused += st.tensors_fused;
        lk_free(od);
        lk_free(of);
    }
    if (!s) {
        DIR *d = opendir(base);
        struct dirent *e;
        if (!d) s = lk_error(LK_ERR_IO, "%s: cannot read: %s", base, strerror(errno));
        while (!s && d && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            int fused = 0;
            for (size_t k = 0; k < N_COMP; k++) fused |= c[k].ck && c[k].hits && !strcmp(e->d_name, c[k].name);
            if (fused) continue;
            char *a = lk_path_join(base, e->d_name), *b = lk_path_join(tmp, e->d_name);
            if (!a || !b) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
            else if (lstat(a, &sb)) s = lk_error(LK_ERR_IO, "%s: %s", a, strerror(errno));
            else if (S_ISDIR(sb.st_mode)) s = copy_tree(a, b, NULL, 0);
            else if (S_ISREG(sb.st_mode)) s = copy_file(a, b);
            else s = lk_error(LK_ERR_UNSUPPORTED, "%s: not a regular file or folder", a);
            lk_free(a);
            lk_free(b);
        }
        if (d) closedir(d);
    }
    if (!s && (s = lk_out_dir_commit(od)) == LK_OK) od = NULL; /* commit frees od on success */
    lk_out_dir_abort(od);
    lk_out_inputs_free(&oin);
    for (size_t k = 0; k < N_COMP; k++) {
        lk_ckpt_close(c[k].ck);
        lk_free(c[k].dir);
    }
    if (!s && stats) *stats = total;
    return s;
}
