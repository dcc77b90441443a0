"""A tiny GGUF checkpoint written with the gguf package: random weights (2-D ones quantized),
a byte-level BPE tokenizer and a chat template. Used by the model-file and quantized-model tests."""

from __future__ import annotations

import gguf
import numpy as np


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path: str, hidden: int = 64, inter: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    qtype: str = "Q4_1", extra_tensors: tuple = (), name: str = "tiny") -> str:
    """A llama GGUF of random weights (2-D ones quantized to ``qtype``), with a byte-level BPE
    tokenizer of 3 special tokens, 256 bytes and 5 merges, and a chat template."""
    rng = np.random.default_rng(0)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_chars() + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    qt = gguf.GGMLQuantizationType[qtype]
    hd = hidden // heads

    def add(name: str, shape: tuple) -> None:
        arr = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", (len(tokens), hidden))
    add("output_norm.weight", (hidden,))
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (heads * hd, hidden)),
                            ("attn_k", (kv_heads * hd, hidden)), ("attn_v", (kv_heads * hd, hidden)),
                            ("attn_output", (hidden, heads * hd)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))]:
            add(f"blk.{i}.{name}.weight", shape)
    for name, shape in extra_tensors:
        add(name, shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
