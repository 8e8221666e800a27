"""Experiment 14: the paged KV cache's memory, against reserving each sequence's maximum.

Experiment 13's workload (64 requests, output lengths median 18, max 231, 1,874 tokens; prompts
of --prompt-len tokens) runs through the continuous-batching engine on the real model, and the
paged pool is read after every step: blocks held, slots filled, slots wasted in partly filled
blocks. Printed against what a contiguous cache would have reserved for the same sequences at
the same moments: each request's own maximum (prompt + max_new_tokens, if the server knew it),
or the model's whole context per sequence.

Then the block-size trade-off on the same workload (smaller blocks waste less and need longer
block tables), the waste of one sequence against its length (vLLM's 16-token blocks keep it
under 4% on average once sequences are a few hundred tokens long; short ones waste more), and
prefix sharing: the same requests behind a common system prompt, blocks held with and without
sharing, against the count the block arithmetic predicts.

Block accounting depends on lengths and block size, not on weights: the sweeps replay the
schedule on a one-layer stand-in with the same vocabulary and convert slots to the real
model's bytes; the stand-in's numbers are checked equal to the real run's at --block-size.
"""
import argparse
import tempfile

import numpy as np

from _common import (
    Progress,
    add_engine_arguments,
    add_model_argument,
    add_threads_argument,
    at_least,
    finished_progress,
    load_model,
    positive_int,
    positive_ints,
    say,
    timing_header,
)
from _table import Table

import minitransformer as mt
from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config
from minitransformer.serve.blocks import blocks_for
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import pool_for
from minitransformer.serve.records import Request
from sim.workload import skewed_lengths

MB = 1024 ** 2


def requests_for(lengths, prompt_len, vocab_size, seed, system=()):
    rng = np.random.default_rng(seed)
    return [Request(tuple(system) + tuple(rng.integers(0, vocab_size, prompt_len).tolist()), n,
                    eos_token_id=[]) for n in lengths]


def serve(model, requests, slots, block_size, share=True, progress=None):
    """-> the PagedStats of every step (continuous batching, a pool no request waits on).
    progress: a Progress over the requests, told as they finish."""
    config = EngineConfig(max_num_seqs=slots, block_size=block_size,
                          num_gpu_blocks_override=pool_for(requests, slots, block_size),
                          enable_prefix_caching=share)
    engine = Engine(model, config, history=True)
    return engine.run(requests, on_step=progress and finished_progress(progress)).memory


def totals(memory, context):
    """Step-averaged slots: held, filled, wasted; reserved two ways; peak blocks held."""
    held = np.mean([m.blocks_held * m.block_size for m in memory])
    filled = np.mean([m.slots_filled for m in memory])
    own = np.mean([m.tokens_reserved for m in memory])
    whole = np.mean([m.sequences * context for m in memory])
    logical = np.mean([m.tokens_logical for m in memory])
    return held, filled, own, whole, logical, max(m.blocks_held for m in memory)


def stand_in_of(config):
    """A one-layer model with the real one's vocabulary and context: the same block books."""
    with tempfile.TemporaryDirectory() as tmp:
        small = qwen2_config(vocab_size=config.vocab_size, hidden_size=16, intermediate_size=16,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=config.max_position_embeddings)
        return mt.load(make_checkpoint(tmp, small, seed=0))


def replay(stand_in, requests, args):
    """The stand-in's PagedStats per block size of the sweep, and at --block-size."""
    sweep, progress = {}, Progress(len(args.block_sizes), "stand-in replay")
    for bs in args.block_sizes:
        sweep[bs] = serve(stand_in, requests, args.slots, bs)
        progress(f"block size {bs}: {len(sweep[bs])} steps")
    return sweep, serve(stand_in, requests, args.slots, args.block_size)


def paged_table(real, lengths, same, context, args) -> Table:
    bpt = real[0].bytes_per_token
    held, filled, own, whole, logical, peak = totals(real, context)
    table = Table("Experiment 14: the paged KV cache on experiment 13's workload", experiment=14,
                  columns=[("approach", ""), ("held MB", ".2f"), ("used MB", ".2f"),
                           ("waste %", ".1f")])
    table.header(f"{len(lengths)} requests (prompts {args.prompt_len} tokens, outputs median "
                 f"{np.median(lengths):g}, max {max(lengths)}), {args.slots} slots, continuous "
                 f"batching; {bpt:,} bytes per token; means over the run's {len(real)} steps")
    rows = [(f"paged, {args.block_size}-token blocks (peak {peak} blocks)", held),
            ("reserve prompt + max_new_tokens per request", own),
            (f"reserve the whole {context:,}-token context", whole)]
    for name, slots in rows:
        table.row(name, slots * bpt / MB, filled * bpt / MB, 100 * (1 - filled / slots))
    sequences = np.mean([m.sequences for m in real])
    table.note(f"prefix caching (on) keeps finished requests' full blocks for later prompts: "
               f"{np.mean([m.blocks_cached for m in real]):.1f} blocks kept per step on "
               f"average, counted free and not held (evicted when the pool needs room), so "
               f"the held columns are what they were without it; chunked prefill (off) changes "
               f"when a prompt is computed, not what it holds (its whole prompt's blocks are "
               f"taken at admission)")
    table.note(f"paged waste: {held - filled:.1f} slots per step over {sequences:.1f} sequences "
               f"(at most {args.block_size - 1} each); stand-in replay identical to the real "
               "run: " + ("yes" if same else "NO"))
    table.plot("approach", ["held MB", "used MB"], "KV memory held: paged against reserving",
               kind="bar", logy=True, xlabel="approach", ylabel="KV memory (MB)")
    return table


