"""Random PEFT LoRA adapters over the tiny random models, and PEFT's merged model's greedy
tokens as the reference (float32)."""

from __future__ import annotations

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out_dir: str, r: int = 8, alpha: int = 16, targets=None, seed: int = 0, use_rslora: bool = False, scale: float = 0.5) -> str:
    """Save a PEFT LoRA adapter of ``model_dir`` with random A and B (PEFT starts B at zero,
    which would make the adapter a no-op) into ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_MODULES), lora_dropout=0.0, use_rslora=use_rslora)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_greedy(model_dir: str, adapter_dir, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of HF transformers on the base model (``adapter_dir`` None) or on PEFT's
    merged model, float32, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    out = []
    with torch.inference_mode():
        for ids in prompts_ids:
            g = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            out.append(g[0, len(ids) :].tolist())
    return out
