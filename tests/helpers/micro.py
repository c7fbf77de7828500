"""The repository root and the micro pipeline's settings, shared by the test modules and the
fixtures of tests/conftest.py."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MICRO_PARAMS = ROOT / "tests/micro/params.yaml"
# a draft for the small test verifiers (aux ids 1..3, H 256 in tests/data/verifier_config.json),
# so that tests built on it do not move with the default params.yaml
DATA_PARAMS = ROOT / "tests/data/params.yaml"

# the micro embedded verifier (conftest.py's micro_verifier fixture): real tokenizer, tiny Llama
MICRO_EMBEDDED = dict(tokenizer_vocab_size=512, hidden_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0,
                      rms_norm_eps=1e-5, train_steps=30, batch_size=4, seq_len=64,
                      learning_rate=5e-3, adam_betas=[0.9, 0.95], weight_decay=0.1,
                      warmup_steps=1, min_lr_ratio=0.1, seed=0, threads=2)


def engine_settings(**override) -> dict:
    """The micro pipeline's vLLM engine settings (tests/micro/params.yaml `vllm:`)."""
    from eagle3pipe.engines import engine
    from eagle3pipe.config import params as P

    return {**engine.settings_of(P.load(MICRO_PARAMS).vllm), **override}
