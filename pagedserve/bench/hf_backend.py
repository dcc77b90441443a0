"""The HF transformers baseline of ``pagedserve bench throughput`` and ``bench latency``:
``generate`` in static batches, left padded, EOS suppressed with ``min_new_tokens``."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedserve.bench.datasets import SampleRequest


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tok


def hf_generate_batch(model, pad_id: int, batch: Sequence[SampleRequest], device: torch.device, max_new: Optional[int] = None) -> int:
    """One static batch, left padded; returns tokens generated per row."""
    max_len = max(r.prompt_len for r in batch)
    max_new = max_new if max_new is not None else max(r.expected_output_len for r in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, max_len - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, max_len - r.prompt_len :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
            use_cache=True,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return int(out.shape[1] - max_len)


def hf_pad_id(model, tok) -> int:
    for v in (tok.pad_token_id, tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0
