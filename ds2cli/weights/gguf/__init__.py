"""GGUF files (llama.cpp, ollama) as a checkpoint the loader takes: every count checked against the
file before it is used. Imports weights' checkpoint and qcheckpoint, text's tokenizer, model's config.

Bottom-up:
    file        the header: metadata and tensor infos, validated against the file's size
    config      GGUF metadata -> a DeepseekV2Config
    tensors     GGUF tensors under Hugging Face names, stacked experts split
    experts     the stacked routed experts read an expert at a time (--memory-budget), Q8_0 as q8b
    tokenizer   the vocabulary and merges in the metadata -> a Tokenizer
    checkpoint  a GGUF model as the loader takes it: config, tensors, tokenizer, target format
"""
