"""XSP leveled profiling (Li et al., IPDPS 2020)."""
