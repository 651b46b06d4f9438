/* test_safetensors.c — writer/reader round trips and the writer's layout.
 *
 * Expectations are independent of the code under test: exact file bytes
 * written out by hand from the format spec (8-byte LE length, compact JSON
 * header padded with spaces to a multiple of 8, data packed in the reference
 * order: dtype largest-first, then name), and round trips that compare every
 * name, dtype, shape, byte and metadata pair with what the test put in. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>

/* Counts directory entries other than . and .. (temp files must not linger). */
static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* The exact bytes of a one-tensor file, written by hand. */
static void test_exact_bytes(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "a.safetensors");
    float v[2] = {1.0f, -2.0f};
    lk_tensor t = {.name = "a", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {2}, .nbytes = 8, .data = v};
    assert_int_equal(lk_st_save(p, &t, 1, NULL, 0), LK_OK);
    const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    size_t hl = strlen(hdr); /* 54 -> padded to 56 */
    assert_int_equal(hl, 54);
    unsigned char want[8 + 56 + 8];
    memset(want, 0, sizeof want);
    want[0] = 56;
    memcpy(want + 8, hdr, hl);
    want[8 + 54] = ' ';
    want[8 + 55] = ' ';
    /* 1.0f = 0x3f800000, -2.0f = 0xc0000000, little-endian. */
    const unsigned char data[8] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0};
    memcpy(want + 64, data, 8);
    size_t n;
    unsigned char *got = tu_read_file(p, &n);
    assert_int_equal(n, sizeof want);
    assert_memory_equal(got, want, sizeof want);
    free(got);
    assert_int_equal(count_entries(dir), 1);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

/* Byte vectors from the reference Rust crate's own unit tests
 * (huggingface/safetensors, safetensors/src/tensor.rs: test_serialization,
 * test_serialization_forced_alignement, test_empty): our writer must produce
 * exactly these bytes and our reader must accept them. */
static void check_ref_bytes(const lk_tensor *t, size_t nt, const char *const *meta, size_t nm,
                            const unsigned char *want, size_t wn) {
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "ref.safetensors");
    assert_int_equal(lk_st_save(p, t, nt, meta, nm), LK_OK);
    size_t n;
    unsigned char *got = tu_read_file(p, &n);
    assert_int_equal(n, wn);
    assert_memory_equal(got, want, wn);
    free(got);
    lk_st *st;
    assert_int_equal(lk_st_open_mem(want, wn, "ref", &st), LK_OK);
    assert_int_equal(lk_st_count(st), nt);
    lk_st_close(st);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

static void test_reference_vectors(void **state) {
    (void)state;
    float data[6] = {0, 1, 2, 3, 4, 5};
    lk_tensor a = {.name = "attn.0", .dtype = LK_DTYPE_F32, .ndim = 3, .shape = {1, 2, 3}, .nbytes = 24, .data = data};
    static const unsigned char ser[] = {
        64, 0, 0, 0, 0, 0, 0, 0, 123, 34, 97, 116, 116, 110, 46, 48, 34, 58, 123, 34, 100,
        116, 121, 112, 101, 34, 58, 34, 70, 51, 50, 34, 44, 34, 115, 104, 97, 112, 101, 34,
        58, 91, 49, 44, 50, 44, 51, 93, 44, 34, 100, 97, 116, 97, 95, 111, 102, 102, 115,
        101, 116, 115, 34, 58, 91, 48, 44, 50, 52, 93, 125, 125, 0, 0, 0, 0, 0, 0, 128, 63,
        0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64};
    check_ref_bytes(&a, 1, NULL, 0, ser, sizeof ser);
    lk_tensor b = {.name = "attn0", .dtype = LK_DTYPE_F32, .ndim = 4, .shape = {1, 1, 2, 3}, .nbytes = 24, .data = data};
    static const unsigned char aligned[] = {
        72, 0, 0, 0, 0, 0, 0, 0, 123, 34, 97, 116, 116, 110, 48, 34, 58, 123, 34, 100, 116,
        121, 112, 101, 34, 58, 34, 70, 51, 50, 34, 44, 34, 115, 104, 97, 112, 101, 34, 58,
        91, 49, 44, 49, 44, 50, 44, 51, 93, 44, 34, 100, 97, 116, 97, 95, 111, 102, 102,
        115, 101, 116, 115, 34, 58, 91, 48, 44, 50, 52, 93, 125, 125, 32, 32, 32, 32, 32,
        32, 32, 0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0,
        160, 64};
    check_ref_bytes(&b, 1, NULL, 0, aligned, sizeof aligned);
    static const unsigned char empty[] = {8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32};
    check_ref_bytes(NULL, 0, NULL, 0, empty, sizeof empty);
    const char *meta[] = {"framework", "pt"};
    static const unsigned char empty_meta[] = {
        40, 0, 0, 0, 0, 0, 0, 0, 123, 34, 95, 95, 109, 101, 116, 97, 100, 97, 116, 97, 95,
        95, 34, 58, 123, 34, 102, 114, 97, 109, 101, 119, 111, 114, 107, 34, 58, 34, 112,
        116, 34, 125, 125, 32, 32, 32, 32, 32};
    check_ref_bytes(NULL, 0, meta, 1, empty_meta, sizeof empty_meta);
}

