"""largebatch.data: real corpora, byte-level BPE, packing, BERT masking, the index-keyed sampler.

    from largebatch.data import DataConfig, build_data
    data = build_data(DataConfig(corpus="shakespeare"), seq_len=256, objective="causal")
    batch = data.train.get_batch(range(position, position + batch_size))  # global indices

Modules: ``config`` (DataConfig), ``corpus`` (documents, split by document), ``tokenizer``
(byte-level BPE), ``dataset`` (packing, get_batch), ``masking`` (Devlin et al. 2019, Sec. 3.1),
``sampler`` (order as a function of the global sample index; data-parallel shares), ``build``
(build_data and the on-disk cache). See docs/data.md.
"""

from .build import Data, DataStats, build_data
from .config import DataConfig
from .corpus import (
                     CorpusError,
                     Document,
                     DocumentSource,
                     bible_documents,
                     iter_documents,
                     load_documents,
                     load_token_array,
                     shakespeare_documents,
                     split_documents,
                     strip_gutenberg_boilerplate,
)
from .dataset import BERTDataset, GPTDataset, MixtureDataset, PackedDataset
from .masking import IGNORE_INDEX, mask_tokens
from .sampler import MixtureSampler, Sampler, mixture_counts, shard_indices, step_indices
from .tokenizer import SPECIAL_TOKENS, TOKENIZER_VERSION, train_tokenizer

__all__ = [
    "BERTDataset", "CorpusError", "Data", "DataConfig", "DataStats", "Document", "DocumentSource", "GPTDataset",
    "IGNORE_INDEX", "MixtureDataset", "MixtureSampler", "PackedDataset", "SPECIAL_TOKENS", "Sampler",
    "TOKENIZER_VERSION", "bible_documents", "build_data", "iter_documents", "load_documents", "load_token_array",
    "mask_tokens", "mixture_counts", "shakespeare_documents", "shard_indices", "split_documents", "step_indices",
    "strip_gutenberg_boilerplate", "train_tokenizer",
]
