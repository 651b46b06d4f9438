/* temp.c — the registry of temporaries in progress, their removal on a
 * signal, and the sweep of temporaries a killed process left (see temp.h).
 *
 * Why a lock-free registry: the removal runs in a signal handler, which may
 * interrupt the very thread that is registering or dropping a path, so it
 * can take no lock and call nothing but unlink and rmdir. The registry is a
 * chain of fixed blocks of slots that are never freed or moved; a slot
 * holds a malloc'd "f<path>" or "d<path>" (file or folder) or NULL.
 * Registering claims a NULL slot with a compare-and-swap; dropping and the
 * handler both take the string out with an exchange, so exactly one of
 * them owns it: the dropper frees it, the handler removes the path and
 * leaks it (the process is about to die of the signal). This is the one
 * piece of process-wide mutable state in the io layer besides the logger;
 * nothing here installs a handler unless asked (lk_temp_cleanup_on_signals,
 * which the CLI calls and the library never does). */
#include "io/temp.h"
#include "lorakit/safetensors.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "core/file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SLOTS 64
/* the handler relies on it: a lock-based atomic could deadlock there */
_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2, "pointer atomics must be lock-free for the signal handler");

typedef struct block {
    _Atomic(char *) slot[SLOTS];
    _Atomic(struct block *) next;
} block;

static block g_first; /* zero: every slot empty; later blocks are never freed */

lk_status lk_temp_add(const char *path, int dir, void **handle) {
    *handle = NULL;
    size_t n = strlen(path);
    char *p = lk_malloc(n + 2);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    p[0] = dir ? 'd' : 'f';
    memcpy(p + 1, path, n + 1);
    for (block *b = &g_first;;) {
        for (int i = 0; i < SLOTS; i++) {
            char *expect = NULL;
            if (atomic_load_explicit(&b->slot[i], memory_order_relaxed) == NULL &&
                atomic_compare_exchange_strong(&b->slot[i], &expect, p)) {
                *handle = &b->slot[i];
                return LK_OK;
            }
        }
        block *next = atomic_load(&b->next);
        if (!next) {
            block *nb = calloc(1, sizeof *nb); /* never freed: the handler may be walking the chain */
            if (!nb) {
                lk_free(p);
                return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
            }
            block *expect = NULL;
            if (atomic_compare_exchange_strong(&b->next, &expect, nb)) next = nb;
            else {
                free(nb);
                next = expect;
            }
        }
        b = next;
    }
}

void lk_temp_drop(void *handle) {
    if (!handle) return;
    lk_free(atomic_exchange((_Atomic(char *) *)handle, NULL));
}

/* Empties the folder open as fd of regular files and of folders of them
 * (to depth 16; links, FIFOs and the like stay), with async-signal-safe
 * calls only (openat, getdents64, fstatat, unlinkat, lseek, close: no
 * malloc, no opendir), since a signal handler runs it: a pipeline's
 * temporary output is a tree (unet/, text_encoder/, ...) whose files are
 * not registered one by one. Entries removed while reading could make a
 * pass miss some, so passes repeat until one removes nothing. Closes fd. */
