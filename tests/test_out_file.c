/* test_out_file.c — io/out_file.h, the one way lorakit writes an output
 * file: whole through a temporary file and a rename, or not at all; what an
 * output may replace (a regular file that is no input: never a FIFO, a
 * socket, a device or a folder); and io/temp.h: temporaries removed on a
 * signal, and those a killed process left removed by the next write.
 * Oracles: the bytes written here, the directory listing (no temporary file
 * left), the old file's bytes after a failed write, the kind of the special
 * files after a refused write (still a FIFO, socket, device), and how a
 * child process ended (by the signal it was sent). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

#include "testutil.h"
#include "io/out_file.h"
#include "io/temp.h"

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    if (d) closedir(d);
    return n;
}

static void test_write_replace_fail(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *p = tu_path(dir, "out.txt");
    assert_int_equal(lk_out_file_write(p, "first\n", 6), LK_OK);
    size_t n;
    char *got = tu_read_file(p, &n);
    assert_int_equal(n, 6);
    assert_memory_equal(got, "first\n", 6);
    free(got);
    /* replacing: the new bytes, and only one file in the folder */
    assert_int_equal(lk_out_file_write(p, "second", 6), LK_OK);
    got = tu_read_file(p, &n);
    assert_memory_equal(got, "second", 6);
    free(got);
    assert_int_equal(count_entries(dir), 1);
    /* an abandoned write leaves the old file and no temporary */
    lk_out_file o;
    assert_int_equal(lk_out_file_begin(&o, p), LK_OK);
    assert_int_equal(write(o.fd, "partial", 7), 7);
    assert_int_equal(count_entries(dir), 2);
    lk_out_file_abort(&o);
    assert_int_equal(count_entries(dir), 1);
    got = tu_read_file(p, &n);
    assert_memory_equal(got, "second", 6);
    free(got);
    /* a target that cannot be replaced (a folder): an error naming it, nothing left behind */
    char *sub = tu_path(dir, "sub");
    assert_int_equal(mkdir(sub, 0777), 0);
    assert_int_equal(lk_out_file_write(sub, "x", 1), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "sub: exists and is a folder; an output replaces only a regular file");
    assert_int_equal(count_entries(dir), 2); /* out.txt and sub */
    /* a folder that does not exist: the temporary cannot be made */
    char *missing = tu_path(dir, "no/such.txt");
    assert_int_equal(lk_out_file_write(missing, "x", 1), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "cannot create temporary file");
    tu_rmtree(dir);
    free(dir); free(p); free(sub); free(missing);
}

/* A FIFO, a socket and (as root) a character device at the output path:
 * refused before a temporary is made, and refused at commit when one
 * appears there during the write; each is still what it was. */
static void test_special_targets(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *fifo = tu_path(dir, "fifo"), *sock = tu_path(dir, "sock"), *dev = tu_path(dir, "dev");
    assert_int_equal(mkfifo(fifo, 0666), 0);
    assert_int_equal(lk_out_file_write(fifo, "x", 1), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "fifo: exists and is a FIFO; an output replaces only a regular file");
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    int sfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(sfd >= 0);
    assert_int_equal(bind(sfd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(lk_out_file_write(sock, "x", 1), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "sock: exists and is a socket");
    int expect = 2;
    if (mknod(dev, S_IFCHR | 0666, makedev(1, 3)) == 0) { /* /dev/null's numbers, in our own folder */
        assert_int_equal(lk_out_file_write(dev, "x", 1), LK_ERR_ARG);
        tu_assert_contains(lk_last_error(), "dev: exists and is a character device");
        struct stat sb;
        assert_int_equal(lstat(dev, &sb), 0);
        assert_true(S_ISCHR(sb.st_mode));
        expect = 3;
    } else {
        print_message("mknod not permitted (%s): the character-device case is skipped\n", strerror(errno));
    }
    assert_int_equal(count_entries(dir), expect);
    /* a FIFO made while the temporary is written: the rename is refused */
    char *late = tu_path(dir, "late");
    lk_out_file o;
    assert_int_equal(lk_out_file_begin(&o, late), LK_OK);
    assert_int_equal(mkfifo(late, 0666), 0);
    assert_int_equal(lk_out_file_commit(&o, late), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "late: exists and is a FIFO");
    lk_out_file_abort(&o);
    struct stat sb;
    assert_int_equal(lstat(late, &sb), 0);
    assert_true(S_ISFIFO(sb.st_mode));
    assert_int_equal(lstat(fifo, &sb), 0);
    assert_true(S_ISFIFO(sb.st_mode));
    assert_int_equal(lstat(sock, &sb), 0);
    assert_true(S_ISSOCK(sb.st_mode));
    assert_int_equal(count_entries(dir), expect + 1);
    close(sfd);
    tu_rmtree(dir);
    free(dir); free(fifo); free(sock); free(dev); free(late);
}

/* lk_out_check: an input by any path (itself, a symlink, a hard link) is
 * refused naming the input; another file, or a new one, is fine. */
static void test_inputs(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *in = tu_path(dir, "in.bin"), *sl = tu_path(dir, "sl.bin"), *hl = tu_path(dir, "hl.bin"),
         *other = tu_path(dir, "other.bin"), *none = tu_path(dir, "none.bin");
    assert_int_equal(tu_write_file(in, "input", 5), 0);
    assert_int_equal(tu_write_file(other, "other", 5), 0);
    assert_int_equal(symlink("in.bin", sl), 0);
    assert_int_equal(link(in, hl), 0);
    lk_out_inputs ins = LK_OUT_INPUTS_INIT;
    assert_int_equal(lk_out_inputs_add(&ins, in, "base shard"), LK_OK);
    assert_int_equal(lk_out_inputs_add(&ins, none, "adapter"), LK_OK); /* missing: skipped */
    const char *as_in[] = {in, sl, hl};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(lk_out_check(as_in[i], &ins), LK_ERR_ARG);
        tu_assert_contains(lk_last_error(), "is the same file as the base shard");
        tu_assert_contains(lk_last_error(), in);
    }
    assert_int_equal(lk_out_check(other, &ins), LK_OK);
    assert_int_equal(lk_out_check(none, &ins), LK_OK);
    assert_int_equal(lk_out_check(dir, &ins), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "exists and is a folder");
    lk_out_inputs_free(&ins);
    tu_rmtree(dir);
    free(dir); free(in); free(sl); free(hl); free(other); free(none);
}

/* A pid that no process has: a child's, reaped. */
static pid_t dead_pid(void) {
    pid_t p = fork();
    assert_true(p >= 0);
    if (p == 0) _exit(0);
    assert_int_equal(waitpid(p, NULL, 0), p);
    return p;
}

static void set_old(const char *path) { /* last modified an hour ago */
    struct timespec ts[2] = {{time(NULL) - 3600, 0}, {time(NULL) - 3600, 0}};
    assert_int_equal(utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW), 0);
}

