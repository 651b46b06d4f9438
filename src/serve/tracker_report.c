/* tracker_report.c — what one tracker call did over the whole group:
 * lk_tracker_summarize (collective: sums of per-rank key counts, the
 * slowest rank's times, every rank's digest compared with rank 0's) fills a
 * struct; lk_tracker_summary_json is the one formatter the programs at the
 * edge use for it (`lorakit swap --json` and the Python package's
 * Tracker.apply print the same fields the same way). Nothing in the library
 * reads the JSON back. */
#include "lorakit/tracker.h"
#include "lorakit/alloc.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

lk_status lk_tracker_summarize(lk_comm *c, const lk_weights *w, const lk_tracker_stats *st, int digest,
                               lk_tracker_summary *out) {
    static const lk_tracker_stats zero;
    if (!st) st = &zero;
    memset(out, 0, sizeof *out);
    uint64_t sum[2] = {st->keys_fused, st->keys_restored};
    uint64_t mx[6] = {st->backup_bytes};
    const double ph[5] = {st->seconds_agree, st->seconds_load, st->seconds_fuse, st->seconds_broadcast, st->seconds};
    for (int k = 0; k < 5; k++) mx[1 + k] = (uint64_t)(ph[k] * 1e9);
    lk_status s = lk_comm_allreduce_u64(c, sum, 2, LK_REDUCE_SUM);
    if (!s) s = lk_comm_allreduce_u64(c, mx, 6, LK_REDUCE_MAX);
    if (s) return s;
    out->keys_fused = sum[0];
    out->keys_restored = sum[1];
    out->bytes_broadcast = st->bytes_broadcast;
    out->backup_bytes_max = mx[0];
    out->skipped = st->skipped != 0;
    out->adapters_changed = st->adapters_changed;
    out->seconds_agree = (double)mx[1] * 1e-9;
    out->seconds_load = (double)mx[2] * 1e-9;
    out->seconds_fuse = (double)mx[3] * 1e-9;
    out->seconds_broadcast = (double)mx[4] * 1e-9;
    out->seconds = (double)mx[5] * 1e-9;
    if (digest) {
        /* a digest failure (out of memory) still joins, as zeros, and makes
         * digests_agree false */
        char hex[LK_DIGEST_HEX] = {0};
        lk_status ds = lk_weights_digest(w, hex);
        lk_comm_same same;
        if ((s = lk_comm_same_bytes(c, LK_OK, hex, LK_DIGEST_HEX, 1, out->digest, &same))) return s;
        out->digest[LK_DIGEST_HEX - 1] = '\0';
        out->has_digest = 1;
        out->digests_agree = !ds && same.n_differ == 0;
    }
    return LK_OK;
}

lk_status lk_tracker_summary_json(const lk_tracker_summary *r, size_t step, lk_status status, const char *message,
                                  char **json) {
    *json = NULL;
    json_t *o = json_object();
    int bad = !o;
    if (!bad && step) bad |= json_object_set_new(o, "step", json_integer((json_int_t)step));
    if (!bad) bad |= json_object_set_new(o, "status", json_string(status ? "error" : "ok"));
    if (!bad && status) {
        json_t *m = json_string(message ? message : "");
        if (!m) m = json_string("(message is not UTF-8)");
        bad |= json_object_set_new(o, "error", m);
    }
    if (!bad) {
        bad |= json_object_set_new(o, "keys_fused", json_integer((json_int_t)r->keys_fused));
        bad |= json_object_set_new(o, "keys_restored", json_integer((json_int_t)r->keys_restored));
        bad |= json_object_set_new(o, "bytes_broadcast", json_integer((json_int_t)r->bytes_broadcast));
        bad |= json_object_set_new(o, "seconds", json_real(r->seconds));
        bad |= json_object_set_new(o, "digest", r->has_digest ? json_string(r->digest) : json_null());
        bad |= json_object_set_new(o, "digests_agree", r->has_digest ? json_boolean(r->digests_agree) : json_null());
        bad |= json_object_set_new(o, "skipped", json_boolean(r->skipped));
        bad |= json_object_set_new(o, "adapters_changed", json_integer((json_int_t)r->adapters_changed));
        bad |= json_object_set_new(o, "backup_bytes_max", json_integer((json_int_t)r->backup_bytes_max));
        bad |= json_object_set_new(o, "phases", json_pack("{s:f, s:f, s:f, s:f}", "agree", r->seconds_agree, "load",
                                                          r->seconds_load, "fuse", r->seconds_fuse, "broadcast",
                                                          r->seconds_broadcast));
    }
    char *txt = bad ? NULL : json_dumps(o, JSON_COMPACT);
    json_decref(o);
    *json = txt ? lk_strdup(txt) : NULL;
    free(txt);
    return *json ? LK_OK : lk_error(LK_ERR_NOMEM, "tracker report: out of memory");
}
