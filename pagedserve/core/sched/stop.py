"""When a request stops after a sampled token (the scheduler's stop rules; torch-free)."""
from __future__ import annotations

from typing import Optional

from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.structured_output import StructuredOutputManager


def check_stop(req: Request, tok: int, max_model_len: int, grammars: Optional[StructuredOutputManager]) -> bool:
    """After ``tok`` was appended to ``req``: set its finished status and return True when it
    ends here (its grammar, which starts after a thinking request's end-of-thinking token,
    completed or failed, EOS unless ``ignore_eos`` once ``min_tokens``
    are out, a stop token id, ``max_tokens``, or ``max_model_len``)."""
    params = req.sampling_params
    if req.in_reasoning:  # unconstrained until it stops thinking; the end token is not the grammar's
        req.in_reasoning = tok != params._reasoning_end_token_id
    elif req.grammar is not None:
        state = grammars.accept_token(req.grammar, tok)
        if state is not None and state != "done":
            req.error = f"structured output failed: {state}"
        if req.error is not None:
            req.status = RequestStatus.FINISHED_ERROR
            return True
        if state == "done":
            req.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            return True
    if req.num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and tok in req.eos_token_ids) or tok in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok if tok in params.stop_token_ids else None
            return True
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
