"""Rotary position embedding as the original DeepSeek-V2 code computes it: plain RoPE or YaRN,
with the original's pair layout. Small pure functions; tables depend on the config only."""

from __future__ import annotations

import math

import numpy as np

from ds2cli.model.config import DeepseekV2Config

# The original DeepseekV2YarnRotaryEmbedding's defaults for keys a rope_scaling may omit.
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 1, "mscale_all_dim": 0}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                               max_pos: int) -> tuple[int, int]:
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_pos))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_pos))
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp_mask(low: float, high: float, dim: int) -> np.ndarray:
    if low == high:
        high += 0.001  # the original's guard against a zero-width ramp
    ramp = (np.arange(dim, dtype=np.float32) - low) / (high - low)
    return np.clip(ramp, 0, 1).astype(np.float32)                     # (dim,)


def base_inv_freq(dim: int, base: float) -> np.ndarray:
    # float32 throughout, as the original computes it in torch
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(base), exponent)).astype(np.float32)  # (dim/2,)


def yarn_inv_freq(dim: int, base: float, rs: dict) -> np.ndarray:
    """Inverse frequencies blended between interpolated (/factor) and extrapolated."""
    p = {**YARN_DEFAULTS, **rs}
    pos = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    freq_extra = (np.float32(1.0) / pos).astype(np.float32)
    freq_inter = (np.float32(1.0) / (np.float32(p["factor"]) * pos)).astype(np.float32)
    low, high = yarn_find_correction_range(p["beta_fast"], p["beta_slow"], dim, base,
                                           p["original_max_position_embeddings"])
    inv_freq_mask = np.float32(1.0) - yarn_linear_ramp_mask(low, high, dim // 2)
    return (freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask).astype(np.float32)


def cos_sin_scale(rs: dict | None, v3: bool = False) -> float:
    """YaRN multiplies cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim).

    The DeepSeek-V3 family's reference (transformers' DeepseekV3, generic YaRN) agrees when both
    are given and non-zero, as in every published V3 config; otherwise it takes an explicit
    attention_factor, or else mscale(factor) alone."""
    if rs is None:
        return 1.0
    if v3 and rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if v3 and not (rs.get("mscale") and rs.get("mscale_all_dim")):
        return yarn_get_mscale(rs["factor"])
    p = {**YARN_DEFAULTS, **rs}
    return yarn_get_mscale(p["factor"], p["mscale"]) / yarn_get_mscale(p["factor"], p["mscale_all_dim"])


def softmax_scale(cfg: DeepseekV2Config) -> float:
    """q_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (when mscale_all_dim != 0)."""
    scale = cfg.q_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.get("mscale_all_dim", 0):
        m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
        scale = scale * m * m
    return scale


def inv_freq(cfg: DeepseekV2Config) -> np.ndarray:
    if cfg.rope_scaling is None:
        return base_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)


def cos_sin(positions: np.ndarray, inv_freq: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables for the given absolute positions, (T, R) each, float32."""
    freqs = np.outer(positions.astype(np.float32), inv_freq)               # (T, R/2)
    emb = np.concatenate([freqs, freqs], axis=-1)                          # (T, R)
    s = np.float32(scale)
    return (np.cos(emb) * s).astype(np.float32), (np.sin(emb) * s).astype(np.float32)


def deinterleave_rows(n: int) -> np.ndarray:
    """Row order that turns interleaved pairs (x0,x1,x2,x3..) into (x0,x2,..,x1,x3,..).

    The original code applies exactly this permutation to q_pe and k_pe (view(d/2, 2).transpose)
    before rotate_half. Applying it to the weight rows once at load gives the same vectors with
    no per-token reshuffle."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def rope_rows(cfg: DeepseekV2Config) -> np.ndarray:
    """Where load puts the stored q_pe/k_pe rows: de-interleaved for the original's pair layout
    (every V2 checkpoint; V3 unless its config says rope_interleave: false, in which case the
    rows are already in rotate_half order)."""
    R = cfg.qk_rope_head_dim
    return deinterleave_rows(R) if cfg.rope_interleave else np.arange(R)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_half RoPE on de-interleaved x (..., T, R) or (T, ..., R) with cos/sin broadcast."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
