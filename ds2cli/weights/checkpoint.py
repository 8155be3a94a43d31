"""safetensors checkpoints: hostile-input-safe header parsing, validation against the config,
and loading into `{hf_name: float32 array}`.

Headers are parsed here rather than trusted to any library, because they are the untrusted part:
every offset is bounds-checked against the file size before a byte of tensor data is touched,
and no allocation is ever sized from a header field."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import struct
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol

import numpy as np
from safetensors import safe_open

from ds2cli.json_files import JSON_ERRORS
from ds2cli.model.config import DeepseekV2Config
from ds2cli.model.linear import widen_bfloat16
from ds2cli.errors import CheckpointError
from ds2cli.wording import plural

# safetensors dtype name -> bytes per element (every dtype the format defines)
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
               "BOOL": 1}
LOADABLE_DTYPES = ("F32", "F16", "BF16")
# safetensors dtype name -> NumPy's, for the dtypes ds2 maps straight from the file (numpy_dtype)
MAPPED_DTYPES = {"F32": "float32", "F16": "float16", "I8": "int8", "U8": "uint8", "BF16": "bfloat16",
                 "F8_E4M3": "float8_e4m3fn"}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit ("header too large")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some exporters store; recomputed from config
# DeepSeek-V3's fp8 storage: "<name>.weight" F8_E4M3 beside a float32 "<name>.weight_scale_inv"
# holding one scale per FP8_BLOCK block of the weight (edge blocks partial).
FP8_DTYPES = ("F8_E4M3",)
FP8_FMT = "e4m3"
FP8_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    nbytes: int
    offset: int = 0   # where the tensor's bytes start in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Shards(Protocol):
    """Where find_shards and read_header find a checkpoint's safetensors files: LocalShards, the
    files of its folder, or hub.RemoteShards, a Hub repository's shards of which only the first
    bytes (8 + the header) were read over HTTP, for `ds2 inspect ORG/NAME`."""
    def names(self) -> list[str]: ...           # every *.safetensors file
    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def open(self, name: str) -> BinaryIO: ...


class LocalShards:
    """A checkpoint folder's safetensors files."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir

    def names(self) -> list[str]:
        return sorted(p.name for p in self.model_dir.glob("*.safetensors") if p.is_file())

    def exists(self, name: str) -> bool:
        return (self.model_dir / name).is_file()

    def size(self, name: str) -> int:
        return (self.model_dir / name).stat().st_size

    def open(self, name: str) -> BinaryIO:
        return open(self.model_dir / name, "rb")


def read_header(path: Path, shards: Shards | None = None) -> dict[str, TensorInfo]:
    """Parse and bounds-check one safetensors file's header; the data is not read. The bytes come
    from `shards` (default: path's own folder), which for a Hub id holds only the header."""
    shards = shards or LocalShards(path.parent)
    try:
        size = shards.size(path.name)
        with shards.open(path.name) as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path.name}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path.name}: header length {n} is larger than the file "
                                      f"({size} bytes): truncated or not a safetensors file")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path.name}: header length {n} is over the safetensors "
                                      f"limit of {MAX_HEADER_BYTES} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) < n:
        raise CheckpointError(f"{path.name}: the header ends after {len(raw)} of its {n} bytes")
    try:
        header = json.loads(raw.decode("utf-8"))
    except JSON_ERRORS:
        raise CheckpointError(f"{path.name}: header is not valid JSON: not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    return _check_entries(path, header, data_len=size - 8 - n, file_len=size)


def _check_entry(path: Path, name: str, e: object) -> tuple[str, tuple[int, ...], int, int]:
    if not (isinstance(e, dict) and isinstance(e.get("dtype"), str)
            and isinstance(e.get("shape"), list) and isinstance(e.get("data_offsets"), list)):
        raise CheckpointError(f"{path.name}: malformed header entry for {name}")
    shape, offs = e["shape"], e["data_offsets"]
    ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not all(ok_int(v) for v in shape) or len(offs) != 2 or not all(ok_int(v) for v in offs):
        raise CheckpointError(f"{path.name}: bad shape or offsets for {name}")
    if e["dtype"] not in DTYPE_SIZES:
        raise CheckpointError(f"{path.name}: tensor {name} has unknown dtype {e['dtype']!r}")
    return e["dtype"], tuple(shape), offs[0], offs[1]


def _nbytes(shape: tuple[int, ...], itemsize: int, limit: int) -> int | None:
    """The tensor's size, or None once it passes `limit`: a hostile shape of thousands of huge
    dimensions would otherwise be a product that takes minutes to compute."""
    if 0 in shape:
        return 0
    n = itemsize
    for dim in shape:
        n *= dim
        if n > limit:
            return None
    return n


def _show_shape(shape: tuple[int, ...]) -> str:
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:4]))}, ... ({len(shape)} dimensions)]"


