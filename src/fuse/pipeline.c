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

static lk_status copy_file(const char *from, const char *to, const lk_cancel *cn) {
    int in = open(from, O_RDONLY | O_CLOEXEC), o = -1;
    lk_status s = LK_OK;
    char *buf = lk_malloc(1 << 20);
    if (in < 0) s = lk_error(LK_ERR_IO, "%s: cannot open: %s", from, strerror(errno));
    else if ((o = open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0)
        s = lk_error(LK_ERR_IO, "%s: cannot create: %s", to, strerror(errno));
    else if (!buf) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", from);
    while (!s && !(s = lk_cancel_check(cn, to))) { /* a cancellation point per MiB */
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

static lk_status copy_tree(const char *from, const char *to, const char *skip, int depth, const lk_cancel *cn);

/* Entry `name` of folder `from` copied into folder `to`: a folder with its
 * tree (copy_tree at depth), a regular file; anything else, a symlink
 * included, is refused by name (hint ends that message). nomem names the
 * out-of-memory error. */
static lk_status copy_entry(const char *from, const char *to, const char *name, int depth, const char *nomem,
                            const char *hint, const lk_cancel *cn) {
    char *a = lk_path_join(from, name), *b = lk_path_join(to, name);
    struct stat sb;
    lk_status s;
    if (!a || !b) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", nomem);
    else if (lstat(a, &sb)) s = lk_error(LK_ERR_IO, "%s: %s", a, strerror(errno));
    else if (S_ISDIR(sb.st_mode)) s = copy_tree(a, b, NULL, depth, cn);
    else if (S_ISREG(sb.st_mode)) s = copy_file(a, b, cn);
    else s = lk_error(LK_ERR_UNSUPPORTED, "%s: not a regular file or folder%s", a, hint);
    lk_free(a);
    lk_free(b);
    return s;
}

/* Copies folder `from` into the new folder `to` (regular files and folders;
 * anything else, a symlink included, is refused by name). skip: a name in
 * `from` not to copy (the checkpoint a fuse writes), or NULL. */
static lk_status copy_tree(const char *from, const char *to, const char *skip, int depth, const lk_cancel *cn) {
    if (depth > 16) return lk_error(LK_ERR_FORMAT, "%s: folders nested too deep", from);
    if (mkdir(to, 0755) && errno != EEXIST) return lk_error(LK_ERR_IO, "%s: cannot create: %s", to, strerror(errno));
    DIR *d = opendir(from);
    if (!d) return lk_error(LK_ERR_IO, "%s: cannot read: %s", from, strerror(errno));
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || (skip && !strcmp(e->d_name, skip))) continue;
        s = copy_entry(from, to, e->d_name, depth + 1, from, "; a pipeline folder is copied as files", cn);
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
    char *why;      /* the folder holds a checkpoint that could not be opened: lk_ckpt_open's message */
    size_t hits;    /* modules landing here, over all adapters */
} comp;

/* Whether folder dir holds a file lk_ckpt_open would consider (a
 * .safetensors file or a checkpoint index); 1 when it cannot be read. */
static int holds_checkpoint_file(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 1;
    int any = 0;
    for (struct dirent *e; !any && (e = readdir(d));) {
        size_t l = strlen(e->d_name);
        any = (l > 12 && !strcmp(e->d_name + l - 12, ".safetensors")) || lk_ckpt_is_index_name(e->d_name);
    }
    closedir(d);
    return any;
}

/* One pipeline fuse: the request, its components, and the output. */
typedef struct pctx {
    const char *base, *out;
    const lk_fuse_input *inputs;
    const lk_adapter_source *const *sources;
    size_t n;
    const lk_fuse_file_opts *opts;
    comp c[N_COMP];
    lk_out_inputs oin; /* adapters and component checkpoints: never an old file of OUT */
    lk_out_dir *od;    /* OUT's temporary folder, once begun */
    lk_fuse_stats total;
} pctx;

/* Every component's folder, and its checkpoint when it has one (a
 * component without one is copied; running out of memory while opening
 * one is LK_ERR_NOMEM, not "no checkpoint"; a checkpoint file there that
 * cannot be opened, or two variants, is kept in c->why: check_unmatched
 * names it rather than let the component pass as having no checkpoint);
 * each checkpoint is added to the inputs OUT is checked against. */
static lk_status open_components(pctx *p) {
    lk_status s = LK_OK;
    for (size_t k = 0; k < N_COMP && !s; k++) {
        comp *c = &p->c[k];
        c->name = g_components[k];
        if (!(c->dir = lk_path_join(p->base, c->name))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", p->base);
        struct stat sb;
        lk_status o = LK_OK;
        if (!s && stat(c->dir, &sb) == 0 && S_ISDIR(sb.st_mode) && (o = lk_ckpt_open(c->dir, &c->ck))) {
            if (o == LK_ERR_NOMEM)
                s = o;
            else if (holds_checkpoint_file(c->dir) && !(c->why = lk_strdup(lk_last_error())))
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory", p->base);
            else
                lk_log(LK_LOG_DEBUG, "%s: %s has no checkpoint (%s): copied", p->base, c->name, lk_last_error());
            c->ck = NULL;
        }
        if (!s && c->ck) s = lk_out_inputs_add_ckpt(&p->oin, c->ck);
    }
    return s;
}

/* Adapter a (input `path`) resolved against every component with a
 * checkpoint (lk_resolve_opts.component keeps other components' prefixed
 * modules out): where[m] is the component module m lands in, -1 for none;
 * a module landing in two is refused. Counts each component's hits. */
static lk_status locate_modules(pctx *p, lk_adapter *a, const char *path, int *where) {
    const size_t nm = lk_adapter_count(a);
    for (size_t m = 0; m < nm; m++) where[m] = -1;
    lk_status s = LK_OK;
    for (size_t k = 0; k < N_COMP && !s; k++) {
        comp *c = &p->c[k];
        if (!c->ck) continue;
        lk_resolve_opts ro = {.allow_unmatched = LK_RESOLVE_LIST_ALL, .arch = p->opts->arch, .maps = p->opts->maps,
                              .n_maps = p->opts->n_maps, .component = c->name};
        s = lk_adapter_resolve_opts(a, lk_ckpt_tensor(c->ck, 0), lk_ckpt_count(c->ck), &ro, NULL);
        for (size_t m = 0; m < nm && !s; m++) {
            if (!lk_adapter_module(a, m)->target) continue;
            if (where[m] >= 0)
                s = lk_error(LK_ERR_FORMAT, "%s: %s lands in both %s and %s of %s", path,
                             lk_adapter_module(a, m)->module, p->c[where[m]].name, c->name, p->base);
            where[m] = (int)k;
            c->hits++;
        }
    }
    return s;
}

/* The modules of adapter a that land nowhere: all of them is refused (the
 * adapter would change nothing), some of them unless allow_unmatched
 * (then skipped with a warning); counted in p->total. */
static lk_status check_unmatched(pctx *p, const lk_adapter *a, const char *path, const int *where) {
    const size_t nm = lk_adapter_count(a);
    size_t un = 0, first = SIZE_MAX;
    for (size_t m = 0; m < nm; m++)
        if (where[m] < 0 && un++ == 0) first = m;
    lk_status s = LK_OK;
    for (size_t k = 0; k < N_COMP && un && !s; k++) /* not a component without a checkpoint: never skipped */
        if (p->c[k].why)
            s = lk_error(LK_ERR_IO, "%s: %s matches no weight in %s, whose %s checkpoint could not be opened: %s", path,
                         lk_adapter_module(a, first)->module, p->base, p->c[k].name, p->c[k].why);
    if (!s && nm && un == nm) /* as for one file: --allow-unmatched skips some modules, never all */
        s = lk_error(LK_ERR_UNMATCHED, "%s: none of its %zu modules matches a weight in any component of %s "
                     "(first: %s), so it would change nothing", path, nm, p->base, lk_adapter_module(a, first)->module);
    if (!s && un && !p->opts->allow_unmatched)
        s = lk_error(LK_ERR_UNMATCHED, "%s: %s matches no weight in any component of %s (unet, transformer, "
                     "text_encoder[_2|_3])%s", path, lk_adapter_module(a, first)->module, p->base,
                     un > 1 ? " (and more modules; --allow-unmatched skips them)" : "");
    if (!s && un) lk_log(LK_LOG_WARN, "%s: %zu of %zu modules match no weight in %s and are skipped (first: %s)",
                         path, un, nm, p->base, lk_adapter_module(a, first)->module);
    p->total.modules_unmatched += un;
    return s;
}

/* Input i opened (its files added to the inputs OUT is checked against),
 * its modules located and checked, then closed: every module of every
 * adapter lands in exactly one component. */
static lk_status route_adapter(pctx *p, size_t i) {
    const lk_fuse_input *in = &p->inputs[i];
    const lk_adapter_source *src = p->sources ? p->sources[i] : NULL;
    lk_adapter *a = NULL;
    lk_adapter_opts ao = {.format = in->format, .alpha_from = p->opts->alpha_from,
                          .convention = p->opts->fuse.convention};
    lk_status s = lk_cancel_check(p->opts->fuse.cancel, p->base);
    if (!s) s = lk_fuse_input_open(in, src, &ao, &a);
    if (s) return s;
    if (!src) s = lk_out_inputs_add(&p->oin, lk_adapter_file(a), "adapter");
    if (!s && lk_adapter_config_file(a)) s = lk_out_inputs_add(&p->oin, lk_adapter_config_file(a), "adapter config");
    const size_t nm = lk_adapter_count(a);
    int *where = s ? NULL : lk_malloc((nm ? nm : 1) * sizeof *where);
    if (!s && !where) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", in->path);
    if (!s) s = locate_modules(p, a, in->path, where);
    if (!s) s = check_unmatched(p, a, in->path, where);
    lk_free(where);
    lk_adapter_free(a);
    return s;
}

/* 1 when `name` is a component that is fused (it has a checkpoint and
 * modules land in it). */
static int is_fused(const pctx *p, const char *name) {
    for (size_t k = 0; k < N_COMP; k++)
        if (p->c[k].ck && p->c[k].hits && !strcmp(name, p->c[k].name)) return 1;
    return 0;
}

/* Component c fused into the temporary folder: for a one-file checkpoint,
 * its folder's other files copied first, then the one fused file
 * (lk_fuse_checkpoint keeps a sharded one's layout), with every input
 * (unmatched modules allowed there: checked over all components). */
static lk_status fuse_component(pctx *p, const comp *c) {
    char *od = lk_path_join(lk_out_dir_path(p->od), c->name), *of = NULL;
    if (!od) return lk_error(LK_ERR_NOMEM, "%s: out of memory", p->out);
    lk_status s = LK_OK;
    if (!lk_ckpt_sharded(c->ck)) {
        const char *path = lk_ckpt_path(c->ck), *sl = strrchr(path, '/');
        const char *ckfile = sl ? sl + 1 : path;
        s = copy_tree(c->dir, od, ckfile, 0, p->opts->fuse.cancel);
        if (!s && !(of = lk_path_join(od, ckfile))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", p->out);
    }
    lk_fuse_file_opts fo = *p->opts;
    fo.component = c->name;
    fo.allow_unmatched = 1; /* checked above over all components */
    lk_fuse_stats st = {0};
    if (!s) s = lk_fuse_checkpoint(c->dir, p->inputs, p->sources, p->n, of ? of : od, &fo, &st);
    p->total.tensors_total += st.tensors_total;
    p->total.tensors_fused += st.tensors_fused;
    p->total.convention = p->opts->fuse.convention;
    lk_free(od);
    lk_free(of);
    return s;
}

/* Everything in the base folder but the fused components, copied into
 * the temporary folder. */
static lk_status copy_rest(pctx *p) {
    DIR *d = opendir(p->base);
    if (!d) return lk_error(LK_ERR_IO, "%s: cannot read: %s", p->base, strerror(errno));
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || is_fused(p, e->d_name)) continue;
        s = copy_entry(p->base, lk_out_dir_path(p->od), e->d_name, 0, p->out, "", p->opts->fuse.cancel);
    }
    closedir(d);
    return s;
}

/* Open the components, route every adapter's modules, check OUT and begin
 * its temporary folder, fuse the components with modules, copy the rest,
 * commit; one cleanup point, where a failure removes the temporary folder. */
lk_status lk_fuse_pipeline(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                           size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    static const lk_fuse_file_opts defaults;
    if (opts && opts->n_tied) /* each component resolves with its own options: tied names are not carried there */
        return lk_error(LK_ERR_UNSUPPORTED, "%s: a pipeline folder: tied names (--tie %s=%s) are not supported on "
                        "pipeline folders yet; fuse the component's checkpoint (e.g. %s/text_encoder) instead", base,
                        opts->tied && opts->tied[0] ? opts->tied[0] : "?", opts->tied && opts->tied[1] ? opts->tied[1] : "?",
                        base);
    pctx p = {.base = base, .out = out, .inputs = inputs, .sources = sources, .n = n,
              .opts = opts ? opts : &defaults, .oin = LK_OUT_INPUTS_INIT};
    lk_status s = open_components(&p);
    for (size_t i = 0; i < n && !s; i++) s = route_adapter(&p, i);
    /* OUT: new, empty, or a pipeline lorakit wrote (replaced whole); never the base */
    if (!s) s = check_out_vs_base(base, out);
    if (!s) s = lk_out_dir_begin_tree(out, &p.oin, &p.od);
    for (size_t k = 0; k < N_COMP && !s; k++)
        if (p.c[k].ck && p.c[k].hits) s = fuse_component(&p, &p.c[k]);
    if (!s) s = copy_rest(&p);
    if (!s && (s = lk_out_dir_commit(p.od)) == LK_OK) p.od = NULL; /* commit frees od on success */
    lk_out_dir_abort(p.od);
    lk_out_inputs_free(&p.oin);
    for (size_t k = 0; k < N_COMP; k++) {
        lk_ckpt_close(p.c[k].ck);
        lk_free(p.c[k].dir);
        lk_free(p.c[k].why);
    }
    if (!s && stats) *stats = p.total;
    return s;
}
