"""ds2: DeepSeek-V2 family language models on a CPU, in pure NumPy.

The public names are imported when first used (PEP 562), so that `import ds2cli` costs nothing
and the `ds2` command can handle a Ctrl-C from its first line on (__main__.py)."""

import importlib

__version__ = "0.1.0"

_PUBLIC = {"load": "ds2cli.loader", "Model": "ds2cli.model", "LatentCache": "ds2cli.cache",
           "DeepseekV2Config": "ds2cli.config", "Ds2Error": "ds2cli.errors", "ConfigError": "ds2cli.errors",
           "CheckpointError": "ds2cli.errors", "TokenizerError": "ds2cli.errors",
           "ContextFullError": "ds2cli.errors", "GenerationError": "ds2cli.errors"}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    try:   # a submodule, as `import ds2cli; ds2cli.loader` finds it once imported anywhere
        return importlib.import_module(f"ds2cli.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'ds2cli' has no attribute {name!r}") from None


def __dir__():
    return sorted([*globals(), *_PUBLIC])