def _check_entries(path: Path, header: dict, data_len: int, file_len: int) -> dict[str, TensorInfo]:
    spans, infos = [], {}
    for name, e in header.items():
        if name == "__metadata__":
            if not (e is None or isinstance(e, dict) and all(isinstance(v, str) for v in e.values())):
                raise CheckpointError(f"{path.name}: __metadata__ must map strings to strings")
            continue
        dtype, shape, begin, end = _check_entry(path, name, e)
        if not begin <= end <= data_len:
            raise CheckpointError(f"{path.name}: tensor {name} offsets [{begin}, {end}] lie outside "
                                  f"the {data_len} data bytes (truncated file?)")
        nbytes = _nbytes(shape, DTYPE_SIZES[dtype], limit=data_len)
        if end - begin != nbytes:
            needs = "more than the whole file" if nbytes is None else nbytes
            raise CheckpointError(f"{path.name}: tensor {name} occupies {end - begin} bytes but "
                                  f"{dtype} {_show_shape(shape)} needs {needs}")
        spans.append((begin, end, name))
        infos[name] = TensorInfo(name, dtype, shape, path, nbytes, file_len - data_len + begin)
    _check_layout(path, sorted(spans), data_len)
    return infos


def _check_layout(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The tensors must tile the data bytes exactly, as the safetensors loader itself requires."""
    covered, last = 0, None
    for begin, end, name in spans:
        if begin < covered:
            raise CheckpointError(f"{path.name}: tensors {last} and {name} overlap")
        if begin > covered:
            raise CheckpointError(f"{path.name}: data bytes [{covered}, {begin}) belong to no tensor: "
                                  f"not a valid safetensors file")
        covered, last = end, name
    if covered != data_len:
        raise CheckpointError(f"{path.name}: the last {data_len - covered} data bytes belong to no "
                              f"tensor: not a valid safetensors file")


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, or model.safetensors."""
    files, found = find_shards(model_dir)
    if found:
        raise CheckpointError(found[0])
    return files


def find_shards(model_dir: Path, shards: Shards | None = None) -> tuple[list[Path], list[str]]:
    """shard_files without raising: the files that exist (in `shards`, default the folder's own
    files), and what is wrong with the rest (an index that names shards outside the model folder
    names none that may be read)."""
    shards = shards or LocalShards(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, *JSON_ERRORS, KeyError, TypeError, AttributeError):
            return [], [f"{index} is not a valid safetensors index (no weight_map)"]
        bad = [f for f in files if not isinstance(f, str) or Path(f).name != f]
        if bad:
            return [], [f"{index.name} names shard files outside the model folder: {bad[:3]}"]
        missing = [f for f in files if not shards.exists(f)]
        found = [f"{index.name} names shards that do not exist: {', '.join(missing)}"] if missing else []
        return [model_dir / f for f in files if f not in missing], found
    if shards.exists(SINGLE_NAME):
        return [model_dir / SINGLE_NAME], []
    found = shards.names()
    if len(found) == 1:
        return [model_dir / found[0]], []
    return [], [f"no {SINGLE_NAME} or {INDEX_NAME} in {model_dir}"]


def read_headers(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint by name; a tensor held by two shards is an error."""
    tensors, found = read_readable_headers(model_dir)
    if found:
        raise CheckpointError(found[0])
    return tensors


def read_readable_headers(model_dir: Path, shards: Shards | None = None
                          ) -> tuple[dict[str, TensorInfo], list[str]]:
    """read_headers without raising, for `ds2 inspect`, which reports a broken checkpoint rather
    than stopping at it: the tensors of every shard that can be read, and one problem for each
    shard that cannot (and for each tensor a second shard holds again). `shards` is where the
    shards are read (default: the folder; hub.RemoteShards for a Hub id's headers)."""
    files, found = find_shards(model_dir, shards)
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            header = read_header(path, shards)
        except CheckpointError as e:
            found.append(str(e))
            continue
        again: dict[str, list[str]] = {}        # earlier shard -> the names this one holds again
        for name, info in header.items():
            if name in tensors:
                again.setdefault(tensors[name].file.name, []).append(name)
            else:
                tensors[name] = info
        found += [f"tensor {names[0]} appears in both {earlier} and {path.name}"
                  + (f" (and {plural(len(names) - 1, 'more tensor')})" if len(names) > 1 else "")
                  for earlier, names in again.items()]
    return tensors, found


def expected_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes the original DeepseekV2ForCausalLM holds for this config."""
    return dict(iter_expected(cfg))


def iter_expected(cfg: DeepseekV2Config) -> Iterator[tuple[str, tuple[int, ...]]]:
    """expected_shapes one (name, shape) at a time, so that a caller can stop early."""
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    yield from {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}.items()
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (V, D)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,)
        yield p + "post_attention_layernorm.weight", (D,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            yield a + "q_proj.weight", (H * cfg.q_head_dim, D)
        else:
            yield a + "q_a_proj.weight", (cfg.q_lora_rank, D)
            yield a + "q_a_layernorm.weight", (cfg.q_lora_rank,)
            yield a + "q_b_proj.weight", (H * cfg.q_head_dim, cfg.q_lora_rank)
        yield a + "kv_a_proj_with_mqa.weight", (C + R, D)
        yield a + "kv_a_layernorm.weight", (C,)
        yield a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C)
        yield a + "o_proj.weight", (D, H * cfg.v_head_dim)
        if cfg.is_moe_layer(i):
            yield p + "mlp.gate.weight", (cfg.n_routed_experts, D)
            if cfg.topk_method == "noaux_tc":  # DeepSeek-V3's load-balancing bias, used to choose
                yield p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                yield from _mlp_shapes(p + f"mlp.experts.{e}.", D, cfg.moe_intermediate_size)
            if cfg.n_shared_experts:
                yield from _mlp_shapes(p + "mlp.shared_experts.", D,
                                       cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            yield from _mlp_shapes(p + "mlp.", D, cfg.intermediate_size)


def _mlp_shapes(prefix: str, D: int, width: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield prefix + "gate_proj.weight", (width, D)
    yield prefix + "up_proj.weight", (width, D)
    yield prefix + "down_proj.weight", (D, width)


def problems(cfg: DeepseekV2Config, tensors: dict[str, TensorInfo]) -> list[str]:
    """Every missing, unexpected, mis-shaped or unloadable tensor, one string each."""
    # A config that describes far more tensors than are stored (a hostile num_hidden_layers or
    # n_routed_experts) is reported as such, without building its billions of names.
    limit = 2 * len(tensors) + 10_000
    want = dict(itertools.islice(iter_expected(cfg), limit + 1))
    if len(want) > limit:
        return [f"config.json describes more than {limit} tensors (num_hidden_layers "
                f"{cfg.num_hidden_layers}, n_routed_experts {cfg.n_routed_experts}) "
                f"but the checkpoint holds {len(tensors)}"]
    out = [f"missing tensor {name} {list(shape)}" for name, shape in want.items() if name not in tensors]
    fp8 = []
    for name, info in tensors.items():
        if (name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings)
                or is_mtp(name, cfg) or is_scale_of(name, want)):
            continue
        if name not in want:
            out.append(f"unexpected tensor {name}")
        elif info.shape != want[name]:
            out.append(f"tensor {name} has shape {list(info.shape)}, config says {list(want[name])}")
        elif info.dtype in FP8_DTYPES and cfg.quantization_config is not None:
            fp8.append(name)
        elif info.dtype not in LOADABLE_DTYPES:
            fp8_hint = f", or {FP8_DTYPES[0]} with an fp8 quantization_config" if cfg.is_v3 else ""
            out.append(f"tensor {name} has unsupported dtype {info.dtype} "
                       f"(ds2 loads {', '.join(LOADABLE_DTYPES)}{fp8_hint})")
    return out + fp8_problems(cfg, tensors, fp8) + stray_scales(tensors, want)


# ---- DeepSeek-V3: multi-token-prediction layers and fp8 block scales ----

def is_mtp(name: str, cfg: DeepseekV2Config) -> bool:
    """A tensor of a multi-token-prediction layer (model.layers.<num_hidden_layers + j>.*):
    stored for speculative decoding and training, never read by inference."""
    if not cfg.num_nextn_predict_layers or not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and int(index) in range(cfg.num_hidden_layers,
                                                    cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def is_scale_of(name: str, want: dict) -> bool:
    """`name` is the weight_scale_inv of an expected weight (checked with that weight)."""
    return name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in want


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """(out, in) -> one scale per block, edge blocks partial: (ceil(out/128), ceil(in/128))."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def fp8_problems(cfg: DeepseekV2Config, tensors: dict[str, TensorInfo], names: list[str]) -> list[str]:
    """The F8_E4M3 weights `names` need a supported quantization_config (reported once) and
    each its own well-shaped float weight_scale_inv."""
    if not names:
        return []
    qc = cfg.quantization_config or {}
    first = f"{names[0]}" + (f" and {len(names) - 1} more F8_E4M3 tensors" if len(names) > 1 else "")
    if qc.get("fmt", FP8_FMT) != FP8_FMT:
        return [f"tensor {first}: quantization_config.fmt {qc['fmt']!r} is not supported "
                f"(ds2 dequantizes {FP8_FMT})"]
    if qc.get("weight_block_size") != list(FP8_BLOCK):
        return [f"tensor {first}: quantization_config.weight_block_size "
                f"{qc.get('weight_block_size')!r} is not supported (ds2 dequantizes {list(FP8_BLOCK)})"]
    out = []
    for name in names:
        if len(tensors[name].shape) != 2:
            out.append(f"tensor {name} is F8_E4M3 with shape {list(tensors[name].shape)}, but fp8 "
                       f"block scales apply to matrices only")
            continue
        scale, want = tensors.get(name + SCALE_SUFFIX), scale_shape(tensors[name].shape)
        if scale is None:
            out.append(f"tensor {name} is F8_E4M3 but its scale {name}{SCALE_SUFFIX} is missing")
        elif scale.shape != want:
            out.append(f"scale {scale.name} has shape {list(scale.shape)}, but F8_E4M3 "
                       f"{list(tensors[name].shape)} in {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks needs {list(want)}")
        elif scale.dtype not in LOADABLE_DTYPES:
            out.append(f"scale {scale.name} has unsupported dtype {scale.dtype}")
    return out


def stray_scales(tensors: dict[str, TensorInfo], want: dict) -> list[str]:
    """A weight_scale_inv beside an expected weight that is stored, but not as fp8."""
    out = []
    for name in tensors:
        weight = tensors.get(name.removesuffix(SCALE_SUFFIX)) if is_scale_of(name, want) else None
        if weight is not None and weight.dtype not in FP8_DTYPES:
            out.append(f"tensor {name} scales {weight.name}, which is {weight.dtype}, not F8_E4M3")
    return out


def validate(cfg: DeepseekV2Config, model_dir: Path) -> dict[str, TensorInfo]:
    tensors = read_headers(model_dir)
    found = problems(cfg, tensors)
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointError(f"checkpoint {model_dir} does not match its config "
                              f"({len(found)} problem{'s' * (len(found) > 1)}): {shown}")
    return tensors


def iter_tensors(tensors: dict[str, TensorInfo], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array in its stored dtype) for `names`, one tensor at a time: the files are
    memory-mapped, so only the tensor being handed out is ever held in memory. An F8_E4M3
    weight comes out dequantized to float32 with its weight_scale_inv (see dequantize_fp8):
    no fp8 array leaves this module, so every reader gets the weight's real values. A BF16
    tensor comes out as float32 (read_bfloat16), exactly its values, which every reader widens
    to anyway."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(tensors[name].file, []).append(name)
    for path, group in by_file.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in group:
                    if tensors[name].dtype in FP8_DTYPES:
                        yield name, dequantize_fp8(read_fp8(tensors[name]), read_scale(tensors, name, f), name)
                    elif tensors[name].dtype == "BF16":
                        yield name, read_bfloat16(tensors[name])
                    else:
                        yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own types; report them as ours
            raise CheckpointError(f"{path.name}: cannot read tensors: {e}") from None


def numpy_dtype(name: str) -> np.dtype:
    """One of MAPPED_DTYPES as a NumPy dtype. bfloat16 and float8_e4m3fn are ml_dtypes' types,
    imported here, where a tensor of them is mapped or an fp8 one read, not at every start."""
    if name in ("BF16", "F8_E4M3"):
        import ml_dtypes  # noqa: F401 - registers its types with NumPy by name
    return np.dtype(MAPPED_DTYPES[name])


def read_bfloat16(info: TensorInfo) -> np.ndarray:
    """A BF16 tensor as float32, widened from its uint16 bits (linear.widen_bfloat16): no
    bfloat16 dtype, so reading a float checkpoint never imports ml_dtypes. read_header has
    bounds-checked the offsets."""
    bits = np.memmap(info.file, dtype=np.uint16, mode="r", offset=info.offset, shape=info.shape)
    return widen_bfloat16(bits)                                             # shape -> float32


def read_fp8(info: TensorInfo) -> np.ndarray:
    """An F8_E4M3 tensor's bytes as ml_dtypes.float8_e4m3fn (safetensors' NumPy reader has no
    fp8 type); read_header has bounds-checked the offsets."""
    raw = np.fromfile(info.file, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    if raw.size != info.nbytes:
        raise CheckpointError(f"{info.file.name}: tensor {info.name} is truncated")
    return raw.view(numpy_dtype("F8_E4M3")).reshape(info.shape)


def read_scale(tensors: dict[str, TensorInfo], name: str, f) -> np.ndarray:
    """`name`'s weight_scale_inv as float32, from the open shard `f` or its own shard."""
    scale = tensors.get(name + SCALE_SUFFIX)
    if scale is None:
        raise CheckpointError(f"tensor {name} is F8_E4M3 but its scale {name}{SCALE_SUFFIX} is missing")
    if scale.file == tensors[name].file:
        return np.asarray(f.get_tensor(scale.name), dtype=np.float32)
    with safe_open(str(scale.file), framework="numpy") as g:
        return np.asarray(g.get_tensor(scale.name), dtype=np.float32)


@functools.cache
def fp8_values() -> np.ndarray:
    """The float32 value of each of the 256 float8_e4m3fn codes, as ml_dtypes converts them.
    Indexing this table is faster than ml_dtypes' own astype(float32) and gives the same
    values, NaN codes included."""
    return np.arange(256, dtype=np.uint8).view(numpy_dtype("F8_E4M3")).astype(np.float32)  # (256,)


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, name: str = "weight",
                   block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    """weight (O, I) float8_e4m3fn times its block's scale_inv (ceil(O/bo), ceil(I/bi)) -> float32,
    one block row at a time, so the only float32 beside the result is a (bo, I) stripe."""
    O, I = weight.shape
    bo, bi = block
    if scale_inv.shape != scale_shape((O, I), block):
        raise CheckpointError(f"scale {name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, but F8_E4M3 "
                              f"{[O, I]} in {bo}x{bi} blocks needs {list(scale_shape((O, I), block))}")
    codes, values = weight.view(np.uint8), fp8_values()
    out = np.empty((O, I), dtype=np.float32)
    for r in range(scale_inv.shape[0]):
        rows = slice(r * bo, min((r + 1) * bo, O))
        out[rows] = values[codes[rows]]                                     # (bo, I) fp8 -> float32
        out[rows] *= np.repeat(scale_inv[r], bi)[:I]                        # (I,) each column's scale
    return out


def iter_float32(tensors: dict[str, TensorInfo], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    for name, array in iter_tensors(tensors, names):
        yield name, np.ascontiguousarray(array, dtype=np.float32)

