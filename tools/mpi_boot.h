/* mpi_boot.h — the process group of `lorakit train` and the demo's
 * hot-swap stage: MPI when the process was started by mpirun (or any PMI/PMIx
 * launcher), else a one-process communicator, so the same command works with
 * and without MPI. Also the small shared helpers of train/demo output. */
#ifndef LK_DEMO_WORLD_H
#define LK_DEMO_WORLD_H

#include "lorakit/comm.h"

/* Initialises MPI when launched under it and returns the world (must be
 * released with lk_demo_world_finish). */
lk_status lk_demo_world_init(int *argc, char ***argv, lk_comm **world);
void lk_demo_world_finish(lk_comm *world);
/* 1 when this lorakit was built with MPI. */
int lk_demo_have_mpi(void);
/* 1 when this process was started by an MPI launcher. */
int lk_demo_under_mpi(void);

/* Draws csv (columns step,loss,...) as a loss-curve PNG with gnuplot.
 * Returns 0 on success, -1 (with a reason in why) if it cannot be drawn. */
int lk_demo_plot_loss(const char *csv, const char *png, const char *title, char *why,
                      size_t cap);

#endif
