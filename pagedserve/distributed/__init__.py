"""Pieces that split one engine across processes or instances: ``kv_transfer`` (prefill/decode
disaggregation), the data-parallel router (``dp_router``), and tensor-parallel state and
sharding (``parallel_state``, ``tensor_parallel``)."""
