/* bench_full.h — the reference's hot-swap tracker (LTX's
 * TransformerWeightTracker) rebuilt from the public API, as the `full`
 * baseline of `lorakit bench swap`. It lives with the benchmark, not in
 * the library: nothing but the benchmark wants a tracker that does more
 * work than it must. */
#ifndef LK_TOOLS_BENCH_BENCH_FULL_H
#define LK_TOOLS_BENCH_BENCH_FULL_H

#include "lorakit/lorakit.h"

typedef struct lk_bench_full lk_bench_full;

/* Collective. Ownership and the check that every rank holds the same base
 * bytes come from an lk_tracker made with opts (so both modes split the keys
 * alike); then every owner clones every key it owns (the reference clones
 * them all up front). */
lk_status lk_bench_full_create(lk_comm *c, lk_weights *w, const lk_tracker_opts *opts, lk_bench_full **out);
/* Collective: as the reference applies a set: every owned key restored from
 * its clone and, where the set touches it, fused in place (the library's
 * plan and kernel, so the bytes equal the delta tracker's), then every key
 * broadcast owner by owner in rounds of the bucket size, after all are fused.
 * stats as lk_tracker_apply's (agree: the agreement on every rank's load). */
lk_status lk_bench_full_apply(lk_bench_full *f, const lk_fuse_input *in, size_t n, lk_tracker_stats *stats);
size_t lk_bench_full_staging_bytes(const lk_bench_full *f);
void lk_bench_full_free(lk_bench_full *f);

#endif
