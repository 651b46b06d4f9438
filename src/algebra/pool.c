/* pool.c — the algebra's thread pool: items 0..n-1 handed out in order to
 * the threads, each item wholly on one thread (so the bytes of a result do
 * not depend on the thread count), the lowest failing item's error the one
 * reported, progress after each item, serialised. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "algebra/algebra_int.h"

typedef struct pool {
    lk_status (*fn)(void *ctx, size_t i);
    void *ctx;
    size_t n;
    const lk_algebra_opts *o;
    pthread_mutex_t mu;
    size_t next, done, failed;
    lk_status s;
    char msg[1024];
} pool;

static void *worker(void *arg) {
    pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        size_t i = p->next++;
        int stop = p->s != LK_OK;
        pthread_mutex_unlock(&p->mu);
        if (i >= p->n || stop) return NULL;
        lk_status s = p->fn(p->ctx, i);
        pthread_mutex_lock(&p->mu);
        if (s && (p->s == LK_OK || i < p->failed)) {
            p->s = s, p->failed = i;
            snprintf(p->msg, sizeof p->msg, "%s", lk_last_error());
        }
        p->done++;
        if (!s && p->o->on_progress) p->o->on_progress(p->o->progress_ctx, p->done, p->n);
        pthread_mutex_unlock(&p->mu);
    }
}

lk_status lk_alg_pool(size_t n, const lk_algebra_opts *o, lk_status (*fn)(void *ctx, size_t i), void *ctx) {
    long nt = o->threads;
    if (nt <= 0) nt = sysconf(_SC_NPROCESSORS_ONLN);
    if (nt < 1) nt = 1;
    if ((size_t)nt > n) nt = (long)n;
    if (nt > 256) nt = 256;
    pool p = {.fn = fn, .ctx = ctx, .n = n, .o = o, .s = LK_OK};
    pthread_mutex_init(&p.mu, NULL);
    pthread_t tid[256];
    int started[256] = {0};
    for (long t = 1; t < nt; t++) started[t] = pthread_create(&tid[t], NULL, worker, &p) == 0;
    worker(&p);
    for (long t = 1; t < nt; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&p.mu);
    return p.s ? lk_error(p.s, "%s", p.msg) : LK_OK;
}
