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
  mlp.fc1 and mlp.gate (column), mlp.fc2 (row).

The Llama-style options (Touvron et al. 2023; docs/papers.md: Llama-style layers) change what a
layer computes and keeps, and the memory model counts each:

* ``norm="rmsnorm"``: y = x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019), no bias; its
  backward keeps the input only, as a LayerNorm's (it recomputes the normalised tensor; written out,
  or through torch's composite kernel, it kept an fp32 copy of a 16-bit input and the normalised
  tensor besides);
* ``position="rope"``: rotary position embeddings (Su et al. 2021, eq. 34) applied to Q and K in
  each layer, in transformers' half-split layout (dimension i pairs with i + d/2), angle
  m * theta^(-2i/d) at position m. The rotation multiplies by constant tables, so it keeps nothing;
* ``activation="swiglu"``: fc2(SiLU(gate(x)) * fc1(x)) (Shazeer 2020, eq. 6): a third f-wide
  matrix, and four f-wide stored tensors instead of GeLU's two;
* ``n_kv_head < n_head``: grouped-query attention (Ainslie et al. 2023): each K/V head serves
  n_head / n_kv_head query heads; K and V are computed and stored at n_kv_head heads;
* ``head_size``: heads of d_h values whatever n_embd / n_head is, so Q and the output projection's
  input are n_head * d_h wide (Qwen3 0.6B: 16 heads of 128 on a 1024-wide stream);
* ``qk_norm``: each query and key head normalised over its d_h values before the rotation (Qwen3;
  Dehghani et al. 2023): the norms keep their inputs, the q and k projections' outputs, and a
  statistic per head; with ``qk_norm_scope="projection"`` the whole query and key projections
  (OLMo 2; OLMo et al. 2024), a statistic per token each;
