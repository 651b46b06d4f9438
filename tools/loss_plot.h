/* loss_plot.h — the loss-curve PNG of `lorakit train` (and so of the demo),
 * drawn by gnuplot when it is installed. */
#ifndef LK_TOOLS_LOSS_PLOT_H
#define LK_TOOLS_LOSS_PLOT_H

#include <stddef.h>

/* Draws csv (columns step,loss,...) as png, written whole or not at all.
 * Returns 0 on success, -1 (with a reason in why) if it cannot be drawn. */
int lk_plot_loss(const char *csv, const char *png, const char *title, char *why, size_t cap);

#endif
