"""The OpenAI-compatible server behind `ds2 serve`, without the click command (cli/serve.py, as
every command's click side lives in cli/). Imports generation, text, model and the base modules; tool
calls sit here because only requests declare them.

Bottom-up:
    tools                tool calls in DeepSeek's syntax: declarations, template, forced calls, parsing
    request_fields       a request's fields beside its prompts, checked: sampling, limits, stops, grammar
    jobs                 a request's prompts read and tokenized, its choices made into jobs (one per choice)
    metrics              the counters of GET /metrics, in Prometheus' text format
    prompt_disk          the pool's second tier on disk (--prompt-cache-dir)
    prompt_cache         the pool of latent caches of recent conversations
    scheduler            up to --parallel requests in each pass, the queue, the prompt cache
    responses            OpenAI's response objects: choices, logprobs, tool calls, usage
    infill               llama-server's /infill: its fields into a fill's job, its answer's shape
    tokenizer_endpoints  /tokenize, /detokenize and /tokenizer_info
    http_io              bodies read within their limit and checked; JSON, errors and server-sent events written
    endpoints            one method an endpoint: the chat page, /health, /metrics, models, tokenizer,
                         completions, /infill
    http_server          the state, the server and the request path: routing, keys, CORS, errors, the log
"""
