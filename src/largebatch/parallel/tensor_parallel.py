"""Tensor and sequence parallelism for largebatch's GPT and BERT (torch.distributed.tensor.parallel).

Tensor parallel (Megatron layout; docs/papers.md: memory, Korthikanti et al. 2022 §2-§3): in every block the
q, k, v projections and mlp.fc1 (and the gated MLP's mlp.gate, activation="swiglu") are split by
output columns (each rank owns n_head/t query heads, n_kv_head/t key/value heads and ffn/t hidden
units), attn.proj and mlp.fc2 by input rows; their partial outputs are summed by an all-reduce (the
paper's g operator) and the input gradients of the column-parallel linears by another (f). Under
grouped-query attention (Ainslie et al. 2023) query head i reads K/V head i // (n_head / n_kv_head),
so rank r's query heads r n_head/t .. read exactly its own K/V heads r n_kv_head/t ..: t must divide
n_kv_head (checked with n_head). Rotary positions (position="rope") rotate each rank's local heads by
the whole sequence's positions: attention always sees the gathered sequence. The token embedding is
split over the vocabulary (each rank looks up its rows; an all-reduce sums the lookups) and so is
the tied output projection (logits all-gathered).

Sequence parallel (Korthikanti et al. 2022 §4.2.2): the LayerNorm (or RMSNorm), dropout and residual
regions between the tensor-parallel regions are split along the sequence across the same t ranks.
The norms' weights stay whole on every rank (replicated DTensors): each rank's weight gradient sums
over its own tokens only, so backward leaves it a ``Partial(sum)`` DTensor, which
``largebatch.optim.core.local_grad`` all-reduces over the t ranks (a redistribution to the
parameter's ``Replicate()``) before the optimizers, the gradient norm and clipping read it: the same
for a LayerNorm's gain and bias and an RMSNorm's gain. Entering attention or the MLP all-gathers the
sequence (reduce-scatter in backward), leaving it
reduce-scatters instead of all-reducing (all-gather in backward): the same communication volume,
and the norm/dropout activations of docs/papers.md: memory (LayerNorm or RMSNorm inputs 4sbh, dropout
masks 2sbh at 16 bits) are divided by t.

Everything no plan splits (the position embedding, LayerNorms outside SP, BERT's prediction head)
runs whole on every rank with its parameters as replicated DTensors (``ReplicateParallel``).

What backward keeps of the gathered input (Korthikanti et al. 2022 §4.2.2, end): the column-parallel
linears need the whole sequence for their weight gradients. Left to torch, each saves the
all-gathered input, so the q/k/v input and the fc1 input (2sbh each at 16 bits) are not divided by
t. Entering a sub-layer (``SequenceGather``) therefore keeps only this rank's sequence shard in
their place and all-gathers it again in backward, as Megatron does: the sequence-parallel layer
then saves the paper's 34sbh/t + 5as^2b/t bytes. Under autocast each linear saves its own
low-precision copy of the gathered input; those copies are recognised by their autograd history
and rebuilt from the shard too. Where another saved-tensor mechanism owns the
region (torch's activation checkpoint: full or op-level recomputation, which keeps none of it) or
inside ``torch.compile``, the gathered input is left to torch. See docs/parallel.md for the
measured bytes.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from largebatch.models.registry import model_spec
from largebatch.parallel.config import check_tp_divides


class ReplicateParallel(ParallelStyle):
    """Run a module whole on every tensor-parallel rank, its parameters as replicated DTensors.

    Every parameter of a tensor-parallel model is then a DTensor, so torch's foreach optimizers
    (AdamW), the norm reduction and DCP see one kind of tensor. ``input_layout``: how the incoming
    local tensor is laid out -- Replicate(), or Shard(1) from a sequence-parallel region, which is
    all-gathered first. The output is handed on as a local tensor.
    """

    def __init__(self, input_layout=Replicate()):
        super().__init__()
        self.input_layout = input_layout

    def _prepare_input(self, module, inputs, mesh):
        def to_replicated(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
            return x.redistribute(mesh, (Replicate(),)) if self.input_layout != Replicate() else x
        return tuple(to_replicated(x) for x in inputs)

    @staticmethod
    def _local_output(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # partition_fn None: distribute_module replicates every parameter of the module
        return distribute_module(module, device_mesh, None, input_fn=self._prepare_input,
                                 output_fn=self._local_output)


class ProjectionNorm(ParallelStyle):
    """An RMSNorm over a whole column-parallel projection (model.qk_norm_scope="projection", OLMo 2's
    q_norm and k_norm): its input is this rank's slice of the projection (its heads' values, a local
    tensor), its gain is split the same way (a ``Shard(0)`` DTensor: each rank steps its own values'
    gains, whose gradients are whole), and the mean of squares is summed over the ranks
    (``largebatch.models.layers.RMSNorm.group``): one all-reduce of a value per token forward, one in
    backward. The output stays local."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from largebatch.models.layers import RMSNorm, split_rms_norm

        if not isinstance(module, RMSNorm):
            raise ValueError(f"the 'projection_norm' role needs largebatch's RMSNorm, got {type(module).__name__}")

        def shard(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        module = distribute_module(module, device_mesh, shard)
        module.group = device_mesh.get_group()
        module.split_norm = torch.compiler.disable(functools.partial(split_rms_norm, module))
        return module


def _gathered(shard: torch.Tensor, mesh) -> DTensor:
    """The whole sequence from this rank's shard (dimension 1), replicated over ``mesh``."""
    return DTensor.from_local(shard, mesh, (Shard(1),), run_check=False).redistribute(mesh, (Replicate(),))


class SequenceGather(ParallelStyle):
    """A sub-layer's input under sequence parallel ("enter"): the local sequence shard is
    all-gathered once (a replicated DTensor for the sub-layer's column-parallel linears; its backward
    reduce-scatters), and what the linears save of the gathered input for backward is replaced by
    the shard, gathered again when backward needs it (once per sub-layer: the q, k and v linears
    share one gather). The same numbers: the shard gathered again is the tensor gathered before.

    The gather again is started asynchronously when backward reaches the sub-layer's output
    (``prefetch``), and waited for where the first linear needs it: it overlaps the backward of the
    sub-layer's row-parallel linear and core attention (or the MLP's second linear) instead of
    stalling the column-parallel linears. ``prefetch=None`` (the default) does so except over gloo:
    gloo runs queued collectives on worker threads (two by default), and an all-gather left in
    flight while other collectives run crashed gloo ranks (SIGSEGV in one run of three of 3000 such
    steps, in a script of torch calls alone), so there the gather waits where it is needed.
    ``prefetch=True`` over gloo gathers at the hook and waits at once (the same bookkeeping, no
    overlap: what the CPU tests run).

    The saved tensors pass through any saved-tensor hooks already active (``saved_tensors_hooks``
    of an enclosing measurement or CPU offload see the shard), except torch's activation-checkpoint
    hooks, which then own the region: nothing is replaced there."""

    def __init__(self, keep_shard: bool = True, prefetch: bool | None = None):
        super().__init__()
        self.keep_shard, self.prefetch = keep_shard, prefetch

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        pushed: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        gloo = torch.distributed.get_backend(device_mesh.get_group()) == "gloo"
        prefetch = (not gloo) if self.prefetch is None else self.prefetch

        def before(mod, args):
            x, *rest = args
            if isinstance(x, DTensor):  # (a model of one's own may hand one on)
                gathered, x = x.redistribute(device_mesh, (Replicate(),)), x.to_local()
            else:  # the local shard of a sequence-parallel region
                gathered = _gathered(x, device_mesh)
            hooks = _ShardForBackward.for_forward(x, gathered) if self.keep_shard else None
            if hooks is not None:
                hooks.__enter__()
            pushed.append(hooks)
            return (gathered, *rest)

        def after(mod, args, output):
            hooks = pushed.pop() if pushed else None
            if hooks is not None:
                hooks.__exit__(None, None, None)
                regathered = hooks.regathered
                regathered.shard = regathered.gathered_node = None  # the saved views hold the shard
                out = output[0] if isinstance(output, (tuple, list)) and output else output
                if prefetch and regathered.pending and isinstance(out, torch.Tensor) and out.requires_grad:
                    regathered.wait_at_once = gloo
                    # backward reaches this sub-layer's output first: start the gather there, so
                    # it runs while the sub-layer's backward computes (Megatron overlaps it too)
                    out.register_hook(regathered.prefetch_hook)
                else:
                    regathered.packed = None

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)  # popped even when forward raises
        return module


