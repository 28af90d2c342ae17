"""Text <-> token ids: the tokenizer and its incremental detokenizer (torch-free)."""
