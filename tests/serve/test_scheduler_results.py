"""What the scheduler writes into each request's result and its own counters, as a user reads
them: the times (first token, last token, handed back) under both policies and when
cancelled, the status and reason, the counts of chunks, preemptions and cached prompt tokens,
and what reserving every sequence's maximum would hold. No model, no array (test_scheduler's
stand-in run)."""
import math

from minitransformer.serve.blocks import BlockManager
from minitransformer.serve.records import Request, Result
from minitransformer.serve.scheduler import Scheduler, Sequence
from test_scheduler import ids, queue, scheduler, step


def test_a_finished_request_records_when_its_first_and_last_tokens_were_made():
    """A 2-token prompt, 3 new tokens, one step a second: the first token at the prefill's
    step (1.0), the last at the third step (3.0), handed back then; no reason."""
    s = scheduler()
    seq, = queue(s, 0, 2, 3)
    for now in (1.0, 2.0, 3.0):
        step(s, now)
    r = seq.result
    assert (r.status, r.reason) == ("finished", "")
    assert (r.first_token, r.ended, r.returned) == (1.0, 3.0, 3.0)


def test_the_default_policy_is_continuous():
    """A scheduler made without a policy returns a short request as soon as it is over and
    lets the next one into its slot at once, as "continuous" does."""
    s = Scheduler(BlockManager(32, 4), slots=2)
    short, = queue(s, 0, 2, 1)
    long, = queue(s, 1, 2, 3, first_token=20)
    third, = queue(s, 2, 2, 1, first_token=40, arrival=1.0)
    step(s, 0.0)
    assert short.result.returned == 0.0 and short.result.id not in s.books.seqs
    plan = step(s, 1.0)
    assert ids(plan.admitted) == [2]


def test_static_returns_a_finished_member_only_when_its_batch_ends():
    """Under static batching a member that made its last token is finished then, but handed
    back (returned) only with its whole batch; every block goes back to the pool then."""
    s = scheduler(slots=2, policy="static")
    short, = queue(s, 0, 2, 1)
    long, = queue(s, 1, 2, 3, first_token=20)
    step(s, 1.0)
    assert short.result.status == "finished" and short.result.ended == 1.0
    assert math.isnan(short.result.returned)
    step(s, 2.0)
    assert math.isnan(short.result.returned)
    step(s, 3.0)
    assert short.result.returned == long.result.returned == 3.0
    assert short.result.ended == 1.0 and long.result.ended == 3.0
    assert not s.books.seqs and s.books.num_free == 32


def test_a_request_prefilled_in_chunks_counts_them():
    s = scheduler(budget=4)
    seq, = queue(s, 0, 10, 2)
    while not seq.result.tokens:
        step(s)
    assert seq.result.prefill_chunks == 3           # 4 + 4 + 2


def test_preemptions_are_counted_per_request_and_in_all():
    """Prompts of 1, 1 and 2 tokens (3, 6 and 6 new) in a pool of 5 blocks of 2: the third,
    the latest admitted, is swapped out at step 2 when the pool cannot take every next token,
    comes back at 3 (the first is over), and is swapped out again at 5: twice, and nobody
    else; each request still makes all its tokens."""
    s = scheduler(num_blocks=5, block_size=2, slots=3)
    seqs = [queue(s, i, n, new, first_token=10 * i)[0]
            for i, (n, new) in enumerate(((1, 3), (1, 6), (2, 6)))]
    preempted = []
    for now in range(12):
        preempted += [(now, *ids(step(s, float(now)).preempted))]
    assert [p for p in preempted if len(p) > 1] == [(2, 2), (5, 2)]
    assert [seq.result.preemptions for seq in seqs] == [0, 0, 2]
    assert s.preemptions == 2
    assert [len(seq.result.tokens) for seq in seqs] == [3, 6, 6]
    assert all(seq.result.status == "finished" for seq in seqs)


def test_cancelling_records_the_time_for_a_waiting_and_a_running_request():
    """Cancelled at 2.0: over and handed back then, its status cancelled; a running one's
    blocks go back to the pool and its slot takes the next request."""
    s = scheduler(slots=1)
    running, = queue(s, 0, 2, 5)
    waiting, = queue(s, 1, 2, 5, first_token=20)
    other, = queue(s, 2, 2, 5, first_token=40)
    step(s, 1.0)
    assert s.cancel(2, 2.0)                         # not the first in the queue
    assert s.cancel(0, 2.0)
    for seq in (running, other):
        r = seq.result
        assert (r.status, r.reason, r.ended, r.returned) == ("cancelled", "", 2.0, 2.0)
    assert 0 not in s.books.seqs and s.slots == [None]
    assert s.books.num_free == 32
    plan = step(s, 3.0)
    assert ids(plan.admitted) == [1]
    assert not s.cancel(0, 3.0)


def test_the_prefix_cache_counts_every_prompt_token_looked_up_and_found():
    s = scheduler(slots=2)
    queue(s, 0, 9, 2)
    queue(s, 1, 9, 2)                               # the same prompt: 8 found
    step(s)
    assert (s.prefix_queries, s.prefix_hits) == (18, 8)


def test_nothing_is_looked_up_when_prefix_caching_is_off_or_every_position_is_scored():
    off = Scheduler(BlockManager(32, 4), 2, prefix_caching=False)
    queue(off, 0, 9, 2)
    queue(off, 1, 9, 2)
    step(off)
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)
    on = scheduler(slots=2)
    queue(on, 0, 9, 2)
    scored = Request(tuple(range(1, 10)), 2, prompt_logprobs=0)
    seq = Sequence(Result(1, 0.0, scored), list(scored.prompt), eos={-1})
    on.waiting.append(seq)
    plan = step(on)
    assert (on.prefix_queries, on.prefix_hits) == (9, 0)
    assert seq.result.cached_tokens == 0            # its whole prompt is computed
    assert [(w.starts, w.n) for w in plan.prefill] == [([0], 9), ([0], 9)]


def test_a_prompt_scored_at_every_position_starts_its_logprobs_with_none_for_the_first():
    """Asked: [None] at admission (nothing predicts the first token), the engine appends the
    rest; not asked: None. The samples of one prompt share its prompt logprobs."""
    s = scheduler(slots=3)
    plain, = queue(s, 0, 3, 2)
    scored = Request((5, 6, 7), 2, n=2, prompt_logprobs=1)
    first, second = (Sequence(Result(1 + i, 0.0, scored, choice=i), list(scored.prompt),
                              eos={-1}) for i in range(2))
    second.shares_prompt_with = first
    s.waiting.extend([first, second])
    step(s)
    assert plain.result.prompt_logprobs is None
    assert first.result.prompt_logprobs == [None]
    assert second.result.prompt_logprobs is first.result.prompt_logprobs


def test_the_books_reserve_each_sequences_prompt_and_new_tokens():
    """tokens_reserved (what reserving every sequence's maximum would hold) is the sum of
    each admitted request's prompt and max_new_tokens."""
    s = scheduler(slots=2)
    queue(s, 0, 5, 7)
    queue(s, 1, 3, 20, first_token=50)
    step(s)
    assert s.books.stats().tokens_reserved == (5 + 7) + (3 + 20)
