/* tracker_internal.h — what the hot-swap tracker offers lorakit's own
 * benchmarks and tests beyond lorakit/tracker.h (internal, not installed). */
#ifndef LK_SERVE_TRACKER_INTERNAL_H
#define LK_SERVE_TRACKER_INTERNAL_H

#include "lorakit/tracker.h"

/* lk_tracker_create, plus with full = 1 the benchmark baseline that behaves
 * like the reference (LTX): every owned key is backed up at creation,
 * restored on every change, and every key is re-broadcast. Same bytes,
 * more work: `lorakit bench swap` measures the difference. */
lk_status lk_tracker_create_ex(lk_comm *group, lk_weights *weights, const lk_tracker_opts *opts, int full,
                               lk_tracker **out);

#endif
