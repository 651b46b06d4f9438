/* fuse_internal.h — shared between the files of src/fuse (not public). */
#ifndef LK_FUSE_INTERNAL_H
#define LK_FUSE_INTERNAL_H

#define LK_FUSE_MAX_THREADS 256

/* Online CPUs, clamped to [1, LK_FUSE_MAX_THREADS]. */
int lk_fuse_default_threads(void);

#endif
