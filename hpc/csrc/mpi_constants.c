/* MPI's constants that rsmpi does not export, as the MPI library in use defines them (OpenMPI
 * and MPICH spell MPI_IN_PLACE differently). */
#include <mpi.h>

/* MPI_IN_PLACE: the send buffer of a reduction that reads and writes the receive buffer. */
void *flux_mpi_in_place(void) { return MPI_IN_PLACE; }
