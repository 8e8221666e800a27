"""Prompt lookup: a speculative draft that costs nothing, copied from the text itself.

Serves experiment 22. When the output repeats its input (rewriting a passage, quoting code,
answering from a document), the tokens after the last few ones have often been seen before:
find the latest earlier place where the sequence's last k tokens occurred, and propose the
tokens that followed there. No draft model, no draft cache, no forward pass; the target
verifies the proposals in one pass as it would a model's (speculative.py). Where nothing
matches the round proposes nothing and is a plain decode step.

The same idea as Hugging Face transformers' `prompt_lookup_num_tokens` and vLLM's `ngram`
speculative method: try the longest n-gram first (max_ngram down to min_ngram), since a longer
match predicts the continuation better. This one takes the latest match (transformers takes
the earliest): in a rewrite the nearest earlier occurrence is the one being copied. The
server's lookup (``lookup_past_insertion``) also keeps its place in a copy when the model puts
in a token of its own (a comma): it resumes past it.
Leaves out: suffix trees and other indexes (a scan of a few thousand tokens is cheap here).
"""
from dataclasses import dataclass

import numpy as np

from minitransformer.checks import is_integer

# Written for this project: a passage to be copied (the task where prompt lookup pays).
PASSAGE = ("The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper "
           "climbed its one hundred and twelve steps, trimmed the wick, polished the lens and "
           "lit the lamp. Ships far out at sea saw the light turn once every ten seconds and "
           "knew where the rocks were. In the morning he put the lamp out, wrote the weather "
           "in his book, and went down the steps to make his breakfast.")
TASK = "Rewrite the following passage exactly, word for word:\n\n"


@dataclass(frozen=True)
class PromptLookup:
    """The draft for speculative_generate: n-grams of max_ngram down to min_ngram tokens;
    past_insertion: a copy resumes past one token the text put in (``lookup_past_insertion``,
    the server's lookup), else the plain rule (``prompt_lookup``, transformers' and vLLM's)."""
    max_ngram: int = 3
    min_ngram: int = 1
    past_insertion: bool = False

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            if not is_integer(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not isinstance(self.past_insertion, (bool, np.bool_)):
            raise ValueError(f"past_insertion must be True or False, "
                             f"got {self.past_insertion!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def propose(self, tokens, n: int) -> list:
        rule = lookup_past_insertion if self.past_insertion else prompt_lookup
        return rule(tokens, n, self.max_ngram, self.min_ngram)


def prompt_lookup(tokens, n: int, max_ngram: int = 3, min_ngram: int = 1) -> list:
    """Up to n tokens that followed the latest earlier occurrence of the last k tokens.

    k goes from max_ngram down to min_ngram; the first k that has an earlier occurrence with
    something after it wins. [] when none has (then the round drafts nothing).

    >>> prompt_lookup([5, 6, 7, 9, 5, 6], 3)    # "5 6" was seen before, then came 7 9 5
    [7, 9, 5]
    >>> prompt_lookup([1, 2, 1, 3, 1], 2)       # "1" was last seen before 3
    [3, 1]
    >>> prompt_lookup([1, 2, 3], 4)             # nothing repeats
    []
    """
    seq = np.asarray(tokens)
    k, follow = latest_match(seq, max_ngram, min_ngram)
    return seq[follow:follow + n].tolist() if k else []


def lookup_past_insertion(tokens, n: int, max_ngram: int = 3, min_ngram: int = 1) -> list:
    """prompt_lookup, unless the text has just put in a token of its own while copying: where
    the n-gram ending one token before the last has a longer earlier match than the n-gram
    ending at the last, the last token is taken as put in (a comma the copy lacks), and the
    proposals are what followed that longer match: the copy resumes where it was.

    A model rewriting a passage adds a comma, "every evening, the keeper": the last 1-gram
    "," matches some comma of the passage, a wrong place, and its proposals are rejected at
    once; "bay. Every evening" (4 tokens) ending just before it matches the passage, and
    what followed there, "the keeper", is what the model writes next.

    >>> text = [5, 6, 7, 8, 9, 2, 5, 6, 7, 0]    # "5 6 7" copied, then 0 put in
    >>> prompt_lookup(text, 3), lookup_past_insertion(text, 3)
    ([], [8, 9, 2])
    >>> lookup_past_insertion([1, 2, 1, 3, 1], 2)  # a longer match at the last token: as before
    [3, 1]
    """
    seq = np.asarray(tokens)
    k, follow = latest_match(seq, max_ngram, min_ngram)
    if k < max_ngram:                               # (else none before it is longer)
        before, resume = latest_match(seq[:-1], max_ngram, min_ngram)
        if before > k:                              # the last token was put in
            k, follow = before, resume
    return seq[follow:follow + n].tolist() if k else []


def latest_match(seq: np.ndarray, max_ngram: int, min_ngram: int) -> tuple:
    """The longest k (max_ngram down to min_ngram) whose last k tokens of seq occurred earlier
    -> (k, where what followed their latest earlier occurrence starts); (0, None) if none.
    The n-gram grows back from the last token while an earlier occurrence of it remains."""
    L, k, follow = len(seq), 0, None
    if L < 2:
        return k, follow
    found = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier 1-gram ends (e < L - 1)
    for size in range(1, min(max_ngram, L - 1) + 1):
        if size > 1:            # the ends whose n-gram also holds seq[L - size], size - 1 back
            found = found[found >= size - 1]
            found = found[seq[found - size + 1] == seq[L - size]]
        if not len(found):
            break
        k, follow = size, found[-1] + 1                                 # latest match
    return (k, follow) if k >= min_ngram else (0, None)


def replay(tokens, prompt_len: int, gamma: int, draft: PromptLookup) -> list:
    """The rounds speculative_generate would run with this draft, given the tokens it yields.

    Greedy speculative decoding yields plain greedy's tokens, so its rounds follow from them:
    each round proposes what the lookup finds in the tokens so far and keeps the proposals
    that match the next tokens, then one more. -> [(proposed, kept), ...], one per target pass.
    No model is run: this is how experiment 22 predicts the passes of every gamma.

    Prompt 1 2 3 1, then greedy's 2 3 1 2 9: round 1 copies "2 3" (what followed the earlier
    "1") and the target adds 1; round 2 copies "2", the target adds 9.
    >>> replay([1, 2, 3, 1, 2, 3, 1, 2, 9], prompt_len=4, gamma=2, draft=PromptLookup())
    [(2, 2), (1, 1)]
    """
    rounds, t = [], prompt_len
    while t < len(tokens):
        n = min(gamma, len(tokens) - t - 1)   # never past the end, as speculative_generate
        proposals = draft.propose(tokens[:t], n) if n > 0 else []
        kept = 0
        while kept < len(proposals) and proposals[kept] == tokens[t + kept]:
            kept += 1
        rounds.append((len(proposals), kept))
        t += kept + 1
    return rounds


def rewrite_prompt(model, passage: str = PASSAGE) -> list:
    """The rewrite task as token ids: through the chat template when the model has one."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: no tokenizer.json, cannot encode the rewrite task")
    if model.tokenizer.chat_template:
        return model.tokenizer.chat_prompt([{"role": "user", "content": TASK + passage}])
    return model.tokenizer.encode(TASK + passage + "\n\n")
