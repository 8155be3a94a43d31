"""What the tests share that is not a test: a GGUF writer, a fake Hugging Face Hub, JSON schemas,
the docs' JSON checker, the tokenizer fixtures' makers and the local Ray cluster
(`from support.gguf_writer import write_gguf`)."""