#define TREE_DEPTH 16
struct lk_dirent64 {
    unsigned long long d_ino;
    long long d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

static void empty_tree_fd(int fd, int depth) {
    char buf[2048] __attribute__((aligned(8)));
    for (int removed = 1; removed;) {
        removed = 0;
        if (lseek(fd, 0, SEEK_SET) != 0) break;
        for (long n; (n = syscall(SYS_getdents64, fd, buf, sizeof buf)) > 0;)
            for (long off = 0; off < n;) {
                struct lk_dirent64 *e = (struct lk_dirent64 *)(buf + off);
                off += e->d_reclen;
                const char *nm = e->d_name;
                if (nm[0] == '.' && (!nm[1] || (nm[1] == '.' && !nm[2]))) continue;
                struct stat es;
                if (fstatat(fd, nm, &es, AT_SYMLINK_NOFOLLOW) != 0) continue;
                if (S_ISREG(es.st_mode)) {
                    removed += unlinkat(fd, nm, 0) == 0;
                } else if (S_ISDIR(es.st_mode) && depth < TREE_DEPTH) {
                    int sub = openat(fd, nm, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                    if (sub >= 0) empty_tree_fd(sub, depth + 1);
                    removed += unlinkat(fd, nm, AT_REMOVEDIR) == 0;
                }
            }
    }
    close(fd);
}

/* Removes a temporary folder: its tree (empty_tree_fd), then itself;
 * -1 with errno when the folder stays. */
static int remove_tree(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) empty_tree_fd(fd, 1);
    return rmdir(path);
}

/* Removes every registered path of one kind ('f' files, 'd' folders). */
static void remove_kind(char kind) {
    for (block *b = &g_first; b; b = atomic_load(&b->next))
        for (int i = 0; i < SLOTS; i++) {
            char *p = atomic_load(&b->slot[i]);
            if (!p || p[0] != kind || !atomic_compare_exchange_strong(&b->slot[i], &p, NULL)) continue;
            if (kind == 'f') unlink(p + 1);
            else remove_tree(p + 1);
        }
}

void lk_temp_cleanup(void) {
    int e = errno;
    remove_kind('f'); /* files first: a folder goes only once empty */
    remove_kind('d');
    errno = e;
}

/* Every asynchronous signal whose default action ends the process (the
 * faults SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS are left
 * to their default: after one the process state is not to be trusted). */
static const int k_signals[] = {SIGINT,  SIGTERM, SIGHUP,    SIGPIPE, SIGXFSZ, SIGQUIT, SIGALRM, SIGUSR1,
                                SIGUSR2, SIGXCPU, SIGVTALRM, SIGPROF, SIGIO,   SIGPWR,  SIGSTKFLT};
#define N_SIGNALS (sizeof k_signals / sizeof k_signals[0])

static void on_signal(int sig) {
    /* a second signal on another thread while the first cleans up: the
     * first one re-raises and ends the process */
    static atomic_flag busy = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&busy)) return;
    lk_temp_cleanup();
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    /* blocked while this handler runs: delivered, with its default action,
     * as soon as it returns */
    raise(sig);
}

lk_status lk_temp_cleanup_on_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < N_SIGNALS; i++) sigaddset(&sa.sa_mask, k_signals[i]);
    for (size_t i = 0; i < N_SIGNALS; i++) {
        struct sigaction old;
        if (sigaction(k_signals[i], NULL, &old) != 0)
            return lk_error(LK_ERR_IO, "cannot read the action of signal %d: %s", k_signals[i], strerror(errno));
        /* an ignored signal (nohup's SIGHUP, a background job's SIGINT) or
         * the host's own handler stays as it is */
        if (!(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL && sigaction(k_signals[i], &sa, NULL) != 0)
            return lk_error(LK_ERR_IO, "cannot handle signal %d: %s", k_signals[i], strerror(errno));
    }
    return LK_OK;
}

int lk_temp_cleanup_handles(int sig) {
    struct sigaction cur;
    if (sigaction(sig, NULL, &cur) != 0) return 0;
    return !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == on_signal;
}

/* ------------------------------------------------------------------ sweep */

/* The pid in a temporary's name: "<name>.tmp.<pid>.<n>" (folder = 0) or
 * ".<name>.lorakit-tmp-<pid>-<n>" (folder = 1); 0 when e is neither. */
static long temp_pid(const char *e, const char *name, size_t nl, int *folder) {
    const char *p;
    char sep;
    if (!strncmp(e, name, nl) && !strncmp(e + nl, ".tmp.", 5)) {
        p = e + nl + 5, sep = '.', *folder = 0;
    } else if (e[0] == '.' && !strncmp(e + 1, name, nl) && !strncmp(e + 1 + nl, ".lorakit-tmp-", 13)) {
        p = e + 1 + nl + 13, sep = '-', *folder = 1;
    } else {
        return 0;
    }
    long pid = 0;
    const char *q = p;
    while (*q >= '0' && *q <= '9' && pid <= INT_MAX) pid = pid * 10 + (*q++ - '0');
    if (q == p || *q != sep || pid <= 0 || pid > INT_MAX) return 0;
    const char *r = ++q;
    while (*q >= '0' && *q <= '9') q++;
    return q > r && !*q ? pid : 0;
}

/* The start time of process pid (seconds since the epoch), from
 * /proc/<pid>/stat field 22 and /proc/stat's btime; -1 when unknown. */
