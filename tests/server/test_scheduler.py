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
from ds2cli.model.executor import Executor
from ds2cli.server.jobs import Job
from ds2cli.server.scheduler import ClientGone, Refused, Request, Scheduler
from ds2cli.weights.source import bundled_model_dir

PROMPT = "User: What is 451 - 123?\n\nAssistant:"


@pytest.fixture(scope="module")
def model():
    return ds2cli.load(bundled_model_dir())


class Recorded(Executor):
    """The reference executor, noting each pass's sequences as (start, tokens). With `depth` 2
    passes run only when waited for, two under way at once: how a cluster's stages by layers
    look to the scheduler (cluster/ray_cluster.py's start_pass). `hold` keeps the first pass
    from running until it is set."""

    def __init__(self, depth: int = 1, hold: threading.Event | None = None):
        self.depth, self.hold, self.passes = depth, hold, []

    def pipeline_depth(self) -> int:
        return self.depth

    def start_pass(self, model, p):
        return lambda: self.run_pass(model, p)

    def run_pass(self, model, p):
        self.passes.append([(start, p.tokens[rows].tolist()) for start, rows in zip(p.starts, p.rows)])
        if self.hold is not None and len(self.passes) == 1:
            assert self.hold.wait(30), "the first pass was held for 30 s"
        return super().run_pass(model, p)


def wait_for(done, what: str, seconds: float = 30) -> None:
    """Poll `done()` until it holds; fail the test once `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds} s for {what}")
        time.sleep(0.001)


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


def test_every_prompt_runs_in_chunks_and_the_shortest_goes_first():
    """Counted passes: a long prompt alone runs chunk by chunk; a short one arriving behind it
    gets the next chunk (the fewest tokens left), and its first token comes before the long one's."""
    queued = threading.Event()
    recorded = Recorded(hold=queued)        # the short one arrives during the first chunk
    model = ds2cli.load(bundled_model_dir(), executor=recorded)
    scheduler = Scheduler(model, 1024, 64 << 20, max_queue=4, parallel=2, prefill_chunk=32, alone_chunk=48)
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
    wait_for(lambda: recorded.passes, "the long prompt's first chunk")
    short = threading.Thread(target=run, args=(job(model, max_tokens=2, index=0), "short"))
    short.start()
    wait_for(lambda: scheduler.waiting_line, "the short one in the queue")
    queued.set()
    short.join(60), long_thread.join(60)
    lengths = [[len(tokens) for _, tokens in p] for p in recorded.passes]
    assert lengths[0] == [48]                           # alone, still a chunk (alone_chunk)
    assert all(max(p) <= 32 for p in lengths if len(p) > 1)  # beside a decoding one, --prefill-chunk
    assert order[0] == "short" and order[-1] == "long", (order, lengths)
    scheduler.close()


def prompt_chunks(passes: list, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt's chunks in the order they ran, as token counts: a sequence of a pass is a
    chunk of the prompt whose tokens from its start it repeats (a decode step is past the prompt)."""
    out = {name: [] for name in prompts}
    for p in passes:
        for start, tokens in p:
            for name, ids in prompts.items():
                if ids[start:start + len(tokens)] == tokens:
                    out[name].append(len(tokens))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 2])
def test_a_prompt_beside_another_in_the_batch_reads_short_chunks_on_every_path(depth):
    """Two long prompts admitted together: each pass runs a chunk of one while the other sits
    out. Run to the end (depth 1) or pipelined (depth 2), the scheduler applies one rule: while
    another request is in the batch, a chunk is --prefill-chunk (32), never alone_chunk (48),
    so the same prompts are read in the same chunks on both paths."""
    recorded = Recorded(depth=depth)
    model = ds2cli.load(bundled_model_dir(), executor=recorded)
    scheduler = Scheduler(model, 1024, 64 << 20, max_queue=4, parallel=3, prefill_chunk=32, alone_chunk=48)
    prompts = {"a": model.tokenizer.encode("The history of the city begins " * 30)[:100],
               "b": model.tokenizer.encode("Once upon a time there was a river " * 30)[:80]}
    jobs = [Job(False, prompts["a"], SamplingParams(temperature=0), 2, (), False, False, ignore_eos=True),
            Job(False, prompts["b"], SamplingParams(temperature=0), 12, (), False, False, index=1,
                ignore_eos=True)]
    answer(scheduler, jobs)                             # b, the shorter, decodes until a has read its prompt
    scheduler.close()
    assert prompt_chunks(recorded.passes, prompts) == {"a": [32, 32, 32, 4], "b": [32, 32, 16]}


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


@pytest.mark.slow
def test_pipelined_micro_batches_give_each_request_the_same_text(model):
    prompts = ["What is 451 - 123?", "What is 12 + 30?", "What is 7 * 6?", "What is 100 - 1?"]

    def jobs(m):
        return [Job(True, m.tokenizer.encode(f"User: {q}\n\nAssistant:"), SamplingParams(temperature=0), 12, (),
                    False, False, index=i) for i, q in enumerate(prompts)]
    plain = Scheduler(model, 256, 64 << 20, max_queue=8, parallel=4)
    want, _ = answer(plain, jobs(model))
    plain.close()
    piped = ds2cli.load(bundled_model_dir(), executor=Recorded(depth=2))
    scheduler = Scheduler(piped, 256, 64 << 20, max_queue=8, parallel=4)
    assert scheduler.depth == 2
    got, _ = answer(scheduler, jobs(piped))
    assert got == want and want[0].strip().startswith("451 - 123 = 3")
    assert scheduler.most_flying == 2          # two micro-batches were under way at once
    scheduler.close()
