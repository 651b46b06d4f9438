/* fuzz_out_record.c — libFuzzer target: the .lorakit-output record that
 * decides whether a sharded output may replace an existing folder
 * (src/io/out_dir.c, io/out_dir.h).
 *
 * The input is the record's text, written into a scratch folder "out" that
 * also holds one regular file, "a.safetensors". lk_out_dir_begin must then
 * either refuse cleanly, or accept; an accepted folder obeys out_dir.h: the
 * record is a JSON object with an integer "lorakit_output" and a "files"
 * array of strings naming "a.safetensors" (checked here with jansson,
 * independently of out_dir.c's reading). The accepted begin is aborted, never
 * committed; afterwards the folder holds exactly what it held (the two
 * files) and its parent no temporary. The same folder through the tree mode
 * (lk_out_dir_begin_tree, a pipeline output): accepted only with the same
 * record, whose "folders", when present, is a list of strings. */
#include "fuzz_common.h"
#include "io/out_dir.h"

#include <dirent.h>
#include <jansson.h>

static size_t fz_count(const char *dir) {
    DIR *d = opendir(dir);
    size_t n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

static void fz_out_record(const uint8_t *data, size_t size) {
    char out[600], p[700];
    snprintf(out, sizeof out, "%s", fz_mkdir_tmp("recparent"));
    snprintf(out + strlen(out), sizeof out - strlen(out), "/out");
    if (mkdir(out, 0755) != 0 && access(out, F_OK) != 0) abort();
    snprintf(p, sizeof p, "%s/a.safetensors", out);
    FILE *f = fopen(p, "wb");
    FZ_CHECK(f && fwrite("x", 1, 1, f) == 1 && fclose(f) == 0);
    snprintf(p, sizeof p, "%s/.lorakit-output", out);
    f = fopen(p, "wb");
    FZ_CHECK(f && (!size || fwrite(data, 1, size, f) == size) && fclose(f) == 0);
    lk_out_dir *od = NULL;
    lk_status s = lk_out_dir_begin(out, NULL, &od);
    if (s) {
        fz_clean_error(s);
        FZ_CHECK(od == NULL);
    } else {
        json_t *root = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, NULL);
        json_t *files = root ? json_object_get(root, "files") : NULL;
        FZ_CHECK(json_is_object(root) && json_is_integer(json_object_get(root, "lorakit_output")) &&
                 json_is_array(files));
        int named = 0;
        for (size_t i = 0; i < json_array_size(files); i++) {
            FZ_CHECK(json_is_string(json_array_get(files, i)));
            named |= !strcmp(json_string_value(json_array_get(files, i)), "a.safetensors");
        }
        FZ_CHECK(named);
        json_decref(root);
        lk_out_dir_abort(od);
    }
    FZ_CHECK(fz_count(out) == 2);
    FZ_CHECK(fz_count(fz_mkdir_tmp("recparent")) == 1);
    lk_status st = lk_out_dir_begin_tree(out, NULL, &od);
    if (st) {
        fz_clean_error(st);
        FZ_CHECK(od == NULL);
    } else {
        FZ_CHECK(s == LK_OK || s == LK_ERR_NOMEM); /* the flat check accepted the same record */
        json_t *root = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, NULL);
        json_t *folders = root ? json_object_get(root, "folders") : NULL;
        FZ_CHECK(root && (!folders || json_is_array(folders)));
        for (size_t i = 0; i < json_array_size(folders); i++) FZ_CHECK(json_is_string(json_array_get(folders, i)));
        json_decref(root);
        lk_out_dir_abort(od);
    }
    FZ_CHECK(fz_count(out) == 2);
    FZ_CHECK(fz_count(fz_mkdir_tmp("recparent")) == 1);
}

LK_FUZZ_MAIN(fz_out_record)