class _Regathered:
    """The shard a sub-layer's forward kept in place of its gathered input, gathered again once for
    every saved view of it that backward unpacks, then let go."""

    def __init__(self, shard: torch.Tensor, gathered: DTensor):
        self.shard, self.mesh = shard, gathered.device_mesh  # (the shard until forward ends)
        self.gathered_node, self.numel = gathered.grad_fn, gathered.numel()
        self.storage = gathered.to_local().untyped_storage().data_ptr()
        self.pending, self.full, self.packed = 0, None, None
        self.inflight = None  # the gather started by ``prefetch_hook``, not yet waited for
        self.wait_at_once = False  # (over gloo: see SequenceGather)
        self.outer_unpack = None  # the enclosing hooks' unpack, where the shard went through them

    def cast_of_gathered(self, t: DTensor, local: torch.Tensor) -> bool:
        """Whether ``t`` is a view of a whole copy of the gathered input in another dtype: what
        autocast hands each linear (a bf16 copy per linear), found through its autograd history
        (views and one dtype cast back to the gathered input). Rebuilt by casting again."""
        if self.gathered_node is None or local.untyped_storage().nbytes() != self.numel * local.element_size():
            return False
        node, cast = t.grad_fn, False
        for _ in range(4):
            if node is None:
                return False
            if node is self.gathered_node:
                return cast
            name = node.name()
            if name.startswith("ToCopyBackward") and not cast:
                cast = True
            elif not name.startswith(("ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward")):
                return False
            node = node.next_functions[0][0] if node.next_functions else None
        return False

    def prefetch_hook(self, grad) -> None:
        """A gradient hook on the sub-layer's output: backward has reached the sub-layer, so start
        gathering the shard (every rank reaches the same hook in the same order, as for any
        collective of backward), unless a gather is held already or nothing is left to unpack."""
        if self.full is None and self.inflight is None and self.pending > 0 and self.packed is not None:
            shard = self.packed if self.outer_unpack is None else self.outer_unpack(self.packed)
            with torch.no_grad():  # along dim 0: what the collective does without being waited for
                self.inflight = funcol.all_gather_single(shard.contiguous(), 0, (self.mesh, 0))
                if self.wait_at_once and isinstance(self.inflight, funcol.AsyncCollectiveTensor):
                    self.inflight = self.inflight.wait()
        self.packed = None

    def take(self, shard: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The gathered input for one saved view (``shard``: how to get the shard back)."""
        if self.full is None:
            with torch.no_grad():
                if self.inflight is not None:  # the prefetched gather: wait, then sequence order
                    chunks, self.inflight = self.inflight, None
                    if isinstance(chunks, funcol.AsyncCollectiveTensor):
                        chunks = chunks.wait()
                    self.full = torch.cat(chunks.chunk(self.mesh.size(), 0), 1)
                else:
                    self.full = _gathered(shard(), self.mesh).to_local()
        full = self.full
        self.pending -= 1
        if self.pending <= 0:  # every view unpacked: backward holds it only as long as it needs it
            self.full = None
        return full


class _ShardForBackward(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks for one sub-layer's forward: a view of the gathered input is packed as
    (the shard, the view's geometry); everything else, and the shard itself, goes to the hooks
    that were active before (or is kept as it is)."""

    @staticmethod
    def for_forward(shard: torch.Tensor, gathered: DTensor) -> _ShardForBackward | None:
        """The hooks for a forward that will save for backward, or None where nothing is replaced:
        no autograd, hooks disabled, inside torch.compile, or inside an activation checkpoint."""
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not torch._C._autograd._saved_tensors_hooks_is_enabled()):
            return None
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None and getattr(outer[0], "__module__", "") == "torch.utils.checkpoint":
            return None
        if not gathered.to_local().is_contiguous():  # (an all-gather's output is; the geometry assumes it)
            return None
        return _ShardForBackward(_Regathered(shard.detach(), gathered), outer)

    def __init__(self, regathered: _Regathered, outer):
        self.regathered = regathered
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            if isinstance(t, DTensor) and regathered.shard is not None:
                local = t.to_local()
                same = local.untyped_storage().data_ptr() == regathered.storage
                if same or regathered.cast_of_gathered(t, local):
                    regathered.pending += 1
                    if regathered.packed is None:  # the shard goes to the outer hooks once
                        regathered.packed = (regathered.shard if outer_pack is None
                                             else outer_pack(regathered.shard))
                        regathered.outer_unpack = outer_unpack
                    return _View(regathered, regathered.packed, t, local, None if same else t.dtype)
            return t if outer_pack is None else outer_pack(t)

        def unpack(packed):
            if isinstance(packed, _View):
                return packed.rebuild(outer_unpack)
            return packed if outer_unpack is None else outer_unpack(packed)

        super().__init__(pack, unpack)


