"""Who the scheduler lets in, and what it spends: memory admission at its exact thresholds (a
new prompt, one asking every prompt position's logprobs, a preempted sequence coming back,
beside running ones that grow), the token budget shared by decodes and chunks, padding rows
freed before anyone is preempted, a preempted sequence resuming and finishing, the moves each
pass must do first, and cancelling among samples. No model, no array (test_scheduler's
stand-in run)."""
import pytest

from minitransformer.serve.blocks import BlockManager, Copy, Swapped
from minitransformer.serve.records import Request, Result
from minitransformer.serve.scheduler import Scheduler, Sequence
from test_scheduler import ids, queue, scheduler, step


def one(num_blocks, block_size, seq):
    """A scheduler over an empty pool with seq at the head of its queue -> its first plan."""
    s = Scheduler(BlockManager(num_blocks, block_size), 2)
    s.waiting.append(seq)
    return s.schedule(0.0)


def sequence(prompt_len, prompt_logprobs=None):
    request = Request(tuple(range(1, prompt_len + 1)), 4, prompt_logprobs=prompt_logprobs)
    return Sequence(Result(0, 0.0, request), list(request.prompt), eos={-1})


@pytest.mark.parametrize("free, enters", [(2, False), (3, True)])
def test_a_new_prompt_enters_only_with_room_for_its_next_token(free, enters):
    """4 tokens in blocks of 2: its 2 blocks and a third for its first new token."""
    assert bool(one(free, 2, sequence(4)).admitted) == enters


@pytest.mark.parametrize("free, enters", [(1, False), (2, True)])
def test_a_prompt_scored_at_every_position_enters_with_room_for_its_next_token(free, enters):
    """3 tokens in blocks of 2, its whole prompt computed (no cache): 2 blocks, the second
    with room for the first new token."""
    assert bool(one(free, 2, sequence(3, prompt_logprobs=0)).admitted) == enters


@pytest.mark.parametrize("length, blocks, free, enters",
                         [(4, 2, 2, False), (4, 2, 3, True), (5, 3, 3, True)])
def test_a_preempted_sequence_comes_back_only_with_room_for_its_next_token(length, blocks, free,
                                                                          enters):
    """Swapped out at length 4 in 2 full blocks of 2, it needs a third for its next token; at
    length 5 in 3 blocks its next token fits the third."""
    seq = sequence(3)
    seq.tokens += [7] * (length - 3)
    seq.result.tokens = [7] * (length - 3)
    seq.swapped = Swapped(length, length + 3, blocks)
    plan = one(free, 2, seq)
    assert bool(plan.admitted) == enters
    assert (seq.swapped is None) == enters


def test_admission_counts_the_blocks_the_running_sequences_next_tokens_take():
    """Blocks of 1 token: a running sequence's every next token takes a block. With 4 blocks,
    after it has 2, a 1-token prompt needs 2 and the running one 1 more: 3 > 2 free, so the
    newcomer waits (it would make the next step preempt); with 5 it enters."""
    for num_blocks, enters in ((4, False), (5, True)):
        s = scheduler(num_blocks=num_blocks, block_size=1, slots=2)
        queue(s, 0, 1, 10)
        late, = queue(s, 1, 1, 10, first_token=20, arrival=1.0)
        step(s, 0.0)
        plan = step(s, 1.0)
        assert (ids(plan.admitted) == [1]) == enters
        assert not plan.preempted


def test_the_decodes_spend_the_budget_before_the_chunks():
    """A budget of 6 with one sequence decoding: a waiting 10-token prompt gets 5."""
    s = scheduler(budget=6)
    queue(s, 0, 2, 5)
    step(s)
    queue(s, 1, 10, 2, first_token=20)
    plan = step(s)
    assert ids(plan.decode.rows) == [0] and plan.decode.n == 1
    assert [(ids(w.rows), w.n) for w in plan.prefill] == [([1], 5)]


