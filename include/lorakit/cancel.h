/* lorakit/cancel.h — stopping a long call part-way (Ctrl-C, SIGTERM, a
 * deadline, another thread's decision).
 *
 * The caller owns an lk_cancel, hands a pointer to it to a long call
 * (lk_fuse_opts.cancel: lk_fuse_file, lk_fuse_tensors, lk_fuse_tensor;
 * lk_tracker_opts.cancel: lk_tracker_apply and lk_tracker_reset), and may
 * request cancellation at any time from any thread or from a signal
 * handler: lk_cancel_request is one lock-free atomic store, so it is
 * async-signal-safe. The call checks the flag at its cancellation points
 * (before each adapter is opened, before each tensor is fused or copied,
 * every 8 MiB of a copy, every chunk of 24 rows inside the fusion kernel,
 * before each key of the tracker's fuse, at the tracker's agreements) and
 * returns LK_ERR_CANCELLED ("<file or tensors>: cancelled") with what it
 * promises for any failure:
 *   - lk_fuse_file: no output (every temporary file or folder removed, an
 *     existing OUT as it was);
 *   - lk_fuse_tensors: every tensor holds its old bytes (restored from the
 *     backup the call takes first);
 *   - lk_fuse_tensor alone: w_out may be partly written (as for
 *     LK_ERR_NONFINITE: a caller fusing in place keeps a copy);
 *   - lk_tracker_apply/reset: a cancel on any rank ends the step on every
 *     rank at the next agreement (the tracker agrees on each phase's status
 *     anyway), every rank returns LK_ERR_CANCELLED ("rank R: ...
 *     cancelled") and every rank's weights are as before the call (the
 *     tracker's rollback). A broadcast already in flight completes first
 *     (a collective cannot be stopped halfway), so a cancel during the
 *     broadcast phase ends the call after that phase and the rollback's
 *     resend. Under no_lora_swap (no backup) the in-place fuse is not
 *     cancellable; the checks before it are.
 * The library never clears the flag: a call begun with it set returns
 * LK_ERR_CANCELLED at its first check, and a signal that arrives between
 * the caller's reset and the call is not lost. Past its last check (the
 * output's rename, the tracker's commit) a call completes.
 *
 * poll, when set, is called at every cancellation point (from any of the
 * call's threads, concurrently: it must be thread-safe and quick); a
 * non-zero return cancels the call, as a request would. It is for
 * deadlines and for tests that cancel at each point in turn. */
#ifndef LORAKIT_CANCEL_H
#define LORAKIT_CANCEL_H

#include "lorakit/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_cancel {
    volatile int requested_;   /* read and written only through the functions below (atomics) */
    int (*poll)(void *ctx);    /* may be NULL */
    void *poll_ctx;
} lk_cancel;

#define LK_CANCEL_INIT {0, 0, 0}

/* Requests cancellation (c may be NULL: nothing). Async-signal-safe. */
void lk_cancel_request(lk_cancel *c);
/* Clears a request, for the next call (not from a signal handler racing a call). */
void lk_cancel_clear(lk_cancel *c);
/* 1 when cancellation was requested (or poll says so); NULL: 0. */
int lk_cancel_requested(const lk_cancel *c);
/* A cancellation point: LK_OK, or LK_ERR_CANCELLED with the message
 * "<what>: cancelled" (what may be NULL: "cancelled"). */
lk_status lk_cancel_check(const lk_cancel *c, const char *what);

#ifdef __cplusplus
}
#endif
#endif
