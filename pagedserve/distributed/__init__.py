"""Parallel execution: the data-parallel router (``dp_router``); tensor-parallel state and
KV transfer live here too (see docs/design.md, "Target layout")."""
