/* tracker_report.c — lk_tracker_report_json: what one tracker call did over
 * the whole group, as the JSON object `lorakit swap --json` prints per step.
 * In the library so the CLI and the Python package's Tracker.apply report
 * the same fields computed the same way (sums of per-rank key counts, the
 * slowest rank's times, every rank's digest compared with rank 0's). */
#include "lorakit/tracker.h"
#include "lorakit/alloc.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

lk_status lk_tracker_report_json(lk_comm *c, const lk_weights *w, size_t step, lk_status status, const char *message,
                                 const lk_tracker_stats *st, int digest, char **json) {
    static const lk_tracker_stats zero;
    if (!st) st = &zero;
    *json = NULL;
    uint64_t sum[2] = {st->keys_fused, st->keys_restored};
    uint64_t mx[6] = {st->backup_bytes};
    const double ph[5] = {st->seconds_agree, st->seconds_load, st->seconds_fuse, st->seconds_broadcast, st->seconds};
    for (int k = 0; k < 5; k++) mx[1 + k] = (uint64_t)(ph[k] * 1e9);
    lk_status s = lk_comm_allreduce_u64(c, sum, 2, LK_REDUCE_SUM);
    if (!s) s = lk_comm_allreduce_u64(c, mx, 6, LK_REDUCE_MAX);
    if (s) return s;
    double phase[5];
    for (int k = 0; k < 5; k++) phase[k] = (double)mx[1 + k] * 1e-9;
    char first[LK_DIGEST_HEX] = {0};
    int agree = 0;
    if (digest) {
        /* a digest failure (out of memory) still joins, as zeros, and makes
         * digests_agree false */
        char hex[LK_DIGEST_HEX] = {0};
        lk_status ds = lk_weights_digest(w, hex);
        lk_comm_same same;
        if ((s = lk_comm_same_bytes(c, LK_OK, hex, LK_DIGEST_HEX, 1, first, &same))) return s;
        first[LK_DIGEST_HEX - 1] = '\0';
        agree = !ds && same.n_differ == 0;
    }
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
        bad |= json_object_set_new(o, "keys_fused", json_integer((json_int_t)sum[0]));
        bad |= json_object_set_new(o, "keys_restored", json_integer((json_int_t)sum[1]));
        bad |= json_object_set_new(o, "bytes_broadcast", json_integer((json_int_t)st->bytes_broadcast));
        bad |= json_object_set_new(o, "seconds", json_real(phase[4]));
        bad |= json_object_set_new(o, "digest", digest ? json_string(first) : json_null());
        bad |= json_object_set_new(o, "digests_agree", digest ? json_boolean(agree) : json_null());
        bad |= json_object_set_new(o, "skipped", json_boolean(st->skipped != 0));
        bad |= json_object_set_new(o, "backup_bytes_max", json_integer((json_int_t)mx[0]));
        bad |= json_object_set_new(o, "phases", json_pack("{s:f, s:f, s:f, s:f}", "agree", phase[0], "load", phase[1],
                                                          "fuse", phase[2], "broadcast", phase[3]));
    }
    char *txt = bad ? NULL : json_dumps(o, JSON_COMPACT);
    json_decref(o);
    *json = txt ? lk_strdup(txt) : NULL;
    free(txt);
    return *json ? LK_OK : lk_error(LK_ERR_NOMEM, "tracker report: out of memory");
}