def test_the_last_token_of_the_budget_is_spent_on_a_chunk():
    s = scheduler(budget=1)
    queue(s, 0, 3, 2)
    assert [(w.starts, w.n) for w in step(s).prefill] == [([0], 1)]


def test_a_decoded_block_is_offered_to_later_prompts():
    """A 3-token prompt's first new token fills its first block of 4 (at its first decode):
    a later prompt starting with those 4 tokens finds them cached."""
    s = scheduler(slots=2)
    first, = queue(s, 0, 3, 3)
    step(s)
    step(s)
    later = Request((1, 2, 3, 7, 50, 51), 2)
    seq = Sequence(Result(1, 0.0, later), list(later.prompt), eos={-1})
    s.waiting.append(seq)
    step(s)
    assert seq.result.cached_tokens == 4


def test_padding_rows_are_freed_before_anyone_is_preempted():
    """Static batching, blocks of 2, a pool of 3: a 1-token prompt done at its first token is
    held as padding (its block, its row's token thrown away) beside a 3-token one, which
    fills the pool; when the running member's 5th token needs a block, the padding row's
    block goes back and the member keeps decoding. The member done early is still handed
    back with its batch."""
    s = scheduler(num_blocks=3, block_size=2, slots=2, policy="static")
    short, = queue(s, 0, 1, 1)
    long, = queue(s, 1, 3, 4, first_token=20)
    step(s, 0.0)
    step(s, 1.0)
    plan = step(s, 2.0)
    assert not plan.preempted and ids(plan.decode.rows) == [1]
    assert 0 not in s.books.seqs and long.result.preemptions == 0
    while long.result.status != "finished":
        step(s, 3.0)
    assert short.result.returned == long.result.returned == 3.0
    assert not s.books.seqs


def test_a_preempted_sequence_resumes_finishes_and_the_next_enters_beside_it():
    """test_scheduler's preemption, with a third request queued behind: once the first is
    over, the preempted one is swapped back in and the third enters in the same step; the
    preempted one makes all its tokens."""
    s = scheduler(num_blocks=4, block_size=2, slots=2)
    early, = queue(s, 0, 3, 6)
    late, = queue(s, 1, 3, 6, first_token=30)
    third, = queue(s, 2, 1, 1, first_token=60)
    for now in range(3):
        step(s, float(now))
    assert late.swapped is not None and ids(s.waiting) == [1, 2]
    while late.swapped is not None:
        plan = step(s, 3.0)
    assert ids(plan.admitted) == [1, 2]
    while late.result.status != "finished":
        step(s, 4.0)
    assert late.result.tokens == [7] * 6 and third.result.tokens == [7]


def test_a_chunk_carries_the_copy_it_writes_into():
    """A prompt cached in full (8 tokens, blocks of 4) computes its last token in a copy of
    its last block: that copy is among its own chunk's moves, done before the chunk's pass."""
    s = scheduler(slots=2)
    queue(s, 0, 8, 2)
    step(s)
    queue(s, 1, 8, 2)
    plan = step(s)
    chunk, = plan.prefill
    assert ids(chunk.rows) == [1] and (chunk.starts, chunk.n) == ([7], 1)
    assert [type(m) for m in chunk.moves] == [Copy]
    assert not plan.moves


def test_cancelling_a_computing_sample_hands_the_prompt_to_the_next_the_others_share_it():
    """Three samples of one prompt waiting behind a busy slot; the first is cancelled: the
    second computes the prompt, the third shares it, and both start from its last chunk."""
    s = scheduler(slots=3)
    busy, = queue(s, 9, 2, 2, first_token=90)
    group = queue(s, 0, 5, 2, n=3)
    step(s)
    assert s.cancel(0, 1.0)
    assert group[1].shares_prompt_with is None and group[2].shares_prompt_with is group[1]
    while group[1].result.status == "waiting":
        plan = step(s, 2.0)
    assert ids(plan.prefill[0].firsts) == [1, 2]
    assert s.books.seqs[2].blocks == s.books.seqs[1].blocks
