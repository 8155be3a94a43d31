"""scheduler.py on its own, without HTTP: choices admitted and their chunks handed back, the
outcome it found (tokens from the prompt cache, echo's logprobs) given back rather than written
into the job, the queue's limit, and closing."""

import contextlib
import queue
import threading
import time

import pytest

import ds2cli
from ds2cli.generation.sampling import SamplingParams
from ds2cli.server.api import Job
from ds2cli.server import scheduler as scheduling
from ds2cli.server.scheduler import ClientGone, Refused, Request, Scheduler
from ds2cli.weights.source import bundled_model_dir

PROMPT = "User: What is 451 - 123?\n\nAssistant:"


@pytest.fixture(scope="module")
def model():
    return ds2cli.load(bundled_model_dir())


def job(model, max_tokens=8, **kw) -> Job:
    return Job(True, model.tokenizer.encode(PROMPT), SamplingParams(temperature=0), max_tokens, (), False, False, **kw)


def answer(scheduler, jobs):
    with scheduler.admit(jobs, lambda: False) as admitted:
        texts = {j.index: "" for j in jobs}
        for index, chunk in admitted.chunks:
            texts[index] += chunk.text
        return texts, admitted.outcomes


def test_a_choice_is_answered_and_the_second_asking_finds_its_prompt_cached(model):
    scheduler = Scheduler(model, 256, 64 << 20, max_queue=4, parallel=2)
    texts, outcomes = answer(scheduler, [job(model)])
    assert texts[0].strip() == "451 - 12"          # 8 tokens of "451 - 123 = 328."
    assert outcomes[0].cached == 0
    again, outcomes = answer(scheduler, [job(model)])
    assert again == texts and outcomes[0].cached == len(model.tokenizer.encode(PROMPT)) - 1
    assert not hasattr(job(model), "cached")          # the job is the request's, not the scheduler's
    scheduler.close()


