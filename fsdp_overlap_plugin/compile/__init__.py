"""Compiling a sharded model: the pass table, the backends, cache records, the cross-rank check, diagnostics."""
