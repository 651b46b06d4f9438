/* lorakit/tracker.h — distributed LoRA hot-swap over a group of ranks that
 * each hold a full working copy of the weights (DESIGN.md, Hot-swap tracker).
 *
 * The tracker references the caller's lk_weights and never owns them. Keys
 * are owned by ranks by size (largest first onto the least-loaded rank,
 * ties by name, then lowest rank), the same on every rank. An owner keeps
 * the clean bytes of a key only once an adapter first touches it. apply and
 * reset are collective: every rank of the group calls them together with
 * its own copy of the request. apply:
 *   1. agrees on the request (XXH3 of the sorted set, min/max allreduce):
 *      ranks asking for different sets all get LK_ERR_MISMATCH;
 *   2. skips when the set equals the current one; an empty set (or all
 *      strengths 0) resets;
 *   3. opens and validates every adapter, backs up newly touched owned keys,
 *      and agrees on success: any rank's failure is every rank's error
 *      ("rank R: <reason>"), with no weight changed; then agrees on what
 *      was read (a hash of each adapter's modules and bytes, and of the
 *      keys they touch), so files differing between ranks are a mismatch;
 *   4. owners recompute only the keys whose terms changed: restore from the
 *      backup and fuse the new terms in one pass (lk_fuse_tensor), terms in
 *      lk_fuse_canonical_order, so the bytes equal an offline lk_fuse_file
 *      of the same set;
 *   5. broadcasts those keys owner by owner in rounds of bucket_bytes
 *      (tensors larger than it go in several rounds), each round one
 *      vectored broadcast straight from the owner's weights into every
 *      receiver's (no staging copy). Steps 4 and 5 overlap: the
 *      broadcasts are non-blocking and every rank fuses its next keys
 *      while they move (plus a worker thread where each rank has a spare
 *      core; it calls no MPI). Then the ranks agree on the fuse: a
 *      failure on any rank (a non-finite result, memory) rolls every owner
 *      back and sends the changed keys again, so every rank returns it
 *      with its weights as they were.
 * A failed call leaves every rank's weights as they were, except after
 * LK_ERR_COMM (the transport itself failed: the group is unusable) and
 * LK_ERR_TIMEOUT (a collective outlived the group's timeout, lorakit/comm.h:
 * the message names the phase, the collective and the ranks waited for;
 * the communicator and the tracker are unusable and the program should
 * end).
 *
 * Adapter order never matters: entries with strength 0 are dropped, the rest
 * put in canonical (path, strength, format) order before anything else. */
#ifndef LORAKIT_TRACKER_H
#define LORAKIT_TRACKER_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/comm.h"
#include "lorakit/device.h"
#include "lorakit/digest.h"
#include "lorakit/fuse.h"
#include "lorakit/knobs.h"
#include "lorakit/weights.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_tracker lk_tracker;

/* Bucket sizes given in MiB by people (swap plans, the CLI's --bucket-mb,
 * Python, the benches) are the knob LK_KNOB_SWAP_BUCKET_MB (lorakit/knobs.h:
 * default and bounds), turned into bytes by lk_knob_mib_bytes; the library
 * itself takes bytes. */

/* Where the clean bytes of the touched keys of device weights are kept
 * (host weights: host memory always). */
typedef enum lk_tracker_backup {
    LK_TRACKER_BACKUP_HOST = 0,  /* pinned host memory: GPU memory is what users run out of */
    LK_TRACKER_BACKUP_DEVICE = 1 /* device memory: restores at device speed, costs the touched bytes */
} lk_tracker_backup;

