"""Stop strings at a bounded cost (generate.StopMatcher, an Aho-Corasick automaton): the text
emitted is the text before the first stop, however the text is cut into tokens, with what could
begin a stop held back; the work per token is its length, whatever the stops' lengths (counted
here as the automaton's lookups); too many stop characters are refused before generating."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds2cli.cli.main import main
from ds2cli.generation.generate import MAX_STOP_CHARS, StopMatcher
from ds2cli.server.request_fields import ApiError, _stop


def first_stop(text: str, stops: list[str]) -> str | None:
    """What comes before the stop that ends first (the longest of those ending there)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s and s in text]
    if not ends:
        return None
    end, neg = min(ends)
    return text[:end + neg]


def run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        assert len(matcher.pending) < max(map(len, matcher.stops), default=1)   # never more than a stop's start
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=60), stops=st.lists(st.text(alphabet="abc\n", max_size=5), max_size=4),
       cuts=st.lists(st.integers(0, 60), max_size=10))
def test_the_text_before_the_first_stop_however_it_is_cut(text, stops, cuts):
    edges = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(edges, edges[1:])]
    got, hit = run(StopMatcher(stops), pieces)
    want = first_stop(text, stops)
    # a stop is found as soon as its last character arrives, so cut the reference at the piece
    # where the matcher saw it; with pieces of one character each the two rules are the same
    assert hit == (want is not None)
    if want is not None:
        seen = run(StopMatcher(stops), list(text))[0]
        assert seen == want and got == want
    else:
        assert got == text


class CountingDict(dict):
    lookups = 0

    def __contains__(self, key):
        CountingDict.lookups += 1
        return super().__contains__(key)

    def get(self, key, default=None):
        CountingDict.lookups += 1
        return super().get(key, default)


def test_work_per_token_is_its_length_not_the_stops_square():
    """The naive matcher compared each held tail with every prefix of every stop: L^2/2 a token.
    Sixteen stops of 1,000 characters that the text keeps almost matching."""
    stops = ["a" * 999 + chr(ord("b") + k) for k in range(16)]
    m = StopMatcher(stops)
    m.goto = [CountingDict(g) for g in m.goto]
    CountingDict.lookups = 0
    fed, emitted = 0, []
    for _ in range(200):
        text, hit = m.feed("aaaaa")
        fed += 5
        emitted.append(text)
        assert not hit
    assert CountingDict.lookups <= 4 * fed, CountingDict.lookups
    text, hit = m.feed("a" * 10 + "c")
    assert hit and "".join(emitted) + text == "a" * (fed + 10 - 999)    # what precedes the stop


def test_too_many_stop_characters_are_refused():
    big = ["x" * (MAX_STOP_CHARS // 4 + 1)] * 4
    with pytest.raises(ApiError) as e:
        _stop({"stop": big})
    assert e.value.status == 400 and e.value.param == "stop"
    assert _stop({"stop": ["x" * 100] * 4}) == tuple(["x" * 100] * 4)


def test_the_cli_refuses_them_as_a_usage_error(capsys):
    args = ["generate", "hi"] + [a for s in ["y" * (MAX_STOP_CHARS // 2 + 1)] * 2 for a in ("--stop", s)]
    with pytest.raises(SystemExit) as e:
        main(args, standalone_mode=True)
    assert e.value.code == 2
    assert "stop strings hold" in capsys.readouterr().err
