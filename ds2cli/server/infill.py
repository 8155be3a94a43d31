"""llama-server's `POST /infill` as data: its fields (`input_prefix`, `input_suffix`,
`input_extra`, `prompt`, and /completion's sampling fields) into one job whose prompt is a fill
(text/fim.py's layout), and its answer in llama-server's /completion shape, whole or as events.
The job runs as every completion does (the scheduler); no HTTP here (endpoints.py)."""

from __future__ import annotations

from ds2cli.generation.generate import Chunk
from ds2cli.server.jobs import ABORTED, Job, fim_prompt, fim_tokens, parse_job, unicode_text
from ds2cli.server.request_fields import ApiError, Defaults
from ds2cli.text import fim
from ds2cli.text.tokenizer import Tokenizer

# ds2's finish reasons -> llama-server's stop_type
STOP_TYPES = {"eos": "eos", "grammar": "eos", "stop": "word", "length": "limit", ABORTED: "limit"}


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", param=name)
    return unicode_text(value, name)


def extra_files(body: dict) -> list[tuple[str, str]]:
    """input_extra: [{"filename": ..., "text": ...}] as (path, text) pairs; counted before it is
    looped over, its bytes measured (fim.check_files) before anything is tokenized."""
    extra = body.get("input_extra")
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise ApiError(400, "input_extra must be a list of {\"filename\", \"text\"} objects", param="input_extra")
    if len(extra) > fim.MAX_FILES:
        raise ApiError(400, f"input_extra has {len(extra)} files, more than the limit of {fim.MAX_FILES}",
                       param="input_extra")
    files = []
    for i, item in enumerate(extra):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) \
                or not isinstance(item.get("filename", ""), str):
            raise ApiError(400, f"input_extra[{i}] must be an object with a string \"text\" (and a string "
                                f"\"filename\")", param="input_extra")
        files.append((unicode_text(item.get("filename", ""), f"input_extra[{i}].filename"),
                      unicode_text(item["text"], f"input_extra[{i}].text")))
    try:
        fim.check_files(files)
    except fim.RepositoryError as e:
        raise ApiError(400, f"input_extra: {e}", param="input_extra") from None
    return files


def infill_job(body: dict, tokenizer: Tokenizer, vocab_size: int, defaults: Defaults, model_id: str) -> Job:
    """The request as one job: the fill's prompt, then the sampling fields as /v1/completions
    reads them (n_predict or max_tokens, temperature, stop, stream, ...). `prompt` is text that
    follows the prefix, as llama-server places it."""
    if "input_prefix" not in body and "input_suffix" not in body:
        raise ApiError(400, "an /infill request needs input_prefix and input_suffix (the text before and after "
                            "the hole)", param="input_prefix")
    for name in ("echo", "logprobs", "top_logprobs", "suffix"):
        if body.get(name) not in (None, False):
            raise ApiError(400, f"{name} is not supported by /infill", param=name)
    tokens = fim_tokens(tokenizer, model_id, "input_prefix")
    prefix, suffix, after = _text(body, "input_prefix"), _text(body, "input_suffix"), _text(body, "prompt")
    ids = fim_prompt(tokenizer, tokens, prefix + after, suffix, defaults.ctx, extra_files(body), "input_prefix")
    return parse_job(body, False, tokenizer, vocab_size, defaults, model_id, fill=ids, ends=tokens.ends)


class InfillResponse:
    """llama-server's /completion objects for one fill: `content` and `stop`, and at the end the
    counts (`tokens_predicted`, `tokens_evaluated`, `tokens_cached`), `stop_type`, the `prompt`
    as text and `timings`. Streamed, each event is {"content", "stop": false}, the last one the
    whole object with "content": "", and no [DONE] line follows (llama-server sends none)."""

    done_event = False

    def __init__(self, job: Job, model_id: str, tokenizer: Tokenizer):
        self.job, self.jobs = job, {job.index: job}
        self.model_id, self.tokenizer = model_id, tokenizer
        self.outcomes: dict = {}

    def final(self, text: str, last: Chunk) -> dict:
        return {"content": text, "stop": True, "model": self.model_id,
                "tokens_predicted": last.generated_tokens, "tokens_evaluated": len(self.job.ids),
                "tokens_cached": self.outcomes[self.job.index].cached,
                "stop_type": STOP_TYPES.get(last.finish_reason, "eos"), "truncated": False,
                "prompt": self.tokenizer.decode(self.job.ids),
                "timings": {"prompt_n": last.prompt_tokens, "prompt_ms": round(last.prefill_s * 1e3, 3),
                            "prompt_per_second": round(last.prefill_tok_per_s, 2),
                            "predicted_n": last.generated_tokens, "predicted_ms": round(last.decode_s * 1e3, 3),
                            "predicted_per_second": round(last.decode_tok_per_s, 2)}}

    # the calls endpoints.py makes of a response, whole or streamed
    def whole(self, texts: dict[int, str], lasts: dict[int, Chunk], entries=None) -> dict:
        return self.final(texts[self.job.index], lasts[self.job.index])

    def content(self, text: str, index: int = 0) -> str:
        return text

    def chunk(self, text: str | None, index: int = 0, entries=None) -> dict:
        return {"content": text or "", "stop": False}

    def pieces(self, text: str, index: int = 0) -> tuple[str, str]:
        return "", text                     # a fill has no reasoning to keep apart

    def piece_chunk(self, thought: str, text: str, index: int = 0, entries=None) -> dict | None:
        return self.chunk(text, index) if text else None

    def finish_chunks(self, last: Chunk, index: int = 0) -> list[dict]:
        return [self.final("", last)]       # the last chunk's text went out as an event before

    def usage_chunk(self, lasts: dict[int, Chunk]) -> list[dict]:
        return []
