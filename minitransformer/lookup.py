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
the earliest): in a rewrite the nearest earlier occurrence is the one being copied.
Leaves out: suffix trees and other indexes (a scan of a few thousand tokens is cheap here).
"""
from dataclasses import dataclass

import numpy as np

# Written for this project: a passage to be copied (the task where prompt lookup pays).
PASSAGE = ("The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper "
           "climbed its one hundred and twelve steps, trimmed the wick, polished the lens and "
           "lit the lamp. Ships far out at sea saw the light turn once every ten seconds and "
           "knew where the rocks were. In the morning he put the lamp out, wrote the weather "
           "in his book, and went down the steps to make his breakfast.")
TASK = "Rewrite the following passage exactly, word for word:\n\n"


@dataclass(frozen=True)
class PromptLookup:
    """The draft for speculative_generate: n-grams of max_ngram down to min_ngram tokens."""
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def propose(self, tokens, n: int) -> list:
        return prompt_lookup(tokens, n, self.max_ngram, self.min_ngram)


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
    L = len(seq)
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier k-gram could end (its last)
    for k in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # a k-gram ending at e matches the last k tokens when seq[e - j] == seq[L-1 - j] for
        # j < k (e = L - 1 itself is not an earlier occurrence): the candidates, narrowed
        found = ends[ends >= k - 1]
        for j in range(1, k):
            found = found[seq[found - j] == seq[L - 1 - j]]
        if len(found):
            follow = found[-1] + 1                                      # latest match
            return seq[follow:follow + n].tolist()
    return []


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