/* buf (512 bytes) = the 8-byte length of hdr, hdr, zeros; returns its length. */
static size_t hand_image(unsigned char *buf, const char *hdr) {
    size_t hl = strlen(hdr);
    assert_true(hl < 256 && 8 + hl < 480);
    memset(buf, 0, 512);
    buf[0] = (unsigned char)hl;
    memcpy(buf + 8, hdr, hl);
    return hl;
}

/* A file written by hand (as another implementation would), read back. */
static void test_read_handmade(void **state) {
    (void)state;
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"w\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                      "\"b\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[16,17]}}";
    unsigned char buf[512];
    size_t hl = hand_image(buf, hdr);
    int32_t w[4] = {1, -2, 3, 40000};
    memcpy(buf + 8 + hl, w, 16);
    buf[8 + hl + 16] = 7;
    lk_st *st;
    assert_int_equal(lk_st_open_mem(buf, 8 + hl + 17, "hand", &st), LK_OK);
    assert_int_equal(lk_st_count(st), 2);
    assert_int_equal(lk_st_header_len(st), hl);
    /* File (offset) order: w then b. */
    const lk_tensor *t0 = lk_st_tensor(st, 0), *t1 = lk_st_tensor(st, 1);
    assert_string_equal(t0->name, "w");
    assert_int_equal(t0->dtype, LK_DTYPE_I32);
    assert_int_equal(t0->ndim, 2);
    assert_int_equal(t0->shape[0], 2);
    assert_int_equal(t0->shape[1], 2);
    assert_int_equal(t0->nbytes, 16);
    assert_memory_equal(t0->data, w, 16);
    assert_int_equal(lk_st_file_offset(st, 0), 8 + hl);
    assert_string_equal(t1->name, "b");
    assert_int_equal(t1->ndim, 0);
    assert_int_equal(t1->nbytes, 1);
    assert_int_equal(*(unsigned char *)t1->data, 7);
    assert_int_equal(lk_st_find(st, "w"), 0);
    assert_int_equal(lk_st_find(st, "b"), 1);
    assert_int_equal(lk_st_find(st, "c"), -1);
    assert_int_equal(lk_st_metadata_count(st), 1);
    assert_string_equal(lk_st_metadata_get(st, "format"), "pt");
    assert_null(lk_st_metadata_get(st, "nope"));
    lk_st_close(st);
}

/* JSON as other writers may emit it: whitespace everywhere, escaped names
 * (\u00e9, a surrogate pair, \" and \\), an escaped __metadata__ key,
 * fields lorakit does not know (nested values, skipped), tensors listed
 * out of offset order. Expected: the names decoded as JSON defines them,
 * file (offset) order, lookup by name, offsets from the data_offsets. Then
 * the writer's escaping: a name with a quote, backslash, control bytes and
 * UTF-8 is written as jansson encodes it (\", \\, \n, \u0001 in capitals,
 * UTF-8 as is) and reads back equal. */
