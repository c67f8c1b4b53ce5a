"""Closed-form activation memory of a transformer: Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4 (Eqs. 1-6, Table 2), as in docs/papers.md: memory.

With its defaults (16-bit activations, 1-byte dropout masks, explicit attention, ffn = 4h) this
reproduces the paper's table exactly, per layer:

    no parallelism                          s b h (34 + 5 a s / h)
    tensor parallel (t)                     s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel              s b h / t (34 + 5 a s / h)
    tensor parallel + selective recompute   s b h (10 + 24/t)
    tensor + sequence + selective           34 s b h / t
    full recompute                          2 s b h   (/ t with sequence parallel)

The same terms are kept apart so other layers can be described: with d = bytes per activation
value and m = bytes per dropout mask value, per token (s b) a layer stores
    replicated under tensor parallelism (split by t only with sequence parallelism):
        2 LayerNorm inputs + Q/K/V input + fc1 input = 4 h d,  2 dropout masks = 2 h m
    split by t under tensor parallelism:
        Q, K, V + projection input = 4 h d,  GeLU input + fc2 input = 2 f d
    core attention (split by t), per token: a s (2d + m) -- softmax output, its dropout mask, the
        dropout output (a s d without dropout: the softmax output is then what @V keeps);
        a fused kernel (SDPA flash / memory-efficient) keeps only a 4-byte log-sum-exp per head: 4 a.
The op-level policy (save matmul outputs, recompute pointwise ops) keeps the layer input, the
projection and fc2 outputs (replicated: 3 h d), q, k, v and the attention output (4 h d), the fc1
output (f d), and for explicit attention the scores (a s d) or, fused, the log-sum-exp (4 a).

The Llama-style layer options (largebatch.models.layers; measured per layer on CPU in fp32 and bf16,
tests/test_memory_llama.py) change these terms, with a_kv key/value heads:
* grouped-query attention: K and V are kept at a_kv heads, 2 h d a_kv / a per token in place of
  2 h d (split by t); Q, the projection input and the s^2 terms are unchanged (the explicit grouped
  path's reshaped copy of q is what Q K^T keeps, q itself is not kept);
* SwiGLU, fc2(SiLU(gate(x)) * fc1(x)): four f-wide values in place of GeLU's two -- the gate output
  (SiLU's input), the SiLU output and the fc1 output (the product's operands), the fc2 input; the
  gate reads the fc1 input (kept once). The op-level policy keeps the gate and fc1 outputs (2 f d);
* rotary positions keep nothing: the rotation multiplies by constant tables (buffers);
* head_size d_h (heads whatever h / a is): Q and the projection input are w = a d_h wide in place of
  h, K and V w a_kv / a; the s^2 terms are unchanged;
* qk_norm (each query and key head normalised, Qwen3; or the whole projections, OLMo 2, a statistic
  per token for each, whole on every tensor-parallel rank): the norms keep their inputs, the q and k
  projections' outputs, (w + w a_kv / a) d more (split by t), and their statistics, one row per head:
  (a + a_kv) 4 bytes (RMSNorm's fp32 1/rms) or 8 (LayerNorm's mean and 1/std, fp32 on a GPU) -- per
  head, so unlike the layer norms' per-token statistics not negligible at small head sizes (6% of
  the RMSNorms' bytes at d_h = 16 in fp32, 11% of LayerNorms'); the op-level policy keeps the inputs already (the matmul
  outputs) and recomputes the statistics;
* the parallel layer (norm_position "parallel", GPT-NeoX: x + attn(LN1(x)) + mlp(LN2(x))) keeps its
  input once for both norms: 3 h d replicated values in place of 4; its partial rotation
  (rope_fraction) keeps nothing, as the whole one;
* RMSNorm keeps its input only, as a LayerNorm (largebatch.models.layers.RMSNorm recomputes the
  normalised tensor in backward; written out, as transformers' LlamaRMSNorm, it keeps an fp32 copy
  of a 16-bit input and the normalised tensor besides, 3 h d at 16 bits: largebatch.memory.hf).
  Per-token statistics (LayerNorm's mean and rstd, RMSNorm's rstd) are not counted.

Whole model (Korthikanti et al. 2022 §4.3): the first pipeline stage holds L layers' worth (L/p layers
for each of p micro-batches in flight), p embedding dropout masks (s b h m), and, without pipeline
parallelism, the output layer (GPT): final-norm input and projection input (2 s b h d) plus fp32 logits
(4 s b v, vocabulary-parallel so / t).

Beyond the paper, with ``document_mask`` (attention within the documents of a packed sequence) a
micro-batch keeps one s x s mask besides, shared by its layers: s^2 b bytes as bool (explicit
attention), s s' b d as sdpa's float mask with rows padded to s' (``attention_mask_bytes``); a pipeline
rank keeps one per stage and micro-batch in flight. A sliding window (``sliding_window``) shorter
than s adds one such mask for its layers (s^2 without documents: every sequence alike); the layers'
own terms are unchanged (the whole s x s scores are computed, then masked).

Per pipeline schedule (Korthikanti et al. 2022 §4.2.3, citing Narayanan et al. 2021), the first
stage's layers' worth (``first_stage_layers``): 1F1B keeps p micro-batches of its L/p layers, L; the
interleaved schedule with V stages per rank keeps L (1 + (p - 1) / (p V)); GPipe keeps all m
micro-batches of the step, m L / p. The embedding masks follow the same count of micro-batches.

Beyond the paper: what the backward pass allocates on top of the stored activations at its peak
(``backward_working_bytes``: a layer's recomputation and gradients, the loss's fp32 logits
gradients), measured against ``measure.measure_peak_bytes``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from largebatch.models.config import MASK_ROW_ALIGNMENT, ModelConfig
from largebatch.models.flops import RECOMPUTE_POLICIES, per_layer_policies
from largebatch.models.registry import model_spec


@dataclass(frozen=True)
class LayerShape:
    """What the per-layer count depends on, validated once."""

    seq_len: int
    micro_batch: int
    hidden: int
    heads: int
    ffn_hidden: int
    tp: int
    sequence_parallel: bool
    kv_heads: int
    head_dim: int | None = None
    """d_h; None: hidden / heads, which heads must then divide."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "hidden", "heads", "ffn_hidden", "tp", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is None and name == "head_dim":
                if self.hidden % self.heads:
                    raise ValueError(f"heads={self.heads} does not divide hidden={self.hidden}: give head_dim "
                                     "(the size of one head), or heads that divide hidden.")
                object.__setattr__(self, name, value := self.hidden // self.heads)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, value := int(value))  # a numpy integer
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer.")
        if self.heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide heads={self.heads}: tensor parallelism "
                             "splits whole heads; choose tp among the divisors of heads.")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} does not divide heads={self.heads}: each key/value "
                             "head serves a whole group of query heads; choose a divisor of heads.")
        if self.kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide kv_heads={self.kv_heads} (model.n_kv_head): tensor "
                             "parallelism splits whole key/value heads; choose tp among the divisors of "
                             "kv_heads, or more key/value heads.")


