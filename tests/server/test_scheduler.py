"""scheduler.py on its own, without HTTP: choices admitted and their chunks handed back, the
outcome it found (tokens from the prompt cache, echo's logprobs) given back rather than written
into the job, the queue's limit, and closing."""

import threading

import pytest

import ds2cli
from ds2cli.generation.sampling import SamplingParams
from ds2cli.server.api import Job
from ds2cli.server.scheduler import Refused, Scheduler
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

    def long_request():
        with scheduler.admit([job(model, max_tokens=200)], lambda: hold.is_set()) as admitted:
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
