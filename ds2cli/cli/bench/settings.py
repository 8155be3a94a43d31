"""What a run asks for, held against the model before anything is loaded: the token counts
against max_position_embeddings, the largest cache they need, and BenchError for what cannot run."""

from __future__ import annotations

from ds2cli.model.config import DeepseekV2Config
from ds2cli.errors import Ds2Error


class BenchError(Ds2Error):
    """The benchmark cannot run as asked (disk, memory, or option values the model cannot take)."""


def cache_tokens(prompt_lengths: list[int], contexts: list[int], steps: int) -> int:
    """The largest cache the run allocates."""
    return max(max(contexts) + steps, max(prompt_lengths))


def check_settings(cfg: DeepseekV2Config, prompt_lengths: list[int], contexts: list[int], steps: int) -> None:
    limit = cfg.max_position_embeddings
    if max(prompt_lengths) > limit:
        raise BenchError(f"--prompt-lengths {max(prompt_lengths)} is longer than the model's "
                         f"max_position_embeddings ({limit})")
    if max(contexts) + steps > limit:
        raise BenchError(f"--contexts {max(contexts)} plus --decode-steps {steps} go past the model's "
                         f"max_position_embeddings ({limit})")


def clip_counts(counts: list[int], most: int) -> list[int]:
    """Every count cut to `most`, each once: [128, 1024, 4096] to 1008 -> [128, 1008]. A count
    that fits stays; the longest that fits replaces those that do not, so a run still measures
    the model's longest context. Counts left alone when not even one token fits."""
    return counts if most < 1 else sorted({min(c, most) for c in counts})
