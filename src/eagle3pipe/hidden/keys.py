"""The store key of a sample's hidden states (eagle3pipe.data.store.key): everything that
determines them, so that an entry is reused exactly when the same states would be computed."""
from __future__ import annotations

from typing import Any

from eagle3pipe.data import store


def sample_keys(fingerprint: str, token_lists, ids: list[int], numeric: dict[str, Any],
                dtype: str, vllm: str) -> list[str]:
    """Each sample's store key: the verifier's fingerprint, the engine's numeric settings
    (eagle3pipe.engines.engine.numeric), the vLLM version that computes them (its kernels
    decide the bits), the layer ids, the stored dtype and the tokens: the capture identity
    every on-demand entry carries (eagle3pipe.hidden.on_demand.describe), plus the tokens."""
    base = {"stage": "extract", "verifier": fingerprint, "engine": numeric, "vllm": vllm,
            "layer_ids": ids, "dtype": dtype}
    return [store.key(**base, tokens=list(tokens)) for tokens in token_lists]
