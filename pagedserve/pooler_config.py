"""Pooling (``--runner pooling``): how a decoder model's hidden states become one embedding per
prompt, and the per-request options of ``/v1/embeddings`` and ``LLM.embed`` (vLLM's
``PoolerConfig`` and ``PoolingParams``).

The pooled vector is read from the final-norm hidden states of the prompt (HF's
``last_hidden_state``): LAST takes the last prompt token's, MEAN the mean over every prompt
token, CLS the first token's. ``normalize`` scales it to unit L2 norm. A request may ask for
fewer ``dimensions`` (Matryoshka truncation: the first ``d`` values, normalized afterwards),
only when the model's config declares it (``is_matryoshka`` or ``matryoshka_dimensions``).

Defaults come from the checkpoint's sentence-transformers files when it has them
(``modules.json`` naming a ``Pooling`` module whose ``config.json`` sets
``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token``; a
``Normalize`` module), else LAST with ``normalize`` on (vLLM's default for decoder models).
Torch-free: the engine core and the frontend import this.
"""

from __future__ import annotations

import array
import base64
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' Pooling config keys -> our pooling types (the first one set wins).
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"))


@dataclass
class PoolerConfig:
    """How the engine pools (``--pooler-config '{"pooling_type": "MEAN", "normalize": true}'``).

    Attributes:
        pooling_type: LAST, MEAN or CLS (None: the checkpoint's sentence-transformers default,
            else LAST).
        normalize: L2-normalize the embedding (None: the checkpoint's default, else True).
        matryoshka_dimensions: filled in at start-up from the model's config: the sizes a
            request's ``dimensions`` may take (an empty list: any size up to the hidden size;
            None: the model is not Matryoshka-trained, so ``dimensions`` is refused).
        hidden_size: filled in at start-up: the embedding's length.
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None
    matryoshka_dimensions: Optional[list[int]] = field(default=None)
    hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")


def parse_pooler_config(value: Any) -> PoolerConfig:
    """A :class:`PoolerConfig` from an instance, a dict or JSON text (``--pooler-config``).

    Raises:
        ValueError: invalid JSON, not an object, an unknown key or a bad value.
    """
    if isinstance(value, PoolerConfig):
        return value
    if value is None:
        return PoolerConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"pooling_type", "normalize", "matryoshka_dimensions", "hidden_size"})
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {', '.join(unknown)}; known: normalize, pooling_type")
    return PoolerConfig(**value)


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, (dict, list)) else None  # type: ignore[return-value]


def sentence_transformers_defaults(model_dir: str) -> dict[str, Any]:
    """``{"pooling_type": ..., "normalize": ...}`` as far as the checkpoint's
    sentence-transformers files say (``modules.json``, the Pooling module's ``config.json``);
    an empty dict without them. Unreadable files are ignored (logged)."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return {}
    out: dict[str, Any] = {"normalize": any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules)}
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            cfg = _read_json(os.path.join(model_dir, str(m.get("path", "")), "config.json"))
            if not isinstance(cfg, dict):
                logger.warning("pooling: %s names a Pooling module without a readable config.json; using LAST", model_dir)
                break
            for key, kind in _ST_MODES:
                if cfg.get(key):
                    out["pooling_type"] = kind
                    break
    return out


def matryoshka_dimensions(hf_config: dict) -> Optional[list[int]]:
    """The ``dimensions`` a request may ask for (see :class:`PoolerConfig`), from config.json."""
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return sorted(dims)
    return [] if hf_config.get("is_matryoshka") or dims else None


def resolve_pooler_config(value: Any, model_dir: str) -> PoolerConfig:
    """The engine's pooler config: what the user set, then the checkpoint's defaults, then
    LAST + normalize; ``matryoshka_dimensions`` from the model's config.json."""
    cfg = parse_pooler_config(value)
    st = sentence_transformers_defaults(model_dir)
    hf = _read_json(os.path.join(model_dir, "config.json"))
    return PoolerConfig(
        pooling_type=cfg.pooling_type or st.get("pooling_type", "LAST"),
        normalize=cfg.normalize if cfg.normalize is not None else st.get("normalize", True),
        matryoshka_dimensions=matryoshka_dimensions(hf if isinstance(hf, dict) else {}),
        hidden_size=hf.get("hidden_size") if isinstance(hf, dict) else None,
    )


def pooler_config_dict(cfg: PoolerConfig) -> dict[str, Any]:
    return asdict(cfg)


@dataclass
class PoolingParams:
    """Per-request options of an embedding (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the first ``dimensions`` values (Matryoshka models only).
        normalize: override the engine's ``pooler_config.normalize`` for this request.
    """

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def verify(self, cfg: PoolerConfig) -> None:
        """Raises ValueError when ``dimensions`` is not allowed for this model."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        d = self.dimensions
        hidden_size = cfg.hidden_size or 0
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if cfg.matryoshka_dimensions is None:
            raise ValueError(
                "this model does not support Matryoshka representation (its config.json declares no is_matryoshka or matryoshka_dimensions), so dimensions cannot be changed"
            )
        if d > hidden_size:
            raise ValueError(f"dimensions ({d}) is larger than the model's embedding size ({hidden_size})")
        if cfg.matryoshka_dimensions and d not in cfg.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {cfg.matryoshka_dimensions} for this model, got {d}")


def pooling_sampling_params(truncate_prompt_tokens: Optional[int] = None) -> SamplingParams:
    """The params a pooling request travels with through the engine: one final output, no
    token (the worker pools instead of sampling), the prompt cut as ``truncate_prompt_tokens`` says."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, truncate_prompt_tokens=truncate_prompt_tokens, output_kind=RequestOutputKind.FINAL_ONLY
    )


def finish_embedding(pooled: bytes, cfg: PoolerConfig, params: Optional[PoolingParams] = None) -> list[float]:
    """The embedding a client gets from the worker's pooled vector (``pooled``: little-endian
    float32 bytes, ``[hidden_size]``): truncated to ``params.dimensions``, then L2-normalized
    when the request or the engine says so."""
    vec = array.array("f")
    vec.frombytes(pooled)
    if sys.byteorder != "little":
        vec.byteswap()
    values = vec.tolist()
    if params is not None and params.dimensions is not None:
        values = values[: params.dimensions]
    normalize = cfg.normalize if params is None or params.normalize is None else params.normalize
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        values = [v / max(norm, 1e-12) for v in values]
    return values


def encode_base64(values: Sequence[float]) -> str:
    """OpenAI's ``encoding_format: "base64"``: base64 of the little-endian float32 values."""
    arr = array.array("f", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")