class _View:
    """A saved view of the gathered input (or of a whole copy of it in another dtype: ``cast``), as
    its shard and the view's geometry."""

    def __init__(self, regathered: _Regathered, shard, view: DTensor, local: torch.Tensor,
                 cast: torch.dtype | None):
        self.regathered, self.shard, self.cast = regathered, shard, cast
        self.geometry = (local.size(), local.stride(), local.storage_offset())
        self.spec = (view.device_mesh, view.placements, view.shape, view.stride())

    def rebuild(self, outer_unpack) -> DTensor:
        full = self.regathered.take(lambda: self.shard if outer_unpack is None else outer_unpack(self.shard))
        mesh, placements, shape, stride = self.spec
        with torch.no_grad():
            local = (full if self.cast is None else full.to(self.cast)).as_strided(*self.geometry)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def check_divisible(model: nn.Module, tp: int, sequence_parallel: bool, seq_len: int | None = None) -> None:
    """ValueError naming the model field that tensor parallel size ``tp`` does not divide: the query
    heads, the key/value heads (grouped-query attention: k and v are split by whole heads, rank r
    holding K/V heads r n_kv/t .. and exactly the query heads that read them), the MLP width."""
    cfg = model.config
    sizes = {"model.n_head": cfg.n_head, "model.ffn_hidden (the MLP width)": cfg.ffn}  # (any vocabulary:
    # DTensor shards it unevenly, the first ranks one row more, as GPT-2's 50257 over 2)
    if getattr(cfg, "n_kv_head", None) is not None:
        sizes["model.n_kv_head"] = cfg.n_kv_head
    if sequence_parallel:
        sizes["model.seq_len"] = seq_len or cfg.seq_len
    for name, value in sizes.items():
        check_tp_divides(tp, name, value)


