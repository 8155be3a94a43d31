"""Weights: every file a model arrives in (safetensors, ds2's low-bit checkpoints, GGUF, a Hugging
Face id), the low-bit formats and their kernels, and the loader that turns them into a Model.
Imports model, text (a checkpoint carries its tokenizer), parallel (the loader hands a Model its
default executor) and the base modules. GGUF sits
inside, as `gguf/`, because its tensors become the same weights and the loader opens both kinds.

Bottom-up:
    downloads    a download in a child process: its bytes metered (an idle bound), Ctrl-C ends it at once
    hub          Hugging Face ids to local snapshots
    checkpoint   safetensors shards: headers, validation, tensors
    checksums    each tensor's checksum (a routed expert's each): recorded by quantize, checked by --verify
    formats/     one class a weight format (float32, bf16, q8, q8b, q4), each with its kernels
    scales       a float weight into a format: round to nearest and the scale search
    calibration  activation statistics for the scale search (GPTQ-style compensation)
    qcheckpoint  ds2's low-bit checkpoint layout: recipes, validation, memory-mapped loading
    memory       what a model needs, the memory check
    expert_cache routed experts' slots filled from disk (O_DIRECT), read outside the lock
    streaming    a memory budget: the resident part, the expert cache, reads ahead of need
    staging      directories built beside their target and renamed when complete
    fingerprint  what a model is (config, headers, sizes, load form), for files that belong to it
    gguf/        GGUF files: header, config, tensors, tokenizer, the checkpoint the loader takes
    source       a model opened once: what a path names, its config, recipe, tokenizer, headers
    loader       a checkpoint (or GGUF) into a Model: checks, memory check, weights, absorption
    quantize     the streaming quantizer behind `ds2 quantize` (a library: bench uses it too)
"""
