"""Text: ids and text, both ways, and chat prompts. Stands apart from the math (the model takes ids)
and imports only the modules below the packages (errors, json_files).

Bottom-up:
    tiktoken_convert  Moonlight's / Kimi's tiktoken.model as the same byte-level BPE, cached
    chat_template     Jinja chat templates in a sandbox, with a budget on steps and sizes
    reasoning         <think>...</think> kept apart from the answer: the prompt's state, the streaming split
    literal           what users write stays text: their special-token text hidden through a render, its spans kept
    tokenizer         tokenizer.json -> ids, chat prompts, the streaming detokenizer
    fim               fill-in-the-middle: the FIM tokens found in a tokenizer, the prompt's layout
"""
