/* out_dir.h — writing a sharded checkpoint folder atomically (internal to
 * the library; used by lk_fuse_file).
 *
 * lk_out_dir_begin checks what OUT_DIR may be (below) and makes a fresh
 * temporary folder next to it (".<name>.lorakit-tmp-<pid>-<n>"); the
 * caller writes every shard into it (lk_out_dir_file gives the paths), then
 * lk_out_dir_index writes the new index and lk_out_dir_copy_small the base
 * folder's other small files; lk_out_dir_commit records the files in
 * OUT_DIR/.lorakit-output, fsyncs and puts the whole folder in place in one
 * rename(2), so OUT_DIR never holds a partial set. lk_out_dir_abort removes
 * the temporary folder and everything in it.
 *
 * OUT_DIR may be: new; an empty folder; or a folder lorakit wrote, which
 * is replaced whole. "lorakit wrote it" means: it holds .lorakit-output (a
 * regular file, JSON {"lorakit_output": 1, "files": [names]}, written by
 * lk_out_dir_commit), and every other entry is a regular file named in it,
 * none of them an input of this run. So a folder with a file of the user's
 * in it is refused by name, never replaced; the replacement is one
 * renameat2(RENAME_EXCHANGE), then the old files (only those named) go. */
#ifndef LK_IO_OUT_DIR_H
#define LK_IO_OUT_DIR_H

#include "io/out_file.h"
#include "lorakit/checkpoint.h"
#include "lorakit/status.h"

typedef struct lk_out_dir lk_out_dir;

/* 1 when out names one file (ends in ".safetensors" and is not a folder). */
int lk_out_is_file(const char *out);

/* in: the run's inputs (io/out_file.h), none of which OUT_DIR's old files may be. */
lk_status lk_out_dir_begin(const char *out, const lk_out_inputs *in, lk_out_dir **od);
/* A folder tree (a pipeline folder: files in subfolders) written the same
 * way: the caller writes anything under lk_out_dir_path(od); commit records
 * every file and folder it finds there (relative paths, in "files" and
 * "folders"), and an existing OUT_DIR may be replaced only when its record
 * names every file and every folder in it (none an input), links and other
 * kinds refused by name. Abort removes the whole temporary tree. */
lk_status lk_out_dir_begin_tree(const char *out, const lk_out_inputs *in, lk_out_dir **od);
/* The temporary folder the output is written into (exists while od lives). */
const char *lk_out_dir_path(const lk_out_dir *od);
/* The temporary path of file `name` (lk_malloc'd; NULL when out of
 * memory), which becomes one of the output's files: recorded in
 * .lorakit-output, and registered for removal on a signal (io/temp.h). */
char *lk_out_dir_file(lk_out_dir *od, const char *name);
/* Writes ck's index under its own name: the same weight_map, the metadata
 * kept with total_size recomputed and key = value added. */
lk_status lk_out_dir_index(lk_out_dir *od, const lk_ckpt *ck, const char *key, const char *value);
/* Copies the regular files of ck's folder that are not checkpoints (no
 * .safetensors, no index, no hidden file; config.json and the like), up to
 * 64 MiB each (larger ones are skipped with a warning). */
lk_status lk_out_dir_copy_small(lk_out_dir *od, const lk_ckpt *ck);
/* Writes .lorakit-output and puts the folder in place (replacing a folder
 * lorakit wrote: exchanged, then its old files removed); frees od on
 * success (else abort it). */
lk_status lk_out_dir_commit(lk_out_dir *od);
/* Removes the temporary folder and frees od (NULL: nothing). */
void lk_out_dir_abort(lk_out_dir *od);

#endif
