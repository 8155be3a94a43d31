"""ds2's error types: each carries one human-readable line that the CLI prints as is."""


class Ds2Error(Exception):
    """Base of every error ds2 raises on purpose. The CLI prints `error: <message>` and exits 1."""


class ConfigError(Ds2Error):
    """config.json is missing, unreadable, or describes something ds2 cannot run."""


class CheckpointError(Ds2Error):
    """The weights are missing, malformed, or disagree with the config."""


class TokenizerError(Ds2Error):
    """tokenizer.json / tokenizer_config.json is missing or unusable, or a chat template failed."""


class ContextFullError(Ds2Error):
    """A write would go past the latent cache's capacity."""


class GenerationError(Ds2Error):
    """Generation cannot continue (for example the model produced non-finite logits)."""


class UnavailableError(Ds2Error):
    """What the model runs on is gone (a node of a cluster was lost): the request cannot be
    served now; the server answers 503 and /health says degraded."""
