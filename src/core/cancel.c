/* cancel.c — the cancellation flag (lorakit/cancel.h).
 *
 * One int set with a sequentially consistent atomic store: lock-free on
 * every target lorakit builds for (checked below), so a signal handler can
 * set it while the call it interrupts is reading it on other threads. */
#include "lorakit/cancel.h"

#include <stddef.h>

_Static_assert(__atomic_always_lock_free(sizeof(int), 0), "int atomics must be lock-free for signal handlers");

void lk_cancel_request(lk_cancel *c) {
    if (c) __atomic_store_n(&c->requested_, 1, __ATOMIC_SEQ_CST);
}

void lk_cancel_clear(lk_cancel *c) {
    if (c) __atomic_store_n(&c->requested_, 0, __ATOMIC_SEQ_CST);
}

int lk_cancel_requested(const lk_cancel *c) {
    if (!c) return 0;
    if (__atomic_load_n(&c->requested_, __ATOMIC_RELAXED)) return 1;
    return c->poll && c->poll(c->poll_ctx) ? 1 : 0;
}

lk_status lk_cancel_check(const lk_cancel *c, const char *what) {
    if (!lk_cancel_requested(c)) return LK_OK;
    return what ? lk_error(LK_ERR_CANCELLED, "%s: cancelled", what) : lk_error(LK_ERR_CANCELLED, "cancelled");
}
