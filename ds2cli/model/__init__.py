"""The math: DeepSeek-V2/V3 as NumPy functions over a latent cache, free of file formats, tokenizers
and processes. Imports parallel.cores (its only execution interface) and the modules below the
packages (errors, json_files); `linear` is the one interface every weight format meets.

Bottom-up:
    config       config.json as a frozen, validated dataclass, Hugging Face field names
    rope         RoPE, YaRN and mscale: small pure functions
    cache        the two-slot latent cache (latent, k_pe), written in place
    linear       Dense and as_weight: a weight you can multiply by, whatever its format; Heads
                 and AbsorbedQuery, attention's per-head products; matmul_all: independent
                 products asked for together
    attention    MLA over the latent cache: absorbed and expanded forms, spans of a batch
    moe          the router (softmax top-k, group-limited, V3's noaux_tc) and the experts that got tokens
    transformer  Model: embed -> blocks -> norm -> lm_head, one code path for B sequences
"""
