"""What a model will hold in memory, what this machine has, and the check between the two.

One home for the sizes: `ds2 inspect` shows them, `ds2 quantize` checks disk space with them,
`ds2 bench` and every command that loads a model (and `ds2cli.load`) check RAM with them before
reading a single weight, so a model too big for the machine gets one clear error instead of the
kernel's OOM killer.

RAM needed = weights in the form they take in memory (float32, or the low-bit formats of the
checkpoint or of --quantize; a memory-mapped low-bit checkpoint counts its file bytes, resident
in the page cache once used) + the latent cache at the requested context + a working margin
(WORKING_MARGIN_BYTES plus WORKING_MARGIN_FRACTION of the weights: activations, dequantization
scratch, the tokenizer and Python). Quantizing at load also holds one layer in float32 at a time.

For tests and for people who know better, DS2_MEMORY_AVAILABLE (bytes, or a number with a K, M,
G suffix for powers of 1000 or KiB, MiB, GiB for powers of 1024) replaces the measured figure.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ds2cli.model import attention, transformer
from ds2cli.model.config import DeepseekV2Config
from ds2cli.weights import checkpoint
from ds2cli.weights import hub
from ds2cli.weights import qcheckpoint
from ds2cli.errors import Ds2Error
from ds2cli.weights.qcheckpoint import QuantConfig
from ds2cli.wording import article

FLOAT32 = 4
WORKING_MARGIN_BYTES = 256 << 20
WORKING_MARGIN_FRACTION = 0.05
DEFAULT_CONTEXT = 4096        # the cache counted when the caller names no context
ENV = "DS2_MEMORY_AVAILABLE"


class MemoryCheckError(Ds2Error):
    """The model would not fit in the memory available."""


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def matrix_bytes(qc: QuantConfig | None, part: str, key: str, shape: tuple[int, ...]) -> int:
    f = qcheckpoint.format_for(qc, part, key, shape)
    if f is not None:
        return f.nbytes_of(shape)
    return math.prod(shape) * checkpoint.DTYPE_SIZES[qc.float_dtype(part, key) if qc is not None else "F32"]


def layer_bytes(cfg: DeepseekV2Config, i: int, qc: QuantConfig | None) -> int:
    return sum(matrix_bytes(qc, p, k, s) for (p, k), s in qcheckpoint.layer_shapes(cfg, i).items())


def weight_bytes(cfg: DeepseekV2Config, qc: QuantConfig | None, layers: range | None = None) -> int:
    """Bytes of the prepared weights in qc's formats (None: float32), the tied head once; with
    `layers`, of those decoder layers and the top weights they need (a node of a cluster)."""
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    needed = qcheckpoint.top_needed(cfg, layers)
    top = sum(matrix_bytes(qc, p, k, s) for (p, k), s in qcheckpoint.top_shapes(cfg).items() if k in needed)
    return top + sum(layer_bytes(cfg, i, qc) for i in layers)


def cache_bytes(cfg: DeepseekV2Config, tokens: int, layers: int | None = None) -> int:
    """A latent cache of `tokens` positions over `layers` decoder layers (default: all)."""
    layers = cfg.num_hidden_layers if layers is None else layers
    return tokens * layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * FLOAT32


def pass_bytes(cfg: DeepseekV2Config) -> int:
    """The working memory of one forward pass, whatever the prompt's length: attention's budget
    of scores and expanded keys (attention.ATTENTION_BUDGET_BYTES) and the activations of a pass
    of PREFILL_CHUNK tokens (the memory chunk: longer prompts run as several passes), counted
    generously per token: the hidden states and their norms, q and its RoPE'd copy, the new
    latent, the absorbed queries and the running sums, the context, the router's scores and the
    rows of the experts a token visits, or the dense MLP's."""
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d, v, k = cfg.qk_nope_head_dim, cfg.v_head_dim, max(1, cfg.num_experts_per_tok or 0)
    expert = cfg.moe_intermediate_size or 0
    mlp = max(cfg.intermediate_size, (cfg.n_shared_experts or 0) * expert)
    per_token = (6 * D + 2 * H * (d + R) + 2 * (C + R) + 3 * H * C + H * v + 2 * (cfg.n_routed_experts or 0)
                 + k * (2 * D + 3 * expert) + 3 * mlp) * FLOAT32
    return attention.ATTENTION_BUDGET_BYTES + transformer.PREFILL_CHUNK * per_token


