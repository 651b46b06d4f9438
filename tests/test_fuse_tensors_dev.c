/* test_fuse_tensors_dev.c — lk_fuse_tensors on tensors in device memory
 * (emul), the entry under Python's fuse_ on CUDA tensors.
 *
 * Oracle: lk_fuse_tensors on host copies of the same tensors (the CPU
 * path, tested against float64 references and the CLI in test_fuse*.c):
 * every tensor's bytes must be equal. The emul counters show the work
 * stayed on the device (no weight bytes came down: only the kernel's 8-byte
 * non-finite verdict per key) and that the backup was device-to-device. A
 * failing fuse (an overflowing adapter: LK_ERR_NONFINITE after earlier keys
 * were fused) leaves every device byte as it was; tensors on two devices
 * are refused naming one key on each. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "lorakit/device.h"
#include "lorakit/fuse.h"
#include "lorakit/weights.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/adapters/"
static const lk_device EMUL = {LK_DEVICE_EMUL, 0};

/* The base's tensors twice: w (host) and d (moved to emul). */
static void load2(lk_weights **w, lk_weights **d) {
    assert_int_equal(lk_weights_load(FX "base.safetensors", w), LK_OK);
    assert_int_equal(lk_weights_load(FX "base.safetensors", d), LK_OK);
    assert_int_equal(lk_weights_to_device(*d, EMUL), LK_OK);
}

/* 1 when every tensor of d (emul) holds the bytes of w's (host). */
static int same(const lk_weights *w, const lk_weights *d) {
    int ok = 1;
    for (size_t i = 0; ok && i < lk_weights_count(w); i++) {
        const lk_tensor *a = lk_weights_tensor(w, i), *b = lk_weights_tensor(d, i);
        unsigned char *h = malloc(b->nbytes ? b->nbytes : 1);
        assert_int_equal(lk_device_copy(EMUL, h, b->data, b->nbytes, LK_COPY_D2H, NULL), LK_OK);
        ok = !memcmp(h, a->data, a->nbytes);
        free(h);
    }
    return ok;
}

static void test_equal_to_host(void **st) {
    (void)st;
    lk_weights *w, *d;
    load2(&w, &d);
    const lk_fuse_input in[] = {{FX "diffusers.safetensors", 0.7, LK_FORMAT_AUTO, 0, 0},
                                {FX "kohya.safetensors", -1.25, LK_FORMAT_AUTO, 0, 0}};
    lk_stream *s = NULL;
    assert_int_equal(lk_stream_create(EMUL, &s), LK_OK);
    lk_fuse_file_opts o = {0};
    o.stream = s;
    lk_fuse_stats sh, sd;
    assert_int_equal(lk_fuse_tensors((lk_tensor *)lk_weights_tensors(w), lk_weights_count(w), in, 2, &o, &sh), LK_OK);
    lk_device_counts c0, c1;
    lk_device_emul_counts(&c0);
    assert_int_equal(lk_fuse_tensors((lk_tensor *)lk_weights_tensors(d), lk_weights_count(d), in, 2, &o, &sd), LK_OK);
    lk_device_emul_counts(&c1);
    assert_true(sd.tensors_fused > 0);
    assert_int_equal(sd.tensors_fused, sh.tensors_fused);
    assert_int_equal(sd.keys_device + sd.keys_host_fallback, sd.tensors_fused);
    assert_true(sd.keys_device > 0);
    assert_true(same(w, d));
    if (!sd.keys_host_fallback) /* no weight bytes came down: only the verdict slots */
        assert_int_equal(c1.bytes[LK_COPY_D2H] - c0.bytes[LK_COPY_D2H], 8 * sd.keys_device);
    assert_true(c1.bytes[LK_COPY_D2D] > c0.bytes[LK_COPY_D2D]); /* the backup, on the device */
    lk_stream_free(s);
    lk_weights_free(w);
    lk_weights_free(d);
}

static void test_failure_changes_nothing(void **st) {
    (void)st;
    lk_weights *w, *d;
    load2(&w, &d);
    const lk_fuse_input in[] = {{FX "overflow.safetensors", 1.0, LK_FORMAT_AUTO, 0, 0}};
    lk_status s = lk_fuse_tensors((lk_tensor *)lk_weights_tensors(d), lk_weights_count(d), in, 1, NULL, NULL);
    assert_int_equal(s, lk_fuse_tensors((lk_tensor *)lk_weights_tensors(w), lk_weights_count(w), in, 1, NULL, NULL));
    assert_int_not_equal(s, LK_OK);
    assert_true(same(w, d)); /* the host copy, unchanged by its own failure, is the base */
    lk_weights_free(w);
    lk_weights_free(d);
}

static void test_mixed_devices_refused(void **st) {
    (void)st;
    lk_weights *w, *d;
    load2(&w, &d);
    size_t n = lk_weights_count(w);
    lk_tensor *t = malloc(n * sizeof *t);
    memcpy(t, lk_weights_tensors(d), n * sizeof *t);
    t[n - 1] = *lk_weights_tensor(w, n - 1); /* the last one on the host */
    const lk_fuse_input in[] = {{FX "diffusers.safetensors", 1.0, LK_FORMAT_AUTO, 0, 0}};
    assert_int_equal(lk_fuse_tensors(t, n, in, 1, NULL, NULL), LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "is on emul but"));
    assert_non_null(strstr(lk_last_error(), t[n - 1].name));
    assert_true(same(w, d));
    free(t);
    lk_weights_free(w);
    lk_weights_free(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equal_to_host),
        cmocka_unit_test(test_failure_changes_nothing),
        cmocka_unit_test(test_mixed_devices_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