def block_size_table(sweep, sizes, bpt, context) -> Table:
    table = Table("Block-size trade-off, same workload", experiment=14, chapter=False,
                  columns=[("block", "d"), ("held MB", ".2f"), ("waste %", ".1f"),
                           ("peak blocks", "d"), ("table entries", ".1f")])
    for bs in sizes:
        h, f, *_, pk = totals(sweep[bs], context)
        entries = np.mean([m.blocks_held / max(m.sequences, 1) for m in sweep[bs]])
        table.row(bs, h * bpt / MB, 100 * (1 - f / h), pk, entries)
    table.plot("block", ["waste %"], "paged waste against block size", logx=True,
               xlabel="block size (tokens)", ylabel="waste (% of held)")
    table.plot("block", ["table entries"], "block-table entries per sequence against block size",
               logx=True, logy=True, xlabel="block size (tokens)",
               ylabel="block-table entries (per sequence)")
    return table


def one_sequence_table(bs) -> Table:
    table = Table(f"One sequence of L tokens in {bs}-token blocks: waste = unfilled slots of its "
                  "last block / slots held", experiment=14, chapter=False,
                  columns=[("L", "d"), ("mean waste %", ".1f"), ("worst %", ".1f")])
    for L in (16, 32, 64, 128, 256, 384, 512, 1024, 2048):
        window = np.arange(L, L + bs)  # lengths L .. L+bs-1, every remainder once
        held_slots = blocks_for(window, bs) * bs
        waste = (held_slots - window) / held_slots
        table.row(L, 100 * waste.mean(), 100 * waste.max())
    return table


def sharing_table(stand_in, lengths, bpt, context, args) -> Table:
    bs, V = args.block_size, stand_in.config.vocab_size
    system = tuple(np.random.default_rng(args.seed + 1).integers(0, V, args.system_len))
    shared = requests_for(lengths, args.prompt_len, V, args.seed, system)
    on = serve(stand_in, shared, args.slots, bs, share=True)
    off = serve(stand_in, shared, args.slots, bs, share=False)
    saved = np.mean([a.blocks_held - b.blocks_held for a, b in zip(off, on, strict=True)])
    full = args.system_len // bs  # the system prompt's full blocks, held once when shared
    expected = np.mean([max(m.sequences - 1, 0) * full for m in on])
    table = Table(f"Prefix sharing: the same requests behind a common {args.system_len}-token "
                  f"system prompt ({full} full blocks of {bs})", experiment=14,
                  chapter=False, columns=[("", ""), ("held MB", ".2f"),
                                          ("peak blocks", "d"), ("shared blocks", ".1f")])
    for name, memory in (("not shared", off), ("shared", on)):
        h, *_, pk = totals(memory, context)
        table.row(name, h * bpt / MB, pk, np.mean([m.blocks_shared for m in memory]))
    table.note(f"blocks saved per step: {saved:.2f} measured, {expected:.2f} expected "
               f"((sequences - 1) x {full} per step)")
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_engine_arguments(parser)
    parser.add_argument("--prompt-len", type=positive_int, default=16)
    parser.add_argument("--system-len", type=at_least(0), default=64,
                        help="tokens of the shared system prompt in the sharing table")
    parser.add_argument("--block-sizes", type=positive_ints, default="1,2,4,8,16,32,64,128,256")
    add_threads_argument(parser)
    args = parser.parse_args(argv)

    say(timing_header(args))
    model = load_model(args.model)
    context, lengths = model.config.max_position_embeddings, skewed_lengths()
    requests = requests_for(lengths, args.prompt_len, model.config.vocab_size, args.seed)
    say(f"serving {len(requests)} requests on the real model (block size {args.block_size})")
    real = serve(model, requests, args.slots, args.block_size,
                 progress=Progress(len(requests), "real model"))
    stand_in = stand_in_of(model.config)
    sweep, check = replay(stand_in, requests, args)
    same = [(m.blocks_held, m.slots_filled, m.tokens_reserved) for m in check] == \
        [(m.blocks_held, m.slots_filled, m.tokens_reserved) for m in real]
    bpt = real[0].bytes_per_token
    paged_table(real, lengths, same, context, args).show()
    block_size_table(sweep, args.block_sizes, bpt, context).show()
    one_sequence_table(args.block_size).show()
    if args.system_len:
        sharing_table(stand_in, lengths, bpt, context, args).show()


if __name__ == "__main__":
    from _common import run
    run(main)