def staging_bytes(cfg: DeepseekV2Config, i: int, qc: QuantConfig | None) -> int:
    """The float32 bytes that exist at once while layer i is quantized as it loads: the layer but
    its routed experts, which qcheckpoint.ExpertStack quantizes as they are read, holding at most
    two batches of them and one expert being read (their quantized stacks count as weights)."""
    full = layer_bytes(cfg, i, None)
    keys = ("experts_gate_up", "experts_down")
    shapes = qcheckpoint.layer_shapes(cfg, i)
    if not all(("mlp", k) in shapes and qcheckpoint.format_for(qc, "mlp", k, shapes["mlp", k]) for k in keys):
        return full
    expert = sum(math.prod(shapes["mlp", k][1:]) for k in keys) * FLOAT32
    return full - cfg.n_routed_experts * expert + min(cfg.n_routed_experts, 2 * qcheckpoint.EXPERT_BATCH + 1) * expert


def required(cfg: DeepseekV2Config, qc: QuantConfig | None, context: int | None,
             quantize_at_load: bool = False, layers: range | None = None, experts: range | None = None) -> dict:
    """The bytes a loaded model holds, by part; with `layers`, the bytes a process holding only
    that range of decoder layers holds (a node of a cluster: cluster/placement.py); with
    `experts`, of the routed experts only those of every MoE layer, whatever `layers` is (a node
    of a cluster spread by experts)."""
    context = min(cfg.max_position_embeddings, DEFAULT_CONTEXT) if context is None else context
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    weights = weight_bytes(cfg, qc, layers)
    if experts is not None:
        weights += routed_share(cfg, qc, experts) - sum(routed_bytes(cfg, qc, range(i, i + 1)) for i in layers)
    staging = max((staging_bytes(cfg, i, qc) for i in layers), default=0) if quantize_at_load else 0
    margin = WORKING_MARGIN_BYTES + int(WORKING_MARGIN_FRACTION * weights) + staging
    cache = cache_bytes(cfg, context, len(layers))
    if len(layers) and layers.stop < cfg.num_hidden_layers:
        # a node's range before the last keeps the hidden state it hands on at each position
        # (execution/stages.py: what heals a lost next node)
        cache += context * cfg.hidden_size * 4
    working = pass_bytes(cfg)
    return {"weights": weights, "cache": cache, "working": working, "margin": margin, "context": context,
            "total": weights + cache + working + margin}


def routed_bytes(cfg: DeepseekV2Config, qc: QuantConfig | None, layers: range | None = None) -> int:
    """Bytes of every MoE layer's routed experts (of those in `layers`): what --memory-budget
    streams from disk."""
    total = 0
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        if cfg.is_moe_layer(i):
            shapes = qcheckpoint.layer_shapes(cfg, i)
            total += sum(matrix_bytes(qc, "mlp", k, shapes["mlp", k]) for k in ("experts_gate_up", "experts_down"))
    return total


def routed_share(cfg: DeepseekV2Config, qc: QuantConfig | None, experts: range) -> int:
    """Bytes of the routed experts `experts` of every MoE layer (every expert is the same size)."""
    return routed_bytes(cfg, qc) * len(experts) // max(1, cfg.n_routed_experts or 1)


def streamed(cfg: DeepseekV2Config, qc: QuantConfig, context: int | None, budget: int,
             layers: range | None = None, experts: range | None = None) -> dict:
    """What a run within `budget` holds: the always-used part resident (weights but the routed
    experts, cache, working memory, margin) and the expert slots the rest admits. `layers` and
    `experts` as in `required`: a node of a cluster holding that share streams only its own
    routed experts (of its layers; spread by experts, its range of every MoE layer's). A budget
    that cannot hold the resident part and one token's experts is a MemoryCheckError."""
    need = required(cfg, qc, context, layers=layers, experts=experts)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    if experts is None:          # its layers' experts, all of them
        moe_layers = sum(cfg.is_moe_layer(i) for i in layers)
        per_layer, routed = cfg.n_routed_experts or 0, routed_bytes(cfg, qc, layers)
    else:                        # its share of every MoE layer's
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        per_layer, routed = len(experts), routed_share(cfg, qc, experts)
    expert = routed // max(1, moe_layers * per_layer)
    weights = need["weights"] - routed
    resident = weights + need["cache"] + need["working"] + WORKING_MARGIN_BYTES + int(WORKING_MARGIN_FRACTION * weights)
    slots = (budget - resident) // expert if expert else 0
    k = min(cfg.num_experts_per_tok or 1, per_layer) if expert else 0     # one token's experts here
    if slots < k:
        raise MemoryCheckError(f"a memory budget of {gb(budget)} cannot stream this model: its always-used part "
                               f"(weights but the routed experts {gb(weights)}, cache {gb(need['cache'])} at "
                               f"{need['context']} tokens, working memory and margin) takes {gb(resident)}, and one "
                               f"token's {k} experts {gb(k * expert)} more; give at least "
                               f"--memory-budget {budget_text(resident + k * expert)}")
    return {"resident": resident, "resident_weights": weights, "routed": routed, "expert": expert,
            "slots": int(min(slots, moe_layers * per_layer)), "context": need["context"],
            "experts": moe_layers * per_layer, "least": resident + k * expert,
            "weights": need["weights"], "total": need["total"]}


