"""The scheduler's plans, made and read with no model and no array: the block manager's books
(host integers) and a stand-in for the run that appends a token per sampled sequence."""
import ast
from pathlib import Path

import pytest

from minitransformer.serve.blocks import BlockManager, Copy, SwapIn, SwapOut
from minitransformer.serve.records import Request
from minitransformer.serve.scheduler import Made, Scheduler, fan_out

SERVE = Path(__file__).resolve().parents[2] / "minitransformer" / "serve"


def scheduler(num_blocks=32, block_size=4, slots=2, policy="continuous", budget=None):
    return Scheduler(BlockManager(num_blocks, block_size), slots, policy, budget)


def queue(scheduler, first_id, prompt_len, max_new, n=1, first_token=1, arrival=0.0):
    """A request of n samples (ids first_id ..), fanned out as the engine fans it out (fan_out)
    -> its sequences, queued one behind the other."""
    request = Request(tuple(range(first_token, first_token + prompt_len)), max_new, n=n,
                      arrival=arrival)
    seqs = fan_out(request, first_id, list(request.prompt), [None] * n, {-1})
    scheduler.waiting.extend(seqs)
    return seqs


def run(plan, token=7) -> Made:
    """What the engine's run gives back, writing nothing to the books: every decoding row
    and every prompt's samples sample a token (here always `token`), a padding row's is
    thrown away -> what the passes made, all of them run."""
    made = [seq for work in [plan.decode] + plan.prefill for seq in work.firsts]
    made += [row for row in plan.decode.rows if not row.padding]
    for seq in made:
        seq.tokens.append(token)
        seq.result.tokens.append(token)
    return Made(made, [plan.decode] + plan.prefill)


def step(s, now=0.0):
    plan = s.schedule(now)
    s.commit(run(plan), now)        # slots written, padding rows trimmed back, retirements
    s.books.check()
    books = s.books                 # readied, unwritten: only blocks past a sequence's length
    assert all(any(b in seq.blocks[books.blocks_for(seq.length):] for seq in books.seqs.values())
               for b in books.filling), "a planned write was not made"
    return plan


def ids(seqs):
    return [seq.result.id for seq in seqs]


def test_the_budget_splits_a_prompt_and_admits_the_next_in_the_room_left():
    s = scheduler(budget=6)
    a, = queue(s, 0, 10, 3)
    b, = queue(s, 1, 3, 3, first_token=50)
    plan = step(s)
    assert [(ids(w.rows), w.starts, w.n) for w in plan.prefill] == [([0], [0], 6)]
    assert ids(plan.admitted) == [0] and not plan.decode.rows
    plan = step(s)                  # a's last 4 tokens, then b enters with the 2 left
    assert [(ids(w.rows), w.starts, w.n) for w in plan.prefill] == [([0], [6], 4),
                                                                     ([1], [0], 2)]
    assert ids(plan.prefill[0].firsts) == [0] and not plan.prefill[1].firsts
    assert ids(plan.admitted) == [1] and a.result.tokens == [7]
    plan = step(s)                  # a decodes (1 token), b's last prompt token
    assert ids(plan.decode.rows) == [0] and plan.decode.starts == [10]
    assert [(ids(w.rows), w.starts, w.n) for w in plan.prefill] == [([1], [2], 1)]
    step(s)
    assert a.result.status == "finished" and len(b.result.tokens) == 2


@pytest.mark.parametrize("policy, admitted_at", [("continuous", 1), ("static", 3)])
def test_a_free_slot_takes_the_next_request_at_once_only_under_continuous(policy, admitted_at):
    """Two requests enter at 0 into 3 slots; a third arrives at 1: continuous admits it into
    the free slot then, static once the batch is over (its short member held as padding)."""
    s = scheduler(slots=3, policy=policy)
    short, = queue(s, 0, 2, 1)
    long, = queue(s, 1, 2, 3, first_token=20)
    third, = queue(s, 2, 2, 1, first_token=40, arrival=1.0)
    admitted, padding = {}, []
    for i in range(6):
        plan = s.schedule(float(i))
        admitted.update((seq.result.id, i) for seq in plan.admitted)
        padding += [ids([row]) for row in plan.decode.rows if row.padding]
        s.commit(run(plan), float(i))
    assert admitted == {0: 0, 1: 0, 2: admitted_at}
    assert (padding == [[0], [0]]) == (policy == "static")   # short's row, held as padding
    assert short.result.returned == (0.0 if policy == "continuous" else 2.0)
    assert third.result.status == long.result.status == "finished"


