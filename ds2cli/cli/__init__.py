"""The terminal: the `ds2` click group and what only a command line needs (options, the chat loop,
inspect's report and tables, progress, bench). Top of the house: may import every package below,
and nothing imports it but __main__.

Bottom-up:
    console         stderr and stdout helpers, the progress bar
    cores_used      the cores a measurement was given and kept busy (bench, --stats)
    options         the options commands share, one validation, model loading
    inspect_report  what `ds2 inspect` reports on a checkpoint, as data
    inspect_gguf    the same report for a GGUF file
    inspect_tables  inspect's report as rich tables
    chat_loop       `ds2 chat`'s terminal loop and line editor (over generation.conversation)
    saved_state     --session and --prompt-cache: checked first, held, saved however the chat ends
    generate_run    `ds2 generate` below its options: the prompt into ids, the run streamed or as --json
    serve           `ds2 serve`: options, loading, listening, the graceful stop
    bench/          `ds2 bench` (its __init__ lists its modules)
    main            the click group and commands: parse, call, render
"""