def test_echo_gives_the_prompts_logprobs_as_its_outcome(model):
    scheduler = Scheduler(model, 256, 64 << 20, max_queue=4)
    _, outcomes = answer(scheduler, [job(model, max_tokens=2, logprobs=1, echo=True)])
    entries = outcomes[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(model.tokenizer.encode(PROMPT))
    scheduler.close()


def test_more_choices_than_the_queue_holds_are_refused_and_closing_refuses_all(model):
    scheduler = Scheduler(model, 256, 64 << 20, max_queue=1, parallel=1)
    hold = threading.Event()
    started = threading.Event()

    def long_request():      # its client leaves once `hold` is set: ClientGone is how that ends
        with contextlib.suppress(ClientGone), \
                scheduler.admit([job(model, max_tokens=200)], lambda: hold.is_set()) as admitted:
            started.set()
            for _ in admitted.chunks:
                if hold.is_set():
                    break
    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(60)
    with pytest.raises(Refused) as refused:
        scheduler.admit([job(model, index=i) for i in range(3)], lambda: False).__enter__()
    assert refused.value.code == "queue_full"
    hold.set()
    t.join(60)
    scheduler.close()
    with pytest.raises(Refused) as refused:
        scheduler.admit([job(model)], lambda: False).__enter__()
    assert refused.value.code == "shutting_down"


def test_every_prompt_runs_in_chunks_and_the_shortest_goes_first(model, monkeypatch):
    """Counted passes: a long prompt alone runs chunk by chunk; a short one arriving behind it
    gets the next chunk (the fewest tokens left), and its first token comes before the long one's."""
    passes, real, queued = [], model.forward_batch, threading.Event()

    def spy(steps, *args, **kwargs):
        passes.append([len(s.ids) for s in steps])
        if len(passes) == 1:
            queued.wait(30)                             # the short one arrives during the first chunk
        return real(steps, *args, **kwargs)
    monkeypatch.setattr(model, "forward_batch", spy)
    monkeypatch.setattr(scheduling, "ALONE_CHUNK", 48)
    scheduler = Scheduler(model, 1024, 64 << 20, max_queue=4, parallel=2, prefill_chunk=32)
    long_ids = model.tokenizer.encode("The history of the city begins " * 30)[:200]
    long_job = Job(False, long_ids, SamplingParams(temperature=0), 4, (), False, False)
    order, lock = [], threading.Lock()

    def run(j, name):
        with scheduler.admit([j], lambda: False) as admitted:
            for _, chunk in admitted.chunks:
                if chunk.text or chunk.finish_reason:
                    with lock:
                        order.append(name)
    long_thread = threading.Thread(target=run, args=(long_job, "long"))
    long_thread.start()
    while not passes:                                   # the long prompt's first chunk has run
        time.sleep(0.001)
    short = threading.Thread(target=run, args=(job(model, max_tokens=2, index=0), "short"))
    short.start()
    while not scheduler.waiting_line:
        time.sleep(0.001)
    queued.set()
    short.join(60), long_thread.join(60)
    assert passes[0] == [48]                            # alone, still a chunk (ALONE_CHUNK)
    assert all(max(p) <= 32 for p in passes if len(p) > 1)   # beside a decoding one, --prefill-chunk
    assert order[0] == "short" and order[-1] == "long", (order, passes)
    scheduler.close()


@pytest.mark.slow
def test_the_last_slot_is_kept_for_a_short_prompt(model):
    scheduler = Scheduler(model, 1024, 64 << 20, max_queue=4, parallel=2, prefill_chunk=24)
    long_ids = model.tokenizer.encode("The history of the city begins " * 30)[:120]
    a = Request(Job(False, long_ids, SamplingParams(temperature=0), 4, (), False, False), queue.Queue())
    b = Request(Job(False, long_ids, SamplingParams(temperature=0), 4, (), False, False, index=1), queue.Queue())
    short = Request(job(model), queue.Queue())
    assert scheduler.is_long(a) and not scheduler.is_long(short)
    with scheduler.cond:
        scheduler.closing = True                        # the thread stops; the test drives admission
    scheduler.thread.join(5)
    scheduler.closing = False
    scheduler.waiting_line.extend([a, b])
    with scheduler.cond:
        scheduler.admit_waiting()
    assert a in scheduler.batch and b not in scheduler.batch and list(scheduler.waiting_line) == [b]
    scheduler.waiting_line.append(short)
    with scheduler.cond:
        scheduler.admit_waiting()
    assert short in scheduler.batch and b in scheduler.waiting_line


@pytest.mark.slow
def test_ignore_eos_runs_to_max_tokens(model):
    scheduler = Scheduler(model, 256, 64 << 20, max_queue=4)
    with scheduler.admit([job(model, max_tokens=40, ignore_eos=True)], lambda: False) as admitted:
        chunks = list(admitted.chunks)
        last = chunks[-1][1]
    assert last.finish_reason == "length" and last.generated_tokens == 40
    # past eos, the special tokens it writes add no text: what comes out is decode's text of the
    # tokens without the special ones' (eos, bos, pad)
    tok = model.tokenizer
    text, shown = "".join(c.text for _, c in chunks), tok.decode(last.tokens)
    for special in tok.special_ids:
        shown = shown.replace(tok.decode([special]), "")
    assert set(last.tokens) & tok.special_ids and text.lstrip() == shown.lstrip() and "<｜" not in text
    with scheduler.admit([job(model, max_tokens=40)], lambda: False) as admitted:
        assert [c for _, c in admitted.chunks][-1].finish_reason == "eos"     # it answers in fewer
    scheduler.close()


class Deferred(ds2cli.model.executor.Executor):
    """Passes that run only when waited for, two under way at once: how a cluster's stages by
    layers look to the scheduler (cluster/ray_cluster.py's start_pass)."""

    def pipeline_depth(self) -> int:
        return 2

    def start_pass(self, model, p):
        return lambda: self.run_pass(model, p)


@pytest.mark.slow
def test_pipelined_micro_batches_give_each_request_the_same_text(model):
    prompts = ["What is 451 - 123?", "What is 12 + 30?", "What is 7 * 6?", "What is 100 - 1?"]

    def jobs(m):
        return [Job(True, m.tokenizer.encode(f"User: {q}\n\nAssistant:"), SamplingParams(temperature=0), 12, (),
                    False, False, index=i) for i, q in enumerate(prompts)]
    plain = Scheduler(model, 256, 64 << 20, max_queue=8, parallel=4)
    want, _ = answer(plain, jobs(model))
    plain.close()
    piped = ds2cli.load(bundled_model_dir(), executor=Deferred())
    scheduler = Scheduler(piped, 256, 64 << 20, max_queue=8, parallel=4)
    assert scheduler.depth == 2
    got, _ = answer(scheduler, jobs(piped))
    assert got == want and want[0].strip().startswith("451 - 123 = 3")
    assert scheduler.most_flying == 2          # two micro-batches were under way at once
    scheduler.close()
