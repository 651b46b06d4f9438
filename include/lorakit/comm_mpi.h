/* lorakit/comm_mpi.h — wraps an MPI communicator as an lk_comm. The only
 * lorakit header that includes mpi.h. The lk_comm duplicates `c` and does not
 * call MPI_Init/MPI_Finalize: the host program owns MPI's lifetime. */
#ifndef LORAKIT_COMM_MPI_H
#define LORAKIT_COMM_MPI_H

#include <mpi.h>
#include "lorakit/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

lk_status lk_comm_from_mpi(MPI_Comm c, lk_comm **out);

#ifdef __cplusplus
}
#endif
#endif
