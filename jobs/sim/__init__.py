"""The simulator's MPI side and its validation against the emulated cluster (front end: jobs.simulate)."""
