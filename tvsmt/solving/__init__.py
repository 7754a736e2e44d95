"""Phase 6: solving SMT-LIB obligations (one per stage) with external solvers."""
