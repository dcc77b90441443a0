"""Kernels the engine calls for speed; the model math stays in ``pagedserve.model``."""