def test_the_latest_admitted_is_preempted_to_host_and_comes_back_first():
    s = scheduler(num_blocks=4, block_size=2, slots=2)
    early, = queue(s, 0, 3, 6)      # prompts of 2 blocks each, the whole pool
    late, = queue(s, 1, 3, 6, first_token=30)
    step(s)                         # both prefilled: 3 tokens held each
    step(s, 1.0)                    # the 4th fills their second blocks
    plan = s.schedule(2.0)          # each wants a third block for its 5th: none free
    assert ids(plan.preempted) == [1] and ids(plan.decode.rows) == [0]
    assert [type(m) for m in plan.decode.moves] == [SwapOut]
    assert plan.decode.moves[0].into is late.swapped and late.swapped.length == 4
    assert late.result.status == "waiting" and s.waiting[0] is late and s.preemptions == 1
    s.commit(run(plan), 2.0)
    while late.swapped is not None:
        plan = step(s, 3.0)
    assert [type(m) for m in plan.moves] == [SwapIn]  # back in once early's blocks are free
    assert early.result.status == "finished"


def test_samples_enter_when_slots_for_all_are_free_and_fork_at_the_last_chunk():
    """The first sample is admitted only with slots for its sharers; they wait at the head of
    the queue, so nobody behind them takes those slots, and enter by fork at the last chunk."""
    s = scheduler(slots=3, budget=4)
    busy, = queue(s, 9, 2, 2, first_token=90)
    group = queue(s, 0, 10, 2, n=3)
    other, = queue(s, 3, 2, 2, first_token=60)
    step(s)
    plan = step(s)                  # busy decodes: two slots free, three needed
    assert not plan.admitted and s.waiting[0] is group[0]
    plan = step(s)                  # busy is over
    assert busy.result.status == "finished"
    assert ids(plan.admitted) == [0] and ids(s.waiting) == [1, 2, 3] and s.queued() == 1
    plan = step(s)                  # two slots free: the sharers wait, and other behind them
    assert ids(s.running()) == [0] and not plan.admitted
    plan = step(s)                  # chunks of 4, 4, 2: the samples fork at the last
    assert ids(plan.prefill[0].firsts) == [0, 1, 2] and ids(s.waiting) == [3]
    assert all(seq.shares_prompt_with is None for seq in group)
    assert s.books.seqs[1].blocks == s.books.seqs[0].blocks
    assert [seq.result.tokens for seq in group] == [[7]] * 3
    plan = step(s)                  # the samples' first decode copies the shared last block
    assert ids(plan.decode.rows) == [0, 1, 2] and not plan.prefill
    assert sum(isinstance(m, Copy) for m in plan.decode.moves) == 2


def test_the_first_sample_enters_only_with_a_block_for_each_sharers_first_token():
    """3 samples of a 10-token prompt (blocks of 4): its 3 blocks, and at the first decode
    two copies of the half-filled last block (the third sample writes into it): 5 blocks.
    With 4 the first sample does not enter; with 5 it does, and nobody is ever preempted."""
    for num_blocks in (4, 5):
        s = scheduler(num_blocks=num_blocks, slots=3)
        queue(s, 0, 10, 3, n=3)
        plan = step(s)
        assert ids(plan.admitted) == ([] if num_blocks == 4 else [0])
    assert ids(plan.prefill[0].firsts) == [0, 1, 2]
    plan = step(s)
    assert not plan.preempted and sum(isinstance(m, Copy) for m in plan.decode.moves) == 2
    assert s.books.num_free == 0


def test_a_prompt_admitted_later_in_a_plan_finds_the_blocks_an_earlier_chunk_names():
    s = scheduler(slots=2)
    queue(s, 0, 9, 2)
    twin, = queue(s, 1, 9, 2)       # the same prompt
    plan = step(s)
    assert [(w.starts, w.n) for w in plan.prefill] == [([0], 9), ([8], 1)]
    assert twin.result.cached_tokens == 8 and s.prefix_hits == 8


def test_cancelling_a_prompt_hands_its_place_to_its_next_sample():
    s = scheduler(slots=2)
    queue(s, 0, 2, 3)
    group = queue(s, 1, 3, 3, n=2, first_token=10)
    step(s)
    assert s.cancel(group[0].result.id, 1.0) and s.waiting[0] is group[1]
    assert group[0].result.status == "cancelled" and group[1].shares_prompt_with is None
    assert not s.cancel(group[0].result.id, 1.0)


def imports(module) -> set:
    tree = ast.parse((SERVE / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names}


def test_the_books_and_the_scheduler_never_import_the_model_or_the_device():
    """Decide (scheduler), account (blocks), compute (paged, engine): who imports whom."""
    assert imports("blocks") <= {"hashlib", "collections", "dataclasses", "numpy",
                                 "minitransformer.shape"}
    assert imports("scheduler") <= {"collections", "dataclasses", "minitransformer.serve.blocks",
                                    "minitransformer.serve.records"}
    assert "minitransformer.serve.scheduler" not in imports("paged")


def test_the_runner_is_the_one_room_of_serve_that_runs_the_model():
    """Compute (runner): the engine and the draft model run their passes through a Runner,
    and the runner, which samples nothing and writes no book, knows no plan."""
    model = {"minitransformer.model", "minitransformer.generate"}
    assert model <= imports("runner")
    assert not model & (imports("engine") | imports("drafting") | imports("speculate"))
    assert not {"minitransformer.serve.scheduler", "minitransformer.sampling",
                "minitransformer.serve.speculate"} & imports("runner")
