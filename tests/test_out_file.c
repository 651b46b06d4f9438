/* test_out_file.c — io/out_file.h, the one way lorakit writes an output
 * file: whole through a temporary file and a rename, or not at all.
 * Oracles: the bytes written here, the directory listing (no temporary file
 * left), and the old file's bytes after a failed write. */
#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"
#include "io/out_file.h"

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    if (d) closedir(d);
    return n;
}

static void test_write_replace_fail(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *p = tu_path(dir, "out.txt");
    assert_int_equal(lk_out_file_write(p, "first\n", 6), LK_OK);
    size_t n;
    char *got = tu_read_file(p, &n);
    assert_int_equal(n, 6);
    assert_memory_equal(got, "first\n", 6);
    free(got);
    /* replacing: the new bytes, and only one file in the folder */
    assert_int_equal(lk_out_file_write(p, "second", 6), LK_OK);
    got = tu_read_file(p, &n);
    assert_memory_equal(got, "second", 6);
    free(got);
    assert_int_equal(count_entries(dir), 1);
    /* an abandoned write leaves the old file and no temporary */
    lk_out_file o;
    assert_int_equal(lk_out_file_begin(&o, p), LK_OK);
    assert_int_equal(write(o.fd, "partial", 7), 7);
    assert_int_equal(count_entries(dir), 2);
    lk_out_file_abort(&o);
    assert_int_equal(count_entries(dir), 1);
    got = tu_read_file(p, &n);
    assert_memory_equal(got, "second", 6);
    free(got);
    /* a target that cannot be replaced (a folder): an error naming it, nothing left behind */
    char *sub = tu_path(dir, "sub");
    assert_int_equal(mkdir(sub, 0777), 0);
    assert_int_equal(lk_out_file_write(sub, "x", 1), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "sub: cannot rename");
    assert_int_equal(count_entries(dir), 2); /* out.txt and sub */
    /* a folder that does not exist: the temporary cannot be made */
    char *missing = tu_path(dir, "no/such.txt");
    assert_int_equal(lk_out_file_write(missing, "x", 1), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "cannot create temporary file");
    tu_rmtree(dir);
    free(dir); free(p); free(sub); free(missing);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_replace_fail),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
