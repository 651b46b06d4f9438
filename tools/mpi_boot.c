/* mpi_boot.c — see mpi_boot.h. MPI is initialised only when a launcher
 * started us: a plain `lorakit train` must not pay for (or depend on) an MPI
 * singleton start, and the library never calls MPI_Init itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "mpi_boot.h"
#include "lorakit/log.h"

#ifdef LK_HAVE_MPI
#include "lorakit/comm_mpi.h"
#endif

int lk_demo_have_mpi(void) {
#ifdef LK_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

int lk_demo_under_mpi(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                       "MPI_LOCALNRANKS", NULL};
    for (int i = 0; vars[i]; i++)
        if (getenv(vars[i])) return 1;
    return 0;
}

#ifdef LK_HAVE_MPI
static int g_mpi_started;
#endif

lk_status lk_demo_world_init(int *argc, char ***argv, lk_comm **world) {
#ifdef LK_HAVE_MPI
    if (lk_demo_under_mpi()) {
        int init = 0;
        MPI_Initialized(&init);
        if (!init) {
            if (MPI_Init(argc, argv) != MPI_SUCCESS)
                return lk_error(LK_ERR_COMM, "MPI_Init failed");
            g_mpi_started = 1;
        }
        lk_status st = lk_comm_from_mpi(MPI_COMM_WORLD, world);
        if (st) return st;
        lk_log_set_rank(lk_comm_rank(*world), lk_comm_size(*world));
        return LK_OK;
    }
#else
    (void)argc;
    (void)argv;
    const char *n = getenv("OMPI_COMM_WORLD_SIZE");
    if (!n) n = getenv("PMI_SIZE");
    if (n && atoi(n) > 1)
        return lk_error(LK_ERR_UNSUPPORTED, "started as one of %s MPI ranks, but this lorakit "
                        "was built without MPI (install Open MPI and rebuild)", n);
#endif
    return lk_comm_self(world);
}

void lk_demo_world_finish(lk_comm *world) {
    lk_comm_free(world);
#ifdef LK_HAVE_MPI
    if (g_mpi_started) {
        MPI_Finalize();
        g_mpi_started = 0;
    }
#endif
}

int lk_demo_plot_loss(const char *csv, const char *png, const char *title, char *why,
                      size_t cap) {
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        snprintf(why, cap, "gnuplot is not installed (scripts/setup.sh installs gnuplot-nox)");
        return -1;
    }
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", png);
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g) {
        snprintf(why, cap, "cannot start gnuplot");
        return -1;
    }
    fprintf(g,
            "set terminal png size 800,500\n"
            "set output '%s'\n"
            "set datafile separator ','\n"
            "set key off\n"
            "set logscale y\n"
            "set xlabel 'step'\nset ylabel 'loss (cross-entropy, answer digits)'\n"
            "set title '%s'\n"
            "plot '%s' every ::1 using 1:2 with lines lw 2\n",
            tmp, title, csv);
    int rc = pclose(g);
    if (rc != 0 || rename(tmp, png) != 0) {
        remove(tmp);
        snprintf(why, cap, "gnuplot could not draw %s (exit status %d)", png,
                 WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
        return -1;
    }
    return 0;
}
