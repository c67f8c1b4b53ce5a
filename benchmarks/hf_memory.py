"""What transformers' eager GPT-2 and BERT layers keep for backward, against the closed form of
Korthikanti et al. 2022 (docs/papers.md: memory) that largebatch's own layers follow.

Per layer = (3-layer model - 1-layer model) / 2 of the bytes the forward pass leaves for backward
(largebatch.memory.measure_forward_bytes), so embeddings and the output layer cancel. Tiny real
GPT2LMHeadModel / BertForMaskedLM built from configs (attn_implementation="eager", dropout 0.1,
training mode), on CPU. "dropout" is F.dropout as transformers calls it (on CPU: a mask in the
activation dtype) or torch.native_dropout (a bool mask, what F.dropout keeps on CUDA).
--tensors lists every tensor the autograd graph of a 1-layer model holds, in units of s b h bytes.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/hf_memory.py [--tensors]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from largebatch.memory import activation_bytes_per_layer, hf_eager_bytes_per_layer, measure_forward_bytes

# (model, s, b, h, a, dtype)
SHAPES = [("gpt2", 128, 4, 128, 4, torch.float32), ("gpt2", 64, 4, 256, 8, torch.float32),
          ("gpt2", 256, 2, 64, 2, torch.float32), ("gpt2", 128, 4, 128, 4, torch.bfloat16),
          ("bert", 128, 4, 128, 4, torch.float32), ("bert", 64, 4, 256, 8, torch.float32),
          ("bert", 128, 4, 128, 4, torch.bfloat16), ("roberta", 128, 4, 128, 4, torch.float32)]


def hf_config(kind: str, n_layer: int, s: int, h: int, a: int, dropout: float = 0.1):
    import transformers
    if kind.startswith("gpt2"):  # "gpt2-pytorch-tanh": torch's one-kernel tanh GeLU for gelu_new
        act = "gelu_pytorch_tanh" if kind == "gpt2-pytorch-tanh" else "gelu_new"
        return transformers.GPT2Config(vocab_size=64, n_positions=s, n_embd=h, n_layer=n_layer,
                                       n_head=a, attn_pdrop=dropout, resid_pdrop=dropout,
                                       embd_pdrop=dropout, activation_function=act,
                                       bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    if kind == "roberta":  # positions from pad_token_id + 1 = 2: two more rows for s positions
        return transformers.RobertaConfig(vocab_size=64, hidden_size=h, num_hidden_layers=n_layer,
                                          num_attention_heads=a, intermediate_size=4 * h,
                                          max_position_embeddings=s + 2, pad_token_id=1,
                                          hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                          attn_implementation="eager")
    return transformers.BertConfig(vocab_size=64, hidden_size=h, num_hidden_layers=n_layer,
                                   num_attention_heads=a, intermediate_size=4 * h,
                                   max_position_embeddings=s, hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout, attn_implementation="eager")


def hf_model_and_loss(kind: str, n_layer: int, s: int, b: int, h: int, a: int, dtype=torch.float32):
    """A tiny transformers model in training mode and a closure computing its loss."""
    import transformers
    config = hf_config(kind, n_layer, s, h, a)
    ids = torch.randint(0, 64, (b, s))
    if kind.startswith("gpt2"):
        model = transformers.GPT2LMHeadModel(config).to(dtype).train()
        return model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss
    masked_lm = transformers.RobertaForMaskedLM if kind == "roberta" else transformers.BertForMaskedLM
    model = masked_lm(config).to(dtype).train()
    return model, lambda: model(input_ids=ids, labels=ids).loss


@contextlib.contextmanager
def bool_mask_dropout():
    """F.dropout replaced by torch.native_dropout, whose mask is bool (what CUDA's F.dropout keeps)."""
    original = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def measured_per_layer(kind: str, s: int, b: int, h: int, a: int, dtype=torch.float32) -> tuple[float, float]:
    """(tensor bytes, allocator bytes) one layer leaves for backward: (3 layers - 1 layer) / 2."""
    held = {}
    for n_layer in (1, 3):
        _, loss = hf_model_and_loss(kind, n_layer, s, b, h, a, dtype)
        measure_forward_bytes(loss)  # warm-up: one-time dispatch caches are not activations
        _, held[n_layer] = measure_forward_bytes(loss)
    alloc = None if held[1].allocator_bytes is None else \
        (held[3].allocator_bytes - held[1].allocator_bytes) / 2
    return (held[3].tensor_bytes - held[1].tensor_bytes) / 2, alloc


def saved_tensors(kind: str, s: int, b: int, h: int, a: int) -> list[tuple[float, str, str]]:
    """Every distinct storage the autograd graph of a 1-layer model saves (parameters excluded):
    (bytes / (s b h), shape and dtype, the backward nodes that hold it)."""
    model, loss = hf_model_and_loss(kind, 1, s, b, h, a)
    out = loss()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: dict[int, tuple[int, str, set]] = {}
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:
                continue
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.numel():
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in params:
                        entry = found.setdefault(storage.data_ptr(), (
                            storage.nbytes(), f"{tuple(t.shape)} {t.dtype}", set()))
                        entry[2].add(f"{node.name()}.{attr[len('_saved_'):]}")
        stack += [f for f, _ in node.next_functions]
    return sorted(((n / (s * b * h), what, ", ".join(sorted(users))) for n, what, users in found.values()),
                  reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", action="store_true", help="list the saved tensors of one layer")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tensors:
        for kind in ("gpt2", "bert"):
            print(f"{kind} s=128 b=4 h=128 a=4 fp32, 1 layer + embeddings + head, units of s b h bytes:")
            for units, what, users in saved_tensors(kind, 128, 4, 128, 4):
                if units >= 1:
                    print(f"  {units:6.2f}  {what:34s} {users}")
        return
    print("model  s    b  h    a   dtype     dropout mask   measured MiB  closed form MiB  "
          "measured/closed  HF terms MiB  measured/HF terms")
    for bool_mask in (False, True):
        for kind, s, b, h, a, dtype in SHAPES:
            d = dtype.itemsize
            with bool_mask_dropout() if bool_mask else contextlib.nullcontext():
                tensors, _ = measured_per_layer(kind, s, b, h, a, dtype)
            closed = activation_bytes_per_layer(s, b, h, a, dtype_bytes=d)
            terms = hf_eager_bytes_per_layer(hf_config(kind, 1, s, h, a).to_dict(), b, dtype_bytes=d,
                                             device="cuda" if bool_mask else "cpu")
            mask = "bool (native)" if bool_mask else f"{d}-byte (F.)"
            print(f"{kind:6s} {s:<4d} {b:<2d} {h:<4d} {a:<3d} {str(dtype)[6:]:9s} {mask:14s} "
                  f"{tensors / 2**20:12.3f}  {closed / 2**20:15.3f}  {tensors / closed:15.3f}  "
                  f"{terms / 2**20:12.3f}  {tensors / terms:17.4f}", flush=True)


if __name__ == "__main__":
    main()
