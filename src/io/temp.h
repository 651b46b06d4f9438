/* temp.h — the temporaries lorakit writes its outputs through (internal;
 * the public half, lk_temp_cleanup and lk_temp_cleanup_on_signals, is in
 * lorakit/safetensors.h).
 *
 * Two ways a temporary could outlive its run, two remedies:
 *   - a catchable signal (SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGXFSZ) mid-
 *     write: every temporary in progress is registered here while it
 *     exists, so a signal handler can remove them with unlink/rmdir alone;
 *   - SIGKILL or a crash: nothing can run, so the next write of the same
 *     output sweeps its folder for temporaries of that output whose process
 *     is gone (lk_temp_sweep). */
#ifndef LK_IO_TEMP_H
#define LK_IO_TEMP_H

#include "lorakit/status.h"

/* Registers path (a file; with dir = 1 a folder, removed with its tree of
 * regular files and folders, after every registered file)
 * as a temporary of this process; *handle is for lk_temp_drop. Register
 * before creating it, drop after renaming or removing it: a signal in
 * between only removes a path that no longer exists. LK_ERR_NOMEM names
 * path. Thread-safe (lock-free). */
lk_status lk_temp_add(const char *path, int dir, void **handle);
/* Forgets a registration (NULL: nothing). The path is not touched. */
void lk_temp_drop(void *handle);

/* Removes the temporaries that a process no longer running left beside
 * out: files "<name>.tmp.<pid>.<n>" (io/out_file.c) and folders
 * ".<name>.lorakit-tmp-<pid>-<n>" (io/out_dir.c, with their trees) in out's folder, where
 * <name> is out's last component. One is stale when no process has that
 * pid, or when the process that has it started after the temporary was
 * last modified (the pid was reused: the writer that modified it is gone).
 * Each removal is logged as a warning; this process's own are never
 * touched, nor anything of another kind (a folder named like a file
 * temporary, a link). A temporary that cannot be removed is a warning;
 * only running out of memory is an error (LK_ERR_NOMEM, naming out). */
lk_status lk_temp_sweep(const char *out);

#endif
