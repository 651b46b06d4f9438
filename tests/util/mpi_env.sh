# mpi_env.sh — sourced by the shell tests that run mpirun (tests/*.sh):
# Open MPI as root, oversubscribed on few cores (yield instead of
# spinning), no single-copy shared memory (needs ptrace rights containers
# lack); under ASan, Open MPI's own never-freed allocations are suppressed
# (tests/mpi_lsan.supp) and stacks are unwound fully. The same settings as
# tests/CMakeLists.txt's LK_MPI_TEST_ENV.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_mca_base_component_disable_dlclose=1
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/mpi_lsan.supp}"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
