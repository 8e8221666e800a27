"""OpenAI's stop strings in a stream of text (detokenize.TextStream, StopStrings): the text sent
is exactly what a search of the whole text with ``str.find`` keeps, however the text arrives,
what is held back is exactly what may still begin a stop string, and the work is linear."""
from itertools import pairwise

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minitransformer.serve.detokenize import StopStrings, TextStream
from minitransformer.serve.openai_api import MAX_STOP_CHARS


class Pieces:
    """A tokenizer whose token i stands for the text pieces[i] (decoding only)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def searched(chunks, stops) -> str:
    """What a stream with these stop strings must send: after each chunk of text, a search of
    all the text so far; at the first chunk where a stop string occurs, the text before its
    earliest occurrence."""
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)]
    return text


def held(text, stops) -> int:
    """Characters at the end of text that may still begin a stop string (a proper prefix of
    one): what a stream must hold back, no more, no less."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@st.composite
def bordered(draw, letters):
    """A stop string of up to 12 letters, often one whose borders nest: a word w, then
    w x w, (w x w) y (w x w), ... (a border of a border of ...), cut somewhere."""
    word = draw(st.text(letters, min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 3))):
        word = word + draw(st.text(letters, max_size=2)) + word
    return word[:draw(st.integers(1, min(len(word), 12)))]


@st.composite
def streams(draw):
    """(stop strings, the chunks a text arrives in) over 2 or 3 letters: the text is made of
    random runs and the stops' prefixes, whole or not (near misses)."""
    letters = draw(st.sampled_from(["ab", "abc"]))
    stops = draw(st.lists(bordered(letters), min_size=1, max_size=3))
    parts = st.one_of(st.text(letters, max_size=4), st.sampled_from(stops).flatmap(
        lambda s: st.integers(1, len(s)).map(lambda n: s[:n])))
    text = "".join(draw(st.lists(parts, max_size=8)))
    return stops, chunked(text, draw(st.lists(st.integers(0, len(text)), max_size=12)))


def chunked(text, cuts) -> list:
    """text cut at these places (any order, repeats: empty chunks) -> its chunks."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[i:j] for i, j in pairwise(bounds)]


def sent(stops, chunks) -> str:
    """What a TextStream sends, the chunks fed one token each, then flushed."""
    stream = TextStream(Pieces(chunks), stop=stops)
    return "".join(stream.add(i) for i in range(len(chunks))) + stream.flush()


@settings(max_examples=600, derandomize=True, database=None, deadline=None)
@given(streams())
@example((["aabaaab"], ["aabaa", "baaab", "aab"]))          # borders that nest
@example((["aabaaab"], ["aaba", "abaa", "abaaab"]))
@example((["bbbaabbbba"], ["bbbaabbb", "baabbbba"]))
@example((["bbbaabbbba"], list("bbbaabbbbaabbbba")))
@example((["bbbaabbbba", "abbbb"], ["bbbaabbbba"]))
def test_a_stop_string_is_found_wherever_str_find_finds_it(case):
    """Fed in the given chunks, one token each: after every chunk, the text sent is all of it
    but what may begin a stop string; at the end, the text before the earliest stop string
    found by the chunk it completed in (one stop string: where str.find finds it, whatever
    the chunks). Fed whole: the text before the earliest str.find of any."""
    stops, chunks = case
    text = "".join(chunks)
    stream, out, seen = TextStream(Pieces(chunks), stop=stops), "", ""
    for i, chunk in enumerate(chunks):
        out, seen = out + stream.add(i), seen + chunk
        if stream.stopped:
            break
        assert out == seen[:len(seen) - held(seen, stops)]
    out += stream.flush()
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert stream.stopped == bool(found)
    assert out == searched(chunks, stops)
    if len(stops) == 1:
        assert out == text[:found[0] if found else len(text)]
    assert sent(stops, [text]) == text[:min(found, default=len(text))]


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.sampled_from(["ab", "abc"]).flatmap(bordered), st.lists(st.integers(0, 24)))
@example("aabaaab", [])
@example("bbbaabbbba", [])
def test_a_stop_string_after_a_prefix_of_itself_is_found_where_it_begins(stop, cuts):
    """The text that sends a matcher down its borders: a prefix of the stop string, then the
    whole of it (s[:j] + s for every j), fed in chunks: the text sent is s[:j] exactly, unless
    the stop string begins sooner (str.find). A random text seldom follows a string's borders
    this far: this is where a matcher that falls back too far misses it."""
    for j in range(len(stop)):
        text = stop[:j] + stop
        assert sent([stop], chunked(text, [c for c in cuts if c <= len(text)])) == \
            text[:text.find(stop)], (stop, j)


def test_stop_strings_cut_where_a_search_of_the_whole_text_would():
    """Random texts over a two-letter alphabet (many partial matches, overlapping stops) in
    random pieces: the stream sends exactly the text before the first stop, and never sends
    text that could still begin one."""
    rng = np.random.default_rng(0)
    for case in range(300):
        pieces = ["".join(rng.choice(list("ab"), size=rng.integers(1, 4))) for _ in range(12)]
        stops = ["".join(rng.choice(list("ab"), size=rng.integers(1, 7)))
                 for _ in range(rng.integers(1, 5))]
        ids = rng.integers(0, len(pieces), size=rng.integers(0, 25)).tolist()
        stream, sent = TextStream(Pieces(pieces), stop=stops), ""
        for i in ids:
            sent += stream.add(i)
        sent += stream.flush()
        assert sent == searched([pieces[i] for i in ids], stops), (case, pieces, stops, ids)


def test_what_a_stream_holds_back_is_exactly_what_may_begin_a_stop_string():
    rng = np.random.default_rng(1)
    for case in range(200):
        stops = ["".join(rng.choice(list("ab"), size=rng.integers(1, 7)))
                 for _ in range(rng.integers(1, 5))]
        stream, sent, text = TextStream(Pieces(["a", "b"]), stop=stops), "", ""
        for i in rng.integers(0, 2, size=30).tolist():
            sent, text = sent + stream.add(i), text + "ab"[i]
            if stream.stopped:
                break
            assert sent == text[:len(text) - held(text, stops)], (case, stops, text)


def test_stop_matching_work_is_linear_in_the_text_whatever_the_stop_length():
    """The worst case for a naive check: the text keeps matching a long prefix of every stop
    string (a's, each stop a's then a b). The automata move at most twice per character and
    string, with stops of 10 or of MAX_STOP_CHARS characters alike."""
    for length in (10, MAX_STOP_CHARS):
        stops = StopStrings(["a" * (length - 1) + "b", "a" * (length // 2) + "c",
                             "ab" * (length // 2), "b" * length])
        for _ in range(500):
            assert stops.feed("aaaa") is None
        assert stops.moves <= 2 * 4 * 500 * 4
        assert stops.partial() == length - 1     # held back: what may begin the first one
    assert stops.feed("b") == -(length - 1)      # found: it began that far back


def test_a_stream_matches_its_stop_strings_with_the_counted_automata():
    """TextStream's own matching is that work: 2,000 one-letter tokens against four stop
    strings of MAX_STOP_CHARS characters, at most 2 moves per character and string."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + "b", "a" * 10 + "c", "ab" * 100, "b" * 50]
    stream = TextStream(Pieces(["a"]), stop=stops)
    sent = "".join(stream.add(0) for _ in range(2000))
    assert stream.stop.moves <= 2 * 4 * 2000
    assert sent == "a" * (2000 - (MAX_STOP_CHARS - 1)) and not stream.stopped
