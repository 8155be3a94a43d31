"""The math: DeepSeek-V2/V3 as NumPy functions over a latent cache, free of file formats, tokenizers,
processes and machines. Imports only the modules below the packages (errors, json_files):
`linear` is the one interface every weight format meets, `executor` the one every way of
running the math meets (the reference here; ds2cli/execution composes the others).

Bottom-up:
    config       config.json as a frozen, validated dataclass, Hugging Face field names
    rope         RoPE, YaRN and mscale: small pure functions
    cache        the two-slot latent cache (latent, k_pe), written in place
    linear       the weight interface (Rows: a product in row spans), Heads (attention's per-head
                 stacks), float32 widening, the kernels' scratch buffers
    layers       a decoder layer's weights as typed objects, Hugging Face names as fields
    attention    MLA over the latent cache: absorbed and expanded forms, spans of a batch
    moe          the router (softmax top-k, group-limited, V3's noaux_tc), the gate, the mixture
    executor     what the math asks of whatever runs it, and the reference that runs it in order
    passes       a pass (Pass, Step), its checks, and the memory chunk every caller is cut into
    block        a decoder block (attention, then MoE or MLP), and a range of them over a pass
    transformer  Model: config, weights and the pass; embed -> blocks -> norm -> lm_head
"""
