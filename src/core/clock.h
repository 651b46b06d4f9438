/* clock.h — the one monotonic clock for timings in stats, logs and benches
 * (internal, not installed). */
#ifndef LK_CORE_CLOCK_H
#define LK_CORE_CLOCK_H

/* Seconds on CLOCK_MONOTONIC: only differences mean anything. */
double lk_now_s(void);

#endif
