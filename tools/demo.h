/* demo.h — `lorakit demo`: the parent (cmd_demo.c) pretrains the base,
 * trains two adapters and starts the hot-swap stage (demo_swap.c), each as a
 * child `lorakit` process under mpirun. */
#ifndef LK_TOOLS_DEMO_H
#define LK_TOOLS_DEMO_H

#include "lorakit/lorakit.h"
#include "app/model.h"
#include "app/task.h"

#define LK_DEMO_PATH 1024
/* held-out examples: a stream no training run draws from */
#define LK_DEMO_EVAL_SEED 777

typedef struct lk_demo_opts {
    char out[LK_DEMO_PATH];  /* absolute */
    int ranks;
    int quick;
    int digits;
    int eval;                /* held-out examples per task and step */
    lk_task_kind tasks[2];   /* the two adapters: reverse, sort (or increment) */
    double min_acc;          /* adapter accuracy expected on its task */
    double max_base;         /* base accuracy expected below this on both */
} lk_demo_opts;

/* Step 3, run on every rank of the hot-swap group. */
int lk_demo_swap_stage(const lk_demo_opts *o);

#endif
