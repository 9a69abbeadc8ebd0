"""Byte-level text data shared by the demo, the examples and the benchmarks."""
from .text import (DEFAULT_MAX_BYTES, PINNED_BYTES, PINNED_CORPUS, PINNED_SHA256, CorpusMismatchError, TextDataset,
                   cache_dir, files_dataset, load_dataset, pinned_dataset, pinned_files, stdlib_dataset, stdlib_files,
                   token_file_dataset)

__all__ = ["DEFAULT_MAX_BYTES", "PINNED_BYTES", "PINNED_CORPUS", "PINNED_SHA256", "CorpusMismatchError", "TextDataset",
           "cache_dir", "files_dataset", "load_dataset", "pinned_dataset", "pinned_files", "stdlib_dataset",
           "stdlib_files", "token_file_dataset"]