def _check_bytes(dtype_bytes: float, mask_bytes: float) -> None:
    if not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes={dtype_bytes!r}: must be > 0 (2 for fp16/bf16, 4 for fp32).")
    if mask_bytes < 0:
        raise ValueError(f"mask_bytes={mask_bytes!r}: must be >= 0 (1 for bool masks).")


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", *,
                               ffn_hidden: int | None = None, dtype_bytes: float = 2,
                               mask_bytes: float = 1, fused_attention: bool = False,
                               dropout: bool = True, replicated_values: float = 4,
                               kv_heads: int | None = None, gated_mlp: bool = False,
                               head_dim: int | None = None, qk_norm: str | None = None,
                               qk_norm_scope: str = "head") -> float:
    """Bytes one transformer layer keeps for its backward pass (Korthikanti et al. 2022, Table 2).

    recompute: "none" | "selective" (core attention recomputed) | "op" (matmul outputs saved,
    pointwise ops recomputed) | "full" (only the layer input kept). dtype_bytes: bytes per stored
    activation (2 = the paper's 16-bit; 4 for fp32). mask_bytes: bytes per dropout-mask element.
    fused_attention: SDPA flash/memory-efficient kernel (no s^2 term). dropout=False: no masks, and
    the softmax output doubles as the attention-dropout output. replicated_values: h-wide values
    per token kept outside the tensor-parallel regions (4: two norm inputs, the Q/K/V input and the
    fc1 input; a block whose attention and MLP read one normed input keeps 2). kv_heads: key/value
    heads a_kv (None: heads; grouped-query attention keeps K and V at 2 s b h d a_kv / a).
    gated_mlp: the SwiGLU MLP, four f-wide values kept (gate output, SiLU output, fc1 output, fc2
    input) in place of two. head_dim: d_h (None: hidden / heads); Q and the projection input are
    heads * d_h wide. qk_norm: the query and key heads' norms, "rmsnorm" or "layernorm" (None: none),
    keep their inputs and a 4-byte (RMSNorm) or two 4-byte (LayerNorm) statistics per head;
    qk_norm_scope="projection" (OLMo 2: the whole projections normalised, RMSNorm only): the same
    inputs and one 4-byte statistic per token for q and one for k, whole on every tensor-parallel rank.
    """
    if qk_norm not in (None, "rmsnorm", "layernorm"):
        raise ValueError(f"qk_norm={qk_norm!r}: must be None, 'rmsnorm' or 'layernorm' (the heads' norm).")
    if qk_norm_scope not in ("head", "projection") or (qk_norm_scope == "projection" and qk_norm == "layernorm"):
        raise ValueError(f"qk_norm_scope={qk_norm_scope!r} with qk_norm={qk_norm!r}: must be 'head', or "
                         "'projection' with an RMSNorm.")
    shape = LayerShape(seq_len, micro_batch, hidden, heads, 4 * hidden if ffn_hidden is None
                       else ffn_hidden, tp, bool(sequence_parallel), heads if kv_heads is None else kv_heads,
                       head_dim)
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute={recompute!r}: must be one of {', '.join(RECOMPUTE_POLICIES)}.")
    _check_bytes(dtype_bytes, mask_bytes)
    if not (isinstance(replicated_values, numbers.Real) and not isinstance(replicated_values, bool)
            and replicated_values >= 0):
        raise ValueError(f"replicated_values={replicated_values!r}: must be a number >= 0 (h-wide values per "
                         "token outside the tensor-parallel regions; 4 for the GPT/BERT block).")
    # the shape's values: numpy integers made Python ints (their products wrapped at 2^31 or 2^63)
    s, b, h, a, f, t = shape.seq_len, shape.micro_batch, shape.hidden, shape.heads, shape.ffn_hidden, shape.tp
    d, m = dtype_bytes, (mask_bytes if dropout else 0)
    t_rep = t if sequence_parallel else 1  # what splits the "replicated" regions
    w = a * shape.head_dim  # the width of Q and of the projection input (h unless head_dim says otherwise)
    kv = shape.kv_heads * shape.head_dim  # the width of K and of V (w unless grouped)
    if recompute == "full":
        return s * b * h * d / t_rep
    if recompute == "op":  # matmul outputs: q, k, v, the attention output; fc1 (and the gate)
        kept_core = 4 * a * s * b if fused_attention else a * s * s * b * d
        return s * b * (3 * h * d / t_rep + (2 * w + 2 * kv + (2 if gated_mlp else 1) * f) * d / t) + kept_core / t
    replicated = s * b * (replicated_values * h * d + 2 * h * m) / t_rep
    # Q and the projection input, K and V, (the query and key norms' inputs), the MLP's f-wide values
    split = s * b * (2 * w + 2 * kv + ((w + kv) if qk_norm else 0) + (4 if gated_mlp else 2) * f) * d / t
    if qk_norm and qk_norm_scope == "projection":  # their statistics: a row per token for q and one for k,
        split += s * b * 2 * 4  # each whole on every tensor-parallel rank (summed over the ranks' heads)
    elif qk_norm:  # their statistics: one row per query and key head
        split += s * b * (a + shape.kv_heads) * (4 if qk_norm == "rmsnorm" else 8) / t
    if recompute == "selective":
        return replicated + split
    core = 4 * a * s * b if fused_attention else a * s * s * b * ((2 * d + m) if dropout else d)
    return replicated + split + core / t


