"""The per-run analyses of `grt eval` (recurrence dynamics, mechanism, representation, method reports) and their
plots."""
