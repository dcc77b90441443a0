"""Pieces that split one engine across processes or instances: ``kv_transfer`` (prefill/decode
disaggregation), the data-parallel router (``dp_router``) and replica placement
(``dp_placement``), and (with its issue) tensor-parallel state."""