static void test_read_json_forms(void **state) {
    (void)state;
    const char *hdr = " {\n \"b\\u00e9\" : { \"x\" : {\"n\": [1, 2.5, null, {\"k\": \"\\n\"}]}, \"dtype\" : \"U8\" ,"
                      " \"shape\" : [ 2 ] , \"data_offsets\" : [ 4 , 6 ] } ,\r\n"
                      "\t\"\\u005f_metadata__\":{\"q\\\"\":\"v\\\\\"},"
                      "\"\\ud83d\\ude00a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]} }  ";
    unsigned char buf[512];
    size_t hl = hand_image(buf, hdr);
    for (int i = 0; i < 6; i++) buf[8 + hl + i] = (unsigned char)(10 + i);
    lk_st *st;
    assert_int_equal(lk_st_open_mem(buf, 8 + hl + 6, "forms", &st), LK_OK);
    assert_int_equal(lk_st_count(st), 2);
    const lk_tensor *t0 = lk_st_tensor(st, 0), *t1 = lk_st_tensor(st, 1);
    assert_string_equal(t0->name, "\xf0\x9f\x98\x80" "a"); /* U+1F600 from its surrogate pair */
    assert_string_equal(t1->name, "b\xc3\xa9");
    assert_int_equal(lk_st_file_offset(st, 0), 8 + hl);
    assert_int_equal(lk_st_file_offset(st, 1), 8 + hl + 4);
    assert_int_equal(((unsigned char *)t1->data)[0], 14);
    assert_int_equal(lk_st_find(st, "b\xc3\xa9"), 1);
    assert_int_equal(lk_st_find(st, "\xf0\x9f\x98\x80" "a"), 0);
    assert_int_equal(lk_st_metadata_count(st), 1);
    assert_string_equal(lk_st_metadata_get(st, "q\""), "v\\");
    lk_st_close(st);

    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "esc.safetensors");
    unsigned char one = 1;
    lk_tensor t = {.name = "q\"\\\n\x01\xc3\xa9/", .dtype = LK_DTYPE_U8, .ndim = 0, .nbytes = 1, .data = &one};
    const char *meta[2] = {"k\t", "v\x1f"};
    assert_int_equal(lk_st_save(p, &t, 1, meta, 1), LK_OK);
    size_t n;
    unsigned char *got = tu_read_file(p, &n);
    const char *want = "{\"__metadata__\":{\"k\\t\":\"v\\u001F\"},\"q\\\"\\\\\\n\\u0001\xc3\xa9/\":"
                       "{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}";
    assert_true(n > 8 + strlen(want));
    assert_memory_equal(got + 8, want, strlen(want));
    free(got);
    assert_int_equal(lk_st_open(p, &st), LK_OK);
    assert_string_equal(lk_st_tensor(st, 0)->name, t.name);
    assert_string_equal(lk_st_metadata_get(st, "k\t"), "v\x1f");
    lk_st_close(st);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

/* Every dtype, 0-d and empty tensors, metadata: write -> read is identity. */
static void test_roundtrip_all_dtypes(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "rt.safetensors");
    tu_rng rng = {42};
    enum { NT = 3 * (LK_DTYPE_COUNT - 1) };
    lk_tensor t[NT];
    char names[NT][32];
    unsigned char *bufs[NT];
    size_t k = 0;
    for (int d = 1; d < LK_DTYPE_COUNT; d++) {
        for (int form = 0; form < 3; form++) {
            lk_tensor *x = &t[k];
            memset(x, 0, sizeof *x);
            snprintf(names[k], sizeof names[k], "t%02d.%s", d * 3 + form, form == 0 ? "mat" : form == 1 ? "scalar" : "empty");
            x->name = names[k];
            x->dtype = (lk_dtype)d;
            if (form == 0) { x->ndim = 3; x->shape[0] = 2; x->shape[1] = 3; x->shape[2] = 5; }
            if (form == 1) x->ndim = 0;
            if (form == 2) { x->ndim = 2; x->shape[0] = 4; x->shape[1] = 0; }
            size_t numel = form == 0 ? 30 : form == 1 ? 1 : 0;
            x->nbytes = numel * lk_dtype_size(x->dtype);
            bufs[k] = malloc(x->nbytes + 1);
            for (size_t i = 0; i < x->nbytes; i++) bufs[k][i] = (unsigned char)tu_next(&rng);
            x->data = bufs[k];
            k++;
        }
    }
    const char *meta[] = {"format", "pt", "z-key", "ünïcode \"quoted\"\n", "empty", ""};
    assert_int_equal(lk_st_save(p, t, NT, meta, 3), LK_OK);
    lk_st *st;
    assert_int_equal(lk_st_open(p, &st), LK_OK);
    assert_int_equal(lk_st_count(st), NT);
    assert_int_equal(lk_st_header_len(st) % 8, 0);
    size_t prev_size = 1000;
    for (size_t i = 0; i < NT; i++) {
        long j = lk_st_find(st, t[i].name);
        assert_true(j >= 0);
        const lk_tensor *r = lk_st_tensor(st, (size_t)j);
        assert_string_equal(r->name, t[i].name);
        assert_int_equal(r->dtype, t[i].dtype);
        assert_int_equal(r->ndim, t[i].ndim);
        for (int d = 0; d < r->ndim; d++) assert_int_equal(r->shape[d], t[i].shape[d]);
        assert_int_equal(r->nbytes, t[i].nbytes);
        if (r->nbytes) assert_memory_equal(r->data, t[i].data, r->nbytes);
        /* Alignment: each tensor's file offset is a multiple of its element size. */
        assert_int_equal(lk_st_file_offset(st, (size_t)j) % lk_dtype_size(r->dtype), 0);
        /* File order: element size never increases. */
        const lk_tensor *f = lk_st_tensor(st, i);
        assert_true(lk_dtype_size(f->dtype) <= prev_size);
        prev_size = lk_dtype_size(f->dtype);
    }
    assert_int_equal(lk_st_metadata_count(st), 3);
    const char *key, *val;
    lk_st_metadata_at(st, 0, &key, &val); /* sorted by key */
    assert_string_equal(key, "empty");
    assert_string_equal(val, "");
    assert_string_equal(lk_st_metadata_get(st, "format"), "pt");
    assert_string_equal(lk_st_metadata_get(st, "z-key"), "ünïcode \"quoted\"\n");
    lk_st_close(st);
    for (size_t i = 0; i < NT; i++) free(bufs[i]);
    assert_int_equal(count_entries(dir), 1);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