typedef struct lk_tracker_opts {
    size_t bucket_bytes; /* broadcast round size, as lk_lora_sync_opts.bucket_bytes;
                            0: LK_TRACKER_BUCKET_DEFAULT (the knob
                            LK_KNOB_SWAP_BUCKET_MB's default, 64 MiB; LTX's
                            tracker defaults to 256 MiB) */
    int no_lora_swap;    /* no backup: the first set is fused in place; any later
                            change or reset is LK_ERR_STATE */
    int threads;         /* fuse threads per rank, 0 = all cores */
    int allow_nonfinite; /* passed to lk_fuse_tensor: 0 (default) refuses a
                            fused weight that turns NaN/Inf from finite inputs, or
                            factors holding NaN/Inf (LK_ERR_NONFINITE on every
                            rank, weights unchanged); 1 fuses them as they come */
    lk_fp8_opts fp8;     /* FP8 weights: rounding, seed, scale mode, saturate
                            (lorakit/fuse.h); must be equal on every rank */
    lk_alpha_from alpha_from; /* where each adapter's alpha comes from (adapter.h);
                            0 = auto. Ranks that differ get different scales,
                            which the content agreement refuses (LK_ERR_MISMATCH) */
    lk_convention convention; /* whose rules where the tools disagree (adapter.h);
                            0 = lorakit; must be equal on every rank */
    const char *arch;    /* model family table every adapter is resolved with, as
                            lk_resolve_opts.arch / `lorakit fuse --arch` ("flux",
                            "sdxl", ...; "none": no table); NULL: recognised from
                            the weights' names. Copied by create */
    const char *const *maps; /* extra name tables (`--map FILE`), as
                            lk_resolve_opts.maps; copied by create */
    size_t n_maps;       /* arch and maps are read and checked by create (an unknown
                            family or a bad table fails it on every rank) and must be
                            equal on every rank (else LK_ERR_MISMATCH). Adapters land
                            where lk_fuse_file with the same arch and maps puts them,
                            row slices of fused weights included */
    const char *const *tied; /* n_tied pairs (NAME, KEY) of tied names, as
                            lk_resolve_opts.tied; copied by create; must be equal on
                            every rank */
    size_t n_tied;
    const char *base_label; /* names the weights in messages about their own tensors
                            (an FP8 scale that is NaN, 0, ...): the base checkpoint's
                            path; copied; NULL: "base weights" */
    lk_tracker_backup backup; /* weights on a device (lk_weights_device: cuda:N, emul):
                            where the backups live; must be equal on every rank */
    const lk_cancel *cancel; /* NULL, or checked by apply/reset on this rank (lorakit/cancel.h):
                            a cancel on any rank ends the call on every rank with
                            LK_ERR_CANCELLED and every rank's weights as before. Borrowed
                            (must outlive the tracker); each rank may have its own */
} lk_tracker_opts;

#define LK_TRACKER_BUCKET_DEFAULT ((size_t)LK_KNOB_SWAP_BUCKET_MB_DEFAULT << 20)
#define LK_TRACKER_OPTS_DEFAULT                                                               \
    {.bucket_bytes = LK_TRACKER_BUCKET_DEFAULT, .no_lora_swap = 0, .threads = 0,             \
     .allow_nonfinite = 0, .fp8 = {LK_FP8_NEAREST, 0, LK_FP8_RESCALE, 0}, .alpha_from = LK_ALPHA_AUTO,   \
     .convention = LK_CONVENTION_LORAKIT,                                                      \
     .arch = NULL, .maps = NULL, .n_maps = 0, .tied = NULL, .n_tied = 0, .base_label = NULL, .backup = LK_TRACKER_BACKUP_HOST}

typedef struct lk_tracker_stats {
    int skipped;               /* the request equalled the current set (and its files read the same) */
    size_t adapters_changed;   /* adapters of the set whose file was rewritten since it was applied and
                                  read again with other content (same on every rank) */
    size_t keys_fused;         /* keys this rank fused (as owner) */
    size_t keys_restored;      /* keys this rank restored to clean (as owner) */
    size_t keys_broadcast;     /* keys sent over the group (same on every rank) */
    uint64_t bytes_broadcast;  /* bytes sent over the group (same on every rank; a
                                  failed call counts its second, restoring send) */
    uint64_t backup_bytes;     /* clean bytes held by this rank after the call */
    double seconds_agree, seconds_load;
    double seconds_fuse;       /* this rank's recomputation (it overlaps the broadcast) */
    double seconds_broadcast;  /* the broadcast phase; overlapped with the fuse, it starts
                                  with the fuse and includes the waits for it */
    double seconds;            /* whole call */
    /* device weights (lk_weights_device not the host): */
    uint64_t device_bytes;     /* device memory the tracker holds beyond the model after the
                                  call (the backups with backup = device; 0 with host backups) */
    uint64_t pinned_bytes;     /* pinned host memory it holds: host backups, a scratch for hashing
                                  (the largest key, at most 4 MiB, plus the largest FP8 scale) and,
                                  where the communicator cannot take device memory, one broadcast
                                  round */
    size_t keys_fused_on_host; /* keys the device kernel (lorakit/fuse_device.h) fused on its host
                                  path (LoHa, LoKr, DoRA, FP8, ...: the key copied to pinned memory,
                                  the CPU kernel, copied back: the same bytes); the rest ran on the
                                  device */
} lk_tracker_stats;

/* Collective. Ranks must hold weights of the same names, dtypes, shapes and
 * bytes and pass the same options, else LK_ERR_MISMATCH on every rank (for
 * bytes: naming the first differing tensor in byte-wise name order, how
 * many differ, and which ranks hold which XXH3-64 of it; the check hashes
 * every tensor once, about the cost of reading the weights). The tracker
 * borrows group and weights; both must outlive it. */
lk_status lk_tracker_create(lk_comm *group, lk_weights *weights, const lk_tracker_opts *opts,
                            lk_tracker **out);
void lk_tracker_free(lk_tracker *t);