def config_layer_kwargs(config: ModelConfig, *, dtype_bytes: float = 2, device: str = "cuda",
                        training: bool = True) -> dict:
    """The keywords of activation_bytes_per_layer that describe `config` (everything but s, b, tp).

    SDPA counts as fused except where PyTorch falls back to its unfused math kernel: on CPU with
    attention dropout in training (the CPU flash kernel has no dropout).
    """
    dropout = training and config.dropout > 0
    fused = config.attention == "sdpa" and not (device == "cpu" and dropout)
    if config.attention == "sdpa" and not fused:
        raise ValueError("attention='sdpa' with dropout on CPU runs PyTorch's unfused math kernel, "
                         "whose float dropout mask the memory model does not describe: use "
                         "attention='explicit' or dropout=0 for CPU memory estimates.")
    spec = model_spec(config.kind)
    # the parallel layer's two norms read its input, kept once (largebatch.models.layers.Block)
    shared_input = 1 if config.norm_position == "parallel" else 0
    return dict(hidden=config.n_embd, heads=config.n_head, ffn_hidden=config.ffn,
                dtype_bytes=dtype_bytes, fused_attention=fused, dropout=dropout,
                replicated_values=spec.layer_replicated - shared_input,
                kv_heads=config.kv_heads, gated_mlp=config.activation == "swiglu",
                head_dim=config.head_dim, qk_norm=config.norm if config.qk_norm else None,
                qk_norm_scope=config.qk_norm_scope)


PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "interleaved-zb", "zbv")


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """V, the pipeline stages one rank holds under ``schedule``: 2 for ZBV, ``virtual_stages`` for the
    interleaved schedules, 1 for GPipe and 1F1B."""
    return 2 if schedule == "zbv" else virtual_stages if schedule.startswith("interleaved") else 1


def last_stage_rank(schedule: str, pp: int) -> int:
    """The rank holding the last pipeline stage: pp - 1, except under ZBV's V shape (rank 0)."""
    return 0 if schedule == "zbv" else pp - 1


def _plain(value):
    """A numpy integer as a Python int (the products here pass 2^31 and 2^63, where numpy wraps);
    anything else as it is, for the checks to name."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)) else value


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def first_stage_layers(n_layer: int, pp: int, schedule: str = "1f1b", virtual_stages: int = 1,
                       micro_batches: int | None = None) -> float:
    """Layers' worth of activations the first pipeline stage keeps (Korthikanti et al. 2022
    §4.2.3): 1F1B L; interleaved with V stages per rank L (1 + (p - 1) / (p V)); GPipe m L / p; the
    zero-bubble schedules (V stages per rank, ZBV V = 2) the peak of torch's action lists
    (largebatch.memory.pipeline_schedule.walk, needs m)."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: must be one of {', '.join(PP_SCHEDULES)}.")
    for name, value in (("n_layer", n_layer), ("pp", pp), ("virtual_stages", virtual_stages)):
        if not _positive_int(value):
            raise ValueError(f"{name}={value!r}: must be a positive integer.")
    if micro_batches is not None and not _positive_int(micro_batches):
        raise ValueError(f"micro_batches={micro_batches!r}: must be a positive integer (micro-batches per step).")
    if n_layer % pp:
        raise ValueError(f"pp={pp}: must divide n_layer={n_layer} (layers per pipeline stage).")
    if pp == 1:
        return float(n_layer)
    if schedule in ("gpipe", "interleaved-zb", "zbv") and not micro_batches:
        raise ValueError(f"schedule={schedule!r} depends on the micro-batches per step: give micro_batches.")
    if schedule == "gpipe":
        return micro_batches * n_layer / pp
    if schedule == "interleaved-1f1b":
        return n_layer * (1 + (pp - 1) / (pp * virtual_stages))
    if schedule in ("interleaved-zb", "zbv"):
        from largebatch.memory.pipeline_schedule import walk  # it imports this module

        return walk(schedule, pp, stages_per_rank(schedule, virtual_stages), micro_batches).layers_worth(n_layer)
    return float(n_layer)


