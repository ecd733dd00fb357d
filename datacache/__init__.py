"""datacache: HDF5-backed multi-level sample cache."""
