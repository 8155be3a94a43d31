"""Calibration: what each projection is multiplied by, measured on a text, and GPTQ's use of it.

`ds2 quantize --calibration FILE` runs the *float* model over the text one decoder layer at a
time (the layer is loaded, run over every chunk of the text, measured, quantized, written and
freed before the next, so memory stays at one float32 layer plus the statistics) and gathers,
for every projection W (out, in), the second-moment matrix of its inputs over the tokens it saw,
H = mean over tokens of x x^T (in, in). Each routed expert's comes only from the tokens the gate
sent to it; an expert that saw fewer than MIN_EXPERT_TOKENS takes its layer's, pooled over all
the experts' tokens.

How the statistics act depends on the format (weights/formats/):
  - q8's scale spans a row, across input channels of very different energy, so the row-scale
    search weighs each column's squared error by diag(H) (the error of output o is
    sum_i e_oi x_i, whose mean square is e_o^T H e_o, diag(H)-weighted when the channels are
    uncorrelated);
  - q4's groups are 32 rows of one column, all multiplied by the same input, so a per-column
    weight scales a group's whole error and cannot move its best scale. There the statistics act
    through GPTQ's error compensation (Frantar et al. 2022): quantize the columns in order and
    push each column's rounding error onto the columns not yet quantized, along H^-1, so that
    the product on the calibration inputs, not the weights, stays close; `compensate` below,
    in NumPy, blockwise (a column at a time within blocks of BLOCK columns, one GEMM per block
    for the rest of the matrix), all experts of a stack at once.
The default text (calibration.txt, in the package) is public-domain verse and prose plus a few
chat turns; the quality figures are measured on text the float model samples from other prompts.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

from ds2cli.weights import checkpoint
from ds2cli.weights import formats as quant
from ds2cli.model import rope
from ds2cli.weights import scales
from ds2cli.model.attention import Span, rms_norm
from ds2cli.model.block import block
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.executor import Executor
from ds2cli.model.layers import Layer
from ds2cli.errors import Ds2Error
from ds2cli.weights.formats import Dense

BUILTIN = "builtin"
BUILTIN_TEXT = Path(__file__).resolve().parent / "calibration.txt"
MIN_TOKENS = 256              # fewer say too little about a model's inputs to be worth using
MAX_TOKENS = 16384            # the rest of a longer text is not read
CHUNK_TOKENS = 512            # the text runs as independent sequences of at most this many tokens
MIN_EXPERT_TOKENS = 32        # an expert seen by fewer tokens takes its layer's statistics
# GPTQ's dampening, the fraction of mean(diag(H)) added to H's diagonal: GPTQ's 0.01 is for 128
# sequences of 2048 tokens; with a few thousand tokens 0.3 measured best on held-out text
# (ds2-tiny's experts, output error against searched scales: 0.76 at 0.01, 0.57 at 0.3)
DAMP = 0.3
SHRINK = 4                    # an expert's H counts SHRINK * in tokens of its layer's (Moments.hessian)
BLOCK = 64                    # GPTQ's columns per block
ACT_ORDER = True              # GPTQ's columns in order of decreasing diag(H)


class CalibrationError(Ds2Error):
    """The calibration text is missing, empty, binary or too short."""


# ---- the text ----

def read_text(path: str | Path) -> tuple[str, str, str]:
    """(text, name, sha256) of a calibration file (`builtin`: the package's own)."""
    p = BUILTIN_TEXT if str(path) == BUILTIN else Path(path).expanduser()
    if not p.is_file():
        raise CalibrationError(f"calibration text {p} {'is a directory' if p.is_dir() else 'does not exist'}")
    raw = p.read_bytes()
    if not raw.strip():
        raise CalibrationError(f"calibration text {p} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise CalibrationError(f"calibration text {p} is not UTF-8 text (a binary file?)")
    return text, (BUILTIN if p == BUILTIN_TEXT else p.name), hashlib.sha256(raw).hexdigest()


def chunks(tokenizer, text: str, cfg: DeepseekV2Config) -> list[np.ndarray]:
    ids = np.asarray(tokenizer.encode(text)[:MAX_TOKENS], np.int64)
    if len(ids) < MIN_TOKENS:
        raise CalibrationError(f"the calibration text is {len(ids)} tokens long; it needs at least {MIN_TOKENS}")
    n = min(CHUNK_TOKENS, cfg.max_position_embeddings)
    return [ids[k:k + n] for k in range(0, len(ids), n) if len(ids[k:k + n]) > 1]


# ---- the statistics ----

class Moments:
    """The running sum of x^T x over the rows x fed to one projection (or to each expert of a
    stack) and how many rows that was."""

    def __init__(self, inp: int, experts: int | None):
        self.sum = np.zeros((experts or 1, inp, inp), np.float32)           # (E, in, in)
        self.count = np.zeros(experts or 1, np.int64)                        # (E,)
        self.stacked = experts is not None
        self.lock = threading.Lock()   # moe.py may run experts on two threads

    def add(self, x: np.ndarray, e: int) -> None:
        xtx = x.T @ x                                                        # (in, in)
        with self.lock:
            self.sum[e] += xtx
            self.count[e] += len(x)

    def hessian(self) -> tuple[np.ndarray, np.ndarray]:
        """H = sum / count, (E, in, in) for a stack, (in, in) otherwise, and the tokens behind
        each. An expert's H is its own tokens' moments shrunk toward the layer's (pooled over
        every expert's tokens) as if SHRINK * in of the layer's tokens were added to its own:
        an (in, in) second-moment matrix from a few hundred tokens fits them and not the next
        text (on ds2-tiny, GPTQ on each expert's own H alone made held-out output errors *worse*
        than no calibration in the deeper layers). An expert with fewer than MIN_EXPERT_TOKENS
        takes the layer's H as it is."""
        count = self.count.copy()
        if not self.stacked:
            return self.sum[0] / max(int(count[0]), 1), count
        n = max(int(count.sum()), 1)
        pool = self.sum.sum(axis=0) / n                                      # (in, in)
        k = SHRINK * self.sum.shape[-1]
        h = (self.sum + k * pool) / (count + k)[:, None, None]               # (E, in, in)
        h[count < MIN_EXPERT_TOKENS] = pool
        return h, count


class Recorder:
    """A float weight (formats.Dense) that adds up the second moments of what it multiplies, so
    attention.py and moe.py run unchanged; `w[e]` records into expert e's moments."""

    def __init__(self, dense: Dense, moments: Moments, expert: int = 0):
        self.dense, self.moments, self.expert = dense, moments, expert

    @property
    def shape(self):
        return self.dense.shape

    def __len__(self) -> int:
        return len(self.dense)

    def __getitem__(self, e) -> "Recorder":
        return Recorder(self.dense[e], self.moments, int(e))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        self.moments.add(x, self.expert)
        return self.dense.matmul(x)


def record(layer: Layer) -> dict[tuple[str, str], Moments]:
    """Wrap every projection of a prepared float layer in a Recorder; return their moments."""
    found = {}
    for part, weights in layer.parts():
        for key, w in list(weights.items()):
            if isinstance(w, Dense):
                found[part, key] = Moments(w.shape[-1], w.shape[0] if len(w.shape) > 2 else None)
                weights[key] = Recorder(w, found[part, key])
    return found


def unrecord(layer: Layer) -> None:
    for _, weights in layer.parts():
        for key, w in list(weights.items()):
            if isinstance(w, Recorder):
                weights[key] = w.dense


class Calibration:
    """The text as hidden states, advanced one float layer at a time; with each layer's
    statistics. Built from the float embedding rows of the text's tokens."""

    def __init__(self, tensors: dict, cfg: DeepseekV2Config, tokenizer, text: str, name: str, sha256: str):
        self.cfg, self.name, self.sha256 = cfg, name, sha256
        self.ids = chunks(tokenizer, text, cfg)
        (_, embed), = checkpoint.iter_float32(tensors, ["model.embed_tokens.weight"])
        self.x = [embed[ids] for ids in self.ids]                           # each (T, D)
        del embed
        self.inv_freq = rope.inv_freq(cfg)
        self.rope_scale = rope.cos_sin_scale(cfg.rope_scaling, cfg.is_v3)
        self.softmax_scale = rope.softmax_scale(cfg)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.ids)

    def run_layer(self, layer: Layer) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
        """Run the float layer over every chunk (the hidden states move on to its output) and
        return {(part, key): (H, tokens)} for each of its projections."""
        cfg = self.cfg
        moments = record(layer)
        ex = Executor()          # the calling thread: the recorders see every product in order
        try:
            for k, x in enumerate(self.x):
                T = len(x)
                cos, sin = rope.cos_sin(np.arange(T), self.inv_freq, self.rope_scale)
                latent = np.zeros((T, cfg.kv_lora_rank), np.float32)         # this layer's cache
                k_pe = np.zeros((T, cfg.qk_rope_head_dim), np.float32)
                self.x[k] = block(ex, 0, layer, x, [Span(slice(0, T), latent, k_pe, 0)], cos, sin, cfg,
                                  self.softmax_scale)
        finally:
            unrecord(layer)
        return {key: m.hessian() for key, m in moments.items()}

    def head(self, norm: np.ndarray) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
        """The lm_head's statistics: the final norm of the last layer's output."""
        m = Moments(self.cfg.hidden_size, None)
        for x in self.x:
            m.add(rms_norm(x, norm, self.cfg.rms_norm_eps), 0)
        return {("", "lm_head"): m.hessian()}

    def describe(self) -> dict:
        """What quantization_config records about the calibration."""
        return {"text": self.name, "sha256": self.sha256, "tokens": self.tokens, "chunk_tokens": CHUNK_TOKENS,
                "min_expert_tokens": MIN_EXPERT_TOKENS, "damp": DAMP}


# ---- using them: q8's weighted scale search, GPTQ's compensation ----

def quantize_calibrated(w: np.ndarray, f: quant.Format, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (..., out, in) in format f given the input second moments h (..., in, in): q8 rows
    searched with diag(h) as the column weights, then (like q4) GPTQ-compensated."""
    diag = np.diagonal(h, axis1=-2, axis2=-1)
    if w.ndim == 2:
        return tuple(a[0] for a in quantize_calibrated(w[None], f, h[None]))
    if not ACT_ORDER:
        return compensate(np.array(w, np.float32), f, inverse_factor(h), diag)
    # GPTQ's act-order: the columns of most energy first, while the most columns remain to take
    # their error. It costs nothing here: a q4 group lies in one column, so any column order
    # leaves the groups whole (GPTQ's row groups need a permutation index at run time instead).
    order = np.argsort(-diag, axis=-1, kind="stable")                        # (E, in)
    undo = np.argsort(order, axis=-1)
    wp = np.take_along_axis(w, order[:, None, :], axis=-1)
    hp = np.take_along_axis(np.take_along_axis(h, order[:, :, None], axis=1), order[:, None, :], axis=2)
    u = inverse_factor(hp)
    del hp    # the copies are one layer's experts' size (V2-Lite: 1 GB of H, 1.5 GB of gate_up)
    ints, found = compensate(wp, f, u, np.take_along_axis(diag, order, axis=-1), packed=False)
    ints = np.take_along_axis(ints, undo[:, None, :], axis=-1)
    if f.group_size is None:
        return ints, found
    return pack_q4(ints), np.take_along_axis(found, undo[:, None, :], axis=-1)


def inverse_factor(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor U of (H + damp)^-1 (E, in, in), H^-1 = U^T U, as GPTQ uses it:
    row i of U, over the columns after i, is how column i's error spreads onto them. One expert
    at a time in float64 (a stack of them at once would be 2 GB for V2-Lite's experts)."""
    E, n, _ = h.shape
    u = np.empty((E, n, n), np.float32)
    for e in range(E):
        a = np.array(h[e], np.float64)
        mean = float(np.diagonal(a).mean())
        damp = DAMP * (mean if mean > 0 else 1.0)
        for _ in range(4):   # a rank-deficient H needs more than the usual dampening
            try:
                a[np.arange(n), np.arange(n)] += damp
                u[e] = np.linalg.cholesky(np.linalg.inv(a)).T
                break
            except np.linalg.LinAlgError:
                damp *= 10
        else:
            raise CalibrationError("the calibration statistics are not positive definite even when damped")
    return u


def compensate(work: np.ndarray, f: quant.Format, u: np.ndarray, diag: np.ndarray,
               packed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ over a stack `work` (E, out, in) float32, updated in place, with U (E, in, in) from
    inverse_factor: columns in order, each
    quantized (q4: its groups' scales searched on the column as compensated so far; q8: the row
    scales fixed first, searched on the weights with diag as the column weights) and its error,
    divided by U[i, i], subtracted from the later columns along U[i, i+1:]."""
    E, out, inp = work.shape
    ints = np.empty((E, out, inp), np.int8)                                 # q8: q; q4: q - 8
    if f.group_size is None:
        found = np.stack([scales.quantize(work[e], f, diag[e])[1] for e in range(E)])   # (E, out)
    else:
        g = f.group_size
        G = -(-out // g)
        found = np.empty((E, G, inp), quant.bfloat16_dtype())
    for b0 in range(0, inp, BLOCK):
        b1 = min(inp, b0 + BLOCK)
        block = work[:, :, b0:b1]                                           # (E, out, B), a view
        err = np.empty((E, out, b1 - b0), np.float32)
        for i in range(b1 - b0):
            col = np.ascontiguousarray(block[:, :, i])                       # (E, out)
            if f.group_size is None:
                q = scales.round_clip(col, found, -127, 127)
                deq = q * found
            else:
                q, s = quantize_column(col, g)
                found[:, :, b0 + i] = s
                deq = q * np.repeat(s.astype(np.float32), g, axis=1)[:, :out]
            ints[:, :, b0 + i] = q
            d = u[:, b0 + i, b0 + i]                                         # (E,)
            e_i = (col - deq) / d[:, None]                                   # (E, out)
            err[:, :, i] = e_i
            block[:, :, i + 1:] -= e_i[:, :, None] * u[:, None, b0 + i, b0 + i + 1:b1]
        if b1 < inp:
            work[:, :, b1:] -= np.matmul(err, u[:, b0:b1, b1:])             # (E, out, rest)
    if f.group_size is None or not packed:
        return ints, found
    return pack_q4(ints), found


def pack_q4(ints: np.ndarray) -> np.ndarray:
    """q - 8 (..., out, in) int8 -> q4's bytes (..., out, in/2), as scales.quantize packs them."""
    q = (ints + 8).astype(np.uint8)
    half = q.shape[-1] // 2
    return np.ascontiguousarray(q[..., :half] | (q[..., half:] << 4))


def quantize_column(col: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """One input column of a stack (E, out) in q4: its groups' searched bfloat16 scales (E, G)
    and its integers q - 8 (E, out)."""
    E, out = col.shape
    pad = -out % g
    if pad:
        col = np.concatenate([col, np.zeros((E, pad), np.float32)], axis=1)
    groups = col.reshape(-1, g, 1)                                          # (E*G, g, 1)
    s = scales.search_q4(groups)                                             # (E*G, 1)
    q = scales.round_clip(groups, s.astype(np.float32)[:, None, :], -8, 7)  # (E*G, g, 1)
    return q.reshape(E, -1)[:, :out], s.reshape(E, -1)
