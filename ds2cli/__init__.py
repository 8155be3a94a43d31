"""ds2: DeepSeek-V2 family language models on a CPU, in pure NumPy."""

__version__ = "0.1.0"

from ds2cli.cache import LatentCache  # noqa: E402
from ds2cli.config import DeepseekV2Config  # noqa: E402
from ds2cli.errors import (CheckpointError, ConfigError, ContextFullError, Ds2Error,  # noqa: E402
                           GenerationError, TokenizerError)
from ds2cli.loader import load  # noqa: E402
from ds2cli.model import Model  # noqa: E402

__all__ = ["load", "Model", "LatentCache", "DeepseekV2Config", "Ds2Error", "ConfigError",
           "CheckpointError", "TokenizerError", "ContextFullError", "GenerationError", "__version__"]
