"""Tensor and sequence parallelism for largebatch's GPT and BERT (torch.distributed.tensor.parallel).

Tensor parallel (Megatron layout; docs/papers.md: memory, Korthikanti et al. 2022 §2-§3): in every block the
q, k, v projections and mlp.fc1 are split by output columns (each rank owns n_head/t heads and
ffn/t hidden units), attn.proj and mlp.fc2 by input rows; their partial outputs are summed by an
all-reduce (the paper's g operator) and the input gradients of the column-parallel linears by
another (f). The token embedding is split over the vocabulary (each rank looks up its rows; an
all-reduce sums the lookups) and so is the tied output projection (logits all-gathered).

Sequence parallel (Korthikanti et al. 2022 §4.2.2): the LayerNorm, dropout and residual regions
between the tensor-parallel regions are split along the sequence across the same t ranks. Entering
attention or the MLP all-gathers the sequence (reduce-scatter in backward), leaving it
reduce-scatters instead of all-reducing (all-gather in backward): the same communication volume,
and the norm/dropout activations of docs/papers.md: memory (LayerNorm inputs 4sbh, dropout masks 2sbh at
16 bits) are divided by t.

Everything no plan splits (the position embedding, LayerNorms outside SP, BERT's prediction head)
runs whole on every rank with its parameters as replicated DTensors (``ReplicateParallel``).

Note on what torch's SP stores: the column-parallel linears save their all-gathered (full-sequence)
input, so unlike Megatron the q/k/v input and the fc1 input (2sbh each) are NOT divided by t; only
the norm/dropout/residual regions are. See docs/parallel.md for the measured bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
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


def check_divisible(model: nn.Module, tp: int, sequence_parallel: bool, seq_len: int | None = None) -> None:
    """ValueError naming the model field that tensor parallel size ``tp`` does not divide."""
    cfg = model.config
    sizes = {"model.n_head": cfg.n_head, "model.ffn_hidden (the MLP width)": cfg.ffn,
             "model.vocab_size": cfg.vocab_size}
    if sequence_parallel:
        sizes["model.seq_len"] = seq_len or cfg.seq_len
    for name, value in sizes.items():
        check_tp_divides(tp, name, value)


def styles(sequence_parallel: bool, loss_parallel: bool) -> dict[str, object | None]:
    """torch's ParallelStyle for each role a model's plan may give (largebatch.models.registry.TP_ROLES);
    None where the role needs nothing (a sequence-parallel-only role without sequence parallel)."""
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
        "enter": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                    use_local_output=False),
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=between),
        "norm": SequenceParallel(use_local_output=True) if sequence_parallel else None,
        "gather": ReplicateParallel(input_layout=Shard(1)) if sequence_parallel else None,
        "output": ColwiseParallel(input_layouts=between, **logits),
        "output_whole": ColwiseParallel(**logits),
    }


def model_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool = False) -> dict[str, object]:
    """The model kind's plan (its ``tp_plan``: module name -> role) as torch's styles, ``blocks.*.``
    expanded to the blocks this rank holds and the modules it does not hold (pipeline) left out."""
    by_role = styles(sequence_parallel, loss_parallel)
    plan: dict[str, object] = {}
    for name, role in model_spec(model.config.kind).tp_plan(model).items():
        if role not in by_role:
            raise ValueError(f"model.kind = {model.config.kind!r}: its tensor-parallel plan gives "
                             f"{name!r} the role {role!r}; use one of {', '.join(by_role)}")
        names = ([name.replace("*", str(i), 1) for i in range(len(model.blocks))]
                 if name.startswith("blocks.*.") else [name])
        plan.update({n: by_role[role] for n in names if by_role[role] is not None and _holds(model, n)})
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool,
                          loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a registered model kind) over ``tp_mesh`` in place, by the plan its kind
    declares; keeps ties (an output projection sharing the token embedding's weight).

    loss_parallel: the logits stay split over the vocabulary (a DTensor) and the cross-entropy is
    computed on the shards; forward AND backward must then run inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (``ParallelState.loss_context()``). The
    returned loss is a plain tensor either way.
    """
    check_divisible(model, tp_mesh.size(), sequence_parallel)
    plan = model_plan(model, sequence_parallel, loss_parallel)
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

    local = logits.to_local()
    mesh = logits.device_mesh
    value, index = local.max(-1)  # the first maximum on this rank's slice
    index = index + mesh.get_local_rank() * local.shape[-1]  # tp divides the vocabulary: equal slices
    group, tp = mesh.get_group(), mesh.size()
    values, indices = [torch.empty_like(value) for _ in range(tp)], [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    best = torch.stack(values).argmax(0, keepdim=True)  # the first rank holding the maximum: lowest id
    return torch.stack(indices).gather(0, best).squeeze(0)
