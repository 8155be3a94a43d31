"""The optional comparison with Hugging Face transformers (`--compare-hf`): the same prefill and
decode runs, timed through transformers in float32 where torch and transformers are importable."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

from ds2cli.cli import console
from ds2cli.cli.bench.timing import seconds, summary



def compare_hf(path: Path, prompt_lengths: list[int], contexts: list[int], steps: int, repeats: int) -> dict | None:
    """Time transformers (float32) on the same checkpoint where torch and transformers happen to
    be importable. Neither is a ds2 dependency; any failure on their side is a note, not an error."""
    try:
        import torch
        import transformers
    except ImportError as e:
        console.warn(f"--compare-hf skipped: {e.name} is not importable (ds2 never needs torch or transformers)")
        return None
    try:
        return time_hf(torch, transformers, path, prompt_lengths, contexts, steps, repeats)
    except Exception as e:  # noqa: BLE001  (a third-party stack: report whatever it raised)
        console.warn(f"--compare-hf failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return None


def time_hf(torch, transformers, path: Path, prompt_lengths: list[int], contexts: list[int], steps: int,
            repeats: int) -> dict:
    """Prefill at each prompt length, then decode `steps` tokens after each context. Logits are
    asked for the last position only (logits_to_keep=1, where transformers offers it), as ds2
    computes them, so that prefill compares like with like."""
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    result = {"transformers": transformers.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "load_s": time.perf_counter() - t0,
              "prefill": [], "decode": []}
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
    result["logits_last_position_only"] = bool(last_only)
    vocab = hf.config.vocab_size

    def run(ids, past=None):
        return hf(ids, past_key_values=past, use_cache=True, **last_only).past_key_values

    with torch.inference_mode():
        for tokens in prompt_lengths:
            console.info(f"hf prefill {tokens} tokens x {repeats}")
            samples = [tokens / seconds(lambda: run(torch.randint(vocab, (1, tokens)))) for _ in range(repeats)]
            result["prefill"].append({"tokens": tokens, "tok_per_s": summary(samples)})
        for context in contexts:
            console.info(f"hf decode at context {context} x {repeats}")
            samples = []
            for _ in range(repeats):
                past = run(torch.randint(vocab, (1, context)))
                ids = torch.randint(vocab, (steps, 1, 1))
                t0 = time.perf_counter()
                for x in ids:
                    past = run(x, past)
                samples.append(steps / (time.perf_counter() - t0))
            result["decode"].append({"context": context, "tok_per_s": summary(samples)})
    return result
