"""Named model sizes (ModelConfig presets), defined once GPT and BERT have registered their kinds."""

from __future__ import annotations

from largebatch.models.config import ModelConfig

# Named sizes. "demo" trains on 2 CPU cores in minutes; the large ones are for the memory planner
# (instantiating them would need terabytes). Shapes of the big GPTs are Korthikanti et al. 2022,
# Table 3 (v = 51200); BERT from Devlin et al. 2019; GPT-2 small to xl from Radford et al. 2019
# (Table 2; the released configs' 1024 positions and 50257 tokens). The Llama 3 (Dubey et al. 2024)
# and Qwen3 (Yang et al. 2025) sizes are the released config.json files' shapes, at the context of
# their main pretraining stage (8192 and 4096 tokens; --seq-len plans another). Pythia's (Biderman et al.
# 2023; GPT-NeoX's layers, Black et al. 2022) are its released config.json files' shapes.
_LLAMA = dict(kind="gpt", norm="rmsnorm", position="rope", activation="swiglu", bias=False, tie_embeddings=False)
_LLAMA3 = dict(_LLAMA, n_kv_head=8, vocab_size=128256, seq_len=8192, rope_theta=500000.0)
_QWEN3 = dict(_LLAMA, n_kv_head=8, head_size=128, qk_norm=True, vocab_size=151936, seq_len=4096, rope_theta=1e6,
              norm_eps=1e-6)
_PYTHIA = dict(kind="gpt", position="rope", rope_fraction=0.25, norm_position="parallel", tie_embeddings=False,
               vocab_size=50304, seq_len=2048)
PRESETS: dict[str, ModelConfig] = {
    "demo": ModelConfig(kind="gpt", n_layer=4, n_embd=256, n_head=4, seq_len=128, vocab_size=4096),
    "demo-bert": ModelConfig(kind="bert", n_layer=4, n_embd=256, n_head=4, seq_len=128,
                             vocab_size=4096),
    "gpt2-small": ModelConfig(kind="gpt", n_layer=12, n_embd=768, n_head=12, seq_len=1024,
                              vocab_size=50257, dropout=0.1),
    "gpt2-medium": ModelConfig(kind="gpt", n_layer=24, n_embd=1024, n_head=16, seq_len=1024,
                               vocab_size=50257, dropout=0.1),
    "gpt2-large": ModelConfig(kind="gpt", n_layer=36, n_embd=1280, n_head=20, seq_len=1024,
                              vocab_size=50257, dropout=0.1),
    "gpt2-xl": ModelConfig(kind="gpt", n_layer=48, n_embd=1600, n_head=25, seq_len=1024,
                           vocab_size=50257, dropout=0.1),
    "bert-base": ModelConfig(kind="bert", n_layer=12, n_embd=768, n_head=12, seq_len=512,
                             vocab_size=30522, dropout=0.1, norm_eps=1e-12),
    "bert-large": ModelConfig(kind="bert", n_layer=24, n_embd=1024, n_head=16, seq_len=512,
                              vocab_size=30522, dropout=0.1, norm_eps=1e-12),
    "gpt-22b": ModelConfig(kind="gpt", n_layer=48, n_embd=6144, n_head=64, seq_len=2048,
                           vocab_size=51200, dropout=0.1),
    "gpt3-175b": ModelConfig(kind="gpt", n_layer=96, n_embd=12288, n_head=96, seq_len=2048,
                             vocab_size=51200, dropout=0.1),
    "mtnlg-530b": ModelConfig(kind="gpt", n_layer=105, n_embd=20480, n_head=128, seq_len=2048,
                              vocab_size=51200, dropout=0.1),
    "gpt-1t": ModelConfig(kind="gpt", n_layer=128, n_embd=25600, n_head=160, seq_len=2048,
                          vocab_size=51200, dropout=0.1),
    "llama3-8b": ModelConfig(n_layer=32, n_embd=4096, n_head=32, ffn_hidden=14336, **_LLAMA3),
    "llama3-70b": ModelConfig(n_layer=80, n_embd=8192, n_head=64, ffn_hidden=28672, **_LLAMA3),
    "llama3.1-405b": ModelConfig(n_layer=126, n_embd=16384, n_head=128, ffn_hidden=53248, rope_scaling="llama3",
                                 **_LLAMA3),
    "qwen3-0.6b": ModelConfig(n_layer=28, n_embd=1024, n_head=16, ffn_hidden=3072,
                              **{**_QWEN3, "tie_embeddings": True}),
    "qwen3-8b": ModelConfig(n_layer=36, n_embd=4096, n_head=32, ffn_hidden=12288, **_QWEN3),
    "pythia-160m": ModelConfig(n_layer=12, n_embd=768, n_head=12, **_PYTHIA),
    "pythia-1b": ModelConfig(n_layer=16, n_embd=2048, n_head=8, **_PYTHIA),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named size, optionally with fields overridden: preset("demo", dropout=0.1)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}.")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
