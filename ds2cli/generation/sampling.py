"""Samplers: small logit filters composed into one `sample(logits, history) -> token` callable."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ds2cli.errors import Ds2Error

Sampler = Callable[[np.ndarray, Sequence[int]], int]


class SamplingError(Ds2Error):
    """A sampling value out of range: `field` is its SamplingParams name, `rule` what it must be."""

    def __init__(self, field: str, label: str, rule: str):
        super().__init__(f"{label} {rule}")
        self.field, self.rule = field, rule


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    min_p: float = 0.0        # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, value) pairs added to the logits first

    def __post_init__(self):
        checks = [("temperature", "temperature", self.temperature >= 0, "must be >= 0"),
                  ("top_k", "top-k", self.top_k >= 0, "must be >= 0"),
                  ("top_p", "top-p", 0 < self.top_p <= 1, "must be in (0, 1]"),
                  ("min_p", "min-p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
                  ("repetition_penalty", "repetition penalty", self.repetition_penalty > 0, "must be > 0"),
                  ("seed", "seed", self.seed is None or self.seed >= 0, "must be >= 0")]  # numpy refuses < 0
        for field, label, ok, rule in checks:
            if not ok:
                raise SamplingError(field, label, rule)

    @staticmethod
    def from_generation_config(gen: dict, **overrides) -> "SamplingParams":
        """Defaults from generation_config.json (do_sample false means greedy), then overrides."""
        base = {}
        if gen.get("do_sample") is False:
            base["temperature"] = 0.0
        elif isinstance(gen.get("temperature"), (int, float)):
            base["temperature"] = float(gen["temperature"])
        for key in ("top_k", "top_p", "repetition_penalty"):
            if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
                base[key] = type(getattr(SamplingParams, key))(gen[key])
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**base)


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """OpenAI's logit_bias: each value added to its token's logit (-100 all but bans a token,
    100 all but forces it), before the penalty and the filters."""
    if not bias:
        return logits
    ids, values = zip(*bias)
    logits = logits.copy()
    np.add.at(logits, list(ids), np.asarray(values, dtype=logits.dtype))    # an id given twice adds twice
    return logits


def apply_repetition_penalty(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style, as Hugging Face does it: seen tokens' positive logits /penalty, negative *penalty."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    seen = np.unique(np.asarray(history, dtype=np.int64))
    vals = logits[seen]
    logits = logits.copy()
    logits[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def filter_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= len(logits):
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits)


def filter_top_p(probs: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    cut = int(np.searchsorted(cumulative, p)) + 1                # tokens needed to reach p
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[:cut]] = True
    return np.where(keep, probs, 0.0)


def filter_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    if min_p <= 0:
        return probs
    return np.where(probs >= min_p * probs.max(), probs, 0.0)


def make_sampler(params: SamplingParams, constraint=None) -> "TokenSampler":
    return TokenSampler(params, constraint)


class TokenSampler:
    """`sample(logits, history) -> token` under `params`, and `verify` for a drafted token.

    The distribution is the one the filters leave: the grammar's mask (a `grammar.Constraint`,
    when the output is constrained: disallowed tokens -> -inf), repetition penalty on the logits,
    then temperature, top-k, softmax, top-p and min-p (greedy: the arg max).

    With a constraint, every token this sampler gives is advanced into it: the generation loop
    feeds back exactly the tokens it samples, in order (a verified draft is the token sampled for
    its position), so the grammar's state follows the sequence without being told. A loop that
    advances drafts before verifying them rolls the rejected ones back (Constraint.rollback)."""

    def __init__(self, params: SamplingParams, constraint=None):
        self.params, self.constraint = params, constraint
        self.rng = np.random.default_rng(params.seed)

    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray | int:
        """The token probabilities (V,) float64, or the one token greedy decoding picks."""
        params = self.params
        logits = apply_logit_bias(logits, params.logit_bias)
        if self.constraint is not None:     # before every filter: they see only what the grammar allows
            logits = self.constraint.apply(logits)
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
        if params.temperature == 0:
            return int(np.argmax(logits))
        logits = filter_top_k(logits.astype(np.float64) / params.temperature, params.top_k)
        probs = np.exp(logits - logits.max())
        probs = filter_min_p(filter_top_p(probs / probs.sum(), params.top_p), params.min_p)
        return probs / probs.sum()

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        token = self._draw(logits, history)
        if self.constraint is not None:
            self.constraint.advance(token)
        return token

    def _draw(self, logits: np.ndarray, history: Sequence[int]) -> int:
        p = self.distribution(logits, history)
        if isinstance(p, int):
            return p
        # what rng.choice(len(p), p=p) does, written out: one uniform draw a token
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        return int(cdf.searchsorted(self.rng.random(), side="right"))

    def verify(self, logits: np.ndarray, history: Sequence[int], draft: int) -> tuple[bool, int]:
        """Speculative sampling for a deterministic draft (a point mass on `draft`): the token
        for this position is sampled as __call__ samples it, with the same one draw, and the
        draft is accepted when they agree. So P(accept) = p(draft), and a rejected draft leaves
        a token distributed as p with the draft removed and renormalised: the standard rule for
        such a draft. And since every position takes exactly one draw, drafted or not, the
        output is the very one plain sampling gives with the same seed, however many drafts
        were made or taken. Greedy: the arg max, accepted when it is the draft."""
        token = self(logits, history)
        return token == draft, token


class CountingSampler:
    """A sampler that counts the tokens it gives (sampled, or drafts verified): what ran, for a
    generation that is interrupted before its last chunk."""

    def __init__(self, sampler: TokenSampler):
        self.sampler, self.count = sampler, 0

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        token = self.sampler(logits, history)
        self.count += 1
        return token

    def verify(self, logits: np.ndarray, history: Sequence[int], draft: int) -> tuple[bool, int]:
        result = self.sampler.verify(logits, history, draft)
        self.count += 1
        return result