/* Reference layout order: dtype descending (U64 > I64 > F64 > F32 > ... > BOOL,
 * the safetensors Dtype order) then name, regardless of declaration order. */
static void test_layout_order(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "o.safetensors");
    lk_st_writer *w;
    assert_int_equal(lk_st_writer_create(p, &w), LK_OK);
    struct { const char *n; lk_dtype d; } decl[] = {
        {"zz", LK_DTYPE_U8}, {"b", LK_DTYPE_F16}, {"c", LK_DTYPE_F32}, {"a", LK_DTYPE_F32},
        {"e", LK_DTYPE_I64}, {"f", LK_DTYPE_BF16}, {"g", LK_DTYPE_BOOL},
    };
    const char *want[] = {"e", "a", "c", "f", "b", "zz", "g"};
    int64_t shape[1] = {3};
    for (size_t i = 0; i < 7; i++) assert_int_equal(lk_st_writer_declare(w, decl[i].n, decl[i].d, 1, shape, NULL), LK_OK);
    assert_int_equal(lk_st_writer_begin(w), LK_OK);
    unsigned char zero[24] = {0};
    for (size_t i = 0; i < 7; i++)
        assert_int_equal(lk_st_writer_write(w, i, 0, zero, 3 * lk_dtype_size(decl[i].d)), LK_OK);
    assert_int_equal(lk_st_writer_commit(w), LK_OK);
    lk_st_writer_free(w);
    lk_st *st;
    assert_int_equal(lk_st_open(p, &st), LK_OK);
    for (size_t i = 0; i < 7; i++) assert_string_equal(lk_st_tensor(st, i)->name, want[i]);
    lk_st_close(st);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

/* Streaming: chunks in any order, across tensors; incomplete data refused
 * and no partial file left; free without commit leaves nothing. */
