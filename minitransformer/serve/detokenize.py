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

>>> from minitransformer.synth import train_tokenizer
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

    >>> from minitransformer.synth import train_tokenizer
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
        self.stop = [s for s in stop if s]
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
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        cut = len(self.pending) - (0 if final else self._may_begin_stop())
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def _may_begin_stop(self) -> int:
        """How many characters at the end of pending could be the start of a stop string."""
        return max((n for s in self.stop for n in range(1, len(s))
                    if self.pending.endswith(s[:n])), default=0)
