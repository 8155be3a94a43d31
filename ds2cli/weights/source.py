"""A model opened once: `open_model(path)` finds what a path names (a Hugging Face safetensors
directory or id, a ds2 low-bit checkpoint, a GGUF file) and reads what every command needs to
check its options, memory and prompt before loading: the config, the stored recipe, the
tokenizer, generation_config, and (when asked) the validated tensor headers. The loader then
loads from the same object, so nothing is parsed twice and the loader never calls back into a
command."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from ds2cli.errors import ConfigError
from ds2cli.json_files import read_json_object
from ds2cli.model.config import DeepseekV2Config
from ds2cli.text.tokenizer import Tokenizer
from ds2cli.weights import checkpoint, qcheckpoint
from ds2cli.weights.gguf import checkpoint as gguf_model
from ds2cli.weights.gguf import file as gguf_file
from ds2cli.weights.hub import resolve_model_dir


def bundled_model_dir() -> Path:
    """ds2-tiny ships inside the package, so it is found wherever ds2cli is installed."""
    return Path(__file__).resolve().parents[1] / "models" / "ds2-tiny"   # ds2cli/models, package data


def check_model_dir(path: str | Path) -> Path:
    path = resolve_model_dir(path)  # a Hugging Face id (not a local path) -> its cached snapshot
    if not path.exists():
        # the path names either form: a GGUF file or a checkpoint directory
        raise ConfigError(f"no such file or directory: {path} (a model is a checkpoint directory or a GGUF file)")
    if gguf_file.find(path) is not None:   # a GGUF file, or a directory holding one (gguf/checkpoint.py)
        return path
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a model directory, and not a GGUF file "
                          f"(it does not start with the GGUF magic bytes)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return path


def read_generation_config(model_dir: Path) -> dict:
    """generation_config.json is optional; a broken one is an error, not silently ignored."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    return read_json_object(path, ConfigError)


def read_quant_config(model_dir: Path) -> qcheckpoint.QuantConfig | None:
    return qcheckpoint.read_quant_config(read_json_object(model_dir / "config.json", ConfigError))


@dataclasses.dataclass(eq=False)
class Source:
    """One model's files, opened: what they hold is read when first asked for, once."""
    path: Path
    config: DeepseekV2Config
    gguf: gguf_model.GGUFModel | None = None

    @property
    def kind(self) -> str:
        return "GGUF" if self.gguf else "ds2 low-bit checkpoint" if self.stored else "Hugging Face checkpoint"

    @functools.cached_property
    def stored(self) -> qcheckpoint.QuantConfig | None:
        """The recipe a ds2 low-bit checkpoint was written with (None: a float checkpoint or GGUF)."""
        return None if self.gguf else read_quant_config(self.path)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return self.gguf.tokenizer() if self.gguf else Tokenizer.load(self.path, vocab_size=self.config.vocab_size)

    @functools.cached_property
    def generation_config(self) -> dict:
        return self.gguf.generation_config if self.gguf else read_generation_config(self.path)

    @functools.cached_property
    def tensors(self) -> dict:
        """The tensor headers, checked against the config (cheap, and they name a broken checkpoint
        precisely): what the memory check and the loader read."""
        if self.gguf:
            self.gguf.check()
            return self.gguf.tensors
        if self.stored is None:
            return checkpoint.validate(self.config, self.path)
        tensors = checkpoint.read_headers(self.path)
        found = qcheckpoint.problems(self.config, self.stored, tensors)
        if found:
            shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
            raise checkpoint.CheckpointError(f"checkpoint {self.path} does not match its config "
                                             f"({len(found)} problem{'s' * (len(found) > 1)}): {shown}")
        return tensors


def open_model(path: str | Path | Source | None = None) -> Source:
    """The model at `path` (default: the bundled ds2-tiny), its config read; a Source as it is."""
    if isinstance(path, Source):
        return path
    model_dir = check_model_dir(bundled_model_dir() if path is None else path)
    gguf = gguf_model.open_model(model_dir, validate=False)   # None unless a GGUF: its config is its metadata
    return Source(model_dir, gguf.config if gguf else DeepseekV2Config.from_file(model_dir / "config.json"), gguf)
