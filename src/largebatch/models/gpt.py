"""GPT: a causal language model (Radford et al. 2019 layout: learned positions, pre-LN blocks,
final LayerNorm, output projection tied to the token embedding).

Its blocks are the shared ``largebatch.models.layers.Block``; its activation memory is the one
docs/papers.md: memory (Korthikanti et al. 2022) writes down: L layers, the embedding dropout mask, and the
output layer (final norm input, projection input, fp32 logits).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from largebatch.models.config import ModelConfig
from largebatch.models.flops import flops_per_token
from largebatch.models.layers import AttentionMask, Block, CoreAttention, Dropout, KVCache, init_weights, norm_layer
from largebatch.models.registry import model_spec


class TransformerBase(nn.Module):
    """What GPT and BERT share: embeddings, blocks, parameter and FLOP counts.

    Pipeline parallel (largebatch.parallel.pipeline) cuts the model at block boundaries; each kind
    declares (largebatch.models.registry) the modules that run before its blocks (on the first
    stage, ``pipeline_first``, run by ``embed_input``) and after them (on the last stage,
    ``pipeline_last``, run by ``output_logits``), as torchtitan's models declare theirs.
    ``block`` is the transformer layer class; a kind with another layer subclasses and replaces it.
    """

    block: type[nn.Module] = Block

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        # rotary positions live in each layer's attention: an empty module keeps the name stages use
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd) if config.position == "learned" else nn.Identity()
        self.drop = Dropout(config.dropout)
        self.blocks = nn.ModuleList(self.block(config) for _ in range(config.n_layer))
        if config.window_layout != "none":  # each layer's sliding window (ModelConfig.layer_window)
            for i, block in enumerate(self.blocks):
                cores = [m for m in block.modules() if isinstance(m, CoreAttention)]
                if len(cores) != 1:
                    raise ValueError(f"ModelConfig.sliding_window={config.sliding_window} with kind={config.kind!r}: "
                                     f"its layer {i} has {len(cores)} CoreAttention modules, so no window can be "
                                     "set on it; leave sliding_window unset for this kind.")
                cores[0].window = config.layer_window(i)
        if config.document_mask:
            if config.separator_id is None:
                raise ValueError("ModelConfig.document_mask=True needs separator_id: the id of the token that "
                                 "starts each document (the trainer takes its tokenizer's <|endoftext|>).")
            if config.separator_id >= config.vocab_size:
                raise ValueError(f"ModelConfig.separator_id={config.separator_id} is not a token of the "
                                 f"vocabulary (vocab_size={config.vocab_size}): give the id the corpus puts "
                                 "before (or between) its documents.")

    def attention_mask(self, idx: torch.Tensor, layers: Sequence[int] | None = None) -> AttentionMask | None:
        """Who attends to whom in the token ids ``idx`` (B, T), the layers' AttentionMask: within
        documents with ModelConfig.document_mask, within each layer's window with sliding_window. None
        otherwise (causal or full attention over the whole sequence). ``layers``: the indices of the
        layers that read it (a pipeline stage's; None: all), whose windows it makes forms for."""
        cfg = self.config
        if not cfg.masks_attention:
            return None
        causal = model_spec(cfg.kind).objective == "causal"
        windows = cfg.windows if layers is None else tuple(cfg.layer_window(i) for i in layers)
        if cfg.document_mask:
            return AttentionMask(idx, cfg.separator_id, causal, windows)
        return AttentionMask(None, None, causal, windows, length=idx.size(1), device=idx.device)

    def embed(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        # idx: (B, T) token ids -> (B, T, C); with a cache, at the positions after its cached ones
        # (and it records where the last document starts, for the next positions)
        T, offset = idx.size(1), 0 if cache is None else cache.offset
        if offset + T > self.config.seq_len:
            raise ValueError(f"input has {offset + T} positions but the model's seq_len is "
                             f"{self.config.seq_len}: crop the input or build a longer model.")
        if self.config.position != "learned":
            return self.tok_emb(idx)
        positions = torch.arange(offset, offset + T, device=idx.device)
        if self.config.document_mask:  # restart at each separator: position - where its document starts
            before = 0 if cache is None or cache.start is None else cache.start[:, None]
            starts = torch.where(idx == self.config.separator_id, positions, before).cummax(dim=1).values
            if cache is not None:
                cache.start = starts[:, -1]
            positions = positions - starts  # (B, T)
        return self.tok_emb(idx) + self.pos_emb(positions)

    def run_blocks(self, x: torch.Tensor, mask: AttentionMask | None = None,
                   cache: KVCache | None = None) -> torch.Tensor:
        """The blocks on hidden states (B, T, C); ``mask``: ``attention_mask`` of the token ids;
        ``cache``: the earlier positions' keys and values (decoding), which each layer extends."""
        if mask is not None:
            mask.prepare(self.config.attention, x)
        for i, block in enumerate(self.blocks):
            extra = {} if cache is None else {"cache": cache.layers[i]}
            x = block(x, **extra) if mask is None else block(x, mask, **extra)
        return x

    def embed_input(self, idx: torch.Tensor) -> torch.Tensor:
        """The first pipeline stage's part: token ids (B, T) -> hidden states (B, T, C)."""
        raise NotImplementedError

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's part: hidden states (B, T, C) -> logits (B, T, v)."""
        raise NotImplementedError

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). non_embedding drops the token and position
        embeddings (with tied embeddings the output projection goes too, as in nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel() + sum(p.numel() for p in self.pos_emb.parameters())
        return n

    def flops_per_token(self, recompute: str | Sequence[str] = "none",
                        mask_fraction: float = 0.15) -> float:
        """Training matmul FLOPs per token: model FLOPs with recompute="none", hardware FLOPs with a
        recompute policy (see largebatch.models.flops)."""
        return flops_per_token(self.config, recompute, mask_fraction=mask_fraction)


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy over the last dim in fp32 (float64 logits stay float64); targets == -100 are
    ignored. reduction="sum" lets a trainer divide by the tokens of the whole (accumulated) batch."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: must be 'mean' or 'sum'.")
    logits = logits.reshape(-1, logits.size(-1))  # (B*T, v)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=-100, reduction=reduction)


class GPT(TransformerBase):
    def __init__(self, config: ModelConfig):
        if model_spec(config.kind).objective != "causal":
            raise ValueError(f"GPT needs ModelConfig.kind='gpt' (or another causal kind), got {config.kind!r}: "
                             "use build_model(config).")
        super().__init__(config)
        self.ln_f = norm_layer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_weights(self, config.n_layer)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean", cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T). Returns logits (B, T, v) and the loss (None without targets).
        With a ``cache`` (``decode``): idx follows the cached positions, and the logits are the last
        position's only, (B, 1, v)."""
        if cache is not None:
            if targets is not None:
                raise ValueError("forward: a KV cache is for decoding (no_grad, no targets); leave cache out to train")
            return self._decode(idx, cache), None
        logits = self.output_logits(self.run_blocks(self.embed_input(idx), self.attention_mask(idx)))  # (B, T, v)
        loss = None if targets is None else token_loss(logits, targets, reduction)
        return logits, loss

    def embed_input(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.drop(self.embed(idx, cache))  # (B, T) -> (B, T, C)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, v)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final (normalised) hidden states (B, T, C) the output layer reads: what a downstream
        head (largebatch.finetune) pools."""
        return self.ln_f(self.run_blocks(self.embed_input(idx), self.attention_mask(idx)))

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next positions ``idx`` (B, T) after the ``cache.offset`` positions ``cache`` holds:
        each layer reads the cached keys and values and adds these positions' own; returns the last
        position's logits (B, v). A fresh cache (``self.cache()``, offset 0) takes a whole prompt.
        It goes through ``forward``, so the hooks of a wrapped model (FSDP2's gathers) run."""
        return _whole_vocabulary(self(idx, cache=cache)[0][:, 0])  # (B, v)

    def _decode(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if idx.dim() != 2 or idx.size(1) < 1 or idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(f"decode: token ids of shape {tuple(idx.shape)} ({idx.dtype}); give integer ids of "
                             "shape (batch, T) with T >= 1")
        if not cache.room(idx.size(1)):
            limit = ("the model's seq_len" if cache.capacity == self.config.seq_len else "the cache's capacity")
            raise ValueError(f"decode: {cache.offset} cached positions + {idx.size(1)} new exceed {limit} "
                             f"{cache.capacity}: reset the cache and decode the last {cache.capacity} positions")
        if cache.capacity > self.config.seq_len:
            raise ValueError(f"decode: a KVCache of capacity {cache.capacity} for a model of seq_len "
                             f"{self.config.seq_len}: make it with model.cache()")
        kept = cache.layers[0].keys
        if cache.offset and kept is not None and kept.size(0) != idx.size(0):
            raise ValueError(f"decode: {idx.size(0)} sequences after {cache.offset} cached positions of "
                             f"{kept.size(0)}: a cache serves one batch of sequences; reset it for another")
        documents, start = cache.documents, cache.start  # (put back if the step fails)
        try:
            mask = None
            if self.config.document_mask:  # each position's document, continuing the cached ones'
                last = 0 if documents is None else documents[:, -1:]
                new = last + (idx == self.config.separator_id).cumsum(dim=1)
                cache.documents = new if documents is None else torch.cat([documents, new], 1)
            if self.config.masks_attention:
                mask = AttentionMask.decoding(cache.documents, idx.size(1), cache.offset + idx.size(1), causal=True,
                                              windows=self.config.windows, device=idx.device)
            x = self.run_blocks(self.embed_input(idx, cache), mask, cache)
        except BaseException:
            cache.documents, cache.start = documents, start
            raise
        cache.advance(idx.size(1))
        return self.output_logits(x[:, -1:])  # (B, 1, v): the output layer on the last position only

    def cache(self) -> KVCache:
        """An empty KVCache for ``decode`` (its memory is allocated at the first write)."""
        return KVCache(len(self.blocks), self.config.seq_len)

    def decodes(self) -> bool:
        """Whether the layers and the model's forward, run_blocks and embedding take a KVCache: the
        shared ones do; a registered kind's own layer (a Block subclass with its own forward) or its
        own forward may not, and generate then reads the whole context for every token."""
        def takes_cache(function) -> bool:
            return "cache" in inspect.signature(function).parameters

        return (all(takes_cache(type(block).forward) for block in self.blocks)
                and all(takes_cache(getattr(type(self), name)) for name in ("forward", "run_blocks", "embed",
                                                                            "embed_input")))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, stop_id: int | None = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Sample max_new_tokens continuations of idx (B, T) -> (B, T + n), n <= max_new_tokens.

        temperature 0 means greedy; top_k keeps the k most likely tokens; top_p keeps the most likely
        tokens whose probabilities add up to p (nucleus sampling, Holtzman et al. 2020), the most
        likely always. With ``stop_id`` a row that draws that token has ended: it is filled with
        stop_id from there on, and generation ends when every row has. The context is the last
        seq_len tokens. With ``use_cache`` (the default) each token costs one position per layer (a
        KVCache); past seq_len tokens, every token reads its last seq_len again, as without it."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.size(1) < 1 or idx.is_floating_point():
            got = (f"a {idx.dim()}-D {idx.dtype} tensor of shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor)
                   else type(idx).__name__)
            raise ValueError(f"idx: {got}; give token ids of shape (batch, T) with T >= 1 (one prompt: "
                             "ids[None]; an empty prompt: start from a token such as <|endoftext|>).")
        if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a whole number >= 0.")
        if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature={temperature!r}: must be a finite number >= 0 (0 = greedy).")
        if top_k is not None and (not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"top_k={top_k!r}: must be a positive integer or None.")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
            raise ValueError(f"top_p={top_p!r}: must be a number in (0, 1] or None (1 keeps every token).")
        vocab = self.config.vocab_size
        if stop_id is not None and (not isinstance(stop_id, numbers.Integral) or isinstance(stop_id, bool)
                                    or not 0 <= stop_id < vocab):
            raise ValueError(f"stop_id={stop_id!r}: must be a token id in [0, {vocab}) or None.")
        cache = self.cache() if use_cache and self.decodes() else None
        # layers compiled in place (the trainer's model.compile) would compile again for every cached
        # length: generation runs them as they are
        compiled = any(getattr(block, "_compiled_call_impl", None) is not None for block in self.blocks)
        with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext():
            return self._generate(idx, max_new_tokens, temperature, top_k, top_p, stop_id, cache)

    def _generate(self, idx, max_new_tokens, temperature, top_k, top_p, stop_id, cache) -> torch.Tensor:
        s = self.config.seq_len
        stopped = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
        for n in range(max_new_tokens):
            if cache is None:
                logits = _whole_vocabulary(self(idx[:, -s:])[0][:, -1, :])  # (B, v)
            elif n > 0 and cache.room(1):
                logits = self.decode(idx[:, -1:], cache)
            else:  # the prompt, or a context past seq_len: its last seq_len positions afresh
                cache.reset()
                logits = self.decode(idx[:, -s:], cache)
            next_id = sample_next(logits, temperature, top_k, top_p)
            if stop_id is not None:
                next_id = torch.where(stopped, stop_id, next_id)
                stopped |= next_id == stop_id
            idx = torch.cat([idx, next_id], dim=1)
            if stop_id is not None and bool(stopped.all()):
                break
        return idx


def _whole_vocabulary(logits: torch.Tensor) -> torch.Tensor:
    """Logits split over the vocabulary (tensor parallel's loss_parallel) gathered whole."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, v) -> (B, 1): the argmax at temperature 0 (or one the
    logits' dtype rounds to 0), else a draw from the softmax of ``sampling_logits``."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or one the logits' dtype rounds to 0
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(torch.softmax(sampling_logits(logits, temperature, top_k, top_p), dim=-1), 1)


def sampling_logits(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    """``logits`` (B, v) / temperature (> 0), -inf outside the top_k most likely tokens and then
    outside the nucleus -- the top-p vocabulary of Holtzman et al. 2020, "The Curious Case of Neural
    Text Degeneration" (docs/papers.md: generating text): the most likely tokens, in order, while the
    probability mass of the tokens before each is below top_p (so the most likely token always stays)."""
    # where the logits over a tiny temperature overflow to inf (the softmax then NaN), from the
    # largest logit down: 0 and -inf (greedy); elsewhere as before, bit for bit
    scaled = logits / temperature
    logits = torch.where(torch.isfinite(scaled).all(), scaled,
                         (logits - logits.amax(dim=-1, keepdim=True)) / temperature)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # the mass before it already reaches top_p
        outside[:, 0] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return logits
