"""Training data: tokenization into Megatron indexed files (`preprocess`), packed / blended / shuffled /
distributed streams, HF datasets streams, SFT chat data, the collator, the stdlib corpus and the
quickstart's stories.

Names load on first access, so importing this package imports neither `datasets` nor `pyarrow`.
"""

from ..utils.lazy import lazy_exports

_LAZY = {
    "DLMDataCollator": ".collator",
    "build_pretraining_dataset": ".streams", "PackedDataset": ".streams", "BlendedDataset": ".streams",
    "ShuffledSamples": ".streams", "DistributedSampleStream": ".streams", "packed_position_ids": ".streams",
    "data_parallel_rank_and_world": ".streams",
    "IndexedDataset": ".indexed_dataset", "IndexedDatasetWriter": ".indexed_dataset",
    "HFPackedStream": ".hf_stream", "HFRowStream": ".hf_stream",
    "SFTDataset": ".sft_data", "SFTDataConfig": ".sft_data", "tokenize_conversation": ".sft_data",
    "TokenWindowDataset": ".memory_dataset", "pack_documents": ".memory_dataset",
    "PreprocessConfig": ".preprocess", "PreprocessError": ".preprocess",  # `preprocess` is the module itself
    "stdlib_documents": ".corpus", "split_documents": ".corpus", "train_bpe_tokenizer": ".corpus",
    "train_word_tokenizer": ".corpus", "simple_stories": ".simple_english",
    "register_data_builder": ".builders", "build_data": ".builders", "DATA_BUILDERS": ".builders",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
