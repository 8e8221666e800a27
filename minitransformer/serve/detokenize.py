"""Token ids in, text out, one piece at a time: what a stream shows while tokens are made.

Decoding each token alone is wrong in two ways. A SentencePiece token carries its space as a
prefix (``▁ball``) that the decoder strips at the start of a text, so ``decode([t])`` loses
every space: ``abig,redball.``. And a byte-level token can hold half of a multi-byte character,
which decodes alone to U+FFFD. So the detokenizer decodes a short window of recent tokens twice,
without and with the new one, and sends the difference, holding it back while the text ends in
an incomplete character (the rule of vLLM's incremental detokenizer and HF's TextStreamer).

The window starts a few tokens before the first new one (the end of the prompt), so the first
piece keeps its leading space. ``TextStream`` adds OpenAI's ``stop`` strings: text that might be
the start of a stop string is held back until it is known not to be one.

>>> from minitransformer.checkpoints.synth import train_tokenizer
>>> from minitransformer.tokenizer import Tokenizer
>>> tokenizer = Tokenizer(train_tokenizer(300), None, False)
>>> ids = tokenizer.encode("The cat sat. Voilà: 漢字!")
>>> detok = Detokenizer(tokenizer)
>>> pieces = [detok.add(i) for i in ids]
>>> "".join(pieces) + detok.flush()
'The cat sat. Voilà: 漢字!'
>>> any("\\ufffd" in piece for piece in pieces)     # a character is never split
False

Leaves out: the detokenizer does not undo ``clean_up_tokenization_spaces``.
"""
REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not yet a whole character
CONTEXT = 5             # prompt tokens decoded with the first new ones, for their spaces


class Detokenizer:
    """Feed token ids with ``add``; each call returns the text that became final (maybe "")."""

    def __init__(self, tokenizer, prompt=()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in list(prompt)[-CONTEXT:]]
        self.start = 0              # the window to decode: ids[start:]
        self.sent = len(self.ids)   # ids[start:sent] were already turned into text

    def add(self, token) -> str:
        piece = self.peek([token])[0]
        self.ids.append(int(token))
        if piece:
            self.start, self.sent = self.sent, len(self.ids)
        return piece

    def peek(self, tokens) -> list:
        """The text ``add`` would return for each of tokens, put next instead of one another,
        without adding any: how logprobs name a token (and each alternative to it), by the text
        it adds to the output. "" for a token that ends in an incomplete character (its bytes
        are named by the token that completes it, which carries the whole character: vLLM's
        rule) or adds no text (a special token)."""
        window = self.ids[self.start:]
        before = self.tokenizer.decode(self.ids[self.start:self.sent])
        pieces = []
        for token in tokens:
            after = self.tokenizer.decode(window + [int(token)])
            new = len(after) > len(before) and not after.endswith(REPLACEMENT)
            pieces.append(after[len(before):] if new else "")
        return pieces

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character shows as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.start:self.sent])
        after = self.tokenizer.decode(self.ids[self.start:])
        self.start = self.sent = len(self.ids)
        return after[len(before):]


class TextStream:
    """A Detokenizer that also stops at OpenAI ``stop`` strings (cut before the stop).

    >>> from minitransformer.checkpoints.synth import train_tokenizer
    >>> from minitransformer.tokenizer import Tokenizer
    >>> tokenizer = Tokenizer(train_tokenizer(300), None, False)
    >>> text = TextStream(tokenizer, stop=["dog"])
    >>> "".join(text.add(i) for i in tokenizer.encode("The cat sat. The dog ran."))
    'The cat sat. The '
    >>> text.stopped
    True
    """

    def __init__(self, tokenizer, prompt=(), stop=()):
        self.detokenizer = Detokenizer(tokenizer, prompt)
        self.stop = StopStrings(stop) if not isinstance(stop, StopStrings) else stop.fresh()
        self.pending = ""           # decoded but not sent: it may begin a stop string
        self.stopped = False

    def add(self, token) -> str:
        if self.stopped:
            return ""
        return self._release(self.detokenizer.add(token), final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._release(self.detokenizer.flush(), final=True)

    def _release(self, text, final) -> str:
        self.pending += text
        start = self.stop.feed(text)    # where in text the first stop string begins, if any
        if start is not None:
            self.stopped = True
            out, self.pending = self.pending[:len(self.pending) - len(text) + start], ""
            return out
        cut = len(self.pending) - (0 if final else self.stop.partial())
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out


class StopStrings:
    """Stop strings found in a stream of text in time linear in the text (Knuth-Morris-Pratt).

    One automaton per string: its state is how many of the string's first characters the text
    now ends with. A character moves each state forward one, or back along the string's
    failure table (the longest proper prefix that is also a suffix of what matched), so feeding
    c characters costs at most 2c moves per string, whatever the strings' lengths; the table is
    built once, in time linear in the string. ``partial`` (the largest state) is how much of
    the text's end may still begin a stop string: what a stream holds back. ``moves`` counts
    the automata's moves (the work done).

    >>> stop = StopStrings(["abab", "x"])
    >>> stop.feed("aaba"), stop.partial()      # no stop yet; "aba" may begin "abab"
    (None, 3)
    >>> stop.feed("bz")                        # "abab" ends here: it began 3 characters back
    -3
    >>> StopStrings(["", "b"]).feed("ab")        # an empty string is no stop string
    1
    """

    def __init__(self, stops=(), tables=None):
        self.stops = tuple(s for s in stops if s)   # an empty string stops nothing
        self.tables = tables or tuple(failure_table(s) for s in self.stops)
        self.states = [0] * len(self.stops)
        self.moves = 0

    def fresh(self) -> "StopStrings":
        """The same strings, nothing matched yet (the tables shared, not rebuilt)."""
        return StopStrings(self.stops, self.tables)

    def feed(self, text: str):
        """Read text -> where (an index into text; negative: in text fed before) the earliest
        stop string found in it begins, or None."""
        found = None
        for k, (stop, table) in enumerate(zip(self.stops, self.tables, strict=True)):
            state = self.states[k]
            for i, char in enumerate(text):
                while state and stop[state] != char:
                    state, self.moves = table[state - 1], self.moves + 1
                state += stop[state] == char
                self.moves += 1
                if state == len(stop):
                    begin = i + 1 - len(stop)
                    found = begin if found is None else min(found, begin)
                    break
            self.states[k] = state
        return found

    def partial(self) -> int:
        """Characters at the end of the text read that may be the start of a stop string."""
        return max(self.states, default=0)


def failure_table(s: str) -> list:
    """table[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix.

    >>> failure_table("abab"), failure_table("aaab")
    ([0, 0, 1, 2], [0, 1, 2, 0])
    """
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        k += s[i] == s[k]
        table[i] = k
    return table
