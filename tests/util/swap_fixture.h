/* swap_fixture.h — small synthetic models and adapters for the hot-swap
 * tests (tracker, swap CLI, example). The model mimics a DiT block layout:
 * per block attn.to_q/to_k/to_v/to_out.0 (dim x dim), ff.net.0.proj
 * (hidden x dim), ff.net.2 (dim x hidden), norm.weight (1-D F32), plus a
 * non-fusable I64 tensor. With mixed dtypes, the 2-D weights cycle through
 * BF16, F16 and F32 so every fusable dtype crosses the broadcast. */
#ifndef LK_TESTS_SWAP_FIXTURE_H
#define LK_TESTS_SWAP_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

#include "lorakit/lorakit.h"

typedef struct swap_model {
    int blocks, dim, hidden;
    int mixed; /* cycle BF16/F16/F32 (else all BF16) */
} swap_model;

#define SWAP_LINEARS 6 /* 2-D weights per block */

/* Name ("blocks.B.attn.to_q"), rows and columns of linear j of block b. */
void swap_linear(const swap_model *m, int b, int j, char *name, size_t cap, int64_t *out, int64_t *in);
/* 1 for the attention projections (j < 4). */
int swap_is_attn(int j);

/* Writes the base model; returns 0 on success. */
int swap_write_base(const char *path, const swap_model *m, uint64_t seed);

/* Which linears an adapter covers. */
enum { SWAP_ATTN = 1, SWAP_FF = 2 };

/* Writes a diffusers-format adapter ("transformer.<m>.lora_A.weight", F32
 * factors, an .alpha per module) over the selected linears of every block.
 * Factor values are uniform in [-mag, mag]; in_delta != 0 makes the A of
 * block 0's first covered linear have in + in_delta columns (a shape
 * mismatch). Returns 0 on success. */
int swap_write_adapter(const char *path, const swap_model *m, int which, int rank, float alpha, float mag,
                       int in_delta, uint64_t seed);

/* Bytes of the model weights an adapter with `which` touches, restricted
 * to those owned by `rank` under `tr` (all ranks when tr is NULL). */
size_t swap_touched_bytes(const lk_weights *w, int which, const lk_tracker *tr, int rank);

/* The independent expectation for a swap: the digest of an offline
 * lk_fuse_file of in[0..n) (inputs in sorted path order) onto base, written
 * to scratch and removed again. Returns 0, or -1 with lk_last_error() set. */
int swap_offline_digest(const char *base, const lk_fuse_input *in, size_t n, const char *scratch,
                        char hex[LK_DIGEST_HEX]);
/* The same with fuse options (arch, maps, ...; NULL: defaults). */
int swap_offline_digest_opts(const char *base, const lk_fuse_input *in, size_t n, const lk_fuse_file_opts *opts,
                             const char *scratch, char hex[LK_DIGEST_HEX]);

#endif