static double proc_start(long pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
    unsigned long long ticks = 0;
    /* after "pid (comm) ": fields 3..21 skipped, 22 is starttime in clock ticks since boot */
    if (!p || sscanf(p + 1, " %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu",
                     &ticks) != 1)
        return -1;
    f = fopen("/proc/stat", "r");
    if (!f) return -1;
    long long btime = -1;
    char line[256];
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "btime %lld", &btime) == 1) break;
    fclose(f);
    long hz = sysconf(_SC_CLK_TCK);
    return btime < 0 || hz <= 0 ? -1 : (double)btime + (double)ticks / (double)hz;
}

/* Why the temporary of pid, last modified at mtime, is stale; NULL while
 * its writer may still be running. */
static const char *stale(long pid, double mtime) {
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return "which is no longer running";
    double st = proc_start(pid);
    /* 2 s: btime has a one-second resolution */
    if (st >= 0 && st > mtime + 2) return "whose process id now belongs to a process started after it was written";
    return NULL;
}

/* Latest modification time of path, and of its entries for a folder. */
static double latest_mtime(const char *path, const struct stat *sb, int folder) {
    double t = (double)sb->st_mtim.tv_sec + 1e-9 * (double)sb->st_mtim.tv_nsec;
    DIR *d = folder ? opendir(path) : NULL;
    for (struct dirent *e; d && (e = readdir(d));) {
        struct stat es;
        if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2]))) continue;
        if (fstatat(dirfd(d), e->d_name, &es, AT_SYMLINK_NOFOLLOW) == 0) {
            double te = (double)es.st_mtim.tv_sec + 1e-9 * (double)es.st_mtim.tv_nsec;
            if (te > t) t = te;
        }
    }
    if (d) closedir(d);
    return t;
}

/* Removes a stale temporary folder: its regular files and folders of them
 * (a pipeline output's tree), then itself; lorakit writes nothing else
 * there, so anything else stays. 0 when something stayed (named in *left). */
static int remove_folder(const char *path, char *left, size_t cap) {
    if (remove_tree(path) == 0) return 1;
    snprintf(left, cap, "%s", strerror(errno));
    return 0;
}

lk_status lk_temp_sweep(const char *out) {
    size_t l = strlen(out);
    while (l > 1 && out[l - 1] == '/') l--;
    char *o = lk_malloc(l + 1);
    if (!o) return lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
    memcpy(o, out, l);
    o[l] = 0;
    char *sl = strrchr(o, '/');
    const char *name = sl ? sl + 1 : o;
    char *dir = NULL;
    if (sl) dir = sl == o ? lk_strdup("/") : lk_malloc((size_t)(sl - o) + 1);
    if (sl && !dir) {
        lk_free(o);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
    }
    if (sl && sl != o) {
        memcpy(dir, o, (size_t)(sl - o));
        dir[sl - o] = 0;
    }
    size_t nl = strlen(name);
    lk_status s = LK_OK;
    DIR *d = nl ? opendir(dir ? dir : ".") : NULL;
    for (struct dirent *e; !s && d && (e = readdir(d));) {
        int folder;
        long pid = temp_pid(e->d_name, name, nl, &folder);
        struct stat sb;
        if (!pid || pid == (long)getpid() || fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 ||
            (folder ? !S_ISDIR(sb.st_mode) : !S_ISREG(sb.st_mode)))
            continue;
        char *p = lk_path_join(dir, e->d_name);
        if (!p) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
            break;
        }
        const char *why = stale(pid, latest_mtime(p, &sb, folder));
        if (why) {
            char left[256] = "";
            int ok = folder ? remove_folder(p, left, sizeof left) : unlink(p) == 0;
            if (!ok && !folder) snprintf(left, sizeof left, "%s", strerror(errno));
            if (ok)
                lk_log(LK_LOG_WARN, "%s: removed %s, a temporary %s left by process %ld, %s (an interrupted write)",
                       o, p, folder ? "folder" : "file", pid, why);
            else
                lk_log(LK_LOG_WARN, "%s: cannot remove %s, a temporary left by process %ld, %s: %s", o, p, pid, why,
                       left);
        }
        lk_free(p);
    }
    if (d) closedir(d);
    lk_free(dir);
    lk_free(o);
    return s;
}
