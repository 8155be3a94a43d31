"""Generation: from a Model and a prompt to tokens and text, for the server and the terminal alike.
Imports model, text and weights (a saved cache names its model by weights.fingerprint). Grammar and
logprobs live here, not in server/, because they shape or score what the sampler picks, whoever
asks; a conversation over one cache is generation's too.

Bottom-up:
    sampling      samplers (temperature, top-k/p, min-p, penalties), speculative acceptance
    draft         draft sources (prompt lookup) and the adaptive draft length
    grammar       constrained output: JSON, JSON Schema, Lark grammars and per-sequence token masks
    generate      the generation loop, plain and speculative, as a generator of chunks
    logprobs      token log-probabilities (raw log-softmax, top-N) and their OpenAI shapes
    saved_cache   a latent cache on disk with its tokens (--session, --prompt-cache), checked on load
    conversation  a conversation over one cache (ChatSession), its transcript and session on disk
"""
