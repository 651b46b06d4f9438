/* test_adapter_mem.c — adapters held in memory (lk_adapter_open_mem and the
 * _src forms of fuse and the tracker). Expectation: the same adapter read
 * from its folder on disk (a PEFT fixture made by PEFT, with rank_pattern /
 * alpha_pattern in its config): the in-memory image must fuse to the same
 * digest by every path, and name its label in errors. */
#include "testutil.h"
#include "core/alloc.h"

#include <stdlib.h>
#include <string.h>

#define FX LK_TEST_SRC_DIR "/tests/fixtures/peft"

static void *g_bytes, *g_cfg;
static size_t g_n, g_cfg_n;
static char *g_dir, g_want[LK_DIGEST_HEX];

static int setup(void **state) {
    (void)state;
    g_bytes = tu_read_file(FX "/patterns/adapter_model.safetensors", &g_n);
    char *cfg = tu_read_file(FX "/patterns/adapter_config.json", &g_cfg_n);
    if (!g_bytes || !cfg) return -1;
    g_cfg = realloc(cfg, g_cfg_n + 1);
    ((char *)g_cfg)[g_cfg_n] = '\0';
    g_dir = tu_mkdtemp();
    char *out = tu_path(g_dir, "file.safetensors");
    lk_fuse_input in[] = {{FX "/patterns", 0.75, LK_FORMAT_AUTO}};
    lk_fuse_stats st;
    lk_ckpt *ck = NULL;
    int rc = lk_fuse_file(FX "/base_f32.safetensors", in, 1, out, NULL, &st) || lk_ckpt_open(out, &ck) ||
             lk_digest_ckpt(ck, g_want);
    lk_ckpt_close(ck);
    free(out);
    return rc ? -1 : 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(g_dir);
    free(g_dir);
    free(g_bytes);
    free(g_cfg);
    return 0;
}

static void test_fuse_and_tracker_equal_the_folder(void **state) {
    (void)state;
    lk_adapter_source src = {"mem", g_bytes, g_n, g_cfg};
    const lk_adapter_source *srcs[] = {&src};
    lk_fuse_input in[] = {{"patterns@memory", 0.75, LK_FORMAT_AUTO}};
    char hex[LK_DIGEST_HEX];
    /* file to file */
    char *out = tu_path(g_dir, "mem.safetensors");
    lk_fuse_stats st;
    assert_int_equal(lk_fuse_file_src(FX "/base_f32.safetensors", in, srcs, 1, out, NULL, &st), LK_OK);
    lk_ckpt *ck;
    assert_int_equal(lk_ckpt_open(out, &ck), LK_OK);
    assert_int_equal(lk_digest_ckpt(ck, hex), LK_OK);
    lk_ckpt_close(ck);
    assert_memory_equal(hex, g_want, LK_DIGEST_HEX);
    free(out);
    /* in place */
    lk_weights *w;
    assert_int_equal(lk_weights_load(FX "/base_f32.safetensors", &w), LK_OK);
    size_t nt = lk_weights_count(w);
    lk_tensor *t = malloc(nt * sizeof *t);
    for (size_t i = 0; i < nt; i++) t[i] = *lk_weights_tensor(w, i);
    assert_int_equal(lk_fuse_tensors_src(t, nt, in, srcs, 1, NULL, &st), LK_OK);
    assert_int_equal(lk_weights_digest(w, hex), LK_OK);
    assert_memory_equal(hex, g_want, LK_DIGEST_HEX);
    lk_weights_free(w);
    /* the tracker */
    lk_comm *c;
    lk_tracker *tr;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(FX "/base_f32.safetensors", &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    assert_int_equal(lk_tracker_apply_src(tr, in, srcs, 1, NULL), LK_OK);
    assert_int_equal(lk_weights_digest(w, hex), LK_OK);
    assert_memory_equal(hex, g_want, LK_DIGEST_HEX);
    lk_tracker_free(tr);
    lk_weights_free(w);
    lk_comm_free(c);
    free(t);
}

static void test_errors_name_the_label(void **state) {
    (void)state;
    lk_adapter *a = NULL;
    lk_adapter_source src = {"mine@0123", g_bytes, g_n, "{\"r\": 4, \"lora_alpha\": "};
    assert_int_not_equal(lk_adapter_open_mem(&src, NULL, &a), LK_OK);
    tu_assert_contains(lk_last_error(), "mine@0123/adapter_config.json");
    assert_null(a);
    src.config_json = NULL;
    src.n = g_n / 2; /* truncated image */
    assert_int_not_equal(lk_adapter_open_mem(&src, NULL, &a), LK_OK);
    tu_assert_contains(lk_last_error(), "mine@0123");
    src.n = g_n;
    assert_int_equal(lk_adapter_open_mem(&src, NULL, &a), LK_OK);
    assert_string_equal(lk_adapter_path(a), "mine@0123");
    lk_adapter_free(a);
    assert_int_equal(lk_adapter_open_mem(NULL, NULL, &a), LK_ERR_ARG);
    /* every allocation of an in-memory open, failed in turn: an error, no leak */
    src.config_json = g_cfg;
    for (int k = 1;; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_adapter_open_mem(&src, NULL, &a);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            lk_adapter_free(a);
            break;
        }
        assert_int_equal(s, LK_ERR_NOMEM);
        assert_true(k < 10000);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuse_and_tracker_equal_the_folder),
        cmocka_unit_test(test_errors_name_the_label),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
