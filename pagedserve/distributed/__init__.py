"""Pieces that split one engine across processes or instances: ``kv_transfer`` (prefill/decode
disaggregation), and (with their issues) tensor-parallel state and the data-parallel router."""
