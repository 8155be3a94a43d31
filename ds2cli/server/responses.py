"""OpenAI's response objects for one request's choices, whole or streamed: text, reasoning apart
from the answer (DeepSeek's `reasoning_content`, text/reasoning.py splits it), logprobs
(logprobs.py shapes them), tool calls (tools.py parses them), finish reasons and usage.
No HTTP here (http_server.py writes them) and no request parsing (jobs.py).
"""

from __future__ import annotations

import time
import uuid

from ds2cli.server import tools as tooling
from ds2cli.server.jobs import ABORTED, Job
from ds2cli.generation.generate import Chunk
from ds2cli.generation.logprobs import TextOffsets, chat_content, completion_logprobs
from ds2cli.text import reasoning
from ds2cli.text.tokenizer import Tokenizer

class Response:
    """Builds the objects of one completion (its choices, one per job), streamed or whole, in
    OpenAI's shapes."""

    done_event = True       # a stream ends with `data: [DONE]`

    def __init__(self, jobs: list[Job], model_id: str, tokenizer: Tokenizer | None = None):
        self.jobs = {j.index: j for j in jobs}
        self.job, self.model_id, self.tokenizer = jobs[0], model_id, tokenizer
        self.id = ("chatcmpl-" if self.job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.job.chat else "text_completion"
        # completions' text_offset counts in each choice's own text
        self.offsets = {i: TextOffsets(tokenizer) for i in self.jobs} if tokenizer is not None else {}
        # streamed tool calls, each choice's held back until it ends
        self.calls = {i: tooling.CallStream() for i in self.jobs} if self.job.tools is not None else None
        # streamed reasoning, each choice's split from its answer as it comes
        self.splitters = {i: reasoning.ReasoningSplitter(j.reasoning_opened) for i, j in self.jobs.items()
                          if j.reasoning}
        # what the scheduler found for each choice (scheduler.Outcome: cached tokens, echo's
        # logprobs), given once the request is admitted
        self.outcomes: dict = {}

    def _wrap(self, choices: list, obj: str, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def _logprobs(self, index: int, entries: list | None, echoed: bool = False) -> dict | None:
        """The choice's logprobs for `entries` (None when the request did not ask for them)."""
        job = self.jobs[index]
        if job.logprobs is None or entries is None:
            return None
        if job.chat:
            return {"content": chat_content(self.tokenizer, entries)}
        return completion_logprobs(self.tokenizer, entries, self.offsets[index], job.ids if echoed else None)

    def _choice(self, index: int, text: str | None, finish: str | None, delta: bool, role: bool = False,
                logprobs: dict | None = None, calls: list | None = None, thought: str | None = None) -> dict:
        if not self.job.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body: dict = {"role": "assistant"} if role or not delta else {}
        if text is not None or (calls and not delta):
            body["content"] = text
        if thought is not None:         # only a reply that had reasoning has the key (llama-server's way)
            body[reasoning.REASONING_FIELD] = thought
        if calls:
            body["tool_calls"] = ([{"index": k, **c} for k, c in enumerate(calls)] if delta else calls)
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs,
                "finish_reason": finish}

    def usage(self, lasts: dict[int, Chunk]) -> dict:
        """A prompt's tokens count once however many samples it has; every sample's reply counts."""
        jobs = self.jobs.values()
        prompt = sum(len(j.ids) for j in jobs if j.sample == 0)
        completion = sum(last.generated_tokens for last in lasts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.outcomes[i].cached for i, j in self.jobs.items()
                                                                 if j.sample == 0)}}

    def echoed_prompt(self, index: int = 0) -> str:
        """Under echo, the text the answer starts with: the prompt's tokens decoded, so that
        text_offset counts in the very text returned."""
        job = self.jobs[index]
        return self.tokenizer.decode(job.ids) if job.echo else ""

    def whole(self, texts: dict[int, str], lasts: dict[int, Chunk], entries: dict[int, list] | None = None) -> dict:
        choices = []
        for index, job in self.jobs.items():
            text, ents = texts[index], (entries or {}).get(index)
            if job.echo:
                text = self.echoed_prompt(index) + text
                ents = None if ents is None or job.logprobs is None else [*self.outcomes[index].prompt_logprobs, *ents]
            finish, calls, thought = finish_reason(lasts[index]), None, None
            if job.reasoning:
                thought, text = reasoning.split(text, job.reasoning_opened)
            if job.tools is not None:
                text, calls, complete = tooling.parse_calls(text)
                if calls:
                    text = text or None
                    finish = "tool_calls" if complete else finish
            choices.append(self._choice(index, text, finish, delta=False, calls=calls, thought=thought,
                                        logprobs=self._logprobs(index, ents, echoed=job.echo)))
        return self._wrap(choices, self.object, usage=self.usage(lasts))

    def content(self, text: str, index: int = 0) -> str:
        """What of a streamed piece can go out as content now (tool calls wait for the end)."""
        return self.calls[index].feed(text) if self.calls is not None else text

    def pieces(self, text: str, index: int = 0) -> tuple[str, str]:
        """What of a streamed piece can go out now as (reasoning, content): a possible marker waits
        for the next piece, tool calls for the end."""
        thought = ""
        if index in self.splitters:
            part = self.splitters[index].feed(text)
            thought, text = part.reasoning, part.content
        return thought, self.content(text, index)

    def piece_chunk(self, thought: str, text: str, index: int = 0, entries: list | None = None) -> dict | None:
        """A streamed piece's chunk (None when it has nothing to send): reasoning as
        delta.reasoning_content, the answer as delta.content."""
        if not (thought or text or entries):
            return None
        return self.chunk(None if thought and not text else text, index=index, entries=entries,
                          thought=thought or None)

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, index: int = 0,
              entries: list | None = None, calls: list | None = None, thought: str | None = None) -> dict:
        extra = {"usage": None} if self.job.include_usage else {}
        choice = self._choice(index, text, finish, delta=True, role=role, logprobs=self._logprobs(index, entries),
                              calls=calls, thought=thought)
        return self._wrap([choice], self._chunk_object(), **extra)

    def echo_chunk(self, index: int = 0) -> dict:
        """A choice's first chunk under echo: the prompt's text (and its logprobs)."""
        extra = {"usage": None} if self.job.include_usage else {}
        choice = self._choice(index, self.echoed_prompt(index), None, delta=True,
                              logprobs=self._logprobs(index, self.outcomes[index].prompt_logprobs, echoed=True))
        return self._wrap([choice], self._chunk_object(), **extra)

    def finish_chunks(self, last: Chunk, index: int = 0) -> list[dict]:
        """A choice's end: what its reasoning split held back, the rest of its content and its
        tool calls (with tools), then the chunk that carries its finish_reason."""
        out, finish = [], finish_reason(last)
        if index in self.splitters:
            rest = self.splitters[index].flush()
            held = self.piece_chunk(rest.reasoning, self.content(rest.content, index), index)
            if held is not None:
                out.append(held)
        if self.calls is not None:
            rest, calls, complete = self.calls[index].finish()
            if rest:
                out.append(self.chunk(rest, index=index))
            if calls:
                out.append(self.chunk(None, index=index, calls=calls))
                finish = "tool_calls" if complete else finish
        out.append(self.chunk(None if self.job.chat else "", finish, index=index))
        return out

    def usage_chunk(self, lasts: dict[int, Chunk]) -> list[dict]:
        """After every choice has finished: (with include_usage) the chunk with usage."""
        return [self._wrap([], self._chunk_object(), usage=self.usage(lasts))] if self.job.include_usage else []

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.chat else "text_completion"


def finish_reason(last: Chunk) -> str:
    """ds2's eos | stop | length | aborted -> OpenAI's stop | length. A reply the server cut
    short (a second Ctrl-C) is "length", which clients already read as "the text is incomplete"."""
    return "length" if last.finish_reason in ("length", ABORTED) else "stop"
