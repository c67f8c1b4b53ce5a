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
    sizes = {"n_head": cfg.n_head, "ffn (MLP width)": cfg.ffn, "vocab_size": cfg.vocab_size}
    if sequence_parallel:
        sizes["seq_len"] = seq_len or cfg.seq_len
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide model {name} = {value}: choose tp among "
                             f"the divisors of {value}, or resize the model (e.g. pad the vocabulary)")


def block_plan(sequence_parallel: bool) -> dict[str, object]:
    """The plan of one transformer block (module names of largebatch.models.layers.Block)."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    # One DTensor input per sub-layer: q, k and v (or fc1) share it, so their partial input
    # gradients are summed locally and reduced ONCE when leaving the region (f in Megatron).
    enter = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                               use_local_output=False)
    plan: dict[str, object] = {
        "attn": enter,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),
        "mlp": enter,
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan["ln1"] = SequenceParallel(use_local_output=True)
        plan["ln2"] = SequenceParallel(use_local_output=True)
    return plan


def _head_plan(model: nn.Module, sequence_parallel: bool,
               loss_parallel: bool) -> tuple[dict[str, object], list[str]]:
    """Plan of the embedding and the output layer; also the module names whose weight is tied."""
    # logits: all-gathered over the vocabulary, or left split for the vocabulary-parallel loss
    logits = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else \
        dict(output_layouts=Replicate())
    plan: dict[str, object] = {
        # vocabulary-parallel embedding: rows = tokens; the partial lookups are all-reduced
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    if sequence_parallel:  # split the sequence where the residual stream starts: a local slice
        plan["drop"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                          use_local_output=True)
    between = Shard(1) if sequence_parallel else Replicate()
    output = model.tp_output  # the model names its output projection
    if not model.tp_head_whole_sequence:  # GPT: final norm in the sequence-parallel region
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel(use_local_output=True)
        plan[output] = ColwiseParallel(input_layouts=between, **logits)
        return plan, [output]
    # BERT: the head picks the masked positions (x[mask]), so it runs on the whole sequence
    if sequence_parallel:
        plan["ln_f"] = ReplicateParallel(input_layout=Shard(1))
    plan[output] = ColwiseParallel(**logits)
    return plan, [output]


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool,
                          loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (GPT or BERT of largebatch.models) over ``tp_mesh`` in place; keeps ties.

    loss_parallel: the logits stay split over the vocabulary (a DTensor) and the cross-entropy is
    computed on the shards; forward AND backward must then run inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (``ParallelState.loss_context()``). The
    returned loss is a plain tensor either way.
    """
    check_divisible(model, tp_mesh.size(), sequence_parallel)
    plan, head_names = _head_plan(model, sequence_parallel, loss_parallel)
    # a pipeline stage holds only some of the modules (the others are None)
    plan = {name: style for name, style in plan.items() if _holds(model, name)}
    tied = [name for name in head_names if _holds(model, name) and model.tok_emb is not None
            and model.get_submodule(name).weight is model.tok_emb.weight]
    parallelize_module(model, tp_mesh, plan)
    for block in model.blocks:
        if block is not None:
            parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    for name in tied:  # both were sharded Shard(0) over the vocabulary: share one DTensor again
        model.get_submodule(name).weight = model.tok_emb.weight
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
