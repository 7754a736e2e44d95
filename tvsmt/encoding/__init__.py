"""Phase 5: symbolic execution of both sides of a stage and its SMT-LIB obligation."""
