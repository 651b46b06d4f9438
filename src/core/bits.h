/* bits.h — bit casts between floats and integers (memcpy, so no aliasing
 * or alignment questions), shared by the core's numeric code and, through
 * LK_HD (core/hd.h), by the device kernels. Internal. */
#ifndef LK_CORE_BITS_H
#define LK_CORE_BITS_H

#include <stdint.h>
#include <string.h>
#include "core/hd.h"

LK_HD uint32_t lk_f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
LK_HD float lk_u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
LK_HD uint64_t lk_d2u(double f) {
    uint64_t u;
    memcpy(&u, &f, 8);
    return u;
}
LK_HD double lk_u2d(uint64_t u) {
    double f;
    memcpy(&f, &u, 8);
    return f;
}

#endif
