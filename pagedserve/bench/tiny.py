"""A tiny random model for ``--tiny`` smoke runs of the benchmarks: Llama-shaped, 2 layers,
hidden 256, 4 query / 2 KV heads (head_dim 64, as SmolLM2's, so the bf16 kernels' fast paths
run), intermediate 512, tied embeddings, SmolLM2's tokenizer (from the default model). Built
once (a few seconds) under ``$PAGEDSERVE_CACHE/bench/``; its text is noise, its timings mean
nothing: smoke runs check that a script runs, never how fast."""

from __future__ import annotations

import os
import shutil
import tempfile

TINY_NAME = "tiny-llama-v1"


def tiny_model_dir() -> str:
    """The tiny model's HF directory, built on first use."""
    from pagedserve.model.loader import cache_dir, resolve_model

    out = os.path.join(cache_dir(), "bench", TINY_NAME)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers
    from transformers import AutoTokenizer

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so greedy choices are separated
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TINY_NAME + ".", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process built it first
            if not os.path.exists(os.path.join(out, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
