/* serve/tracker.h — what the hot-swap tracker offers lorakit's own
 * benchmarks and tests beyond lorakit/tracker.h (internal, not installed). */
#ifndef LK_SERVE_TRACKER_H
#define LK_SERVE_TRACKER_H

#include "lorakit/tracker.h"

/* lk_tracker_create_ex modes (bits; 0 is lk_tracker_create's tracker). */
enum {
    /* (1 was the LTX-tracker-like `full` baseline: it is the benchmark's
     * own now, tools/bench/bench_full.c.) */
    /* No overlap: owners fuse every changed key, the ranks agree, then the
     * broadcast starts (the tracker before the overlap). Same bytes. */
    LK_TRACKER_SERIAL = 2,
    /* The overlap with a fuse worker thread even where spare_cores
     * (tracker.c) finds no spare core. Same bytes. Neither bit: the
     * overlap (non-blocking broadcasts, the fuse in between), with the
     * worker where cores are spare. `lorakit bench swap --compare` times
     * SERIAL and OVERLAP next to the default in one run. */
    LK_TRACKER_OVERLAP = 4,
};

/* lk_tracker_create with a mode (bits above); every rank must pass the
 * same mode (checked like the options). */
lk_status lk_tracker_create_ex(lk_comm *group, lk_weights *weights, const lk_tracker_opts *opts, int mode,
                               lk_tracker **out);

/* How apply overlaps the fuse with the broadcast: 0 not at all (serial,
 * one rank), 1 non-blocking broadcasts with the fuse in between, 2 that
 * plus a fuse worker thread (decided by this rank in lk_tracker_create). */
int lk_tracker_overlaps(const lk_tracker *t);

#endif
