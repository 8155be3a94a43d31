"""ds2: DeepSeek-V2 family language models on a CPU, in pure NumPy.

The packages are the layers, bottom-up; each imports only those before it in this list:
    errors, wording, user_files, json_files   modules every layer may use (error types, words,
                 a user's files read within limits and written atomically, untrusted JSON)
    model        the math: config, RoPE, latent cache, MLA attention, MoE, the decoder block,
                 passes, and the executor interface it asks for work (run on the calling thread)
    text         tokenizers and chat templates
    weights      checkpoints (safetensors, low-bit, GGUF, hub ids), formats and kernels, the loader
    cluster      a Ray cluster joined and its nodes probed, the placement of a model on them
    execution    how a model runs: compute, experts and passes parts composed into its executor,
                 the machine (cores, BLAS, helper processes), the options' factory, ds2cli.load
    generation   sampling, drafts, grammars, the generation loop, logprobs, a conversation
    server       the OpenAI-compatible server (`ds2 serve` without its click command)
    cli          the `ds2` command line: every command's click side, chat's loop, inspect, bench
docs/internals.md draws the same map, one line a module.

The public names are imported when first used (PEP 562), so that `import ds2cli` costs nothing
and the `ds2` command can handle a Ctrl-C from its first line on (__main__.py)."""

import importlib

__version__ = "0.1.0"

_PUBLIC = {"load": "ds2cli.execution.factory", "Model": "ds2cli.model.transformer", "LatentCache": "ds2cli.model.cache",
           "DeepseekV2Config": "ds2cli.model.config", "Ds2Error": "ds2cli.errors", "ConfigError": "ds2cli.errors",
           "CheckpointError": "ds2cli.errors", "TokenizerError": "ds2cli.errors",
           "ContextFullError": "ds2cli.errors", "GenerationError": "ds2cli.errors"}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    try:   # a submodule, as `import ds2cli; ds2cli.weights.loader` finds it once imported anywhere
        return importlib.import_module(f"ds2cli.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'ds2cli' has no attribute {name!r}") from None


def __dir__():
    return sorted([*globals(), *_PUBLIC])