def budget_text(n: int) -> str:
    """A budget as --memory-budget takes it, rounded up to 0.1 GB: "3.2G"."""
    return f"{math.ceil(n / 1e8) / 10:.1f}G"


def streaming_summary(cfg: DeepseekV2Config, qc: QuantConfig, context: int | None = None,
                      budget: int | None = None) -> dict | None:
    """What --memory-budget means for a model in qc's low-bit formats (`ds2 inspect`): the
    resident part beside the whole, the least budget that runs it, and with `budget` the experts
    it caches; None for a model without routed experts."""
    if not routed_bytes(cfg, qc):
        return None
    plan = streamed(cfg, qc, context, 1 << 62)
    least = int(math.ceil(plan["least"] / 1e8) * 1e8)
    cached = None if budget is None or budget < plan["least"] else min(plan["experts"], (budget - plan["resident"]) // plan["expert"])
    return {"format": label(qc), "weight_bytes": plan["weights"], "resident_weight_bytes": plan["resident_weights"],
            "routed_bytes": plan["routed"], "expert_bytes": plan["expert"], "experts": plan["experts"],
            "ram_bytes": plan["total"], "resident_bytes": plan["resident"], "context": plan["context"],
            "least_budget_bytes": least, "least_budget": budget_text(plan["least"]),
            "budget_bytes": budget, "cached_experts": None if cached is None else int(cached)}


def parse_size(text: str) -> int:
    """"8589934592", "8G" or "8GB" (10^9, as ds2 prints sizes), "8GiB" (2^30); K, M, T alike."""
    t = text.strip().upper()
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise Ds2Error(f"{ENV} must be a size such as 8G, 8GiB or 8000000000, got {text!r}")
    return int(value * units.get(unit, 1))


def available_bytes() -> int | None:
    """Memory available to a new allocation now: MemAvailable on Linux (page cache that can be
    dropped included), free pages where the platform says only that, None when unknown."""
    if os.environ.get(ENV):
        return parse_size(os.environ[ENV])
    machine = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if machine is None:
        try:
            machine = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            machine = None
    group = cgroup_room()
    return machine if group is None else group if machine is None else min(machine, group)


def cgroup_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup: v2's memory.max and memory.current,
    v1's memory.limit_in_bytes and memory.usage_in_bytes, at the path /proc/self/cgroup names."""
    out = []
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":                                                        # v2
            out.append((f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"))
        elif "memory" in controllers.split(","):                                      # v1
            base = f"/sys/fs/cgroup/memory{path}"
            out.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"))
    return out


def cgroup_room(files: list[tuple[str, str]] | None = None) -> int | None:
    """What this process's memory cgroup still admits (its limit less its usage, page cache
    included, as the kernel counts it), None without a limit."""
    files = cgroup_files() if files is None else files
    for limit_file, usage_file in files:
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None                     # no limit (v1 says so with a huge number)
        return max(0, int(limit) - usage)
    return None


def describe_params(cfg: DeepseekV2Config) -> str:
    n = weight_bytes(cfg, None) / FLOAT32
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def label(qc: QuantConfig | None) -> str:
    return "float32" if qc is None else f"{qc.bits}-bit"


def forms(stored: QuantConfig | None) -> list[tuple[str, QuantConfig | None, bool]]:
    """(name, formats, quantized at load) of each form a checkpoint can be loaded in, most
    precise first: its stored form for a low-bit checkpoint; float32, --quantize 8 and
    --quantize 4 for a float one."""
    if stored is not None:
        return [(f"{stored.bits}-bit (stored)", stored, False)]
    return [("float32", None, False), ("8-bit", QuantConfig.recipe(8), True), ("4-bit", QuantConfig.recipe(4), True)]


def fits(cfg: DeepseekV2Config, stored: QuantConfig | None, context: int | None = None,
         available: int | None = None) -> list[dict]:
    """What each form needs (weights, and RAM with the cache and margin) and whether it fits the
    memory available now (None when that is unknown)."""
    available = available_bytes() if available is None else available
    out = []
    for name, qc, at_load in forms(stored):
        need = required(cfg, qc, context, quantize_at_load=at_load)
        out.append({"format": name, "weight_bytes": need["weights"], "ram_bytes": need["total"],
                    "context": need["context"], "available_bytes": available,
                    "fits": None if available is None else need["total"] <= available})
    return out


def choose_auto(cfg: DeepseekV2Config, context: int | None, available: int | None = None,
                path: Path | None = None) -> int | None:
    """--quantize auto: None (float32) if it fits, else 8, else 4; an error when nothing fits."""
    available = available_bytes() if available is None else available
    if available is None:
        return None
    for form in fits(cfg, None, context, available):
        if form["fits"]:
            return {"float32": None, "8-bit": 8, "4-bit": 4}[form["format"]]
    raise MemoryCheckError(f"{model_name(cfg, path)} does not fit even as 4-bit: it needs {gb(form['ram_bytes'])} but "
                           f"{gb(available)} is available")


def model_name(cfg: DeepseekV2Config, path: Path | None = None) -> str:
    """The model as the user names it: a Hub snapshot by its id (org/name), a directory by its name."""
    name = cfg.model_type if path is None else hub.snapshot_id(path) or path.name
    return f"{name} ({describe_params(cfg)})"


def check(cfg: DeepseekV2Config, model_dir: Path, stored: QuantConfig | None, quantize: int | None,
          context: int | None, available: int | None = None, recipe: QuantConfig | None = None,
          streamable: bool = False) -> None:
    """Raise MemoryCheckError, naming both figures and what would fit, when the model in the form
    it will be loaded would not fit in the memory available (`recipe`: the formats it loads
    into, when not --quantize's own recipe, as a GGUF's exact one; `streamable`: a model that is
    not a ds2 low-bit checkpoint but whose experts --memory-budget can stream, a Q8_0 GGUF)."""
    available = available_bytes() if available is None else available
    qc = stored or recipe or (QuantConfig.recipe(quantize) if quantize else None)
    need = required(cfg, qc, context, quantize_at_load=stored is None and quantize is not None)
    if available is None or need["total"] <= available:
        return
    head = (f"{model_name(cfg, model_dir)} needs {gb(need['total'])} as {label(qc)} "
            f"(weights {gb(need['weights'])}, cache {gb(need['cache'])} at {need['context']} tokens, "
            f"working memory {gb(need['working'])}, margin {gb(need['margin'])}) but {gb(available)} is available")
    raise MemoryCheckError(head + "; " + suggestion(cfg, model_dir, stored, quantize, context, available, streamable)
                           + "; --no-memory-check skips this check")


def suggestion(cfg: DeepseekV2Config, model_dir: Path, stored: QuantConfig | None, quantize: int | None,
               context: int | None, available: int, streamable: bool = False) -> str:
    budget = f"--memory-budget {max(0.1, math.floor(available / 1e8) / 10):.1f}G streams the routed experts from disk"
    if stored is not None:
        return ("use a smaller --ctx or a machine with more memory" if stored.bits == 4 else
                "a 4-bit copy (ds2 quantize from the float checkpoint with --bits 4) takes "
                f"{gb(required(cfg, QuantConfig.recipe(4), context)['total'])}") + "; " + budget
    source = hub.snapshot_id(model_dir) or model_dir   # `ds2 quantize` takes a Hub id as SRC too
    options = []
    for bits in (8, 4):
        if quantize is not None and bits >= quantize:
            continue
        on_disk = required(cfg, QuantConfig.recipe(bits), context)["total"]
        at_load = required(cfg, QuantConfig.recipe(bits), context, quantize_at_load=True)["total"]
        if on_disk <= available:
            size = gb(weight_bytes(cfg, QuantConfig.recipe(bits)))
            how = f"ds2 quantize {source} OUT --bits {bits} makes {article(size)} {size} copy that fits"
            options.append(how + (f" (or add --quantize {bits})" if at_load <= available else ""))
    text = "; ".join(options) if options else "neither the 8-bit nor the 4-bit form fits either"
    return text + "; " + budget if streamable else text