static void test_stream_chunks(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "s.safetensors");
    enum { N = 1000 };
    float a[N], b[N];
    for (int i = 0; i < N; i++) { a[i] = (float)i; b[i] = (float)-i; }
    lk_st_writer *w;
    assert_int_equal(lk_st_writer_create(p, &w), LK_OK);
    assert_int_equal(lk_st_writer_metadata(w, "k", "v1"), LK_OK);
    assert_int_equal(lk_st_writer_metadata(w, "k", "v2"), LK_OK); /* replaces */
    int64_t sh[1] = {N};
    size_t ia, ib;
    assert_int_equal(lk_st_writer_declare(w, "a", LK_DTYPE_F32, 1, sh, &ia), LK_OK);
    assert_int_equal(lk_st_writer_declare(w, "b", LK_DTYPE_F32, 1, sh, &ib), LK_OK);
    assert_int_equal(lk_st_writer_write(w, ia, 0, a, 4), LK_ERR_STATE); /* before begin */
    assert_int_equal(lk_st_writer_begin(w), LK_OK);
    assert_int_equal(lk_st_writer_declare(w, "c", LK_DTYPE_F32, 1, sh, NULL), LK_ERR_STATE);
    /* b in reverse 700-byte chunks, a in interleaved odd/even chunks. */
    for (size_t off = 4 * N; off > 0;) {
        size_t n = off >= 700 ? 700 : off;
        off -= n;
        assert_int_equal(lk_st_writer_write(w, ib, off, (char *)b + off, n), LK_OK);
    }
    for (int pass = 0; pass < 2; pass++)
        for (size_t c = (size_t)pass; c * 300 < 4 * N; c += 2) {
            size_t off = c * 300, n = 4 * N - off < 300 ? 4 * N - off : 300;
            assert_int_equal(lk_st_writer_write(w, ia, off, (char *)a + off, n), LK_OK);
        }
    assert_int_equal(lk_st_writer_write(w, ia, 4 * N - 2, a, 4), LK_ERR_ARG); /* past the end */
    assert_int_equal(lk_st_writer_commit(w), LK_OK);
    lk_st_writer_free(w);
    lk_st *st;
    assert_int_equal(lk_st_open(p, &st), LK_OK);
    assert_memory_equal(lk_st_tensor(st, (size_t)lk_st_find(st, "a"))->data, a, sizeof a);
    assert_memory_equal(lk_st_tensor(st, (size_t)lk_st_find(st, "b"))->data, b, sizeof b);
    assert_string_equal(lk_st_metadata_get(st, "k"), "v2");
    lk_st_close(st);

    /* Incomplete: commit refused, temp removed on free, old file untouched. */
    size_t n0;
    unsigned char *before = tu_read_file(p, &n0);
    assert_int_equal(lk_st_writer_create(p, &w), LK_OK);
    assert_int_equal(lk_st_writer_declare(w, "a", LK_DTYPE_F32, 1, sh, &ia), LK_OK);
    assert_int_equal(lk_st_writer_begin(w), LK_OK);
    assert_int_equal(count_entries(dir), 2); /* the temporary exists meanwhile */
    assert_int_equal(lk_st_writer_write(w, ia, 0, a, 4 * N - 4), LK_OK);
    assert_int_equal(lk_st_writer_commit(w), LK_ERR_STATE);
    tu_assert_contains(lk_last_error(), "a: data incomplete");
    lk_st_writer_free(w);
    assert_int_equal(count_entries(dir), 1);
    size_t n1;
    unsigned char *after = tu_read_file(p, &n1);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    free(before);
    free(after);

    /* Duplicate names and reserved names are refused. */
    assert_int_equal(lk_st_writer_create(p, &w), LK_OK);
    assert_int_equal(lk_st_writer_declare(w, "__metadata__", LK_DTYPE_F32, 1, sh, NULL), LK_ERR_ARG);
    assert_int_equal(lk_st_writer_declare(w, "x", LK_DTYPE_F32, 1, sh, NULL), LK_OK);
    assert_int_equal(lk_st_writer_declare(w, "x", LK_DTYPE_F16, 1, sh, NULL), LK_OK);
    assert_int_equal(lk_st_writer_begin(w), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "x: tensor declared twice");
    lk_st_writer_free(w);
    assert_int_equal(count_entries(dir), 1);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

/* Every allocation of save and open can fail cleanly (no leak under ASan). */
static void test_alloc_failures(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "f.safetensors");
    float v[4] = {1, 2, 3, 4};
    lk_tensor t[2] = {
        {.name = "x", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {4}, .nbytes = 16, .data = v},
        {.name = "y", .dtype = LK_DTYPE_F16, .ndim = 2, .shape = {2, 2}, .nbytes = 8, .data = v},
    };
    const char *meta[] = {"a", "b"};
    int saw_ok = 0;
    for (unsigned long k = 1; k < 200 && !saw_ok; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_st_save(p, t, 2, meta, 1);
        lk_alloc_fail_at(0);
        if (s == LK_OK) saw_ok = 1;
        else assert_int_equal(s, LK_ERR_NOMEM);
        assert_int_equal(count_entries(dir), saw_ok ? 1 : 0);
    }
    assert_true(saw_ok);
    saw_ok = 0;
    for (unsigned long k = 1; k < 200 && !saw_ok; k++) {
        lk_st *st = NULL;
        lk_alloc_fail_at(k);
        lk_status s = lk_st_open(p, &st);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            saw_ok = 1;
            assert_int_equal(lk_st_count(st), 2);
            lk_st_close(st);
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
            assert_null(st);
        }
    }
    assert_true(saw_ok);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_bytes),
        cmocka_unit_test(test_reference_vectors),
        cmocka_unit_test(test_read_handmade),
        cmocka_unit_test(test_read_json_forms),
        cmocka_unit_test(test_roundtrip_all_dtypes),
        cmocka_unit_test(test_layout_order),
        cmocka_unit_test(test_stream_chunks),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