* ``norm_position="reordered"``: x + norm(f(x)), each sub-layer's output normalised before the
  residual add (OLMo 2: OLMo et al. 2024, "2 OLMo 2 Furious"; Liu et al. 2022's res-post-norm): the norms keep
  the sub-layers' outputs and the sub-layers the stream itself, as many values as pre-LN keeps.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from largebatch.models.config import MASK_ROW_ALIGNMENT, ModelConfig
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


_HALF = (torch.float16, torch.bfloat16)


class _RMSNormFunction(torch.autograd.Function):
    """(y, r): y = round(x r) * g with r = 1 / sqrt(mean(x^2) + eps) per token (over the last ``dims``),
    computed in fp32 for a 16-bit x and rounded back to its dtype before the gain (transformers'
    LlamaRMSNorm). Backward keeps x, g and r only -- a LayerNorm's input and one statistic -- and
    recomputes x_hat = x r from them:
        dL/dg = sum over tokens of dL/dy * round(x_hat),
        dL/dx = r (u - x_hat mean(u x_hat)),  u = dL/dy * g (rounded to x's dtype, then fp32),
    the derivative of x_hat_i = x_i r, as autograd would take it through the written-out ops (which
    keep an fp32 copy of a 16-bit x and the normalised tensor besides: 3 h values at 16 bits).
    Under create_graph backward recomputes r from x too, in differentiable ops, so second
    derivatives (a gradient penalty, a Hessian-vector product) are exact; torch.func's reverse mode
    and vmap take it (no jvp: not its forward mode)."""

    generate_vmap_rule = True

    @staticmethod
    def _normalised(x: torch.Tensor, eps: float | None, axes: tuple[int, ...],
                    group=None) -> tuple[torch.Tensor, torch.Tensor]:
        wide = x.float() if x.dtype in _HALF else x
        eps = torch.finfo(wide.dtype).eps if eps is None else eps  # (nn.RMSNorm's, of the dtype it works in)
        return wide * (r := torch.rsqrt(_RMSNormFunction._mean(wide.pow(2), axes, group) + eps)), r

    @staticmethod
    def _mean(t: torch.Tensor, axes: tuple[int, ...], group) -> torch.Tensor:
        """The mean of ``t`` over ``axes``; with a ``group`` (tensor parallel: each rank holds an equal
        slice of the last dimension), over every rank's slice: the local sums all-reduced."""
        if group is None:
            return t.mean(axes, keepdim=True)
        import torch.distributed as dist

        total = t.sum(axes, keepdim=True)
        dist.all_reduce(total, group=group)
        return total / (math.prod(t.shape[a] for a in axes) * dist.get_world_size(group))

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, dims: int, group=None):
        x_hat, r = _RMSNormFunction._normalised(x, eps, tuple(range(-dims, 0)), group)
        y = x_hat.to(x.dtype)
        return (y if weight is None else y * weight), r

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, eps, dims, group = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, weight, output[1])
        ctx.eps, ctx.axes, ctx.group = eps, tuple(range(-dims, 0)), group

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        x, weight, r = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: r as a function of x, for second derivatives
            if ctx.group is not None:
                raise RuntimeError("RMSNorm over a tensor-parallel split (model.qk_norm_scope='projection' with "
                                   "parallel.tp > 1) has no second derivative; run create_graph without tensor "
                                   "parallel, or with qk_norm_scope='head'")
            x_hat, r = _RMSNormFunction._normalised(x, ctx.eps, ctx.axes)
        else:
            x_hat = (x.float() if x.dtype in _HALF else x) * r
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            u = (grad if weight is None else grad * weight).to(x.dtype).to(x_hat.dtype)
            grad_x = (r * (u - x_hat * _RMSNormFunction._mean(u * x_hat, ctx.axes, ctx.group))).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (grad * x_hat.to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        return grad_x, grad_weight, None, None, None


class RMSNorm(nn.RMSNorm):
    """Root-mean-square norm, y = x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019, eq. 4),
    torch's module and parameters. A 16-bit input is normalised in fp32, rounded back to its dtype,
    then scaled by the gain, as transformers' LlamaRMSNorm does (the result has the promoted dtype of
    the input and the gain). Its backward keeps the input only, as a LayerNorm's does
    (``_RMSNormFunction``, which recomputes the normalised tensor). On a GPU an input of the gain's
    32- or 64-bit dtype (a bf16 autocast run's fp32 residual stream) goes to torch's fused kernel,
    which keeps the same (its input and 1/rms: not measured here, benchmarks/gpu_check.sh does) in
    one kernel each way.

    ``group`` (set by tensor parallel, largebatch.parallel.tensor_parallel.ProjectionNorm): the last
    dimension is split evenly over that process group's ranks, the gain a ``Shard(0)`` DTensor of
    the same split; the mean of squares is then every rank's, its local sums all-reduced (and so
    is backward's mean(u x_hat)): the whole projection normalised, as on one device."""

    group = None
    split_norm = None  # (set with group: split_rms_norm, kept out of compiled frames)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.split_norm(x)
        if x.device.type == "cuda" and x.dtype not in _HALF and (self.weight is None or x.dtype == self.weight.dtype):
            return super().forward(x)
        if not torch.is_grad_enabled():  # inference (generation): the same ops, without the Function's
            return _RMSNormFunction.forward(x, self.weight, self.eps, len(self.normalized_shape))[0]  # cost
        return _RMSNormFunction.apply(x, self.weight, self.eps, len(self.normalized_shape))[0]


def split_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` over a last dimension split across ``norm.group`` (its gain a ``Shard(0)`` DTensor of the
    same split). Tensor parallel sets it as the norm's ``split_norm`` wrapped in
    ``torch.compiler.disable``: eager even inside a compiled block, where the collective in the Function
    and the DTensor gain are a graph break (the block's other ops stay compiled); wrapped there, not
    here, so importing the model does not import torch._dynamo."""
    weight = norm.weight
    weight = weight.to_local() if hasattr(weight, "to_local") else weight
    args = (x, weight, norm.eps, len(norm.normalized_shape), norm.group)
    return _RMSNormFunction.forward(*args)[0] if not torch.is_grad_enabled() else _RMSNormFunction.apply(*args)[0]


def norm_layer(config: ModelConfig, width: int | None = None) -> nn.Module:
    """The model's normalisation over ``width`` values (n_embd when None): LayerNorm (with a bias
    when config.bias) or RMSNorm (never a bias)."""
    width = config.n_embd if width is None else width
    if config.norm == "rmsnorm":
        return RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps, bias=config.bias)


def scaled_frequencies(w: torch.Tensor, scaling: str, factor: float, low: float, high: float,
                       original: int) -> torch.Tensor:
    """The rotary frequencies ``w`` rescaled for a longer context (ModelConfig.rope_scaling): "none"
    keeps them; "linear" divides each by ``factor``; "llama3" (Llama 3.1) divides those whose wavelength
    2 pi / w exceeds original / low by ``factor``, keeps those under original / high, and between the
    two takes (1 - a) w / factor + a w with a = (original / wavelength - low) / (high - low), which
    runs from 0 to 1 across that band."""
    if scaling == "none":
        return w
    if scaling == "linear":
        return w / factor
    wavelength = 2 * math.pi / w
    a = (original / wavelength - low) / (high - low)
    between = (1 - a) * w / factor + a * w
    return torch.where(wavelength > original / low, w / factor, torch.where(wavelength < original / high, w, between))


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021): x (B, heads, T, d) -> x cos(m w) + rot(x) sin(m w),
    rot(x) = (-x[d/2:], x[:d/2]), w_i = theta^(-2i/d) for i < d/2 (rescaled by ``scaled_frequencies``
    under ModelConfig.rope_scaling), repeated for the second half. With ModelConfig.rope_fraction < 1
    (GPT-NeoX) the same on the first r = ModelConfig.rotary_dim values of x, r in place of d, and the
    other d - r values unchanged.
    The tables (seq_len, r) are buffers, not weights: rebuilt after a meta-device build."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.seq_len = config.rotary_dim, config.rope_theta, config.seq_len
        self.scaling = (config.rope_scaling, config.rope_factor, config.rope_low_freq_factor,
                        config.rope_high_freq_factor, config.rope_original_seq_len)
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        # computed on the CPU, whatever the device: a GPU's cos/sin may round an entry otherwise, and a
        # meta-device start (init_buffers) must give the plain build's tables to the bit; in a
        # meta-device build (the default device meta) they stay shapes until init_buffers
        d = self.head_dim
        device = torch.empty(0, device=device).device  # None: the default device
        if device.type == "meta":
            return torch.empty(self.seq_len, d, device=device), torch.empty(self.seq_len, d, device=device)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
        inv_freq = scaled_frequencies(inv_freq, *self.scaling)
        angles = torch.outer(torch.arange(self.seq_len, dtype=torch.float64, device="cpu"), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (s, d)
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def init_buffers(self, device: torch.device) -> None:
        """Rebuild the tables on ``device`` (after a meta-device build, largebatch.parallel.materialize)."""
        self.cos, self.sin = self._tables(device)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        # x: (B, heads, T, d) at positions offset .. offset + T - 1 (offset > 0: decoding with a KVCache)
        T, r = x.size(-2), self.head_dim
        cos, sin = self.cos[offset:offset + T].to(x.dtype), self.sin[offset:offset + T].to(x.dtype)
        if r < x.size(-1):  # a partial rotation: the first r values turn, the rest pass. Written into a tensor
            # of x's layout, as the whole rotation's output has: a contiguous cat made sdpa's output contiguous in
            # (B, heads, T, d), so the output projection's input became a copy, kept besides (measured: h values a
            # token more)
            out = torch.empty_like(x)
            out[..., :r] = self._turn(x[..., :r], cos, sin)
            out[..., r:] = x[..., r:]
            return out
        return self._turn(x, cos, sin)

    @staticmethod
    def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.size(-1) // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def extra_repr(self) -> str:
        scaling = "" if self.scaling[0] == "none" else f", scaling={self.scaling}"
        return f"rotary_dim={self.head_dim}, theta={self.theta}{scaling}"


class AttentionMask:
    """Which positions attend to which beyond the plain causal (or full) rule: within documents when
    sequences pack several (ModelConfig.document_mask), and within each layer's sliding window
    (ModelConfig.sliding_window). Position j is visible from position i when

    * both lie in the same document (with ``ids``) -- a document starts at each separator token and
      runs to the next, so a separator opens the document after it;
    * for a causal model, j <= i;
    * for a layer with window W, i - W < j (the W latest positions, i itself included).

    Every position sees itself, so no row is empty. Without documents the mask is the same for every
    sequence: (1, 1, T, T), broadcast over the batch.

    Built once per forward and handed to every layer; a layer reads the form of its own window
    (``window`` None: the documents' mask alone; a layer without a window and without documents
    reads none, the plain causal attention). ``prepare`` makes the forms the layers read before they
    run (outside any recomputed or compiled region, which must not change state from outside):
    ``allowed(window)``, bool (1 byte an entry: the explicit attention's ``torch.where``), or
    ``additive(dtype, window)``, 0 where allowed and -inf elsewhere in the attention's dtype
    (measured on CPU: sdpa turns a bool mask into that form on every call and keeps each layer's
    copy; given it in the query's dtype, it keeps the one). The layers' backward then keeps one
    tensor per distinct window. A form asked for in another dtype is made then, and kept too."""

    def __init__(self, ids: torch.Tensor | None, separator_id: int | None, causal: bool,
                 windows: tuple[int | None, ...] = (None,), length: int | None = None,
                 device: torch.device | None = None):
        if ids is not None:
            if ids.dim() != 2:
                raise ValueError(f"token ids of shape {tuple(ids.shape)}: document masking needs (batch, T)")
            documents = (ids == separator_id).cumsum(dim=1)  # (B, T): separators at or before each position
            length, device = ids.size(1), ids.device
        elif length is None:
            raise ValueError("AttentionMask: give the token ids (document masking) or the length")
        else:
            documents = None
        self._set(documents, length, length, causal, windows, device)

    @classmethod
    def decoding(cls, documents: torch.Tensor | None, queries: int, keys: int, causal: bool,
                 windows: tuple[int | None, ...], device: torch.device) -> AttentionMask:
        """The mask of the last ``queries`` positions (rows) over all ``keys`` positions (columns), from
        each position's document index ``documents`` (B, keys) or None: what a decoding step with a
        KVCache reads."""
        mask = cls.__new__(cls)
        mask._set(documents, queries, keys, causal, windows, device)
        return mask

    def _set(self, documents, queries: int, keys: int, causal: bool, windows, device) -> None:
        self.documents, self.causal, self.device = documents, causal, device
        self.queries, self.keys = queries, keys  # rows, columns
        # the distinct windows the layers read (one that covers every key is the full attention's)
        self.windows = tuple(dict.fromkeys(self.effective(w) for w in windows))
        self._made: dict[object, torch.Tensor] = {}

    def effective(self, window: int | None) -> int | None:
        """``window``, or None where it covers every key (the same mask as none)."""
        return None if window is None or window >= self.keys else window

    def reads(self, window: int | None) -> bool:
        """Whether a layer with ``window`` reads this mask (else: the plain causal or full attention)."""
        return self.documents is not None or self.effective(window) is not None

    def prepare(self, attention: str, x: torch.Tensor) -> AttentionMask:
        """Make the forms ``attention`` ("explicit" or "sdpa") reads, for layers whose input is ``x``:
        sdpa's in the dtype the queries will have (autocast's where it is on, else ``x``'s)."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        for window in filter(self.reads, self.windows):
            if attention == "explicit":
                self.allowed(window)
            else:
                self.additive(dtype, window)
        return self

    def _visible(self, window: int | None) -> torch.Tensor:
        Tq, Tk = self.queries, self.keys
        visible = None
        if self.documents is not None:
            d = self.documents
            visible = (d[:, Tk - Tq:, None] == d[:, None, :])[:, None]  # (B, 1, Tq, Tk)
        # row r is position Tk - Tq + r: keys j <= that (causal) and > that - window
        band = None
        if self.causal:
            band = torch.ones(Tq, Tk, dtype=torch.bool, device=self.device).tril(Tk - Tq)
        if window is not None:
            recent = torch.ones(Tq, Tk, dtype=torch.bool, device=self.device).triu(Tk - Tq - window + 1)
            band = recent if band is None else band & recent
        if visible is None:
            return band[None, None]  # (1, 1, Tq, Tk): every sequence alike
        return visible if band is None else visible & band

    def allowed(self, window: int | None = None) -> torch.Tensor:
        """(B or 1, 1, Tq, Tk) bool: True where position i (rows) may attend to position j (columns) in a
        layer with ``window``; the rows are the last ``queries`` positions (all of them but when decoding)."""
        window = self.effective(window)
        if ("bool", window) not in self._made:
            self._made["bool", window] = self._visible(window)
        return self._made["bool", window]

    def additive(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """(B or 1, 1, Tq, Tk) in ``dtype``: 0 where allowed, -inf elsewhere (sdpa's float mask); rows
        MASK_ROW_ALIGNMENT-aligned."""
        window = self.effective(window)
        if (dtype, window) not in self._made:
            visible = self._made.get(("bool", window))
            visible = self._visible(window) if visible is None else visible  # (the bool form is not kept for it)
            B, _, Tq, Tk = visible.shape
            width = -(-Tk // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT
            mask = torch.zeros(B, 1, Tq, width, dtype=dtype, device=visible.device)[..., :Tk]
            self._made[dtype, window] = mask.masked_fill_(~visible, float("-inf"))
        return self._made[dtype, window]


class KVCache:
    """Every layer's keys and values at the positions a causal model has read, so that each generated
    token costs one position per layer instead of the whole context again (decoding; GPT.generate):
    the key/value cache whose memory Pope et al. 2022 ("Efficiently Scaling Transformer Inference")
    count, docs/papers.md: generating text.

    ``capacity`` positions (the model's seq_len) are allocated per layer at the first write, in the
    keys' dtype (autocast's under autocast) and device: 2 x L x B x a_kv x capacity x d values (local heads under tensor
    parallel). ``offset`` positions are filled; a model's ``decode`` writes the next ones through each
    layer's ``LayerCache`` and then calls ``advance``. With ModelConfig.document_mask it also keeps
    each position's document index (``documents``, (B, offset)) and where the last document starts
    (``start``, (B,): learned positions restart there). ``reset`` empties it for a new context and
    keeps the memory."""

    def __init__(self, n_layer: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"KVCache capacity={capacity!r}: must be a positive number of positions")
        self.capacity = capacity
        self.offset = 0
        self.layers = [LayerCache(self) for _ in range(n_layer)]
        self.documents: torch.Tensor | None = None
        self.start: torch.Tensor | None = None

    def room(self, n: int) -> bool:
        """Whether ``n`` more positions fit."""
        return self.offset + n <= self.capacity

    def advance(self, n: int) -> None:
        self.offset += n

    def reset(self) -> None:
        self.offset = 0
        self.documents = self.start = None


class LayerCache:
    """One layer's part of a KVCache: ``update(k, v)`` stores the new positions' keys and values
    (B, a_kv, T, d) after the cached ones and returns all of them, (B, a_kv, offset + T, d)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, heads, T, d = k.shape
        start, end = self.cache.offset, self.cache.offset + T
        if end > self.cache.capacity:
            raise ValueError(f"KVCache: {end} positions do not fit its capacity of {self.cache.capacity} "
                             "(the model's seq_len): reset it and decode the last seq_len positions again")
        shape = (B, heads, self.cache.capacity, d)
        if self.keys is None or self.keys.shape != shape or self.keys.dtype != k.dtype or self.keys.device != k.device:
            if start and self.keys is None:
                raise ValueError(f"KVCache: offset {start} but no keys cached in this layer: set no offset by "
                                 "hand; decode from a fresh (or reset) cache")
            if start:
                kept = f"{tuple(self.keys.shape)} {self.keys.dtype} on {self.keys.device}"
                raise ValueError(f"KVCache: keys of shape {tuple(k.shape)} ({k.dtype} on {k.device}) after {start} "
                                 f"cached positions held as {kept}: a cache serves one batch of sequences in one "
                                 "dtype (the same autocast) and device; reset it for another")
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d)) V with dropout on the probabilities: the region selective
    recomputation recomputes (it holds the 5 a s^2 b bytes of docs/papers.md: memory).

    With fewer K/V heads than query heads (grouped-query attention), the explicit form multiplies
    each K/V head by its group of query heads stacked along the rows, so K and V are kept once per
    K/V head, never repeated; sdpa gets ``enable_gqa``.

    ``window``: this layer's sliding window (ModelConfig.layer_window; None: every earlier position),
    set by the model that builds the layers; a layer with a window reads the AttentionMask's form for
    it (the whole s x s scores are still computed, then masked)."""

    def __init__(self, config: ModelConfig, window: int | None = None):
        super().__init__()
        self.window = window
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        # q: (B, a, T, d), k and v: (B, a_kv, T, d) -> (B, a, T, d); mask: attention within documents
        # and sliding windows. Decoding with a KVCache, q holds the last Tq of the Tk positions of k and v.
        Tq, Tk = q.size(-2), k.size(-2)
        if mask is not None and not mask.reads(self.window):
            mask = None  # (no documents, and no window shorter than the keys: the plain causal attention)
        if self.window is not None and mask is None and self.window < Tk:
            raise ValueError(f"a layer with sliding window {self.window} over {Tk} positions needs the model's "
                             "AttentionMask (model.attention_mask): call it through the model")
        if self.kind == "sdpa":
            p = self.dropout_p if self.training else 0.0
            grouped = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
            if mask is not None:  # (causality is in the mask)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.additive(q.dtype, self.window),
                                                      dropout_p=p, **grouped)
            if self.causal and Tq != Tk and Tq > 1:  # the last Tq rows of the causal mask
                visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=p, **grouped)
            # (one query, the newest position, sees every key)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal and Tq > 1,
                                                  **grouped)
        if k.size(1) != q.size(1):
            return self._grouped(q, k, v, mask)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, a, Tq, Tk)
        if mask is not None:  # where() keeps the shared mask for backward, not a copy
            scores = torch.where(mask.allowed(self.window), scores, float("-inf"))
        elif self.causal:
            scores = scores.masked_fill(self.future[Tk - Tq:Tk, :Tk], float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1))  # (B, a, Tq, Tk)
        return probs @ v

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: AttentionMask | None = None) -> torch.Tensor:
        B, a, T, d = q.shape
        kv, Tk = k.size(1), k.size(-2)
        g = a // kv
        rows = q.reshape(B, kv, g * T, d)  # query heads kv*g+j: rows j*T.. of K/V head kv
        scores = (rows @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (B, kv, g T, Tk)
        scores = scores.view(B, kv, g, T, Tk)
        if mask is not None:
            scores = torch.where(mask.allowed(self.window)[:, :, None], scores, float("-inf"))  # (B, 1, 1, T, Tk)
        elif self.causal:
            scores = scores.masked_fill(self.future[Tk - T:Tk, :Tk], float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1))  # (B, kv, g, T, Tk)
        return (probs.view(B, kv, g * T, Tk) @ v).view(B, a, T, d)


class Attention(nn.Module):
    """Multi-head self-attention: q/k/v projections, (with ModelConfig.qk_norm) each query and key
    head normalised, core attention, output projection, dropout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, width, kv = config.n_embd, config.attention_width, config.kv_heads * config.head_dim
        self.head_dim = config.head_dim
        # separate q/k/v (not one fused qkv) so tensor parallelism can shard each by output rows
        self.q = nn.Linear(h, width, bias=config.qkv_biased)
        self.k = nn.Linear(h, kv, bias=config.qkv_biased)
        self.v = nn.Linear(h, kv, bias=config.qkv_biased)
        # qk_norm_scope "head": over each head's values, one gain for all heads (Qwen3's q_norm, k_norm);
        # "projection": over the whole q (k) projection, a gain per value (OLMo 2's)
        self.q_norm, self.k_norm = (norm_layer(config, w) if w else None for w in config.qk_norm_width)
        self.norm_heads = config.qk_norm_layout == "head"
        self.rotary = Rotary(config) if config.position == "rope" else None
        self.core = CoreAttention(config)
        self.proj = nn.Linear(width, h, bias=config.bias)
        self.drop = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: AttentionMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None and not self.norm_heads:  # (B, T, width): the whole projection (under tensor
            # parallel this rank's heads' slice, the statistic summed over the ranks); in the projections' dtype
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        # (B, T, C) -> (B, a, T, d), K/V (B, a_kv, T, d); heads from the tensor so a sharded linear works
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None and self.norm_heads:  # (B, heads, T, d): heads on dimension 1, where tensor
            # parallel splits them; in the projections' dtype: under autocast an fp32 gain would make them fp32
            # (the rotation in fp32, a KV cache of fp32 keys beside 16-bit values)
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        offset = 0 if cache is None else cache.offset  # x: the positions after the cached ones
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        if cache is not None:
            k, v = cache.update(k, v)  # every position's keys and values: (B, a_kv, offset + T, d)
        y = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)  # (B, a, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, a d)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """fc2(GeLU(fc1(x))), or with activation="swiglu" fc2(SiLU(gate(x)) * fc1(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = (nn.Linear(config.n_embd, config.ffn, bias=config.bias) if config.activation == "swiglu"
                     else None)
        self.fc1 = nn.Linear(config.n_embd, config.ffn, bias=config.bias)
        self.act = nn.SiLU() if self.gate is not None else gelu(config)
        self.fc2 = nn.Linear(config.ffn, config.n_embd, bias=config.bias)
        self.drop = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, f) -> (B, T, C)
        if self.gate is not None:
            return self.drop(self.fc2(self.act(self.gate(x)) * self.fc1(x)))
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """One transformer layer. pre-LN: x + attn(ln1(x)), then + mlp(ln2(.)).
    post-LN (original BERT): ln1(x + attn(x)), then ln2(. + mlp(.)).
    reordered (OLMo 2): x + ln1(attn(x)), then + ln2(mlp(.)).
    parallel (GPT-J, GPT-NeoX): x + attn(ln1(x)) + mlp(ln2(x)), both sub-layers reading x."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm_position = config.norm_position
        self.ln1 = norm_layer(config)
        self.attn = Attention(config)
        self.ln2 = norm_layer(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: AttentionMask | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        # x: (B, T, C) -> (B, T, C); mask: attention within documents (ModelConfig.document_mask);
        # cache: this layer's keys and values of the earlier positions (generation, KVCache)
        extra = {} if mask is None else {"mask": mask}
        if cache is not None:
            extra["cache"] = cache
        if self.norm_position == "pre":
            x = x + self.attn(self.ln1(x), **extra)
            return x + self.mlp(self.ln2(x))
        if self.norm_position == "reordered":
            x = x + self.ln1(self.attn(x, **extra))
            return x + self.ln2(self.mlp(x))
        if self.norm_position == "parallel":  # (transformers' GPT-NeoX adds mlp + attn + x, in that order)
            return self.mlp(self.ln2(x)) + self.attn(self.ln1(x), **extra) + x
        x = self.ln1(x + self.attn(x, **extra))
        return self.ln2(x + self.mlp(x))


def gelu(config: ModelConfig) -> nn.GELU:
    """exact (erf) GeLU, as BERT and transformers' "gelu"; or GPT-2's tanh approximation
    (transformers' "gelu_new", the same formula)."""
    return nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) everywhere, residual-branch outputs (attn.proj, mlp.fc2)
    scaled by 1/sqrt(2 L) (Radford et al. 2019), zero biases, unit LayerNorm and RMSNorm gains."""
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
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