def model_activation_bytes(config: ModelConfig, micro_batch: int, recompute: str | Sequence[str] = "none",
                           tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                           seq_len: int | None = None, *, dtype_bytes: float = 2,
                           device: str = "cuda", training: bool = True,
                           mask_fraction: float = 0.15, schedule: str = "1f1b", virtual_stages: int = 1,
                           micro_batches: int | None = None, loss_parallel: bool = True) -> float:
    """Activation bytes on the first pipeline stage for `config` (Korthikanti et al. 2022 §4.3).

    recompute is one policy or a per-layer list for the L / pp layers of a stage (each stage runs
    the same mix); with 1F1B the stage holds pp micro-batches in flight, hence L layers' worth
    (other schedules: ``first_stage_layers``; under ZBV rank 0 also holds the last stage, whose
    output layer this leaves out: ``pipeline_schedule.schedule_activation_bytes`` counts it). What
    the modules before and after the blocks keep
    is the model kind's (``embedding_activations``, ``output_activations``): for BERT the head
    (dense, GeLU, LayerNorm, decoder inputs, fp32 logits) runs on mask_fraction of the positions.
    loss_parallel: the fp32 logits stay split over the vocabulary across tp (the paper's layout, the
    trainer's parallel.loss_parallel); False: gathered, the whole vocabulary on every rank.
    """
    micro_batch, tp, pp, seq_len = _plain(micro_batch), _plain(tp), _plain(pp), _plain(seq_len)
    if not isinstance(pp, int) or pp < 1 or config.n_layer % pp:
        raise ValueError(f"pp={pp!r}: must be a positive integer dividing n_layer={config.n_layer}.")
    in_flight = first_stage_layers(config.n_layer, pp, schedule, virtual_stages, micro_batches) * pp / config.n_layer
    one = stage_activation_bytes(config, micro_batch, config.n_layer // pp, recompute, first=True, last=False,
                                 tp=tp, sequence_parallel=sequence_parallel, seq_len=seq_len, dtype_bytes=dtype_bytes,
                                 device=device, training=training, mask_fraction=mask_fraction)
    if pp > 1:  # an attention mask is per stage and micro-batch: V of them a micro-batch on a rank
        mask = attention_mask_bytes(config, micro_batch, seq_len, dtype_bytes) if training else 0.0
        return in_flight * (one - mask) + in_flight * stages_per_rank(schedule, virtual_stages) * mask
    return one + stage_activation_bytes(config, micro_batch, 0, first=False, last=True, tp=tp,
                                        sequence_parallel=sequence_parallel, seq_len=seq_len,
                                        dtype_bytes=dtype_bytes, device=device, training=training,
                                        mask_fraction=mask_fraction, loss_parallel=loss_parallel)


