/* loss_plot.c — see loss_plot.h. gnuplot writes into the temporary file of
 * io/out_file.h, which is renamed onto the PNG only when gnuplot succeeded. */
#include "loss_plot.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "io/out_file.h"
#include "lorakit/status.h"

int lk_plot_loss(const char *csv, const char *png, const char *title, char *why, size_t cap) {
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        snprintf(why, cap, "gnuplot is not installed (scripts/setup.sh installs gnuplot-nox)");
        return -1;
    }
    lk_out_file out;
    if (lk_out_file_begin(&out, png)) {
        snprintf(why, cap, "%s", lk_last_error());
        return -1;
    }
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g) {
        lk_out_file_abort(&out);
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
            out.tmp, title, csv);
    int rc = pclose(g);
    if (rc != 0) {
        lk_out_file_abort(&out);
        snprintf(why, cap, "gnuplot could not draw %s (exit status %d)", png,
                 WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
        return -1;
    }
    if (lk_out_file_commit(&out, png)) {
        snprintf(why, cap, "%s", lk_last_error());
        lk_out_file_abort(&out);
        return -1;
    }
    return 0;
}