/* The sweep: the next write of an output removes the temporaries of that
 * output whose process is gone (a dead pid, or a pid now held by a process
 * started after the temporary was last written), and keeps a live one's,
 * another output's, and anything of another kind. */
static void test_sweep(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *out = tu_path(dir, "out.bin"), p[4096];
    pid_t dead = dead_pid();
    /* a live process started now: a temporary last written an hour ago
     * with its pid cannot be its own (the pid was reused) */
    int hold[2];
    assert_int_equal(pipe(hold), 0);
    pid_t young = fork();
    assert_true(young >= 0);
    if (young == 0) {
        char c;
        close(hold[1]);
        (void)!read(hold[0], &c, 1);
        _exit(0);
    }
    close(hold[0]);
    pid_t parent = getppid(); /* alive, started before anything here was written */
    struct { const char *fmt; long pid; int folder, old, gone; } c[] = {
        {"%s/out.bin.tmp.%ld.0", (long)dead, 0, 0, 1},
        {"%s/.out.bin.lorakit-tmp-%ld-3", (long)dead, 1, 0, 1},
        {"%s/out.bin.tmp.%ld.1", (long)young, 0, 1, 1},
        {"%s/out.bin.tmp.%ld.2", (long)parent, 0, 0, 0},
        {"%s/.out.bin.lorakit-tmp-%ld-4", (long)parent, 1, 0, 0},
        {"%s/other.bin.tmp.%ld.0", (long)dead, 0, 0, 0},  /* another output's */
        {"%s/out.bin.tmp.%ld.x", (long)dead, 0, 0, 0},    /* not lorakit's pattern */
        {"%s/out.bin.tmp.%ld.5", (long)dead, 1, 0, 0},    /* a folder with a file temporary's name */
    };
    size_t nc = sizeof c / sizeof c[0];
    for (size_t i = 0; i < nc; i++) {
        snprintf(p, sizeof p, c[i].fmt, dir, c[i].pid);
        if (c[i].folder) {
            assert_int_equal(mkdir(p, 0777), 0);
            char *q = tu_path(p, "model-00001-of-00002.safetensors");
            assert_int_equal(tu_write_file(q, "partial", 7), 0);
            if (c[i].old) set_old(q);
            free(q);
        } else {
            assert_int_equal(tu_write_file(p, "partial", 7), 0);
        }
        if (c[i].old) set_old(p);
    }
    assert_int_equal(lk_out_file_write(out, "new", 3), LK_OK);
    for (size_t i = 0; i < nc; i++) {
        snprintf(p, sizeof p, c[i].fmt, dir, c[i].pid);
        if (tu_exists(p) == c[i].gone) fail_msg("%s: %s", p, c[i].gone ? "left" : "removed");
    }
    /* a sharded output's begin sweeps its folder temporaries the same way */
    snprintf(p, sizeof p, "%s/.outdir.lorakit-tmp-%ld-0", dir, (long)dead);
    assert_int_equal(mkdir(p, 0777), 0);
    char *q = tu_path(p, "x.safetensors.tmp.1.0");
    assert_int_equal(tu_write_file(q, "partial", 7), 0);
    /* a pipeline output's temporary is a tree: unet/, unet/sub/ (nothing in
     * them is registered; the sweep removes the tree whole) */
    char *u = tu_path(p, "unet"), *us = tu_path(u, "sub"), *uf = tu_path(us, "w.safetensors");
    assert_int_equal(mkdir(u, 0777), 0);
    assert_int_equal(mkdir(us, 0777), 0);
    assert_int_equal(tu_write_file(uf, "partial", 7), 0);
    free(u); free(us); free(uf);
    char *od = tu_path(dir, "outdir");
    assert_int_equal(lk_temp_sweep(od), LK_OK);
    assert_false(tu_exists(p));
    close(hold[1]);
    assert_int_equal(waitpid(young, NULL, 0), young);
    tu_rmtree(dir);
    free(dir); free(out); free(q); free(od);
}

