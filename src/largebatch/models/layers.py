"""The transformer block GPT and BERT share, laid out as Korthikanti et al. 2022 count it.

Every tensor the backward pass keeps is one of the terms of docs/papers.md: memory (34 s b h + 5 a s^2 b
bytes per layer at 16 bits): the LayerNorm inputs, the Q/K/V input, Q, K and V, the softmax output,
its dropout mask and output, the output-projection input, the MLP's fc1 input, GeLU input and fc2
input, and the two 1-byte dropout masks. Keeping that true is why:

* dropout calls ``torch.native_dropout``, whose saved mask is bool (1 byte) on every device;
  ``F.dropout`` on CPU saves a mask in the input's dtype (4 bytes in fp32);
* the core attention (Q K^T, softmax, dropout, @V) is its own module, ``attn.core``, so selective
  recomputation (``largebatch.memory.apply_recompute``) checkpoints exactly that region;
* the linears carry the names tensor parallelism shards by: attn.q/k/v (column), attn.proj (row),
  mlp.fc1 (column), mlp.fc2 (row).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from largebatch.models.config import ModelConfig
from largebatch.models.registry import model_spec


class Dropout(nn.Module):
    """nn.Dropout whose saved mask is 1 byte per element on CPU and GPU alike (the paper's count)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return torch.native_dropout(x, self.p, True)[0]

    def extra_repr(self) -> str:
        return f"p={self.p}"


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d)) V with dropout on the probabilities: the region selective
    recomputation recomputes (it holds the 5 a s^2 b bytes of docs/papers.md: memory)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kind = config.attention
        self.causal = model_spec(config.kind).objective == "causal"
        self.dropout_p = config.dropout
        self.dropout = Dropout(config.dropout)
        self.seq_len = config.seq_len
        if self.causal and self.kind == "explicit":
            # a view of this buffer is what masked_fill saves: no per-batch allocation
            self.register_buffer("future", self._future_mask(None), persistent=False)

    def _future_mask(self, device) -> torch.Tensor:
        return torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=device).triu(1)

    def init_buffers(self, device: torch.device) -> None:
        """Rebuild the causal mask on ``device`` (after a meta-device build, largebatch.parallel.materialize)."""
        self.future = self._future_mask(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (B, a, T, d) -> (B, a, T, d)
        if self.kind == "sdpa":
            p = self.dropout_p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, a, T, T)
        if self.causal:
            scores = scores.masked_fill(self.future[:T, :T], float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1))  # (B, a, T, T)
        return probs @ v


class Attention(nn.Module):
    """Multi-head self-attention: q/k/v projections, core attention, output projection, dropout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.n_embd
        self.n_head = config.n_head
        # separate q/k/v (not one fused qkv) so tensor parallelism can shard each by output rows
        self.q = nn.Linear(h, h, bias=config.bias)
        self.k = nn.Linear(h, h, bias=config.bias)
        self.v = nn.Linear(h, h, bias=config.bias)
        self.core = CoreAttention(config)
        self.proj = nn.Linear(h, h, bias=config.bias)
        self.drop = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, a, T, d); shape from the tensor so a sharded linear (C / t) still works
        q, k, v = (lin(x).view(B, T, -1, C // self.n_head).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = self.core(q, k, v)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, config.ffn, bias=config.bias)
        self.act = gelu(config)
        self.fc2 = nn.Linear(config.ffn, config.n_embd, bias=config.bias)
        self.drop = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))  # (B, T, C) -> (B, T, f) -> (B, T, C)


class Block(nn.Module):
    """One transformer layer. pre-LN: x + attn(ln1(x)), then + mlp(ln2(.)).
    post-LN (original BERT): ln1(x + attn(x)), then ln2(. + mlp(.))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.ln1 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> (B, T, C)
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def gelu(config: ModelConfig) -> nn.GELU:
    """exact (erf) GeLU, as BERT and transformers' "gelu"; or GPT-2's tanh approximation
    (transformers' "gelu_new", the same formula)."""
    return nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) everywhere, residual-branch outputs (attn.proj, mlp.fc2)
    scaled by 1/sqrt(2 L) (Radford et al. 2019), zero biases, unit LayerNorms."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn.proj", "mlp.fc2")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