def last_rank_activation_bytes(config: ModelConfig, micro_batch: int, recompute: str | Sequence[str] = "none", *,
                               tp: int = 1, pp: int, sequence_parallel: bool = False, seq_len: int | None = None,
                               dtype_bytes: float = 2, device: str = "cuda", training: bool = True,
                               mask_fraction: float = 0.15, schedule: str = "1f1b", virtual_stages: int = 1,
                               micro_batches: int, loss_parallel: bool = True) -> float:
    """Peak activation bytes on the rank that holds the last pipeline stage (rank pp - 1; under ZBV
    rank 0, which holds the first stage too): the schedule's own action order
    (``pipeline_schedule.walk``) with each stage's bytes per micro-batch, the output layer's inputs
    and fp32 logits on the last. It keeps fewer micro-batches in flight than the first rank (1F1B:
    one) but the logits, 4 s b v bytes (/ tp under ``loss_parallel``), can outweigh them.
    ``recompute``: one policy or a per-layer list for the L / pp layers of a rank (every rank runs the
    same mix; a rank's k-th virtual stage takes the k-th share of the list)."""
    from largebatch.memory.pipeline_schedule import walk  # it imports this module

    micro_batch, tp, pp, seq_len = _plain(micro_batch), _plain(tp), _plain(pp), _plain(seq_len)
    virtual = stages_per_rank(schedule, virtual_stages)
    stages = pp * virtual
    if config.n_layer % stages:
        raise ValueError(f"pp x V = {pp} x {virtual} = {stages} stages: must divide n_layer={config.n_layer}.")
    per_stage = config.n_layer // stages
    policies = per_layer_policies(recompute, config.n_layer // pp)
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, seq_len=seq_len, dtype_bytes=dtype_bytes,
              device=device, training=training, mask_fraction=mask_fraction, loss_parallel=loss_parallel)
    per = {s: stage_activation_bytes(config, micro_batch, per_stage,
                                     policies[(s // pp) * per_stage:(s // pp + 1) * per_stage],
                                     first=s == 0, last=s == stages - 1, **kw) for s in range(stages)}
    return walk(schedule, pp, virtual, micro_batches).peak_bytes(per.__getitem__, last_stage_rank(schedule, pp))


LOGITS_GRADIENT_COPIES = 3
"""fp32 vocabulary-wide tensors the loss's backward holds at once beside the stored logits: the
gradient of the log-softmax output, a temporary and the logits' gradient (measured on CPU)."""


def backward_working_bytes(config: ModelConfig, micro_batch: int, recompute: str | Sequence[str] = "none", *,
                           layers: int | None = None, output_layer: bool = True, tp: int = 1,
                           sequence_parallel: bool = False, seq_len: int | None = None, dtype_bytes: float = 2,
                           device: str = "cuda", training: bool = True, mask_fraction: float = 0.15,
                           loss_parallel: bool = True) -> float:
    """What the backward pass allocates on top of the stored activations at its peak, per device.

    The paper's Table 2 counts what the forward leaves stored; backward needs more while it runs.
    First the loss: LOGITS_GRADIENT_COPIES fp32 tensors of the logits' size (4 s b v, / t under
    ``loss_parallel``; BERT: on ``mask_fraction`` of the positions), on the rank holding the output
    layer. Then one layer at a time, last to first, each freeing what it stored once done: layer i
    re-materialises what its policy dropped (full: the whole layer's activations less the kept
    input; selective: the core attention; op: the pointwise outputs) and holds the gradients of its
    largest intermediates -- the attention scores' (a s^2 b d / t; two at once without dropout,
    where the softmax output stays saved until the softmax's backward, one with dropout, whose
    output is freed first, two under the op-level policy, which holds its recomputed dropout
    output) or the MLP's (2 s b f d / t). Layer i's peak is that, less what the
    layers after it stored (already freed). The largest of these, or 0. ``layers``: the blocks of a
    stage (default all); ``recompute``: one policy or one per block. Measured on CPU, fp32, against
    ``measure_peak_bytes`` (docs/memory.md)."""
    micro_batch, tp = _plain(micro_batch), _plain(tp)
    s = config.seq_len if seq_len is None else _plain(seq_len)
    kw = config_layer_kwargs(config, dtype_bytes=dtype_bytes, device=device, training=training)
    policies = per_layer_policies(recompute, config.n_layer if layers is None else layers)
    layer = dict(tp=tp, sequence_parallel=sequence_parallel, **kw)
    stored = {p: activation_bytes_per_layer(s, micro_batch, recompute=p, **layer) for p in set(policies) | {"none"}}
    scores = 0.0 if kw["fused_attention"] else config.n_head * s * s * micro_batch * dtype_bytes / tp
    mlp = 2 * s * micro_batch * config.ffn * dtype_bytes / tp
    peak, freed = 0.0, 0.0
    for p in reversed(policies):  # backward order
        copies = 1 if kw["dropout"] and p != "op" else 2  # op: the recomputed dropout output is held too
        peak = max(peak, stored["none"] - stored[p] + max(copies * scores, mlp) - freed)
        freed += stored[p]
    if output_layer:
        share = mask_fraction if model_spec(config.kind).objective == "masked" else 1.0
        logits = 4 * share * s * micro_batch * config.vocab_size / (tp if loss_parallel else 1)
        peak = max(peak, LOGITS_GRADIENT_COPIES * logits)
    return peak


def attention_mask_bytes(config: ModelConfig, micro_batch: int, seq_len: int | None = None,
                         dtype_bytes: float = 2) -> float:
    """Bytes of the attention masks a micro-batch keeps (largebatch.models.layers.AttentionMask: its
    layers' backward, or their recomputation, keep one tensor per distinct form): under
    ``document_mask`` s^2 b per distinct layer window (full attention, or a sliding_window), without
    it s^2 for the sliding window alone (every sequence alike) when the window is shorter than s --
    as bool for explicit attention (``torch.where`` keeps its condition) or in the activation dtype
    for sdpa (its float mask, each row padded to a multiple of MASK_ROW_ALIGNMENT values, which CUDA's
    kernel needs uncopied); on every tensor-parallel rank whole (heads are split, the mask is not); 0
    when no layer reads a mask. A pipeline stage is counted with the whole model's windows (an upper
    bound where its layers have fewer). The per-token integers beside it (the document index a
    recomputation keeps with the mask, learned positions' restarted indices: 8 bytes a token each) are
    not counted, as the norms' per-token statistics are not."""
    s = config.seq_len if seq_len is None else _plain(seq_len)
    masks = attention_mask_count(config, s)
    sequences = _plain(micro_batch) if config.document_mask else 1
    if config.attention == "explicit":
        return masks * s * s * sequences
    rows = -(-s // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT  # (sdpa's: each row padded to alignment)
    return masks * s * rows * sequences * dtype_bytes


def attention_mask_count(config: ModelConfig, seq_len: int | None = None) -> int:
    """How many distinct attention masks the layers read at context ``seq_len``: one per distinct layer
    window under document_mask (full attention, and a window of s or more, counted once), else one per
    distinct window shorter than s."""
    s = config.seq_len if seq_len is None else _plain(seq_len)
    windows = set(config.windows_at(s))  # (one covering s: the full one's)
    return len(windows if config.document_mask else windows - {None})


def stage_activation_bytes(config: ModelConfig, micro_batch: int, layers: int,
                           recompute: str | Sequence[str] = "none", *, first: bool, last: bool, tp: int = 1,
                           sequence_parallel: bool = False, seq_len: int | None = None, dtype_bytes: float = 2,
                           device: str = "cuda", training: bool = True, mask_fraction: float = 0.15,
                           loss_parallel: bool = True) -> float:
    """Bytes ONE micro-batch keeps on a pipeline stage of ``layers`` blocks until its backward: the
    blocks (recompute: one policy or one per block), the embeddings' if ``first``, the final norm's
    and output layer's and loss's if ``last`` (Korthikanti et al. 2022 §4.3; ``loss_parallel`` as in
    model_activation_bytes)."""
    micro_batch, tp = _plain(micro_batch), _plain(tp)
    s = config.seq_len if seq_len is None else _plain(seq_len)
    kw = config_layer_kwargs(config, dtype_bytes=dtype_bytes, device=device, training=training)
    policies = per_layer_policies(recompute, layers) if layers else []
    total = sum(policies.count(p) * activation_bytes_per_layer(
        s, micro_batch, tp=tp, sequence_parallel=sequence_parallel, recompute=p, **kw) for p in set(policies))
    t_rep = tp if sequence_parallel else 1
    spec = model_spec(config.kind)
    if policies and training:  # the masks (documents, windows), kept once for all layers
        total += attention_mask_bytes(config, micro_batch, s, dtype_bytes)
    if first:  # the embedding dropout mask, and what the kind's modules before the blocks keep
        per_token = config.n_embd * (1 if kw["dropout"] else 0) + spec.embedding_activations(config, dtype_bytes)
        total += s * micro_batch * per_token / t_rep
    if last:  # the kind's final norm, output layer and loss (BERT: the head on mask_fraction of the positions)
        vocab_split = tp if loss_parallel else 1  # (the kinds' output terms use tp for the logits only)
        total += s * micro_batch * spec.output_activations(config, dtype_bytes, vocab_split, t_rep, mask_fraction)
    return total