/* In a child: registered temporaries (a file, a folder with a file in it)
 * are removed by lk_temp_cleanup; then, with the handlers installed, a
 * temporary in progress is removed by SIGTERM and the child dies of it; an
 * ignored signal stays ignored. */
static void test_signal_cleanup(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *f = tu_path(dir, "f.tmp"), *d = tu_path(dir, "d.tmp"), *df = tu_path(d, "inner"),
         *out = tu_path(dir, "out.bin");
    pid_t p = fork();
    assert_true(p >= 0);
    if (p == 0) {
        void *h1, *h2, *h3;
        if (lk_temp_add(f, 0, &h1) || lk_temp_add(d, 1, &h2) || lk_temp_add(df, 0, &h3)) _exit(10);
        if (tu_write_file(f, "x", 1) || mkdir(d, 0777) || tu_write_file(df, "y", 1)) _exit(11);
        /* a registered folder's tree goes whole (a pipeline output's
         * temporary: its components' files are not registered one by one) */
        char sub[4096], subf[4096];
        snprintf(sub, sizeof sub, "%s/unet", d);
        snprintf(subf, sizeof subf, "%s/unet/w.safetensors", d);
        if (mkdir(sub, 0777) || tu_write_file(subf, "z", 1)) _exit(13);
        lk_temp_cleanup();
        _exit(tu_exists(f) || tu_exists(d) ? 12 : 0); /* _exit: the consumed registrations are not leaks */
    }
    int st;
    assert_int_equal(waitpid(p, &st, 0), p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGXFSZ};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        p = fork();
        assert_true(p >= 0);
        if (p == 0) {
            signal(sigs[i], SIG_DFL); /* whatever the runner had */
            if (lk_temp_cleanup_on_signals()) _exit(20);
            lk_out_file o;
            if (lk_out_file_begin(&o, out) || write(o.fd, "partial", 7) != 7) _exit(21);
            raise(sigs[i]);
            _exit(22); /* not reached: the signal ends the process */
        }
        assert_int_equal(waitpid(p, &st, 0), p);
        if (!WIFSIGNALED(st) || WTERMSIG(st) != sigs[i])
            fail_msg("signal %d: the child %s %d", sigs[i], WIFSIGNALED(st) ? "died of signal" : "exited",
                     WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        assert_int_equal(count_entries(dir), 0);
    }
    /* a signal while a registered folder holds a tree (a pipeline output in
     * progress): the handler removes it whole, async-signal-safely */
    p = fork();
    assert_true(p >= 0);
    if (p == 0) {
        signal(SIGUSR1, SIG_DFL);
        if (lk_temp_cleanup_on_signals()) _exit(20);
        void *h;
        char a[4096], b[4096], c[4096];
        snprintf(a, sizeof a, "%s/text_encoder", d);
        snprintf(b, sizeof b, "%s/text_encoder/deep", d);
        snprintf(c, sizeof c, "%s/text_encoder/deep/m.safetensors", d);
        if (lk_temp_add(d, 1, &h) || mkdir(d, 0777) || mkdir(a, 0777) || mkdir(b, 0777) || tu_write_file(c, "w", 1) ||
            tu_write_file(df, "y", 1))
            _exit(21);
        raise(SIGUSR1);
        _exit(22);
    }
    assert_int_equal(waitpid(p, &st, 0), p);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGUSR1);
    assert_int_equal(count_entries(dir), 0);
    p = fork();
    assert_true(p >= 0);
    if (p == 0) {
        signal(SIGHUP, SIG_IGN); /* as under nohup */
        if (lk_temp_cleanup_on_signals()) _exit(20);
        lk_out_file o;
        if (lk_out_file_begin(&o, out)) _exit(21);
        raise(SIGHUP);
        lk_out_file_abort(&o);
        _exit(0);
    }
    assert_int_equal(waitpid(p, &st, 0), p);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    tu_rmtree(dir);
    free(dir); free(f); free(d); free(df); free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_replace_fail),
        cmocka_unit_test(test_special_targets),
        cmocka_unit_test(test_inputs),
        cmocka_unit_test(test_sweep),
        cmocka_unit_test(test_signal_cleanup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