/* Collective: makes the fused set equal loras[0..n) (see above). stats may
 * be NULL. Two checks come first, on every call:
 * - a file adapter of the current set whose files (the safetensors file,
 *   its adapter_config.json, their folder) changed since it was read (dev,
 *   inode, size, mtime, ctime; or written within 2 s of its read, where a
 *   timestamp may not show a later write) is read again: a request equal
 *   to the set is then not skipped when the content differs
 *   (stats.adapters_changed), and is skipped when it reads the same;
 * - every key the tracker has written must still hold the bytes it last
 *   wrote (an XXH3-64 per touched key, kept at each apply): else every
 *   rank fails with LK_ERR_STATE "the model's weights were changed outside
 *   the tracker: make a new Tracker (...: KEY holds XXH3-64 ..., the
 *   tracker last wrote ...)", changing nothing. It costs one hash of the
 *   touched keys per call. */
lk_status lk_tracker_apply(lk_tracker *t, const lk_fuse_input *loras, size_t n, lk_tracker_stats *stats);
/* lk_tracker_apply with some adapters held in memory: sources (may be NULL)
 * beside loras, as lk_fuse_tensors_src. The sources are read during the
 * call only. The ranks' agreement covers them: each label (the Python
 * package makes it from a digest of the bytes and config) is part of the
 * request, and the loaded adapters' contents are hashed, as for files. */
lk_status lk_tracker_apply_src(lk_tracker *t, const lk_fuse_input *loras, const lk_adapter_source *const *sources,
                               size_t n, lk_tracker_stats *stats);
/* Collective: every touched key back to its clean bytes on every rank; a
 * no-op when nothing is applied. Same as apply with an empty set. */
lk_status lk_tracker_reset(lk_tracker *t, lk_tracker_stats *stats);

/* Device weights: the stream the following calls queue this rank's device
 * work on (restores, backups, the fuse kernel, the stage's copies), e.g.
 * torch's current stream wrapped by lk_stream_wrap; NULL (the default): the
 * device's default stream. Borrowed: it must outlive its use. Every move
 * completes on it before the call goes on, so the collectives (the comm's
 * own stream) see finished bytes; work queued on it earlier by the host
 * program runs first. Local (each rank its own); ignored for host weights.
 * LK_ERR_ARG when s belongs to another device. */
lk_status lk_tracker_set_stream(lk_tracker *t, lk_stream *s);

/* The rank owning weight i. */
int lk_tracker_owner(const lk_tracker *t, size_t i);
/* Number of adapters currently fused (after dropping strength 0). */
size_t lk_tracker_applied(const lk_tracker *t);
/* Bytes per broadcast round (min(bucket_bytes, model bytes); 0 at one
 * rank, where nothing is broadcast). No buffer of that size is allocated:
 * rounds move straight between the ranks' weights. */
size_t lk_tracker_staging_bytes(const lk_tracker *t);

/* What one apply/reset did over the whole group (equal on every rank). */
typedef struct lk_tracker_summary {
    uint64_t keys_fused, keys_restored; /* summed over the ranks */
    uint64_t bytes_broadcast;           /* as lk_tracker_stats (same on every rank) */
    uint64_t backup_bytes_max;          /* the most clean bytes one rank holds */
    int skipped;                        /* the request equalled the current set */
    uint64_t adapters_changed;          /* as lk_tracker_stats (same on every rank) */
    double seconds;                     /* the slowest rank's whole call */
    double seconds_agree, seconds_load, seconds_fuse, seconds_broadcast; /* slowest rank, per phase */
    int has_digest;                     /* 0: digest and digests_agree not made */
    char digest[LK_DIGEST_HEX];         /* rank 0's content digest of its weights */
    int digests_agree;                  /* every rank's digest equals rank 0's */
} lk_tracker_summary;

/* Collective: sums, maxima and (when digest is 1) every rank's content
 * digest of its weights compared with rank 0's (lk_comm_same_bytes), from
 * each rank's stats of its last call (NULL: zeros; w may be NULL when
 * digest is 0). Call it on every rank
 * after each call, whatever its status, except after LK_ERR_COMM (the group
 * is gone). */
lk_status lk_tracker_summarize(lk_comm *c, const lk_weights *w, const lk_tracker_stats *stats, int digest,
                               lk_tracker_summary *out);

/* The one formatter of a summary, for the programs at the edge (the line of
 * `lorakit swap --json`, the Python package's Tracker.apply/reset): one JSON
 * object {"step" (when step > 0), "status": "ok"|"error", "error" (when
 * status != LK_OK: message, that call's lk_last_error), "keys_fused",
 * "keys_restored", "bytes_broadcast", "seconds", "digest", "digests_agree"
 * (null both without a digest), "skipped", "adapters_changed", "backup_bytes_max", "phases":
 * {agree, load, fuse, broadcast}}. *json is lk_malloc'd. Local. */
lk_status lk_tracker_summary_json(const lk_tracker_summary *sum, size_t step, lk_status status, const char *message,
                                  char **json);

#ifdef __cplusplus
}
#endif
#endif
