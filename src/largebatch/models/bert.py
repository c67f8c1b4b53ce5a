"""BERT: a masked language model (Devlin et al. 2019) on the shared block.

Default pre-LN with a final LayerNorm, as Cramming (Geiping & Goldstein 2022, docs/papers.md: Cramming);
norm_position="post" gives the original post-LN BERT (embedding LayerNorm, LN after each residual
add), which matches transformers' BertForMaskedLM. The prediction head (dense, GeLU, LayerNorm,
vocabulary projection tied to the embedding, bias) runs on masked positions only (Cramming's sparse
head): the logits are (n_masked, v), not (B, T, v).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from largebatch.models.config import ModelConfig
from largebatch.models.gpt import TransformerBase, token_loss
from largebatch.models.layers import gelu, init_weights, norm_layer
from largebatch.models.registry import model_spec


class MaskedLMHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.act = gelu(config)
        self.norm = norm_layer(config)
        self.decoder = nn.Linear(config.n_embd, config.vocab_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))  # (..., C) -> (..., v)


class BERT(TransformerBase):
    def __init__(self, config: ModelConfig):
        if model_spec(config.kind).objective != "masked":
            raise ValueError(f"BERT needs ModelConfig.kind='bert' (or another masked kind), got {config.kind!r}: "
                             "use build_model(config).")
        super().__init__(config)
        post = config.norm_position == "post"
        self.emb_norm = norm_layer(config) if post else nn.Identity()
        self.ln_f = nn.Identity() if post else norm_layer(config)
        self.head = MaskedLMHead(config)
        init_weights(self, config.n_layer)
        if config.tie_embeddings:
            self.head.decoder.weight = self.tok_emb.weight

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, T, C) the prediction head reads: what a downstream head
        (largebatch.finetune) pools."""
        return self.ln_f(self.run_blocks(self.embed_input(input_ids), self.attention_mask(input_ids)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, labels: (B, T); labels == -100 marks positions not predicted.
        With labels: logits (n_masked, v) for the positions labels != -100, and the loss.
        Without labels: logits (B, T, v) for every position, loss None."""
        x = self.hidden_states(input_ids)  # (B, T, C)
        if labels is None:
            return self.head(x), None
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}: give one label per position (-100 = none).")
        predicted = labels != -100  # (B, T) bool
        logits = self.head(x[predicted])  # (n_masked, v)
        return logits, token_loss(logits, labels[predicted], reduction)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.emb_norm(self.embed(input_ids)))  # (B, T) -> (B, T, C)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every position's logits (B, T, v): under pipeline parallel the last stage does not see the
        labels, so the loss picks the predicted positions (the same values, more compute)."""
        return self.head(self.ln_f(x))