def styles(sequence_parallel: bool, loss_parallel: bool, regather: bool = True,
           prefetch: bool | None = None) -> dict[str, object | None]:
    """torch's ParallelStyle for each role a model's plan may give (largebatch.models.registry.TP_ROLES);
    None where the role needs nothing (a sequence-parallel-only role without sequence parallel).
    ``regather``: under sequence parallel, a sub-layer keeps its input's sequence shard for backward
    and gathers it again there (``SequenceGather``); False leaves the gathered input to torch.
    ``prefetch``: that gather starts when backward reaches the sub-layer's output (True) or when
    its first linear needs it (False); None: True except over gloo (``SequenceGather``)."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    # logits: all-gathered over the vocabulary, or left split for the vocabulary-parallel loss
    logits = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else \
        dict(output_layouts=Replicate())
    return {
        # vocabulary-parallel embedding: rows = tokens; the partial lookups are all-reduced
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # split the sequence where the residual stream starts: a local slice
        "sequence_start": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True) if sequence_parallel else None,
        # One DTensor input per sub-layer: q, k and v (or fc1) share it, so their partial input
        # gradients are summed locally and reduced ONCE when leaving the region (f in Megatron).
        "enter": SequenceGather(keep_shard=regather, prefetch=prefetch) if sequence_parallel else
        PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_output=False),
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=between),
        "norm": SequenceParallel(use_local_output=True) if sequence_parallel else None,
        "gather": ReplicateParallel(input_layout=Shard(1)) if sequence_parallel else None,
        # q or k (B, heads, T, d) with the rank's heads: a DTensor split on dimension 1, so the gain's
        # gradient (partial on each rank: its own heads) is summed over the ranks
        "head_norm": SequenceParallel(sequence_dim=1, use_local_output=True),
        # q or k (B, T, width) with the rank's heads' values: the gain split as they are, the statistic summed
        "projection_norm": ProjectionNorm(),
        "output": ColwiseParallel(input_layouts=between, **logits),
        "output_whole": ColwiseParallel(**logits),
    }


def model_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool = False,
               regather: bool = True, prefetch: bool | None = None) -> dict[str, object]:
    """The model kind's plan (its ``tp_plan``: module name -> role) as torch's styles, ``blocks.*.``
    expanded to the blocks this rank holds and the modules it does not hold (pipeline) left out."""
    by_role = styles(sequence_parallel, loss_parallel, regather, prefetch)
    plan: dict[str, object] = {}
    for name, role in model_spec(model.config.kind).tp_plan(model).items():
        if role not in by_role:
            raise ValueError(f"model.kind = {model.config.kind!r}: its tensor-parallel plan gives "
                             f"{name!r} the role {role!r}; use one of {', '.join(by_role)}")
        names = ([name.replace("*", str(i), 1) for i in range(len(model.blocks))]
                 if name.startswith("blocks.*.") else [name])
        plan.update({n: by_role[role] for n in names if by_role[role] is not None and _holds(model, n)})
    if getattr(model.config, "qk_norm", False):  # left to the replicated fallback, a gain would step with
        # its rank's partial gradient (its own heads only), or normalise over its rank's values: wrong, silently
        role = "projection_norm" if model.config.qk_norm_layout == "projection" else "head_norm"
        loose = [n for n, _ in model.named_modules() if n.endswith(("attn.q_norm", "attn.k_norm"))
                 and plan.get(n) is not by_role[role]]
        if loose:
            raise ValueError(f"model.kind = {model.config.kind!r} with model.qk_norm (qk_norm_scope="
                             f"{model.config.qk_norm_scope!r}): its tensor-parallel plan gives {loose[0]!r} no "
                             f"{role!r} role, so it would not be computed over the ranks' heads as on one device; "
                             "build the plan's blocks with largebatch.models.kinds.block_tp_plan(config)")
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool,
                          loss_parallel: bool = False, regather: bool = True,
                          prefetch: bool | None = None) -> nn.Module:
    """Shard ``model`` (a registered model kind) over ``tp_mesh`` in place, by the plan its kind
    declares; keeps ties (an output projection sharing the token embedding's weight).

    loss_parallel: the logits stay split over the vocabulary (a DTensor) and the cross-entropy is
    computed on the shards; forward AND backward must then run inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (``ParallelState.loss_context()``). The
    returned loss is a plain tensor either way.

    regather (sequence parallel only): the column-parallel linears keep their input's sequence
    shard for backward and gather it again there (Korthikanti et al. 2022, 2sbh(1 - 1/t) bytes less
    per sub-layer at 16 bits, one more all-gather per sub-layer in backward); False keeps torch's
    own behaviour (the gathered input saved). prefetch: that all-gather is started, without
    waiting, when backward reaches the sub-layer's output, so it overlaps the backward of the
    row-parallel linear and core attention (or fc2); False starts it where the first
    column-parallel linear needs it (the gathered input then lives a shorter time in backward);
    None (default): True except over gloo, whose ranks crash with a collective left in flight
    (True there gathers at the same point but waits at once).
    """
    check_divisible(model, tp_mesh.size(), sequence_parallel)
    plan = model_plan(model, sequence_parallel, loss_parallel, regather, prefetch)
    # weights shared by planned modules (tied embeddings): both are sharded Shard(0) over the
    # vocabulary; afterwards they share the first one's DTensor again
    first_of: dict[int, str] = {}
    tied: list[tuple[str, str]] = []
    for name in plan:
        weight = getattr(model.get_submodule(name), "weight", None)
        if isinstance(weight, nn.Parameter):
            if id(weight) in first_of:
                tied.append((name, first_of[id(weight)]))
            first_of.setdefault(id(weight), name)
    parallelize_module(model, tp_mesh, plan)
    for name, owner in tied:
        model.get_submodule(name).weight = model.get_submodule(owner).weight
    for module in list(model.modules()):  # what no plan split (positions, norms outside SP, heads)
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicateParallel())
    if loss_parallel:
        model.register_forward_hook(_local_loss)
    return model


def _holds(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def _local_loss(module, args, output):
    """(logits, loss): the vocabulary-parallel loss is a replicated DTensor; hand back its value."""
    logits, loss = output
    return logits, (loss.to_local() if isinstance(loss, DTensor) else loss)


def vocab_parallel_argmax(logits: DTensor) -> torch.Tensor:
    """``argmax(-1)`` of logits split over the vocabulary (the vocabulary-parallel loss's layout,
    ``Shard(-1)`` on the tensor-parallel mesh), without gathering them: each rank's best token and
    its value, all-gathered over the tp ranks (tp values per position, not the vocabulary), then the
    best of those. Ties go to the lowest token id, as ``torch.argmax`` gives them on whole logits.
    Returns a plain tensor of token ids, the same on every tp rank."""
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = logits.to_local()
    mesh = logits.device_mesh
    value, index = local.max(-1)  # the first maximum on this rank's slice
    # where this rank's slice starts (a vocabulary tp does not divide is split unevenly)
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    index = index + offset[-1]
    group, tp = mesh.get_group(), mesh.size()
    values, indices = [torch.empty_like(value) for _ in range(tp)], [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    best = torch.stack(values).argmax(0, keepdim=True)  # the first rank holding the maximum: lowest id
    return torch.stack(indices).gather(0, best).squeeze(0)
