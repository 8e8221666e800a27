"""Mutation testing of the modules that carry the claims, with mutmut 3 (the 'mutation' extra).

A test suite earns trust when breaking the code makes it fail. mutmut breaks one thing at a time
(a comparison flipped, a constant off by one, an argument dropped, a statement made a no-op),
runs the tests that reach the broken function, and records whether they failed ("killed") or
passed ("survived"). A survivor is a property no test checks, or an equivalent mutant: a change
that cannot alter any result (each is listed in EQUIVALENT below, with the reason).

Each module runs on its own: a scratch copy of the tree in out/mutation/<module>/, mutmut's
shared settings from setup.cfg's [mutmut] section plus the module to mutate and the test files
that cover it (MODULES below; each mutant runs only the tests that reach it, stopping at the
first failure), then the outcome read from mutmut's records. Prints one row per module on
stdout (mutants, killed, survived, equivalent, no tests, timeout) with the equivalent mutants and
their reasons under the table; every survivor that is not listed as equivalent goes to stderr
with its diff, and to out/mutation/<module>/survivors.txt. Not in CI and not in the default test
run: a minute or more per module on one core. On a shared machine:

    nice -n 10 python3 scripts/mutation.py sampling speculative --markdown out/mutation.md

The exit status is 1 when a survivor is neither killed nor listed as equivalent.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from configparser import ConfigParser
from pathlib import Path

from _common import run, say
from _table import Table

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("minitransformer", "quant", "sim", "tests", "scripts", "setup.cfg", "pyproject.toml",
          "README.md")

# module -> (its file, the test files that cover it, pytest's -k filter or "").
# The filters leave out the few tests that run the real SmolLM2 or the default model end to
# end (tens of seconds each, and each runs again for every mutant that reaches it).
MODULES = {
    "sampling": ("minitransformer/sampling.py",
                 ["tests/test_sampling.py"], ""),
    "speculative": ("minitransformer/speculative.py",  # the tiny models' greedy test stands
                    ["tests/test_speculative.py"],     # for stories260K's three prompts
                    "not default_model and not real_model"),
    "kvquant": ("minitransformer/kvquant.py",
                ["tests/test_kvquant.py", "tests/sim/test_kv_bytes.py",
                 "tests/test_kvquant_bounds.py"], ""),
    "logprobs": ("minitransformer/logprobs.py",
                 ["tests/test_logprobs.py", "tests/test_logprobs_top_and_positions.py"],
                 "not smollm2"),
    # test_tiled_in_use's two "which function ran" tests watch the functions' code objects,
    # which mutmut's trampolines replace (they fail on the unmutated copy)
    "tiled": ("minitransformer/tiled.py", ["tests/test_tiled.py", "tests/test_tiled_in_use.py"],
              "not smollm2 and not runs_the_tiled_function and not pass_it_down"),
    "gguf_file": ("minitransformer/formats/gguf_file.py",
                  ["tests/formats/test_gguf.py", "tests/formats/test_gguf_malformed.py",
                   "tests/formats/test_gguf_alignment.py", "tests/formats/test_gguf_fields.py"], ""),
    "training": ("minitransformer/drafts/training.py",
                 ["tests/drafts/test_training.py", "tests/drafts/test_distill_metrics.py"], ""),
    "blocks": ("minitransformer/serve/blocks.py",
               ["tests/serve/test_blocks.py", "tests/serve/test_block_state.py",
                "tests/serve/test_prefix_cache.py", "tests/serve/test_paged.py"], ""),
    # test_scheduler's import test reads the module's imports, and mutmut's copy imports its
    # trampoline (it fails on the unmutated copy)
    "scheduler": ("minitransformer/serve/scheduler.py",
                  ["tests/serve/test_scheduler.py", "tests/serve/test_scheduler_results.py",
                   "tests/serve/test_scheduler_admission.py"], "not never_import"),
    "paged": ("minitransformer/serve/paged.py",     # the ragged view: the mixed step's and
              ["tests/serve/test_paged.py", "tests/serve/test_mixed_step.py",  # the verification pass's
               "tests/test_batched.py", "tests/serve/test_speculate.py",  # and (test_kvquant) the
               "tests/test_kvquant.py", "tests/serve/test_blocks.py"], ""),  # quantized pool's
    "engine": ("minitransformer/serve/engine.py",      # test_logprobs: the prompt's scores;
               ["tests/serve/test_engine.py", "tests/serve/test_engine_properties.py",  # the speculative
                "tests/serve/test_engine_results.py", "tests/test_logprobs.py",   # engine's own
                "tests/serve/test_engine_speculative.py", "tests/serve/test_engine_config.py"],
               "not smollm2"),
}

# mutant name -> why no test can tell it from the original. A name is mutmut's: the module, the
# function (x_NAME, or xǁCLASSǁNAME for a method) and the mutant's number in that function.
EQUIVALENT = {
    # sampling.py
    "minitransformer.sampling.x_apply_repetition_penalty__mutmut_18":
        "chosen >= 0: a logit of exactly 0 gives 0 / penalty == 0 * penalty == 0",
    "minitransformer.sampling.x_probabilities__mutmut_7":
        "0 <= top_k: top_k 0 partitions at 0, the k-th is the minimum, every token is kept",
    "minitransformer.sampling.x_probabilities__mutmut_8":
        "top_k <= V: top_k V makes the minimum the k-th, every token is kept",
    "minitransformer.sampling.x_probabilities__mutmut_34":
        "temperature or 2.0: only temperature 0 reaches it, which is greedy, and no caller "
        "asks greedy settings for a distribution (next_token and speculative check greedy)",
    "minitransformer.sampling.x_probabilities__mutmut_48":
        'kind="STABLE": numpy reads the sort kind by its first letter, either case',
    "minitransformer.sampling.x_probabilities__mutmut_56":
        "a float mask of 0 and 1 selects in np.where as the bool mask does",
    "minitransformer.sampling.x_probabilities__mutmut_58":
        "a float mask of 0 and 1 selects in np.where as the bool mask does",
    "minitransformer.sampling.x_draw__mutmut_19":
        "the clamp is never reached: u < 1 so u * total < total, searchsorted stops inside",
    "minitransformer.sampling.x_next_token__mutmut_9":
        "the float32 cast is a no-op on the model's logits, float32 everywhere (loader.py)",
    "minitransformer.sampling.x_next_token__mutmut_11":
        "the float32 cast is a no-op on the model's logits, float32 everywhere (loader.py)",
    # kvquant.py
    "minitransformer.kvquant.x_quantize__mutmut_15":
        "the float32 cast is a no-op on what the caches write: the model's float32 k and v",
    "minitransformer.kvquant.x_quantize__mutmut_17":
        "the float32 cast is a no-op on what the caches write: the model's float32 k and v",
    "minitransformer.kvquant.x_quantize__mutmut_46":
        "take_along_axis without axis=-1: -1 is numpy's default",
    "minitransformer.kvquant.x_quantize__mutmut_54":
        "a float16 scale is exact in float32 and float64 alike; x / s in float64 can round "
        "a code differently only at a half-step tie, where either code is within the bound",
    "minitransformer.kvquant.x_quantize__mutmut_66":
        "an all-zero block divided by 2 instead of 1 is still all zeros",
    "minitransformer.kvquant.x_quantize__mutmut_107":
        "reshape(..., -2): numpy takes any negative size as the one to infer",
    "minitransformer.kvquant.x_dequantize__mutmut_17":
        "reshape(..., -2): numpy takes any negative size as the one to infer",
    "minitransformer.kvquant.x_dequantize__mutmut_2":
        "a float32 store copied to float32 instead of returned as is: the same numbers",
    # formats/gguf_file.py
    "minitransformer.formats.gguf_file.xǁReaderǁstring__mutmut_15":
        'decode("UTF-8"): Python reads codec names in either case',
    "minitransformer.formats.gguf_file.xǁReaderǁvalue__mutmut_53":
        "the name of an array's numbers is never shown: the count check just before makes "
        "sure the bytes are there, so this take cannot fail",
    "minitransformer.formats.gguf_file.xǁGGUFFileǁopen__mutmut_16":
        "np.memmap without dtype=np.uint8: uint8 is memmap's default",
    "minitransformer.formats.gguf_file.xǁGGUFFileǁparse__mutmut_5":
        'cast("b"): every read of the bytes goes through the buffer protocol with its own '
        "format (bytes(), struct.unpack, np.frombuffer with a dtype), never by item",
    "minitransformer.formats.gguf_file.xǁGGUFFileǁparse__mutmut_36":
        'int.from_bytes without "big": big is its default (Python 3.11 on)',
    "minitransformer.formats.gguf_file.xǁGGUFFileǁparse__mutmut_208":
        "a tensor of no bytes taken as the previous one: sorted by start, it starts at or "
        "after the previous end (or the check before raised), and so does every later one",
    "minitransformer.formats.gguf_file.xǁGGUFFileǁparse__mutmut_209":
        "end >= begin always holds: the same as mutant 208",
    # speculative.py
    "minitransformer.speculative.x_speculative_generate__mutmut_1":
        "gamma's default 5 instead of 4: no caller and no claim rests on the default (the "
        "README, the scripts and the tests all pass gamma), and the tokens are the same for "
        "every gamma (greedy: generate's; sampled: the target's distribution)",
    "minitransformer.speculative.x_leviathan_step__mutmut_2":
        "u * q[x] <= p[x]: differs from < only where they are equal, u on [0, 1) in steps of "
        "2^-53: a chance of about 2^-53 a proposal",
    "minitransformer.speculative.xǁLookupDraftǁpropose__mutmut_6":
        "point masses in greedy mode too: greedy verify never reads the distributions",
    "minitransformer.speculative.xǁModelDraftǁpropose__mutmut_21":
        "hidden[:, -2:] then row -1 is the same last position as hidden[:, -1:]",
    "minitransformer.speculative.xǁModelDraftǁpropose__mutmut_29":
        "no generator for a greedy step: greedy next_token never draws",
    "minitransformer.speculative.x_verify__mutmut_7":
        "no generator for a greedy step: greedy next_token never draws",
    "minitransformer.speculative.x_verify__mutmut_50":
        "the words of an unreachable error: the loop returns at its last row",
    "minitransformer.speculative.x_verify__mutmut_51":
        "the words of an unreachable error: the loop returns at its last row",
    "minitransformer.speculative.x_verify__mutmut_52":
        "the words of an unreachable error: the loop returns at its last row",
    "minitransformer.speculative.x_rollback__mutmut_9":
        "a kept token trimmed when nothing was rejected: the next round's pass feeds it "
        "again (the same tokens, one more position in that pass)",
    "minitransformer.speculative.x_speculative_generate__mutmut_128":
        "the target's cache trimmed one token short of the kept ones: the next pass feeds that "
        "token again (fresh starts at the cache's length), as x_rollback__mutmut_9",
    "minitransformer.speculative.x_speculative_generate__mutmut_132":
        "the draft's cache trimmed one token short: its next proposal feeds that token again, "
        "as mutant 128 for the target",
    # tiled.py
    "minitransformer.tiled.x_tiled_attention__mutmut_84":
        "the running sum l kept in float64: the same formula rounded less; over one tile the "
        "same bits (a float32 quotient rounded from float64 is the float32 quotient), over "
        "several the last bits only, which the float32 tolerance forgives",
    "minitransformer.tiled.x_tiled_attention__mutmut_86":
        "l in float64 (zeros' default dtype): as mutant 84",
    "minitransformer.tiled.x_tiled_attention__mutmut_91":
        "the running output acc kept in float64: as mutant 84",
    "minitransformer.tiled.x_tiled_attention__mutmut_93":
        "acc in float64 (zeros' default dtype): as mutant 84",
    "minitransformer.tiled.x_tiled_attention__mutmut_110":
        "queries 0..i+t asked instead of i..i+t: positions rise along a row, so for the causal "
        "tiles the largest is the same; for an explicit mask more rows only skip fewer tiles, "
        "and a tile computed though all hidden adds exp(-inf) = 0",
    "minitransformer.tiled.x_tiled_attention__mutmut_112":
        "slice(i + t) is queries 0..i+t: as mutant 110",
    "minitransformer.tiled.x_tiled_attention__mutmut_116":
        "keys j.. to the end asked instead of j..j+block: the causal tiles read only the "
        "start; for an explicit mask more keys only skip fewer tiles (as mutant 110)",
    "minitransformer.tiled.x_tiled_attention__mutmut_200":
        "a row that has seen no visible key has every score -inf: exp(-inf - 1) is "
        "exp(-inf - 0) = 0",
    # drafts/training.py (its functions take (N, D) and (N, V) arrays: axis 1 is the last)
    "minitransformer.drafts.training.x_linear_backward__mutmut_8":
        "reshape(-2, ...): numpy takes any negative size as the one to infer",
    "minitransformer.drafts.training.x_linear_backward__mutmut_16":
        "reshape(-2, ...): numpy takes any negative size as the one to infer",
    "minitransformer.drafts.training.x_rms_norm_forward__mutmut_12":
        "axis=+1 of x (N, D) is its last axis",
    "minitransformer.drafts.training.x_rms_norm_forward__mutmut_15":
        "x.shape[+1] of x (N, D) is D",
    "minitransformer.drafts.training.x_rms_norm_backward__mutmut_16":
        "axis=+1 of x (N, D) is its last axis",
    "minitransformer.drafts.training.x_rms_norm_backward__mutmut_19":
        "x.shape[+1] of x (N, D) is D",
    "minitransformer.drafts.training.x_rms_norm_backward__mutmut_30":
        "reshape(-2, ...): numpy takes any negative size as the one to infer",
    "minitransformer.drafts.training.x_rms_norm_backward__mutmut_31":
        "x.shape[+1] of x (N, D) is D",
    "minitransformer.drafts.training.xǁAdamǁ__post_init____mutmut_10":
        'float("INF"): Python reads "inf" in either case',
    "minitransformer.drafts.training.xǁAdamǁstep__mutmut_41":
        "the step subtracted in float64 and the difference rounded to float32 (in place: the "
        "parameter stays float32), instead of the step rounded first: the two roundings "
        "differ by at most one float32 step of the parameter, and no result is defined to "
        "that bit (the tests hold Adam to its formulas at a relative 1e-12 in float64)",
    "minitransformer.drafts.training.x_host32__mutmut_2":
        "no dtype: what host32 is given is float32 already (the loader converts every weight "
        "to float32 once, and the model computes in float32)",
    "minitransformer.drafts.training.x_host32__mutmut_4":
        "no dtype: as mutant 2",
    "minitransformer.drafts.training.x_train__mutmut_24":
        "a new pass appended when exactly one batch is left, not once it is used: that batch "
        "is taken from the old pass first either way, and the passes come in the same order "
        "from the same generator, so every step draws the same rows",
    "minitransformer.drafts.training.x_teacher_logits__mutmut_1":
        "the default chunk 129 rows, not 128: a bound on memory; each row's logits are its "
        "own product (test_distill_metrics runs chunks of 1, 7 and 128)",
    "minitransformer.drafts.training.x_closeness__mutmut_1":
        "the default chunk 129 rows, not 128: as teacher_logits' mutant 1; the sums over "
        "the chunks differ in float64's last bits only",
    "minitransformer.drafts.training.x_closeness__mutmut_23":
        "the student's logits not cast to float64 first: logprobs.log_softmax casts them "
        "itself (test_training's float64 test fails when it does not)",
    "minitransformer.drafts.training.x_closeness__mutmut_25":
        "the teacher's logits not cast to float64 first: as mutant 23",
    "minitransformer.drafts.training.x_closeness__mutmut_38":
        "argmax(axis=+1) of s (n, V) is along its last axis",
    "minitransformer.drafts.training.x_closeness__mutmut_42":
        "argmax(axis=+1) of z (n, V) is along its last axis",
    # serve/blocks.py
    "minitransformer.serve.blocks.xǁPrefixIndexǁreleased__mutmut_2":
        'unheld[block] = "": the OrderedDict is an ordered set, its values never read',
    "minitransformer.serve.blocks.xǁPrefixIndexǁevict__mutmut_2":
        "popitem(last=None): None is false, as False is: the oldest goes first",
    "minitransformer.serve.blocks.xǁBlockManagerǁadd__mutmut_1":
        "max_len's default 1, not 0: the sequence's max_len is max(max_len, len(prompt)), "
        "and a prompt has at least one token (refused otherwise)",
    "minitransformer.serve.blocks.xǁBlockManagerǁseal__mutmut_4":
        "full >= named: with full == named there is no block to name (block_names of no "
        "tokens is empty, and so is the zip that offers them)",
    "minitransformer.serve.blocks.xǁBlockManagerǁcheck__mutmut_3":
        "holders counted in float64 (dtype None) instead of int64: small whole numbers, "
        "exact in both, compared equal to the same refcounts",
    "minitransformer.serve.blocks.xǁBlockManagerǁcheck__mutmut_5":
        "holders without dtype: float64, as mutant 3",
    "minitransformer.serve.blocks.xǁBlockManagerǁcheck__mutmut_53":
        "names <= length / block_size instead of // : a count of names is a whole number, "
        "at most x exactly when at most floor(x)",
    # logprobs.py
    "minitransformer.logprobs.x_token_logprob__mutmut_15":
        "0 <= k: k 0 takes argpartition(..., -1)[:0], as empty as arange(V)[:0]",
    "minitransformer.logprobs.x_token_logprob__mutmut_16":
        "k <= V: k V takes argpartition(..., V - 1)[:V], all V ids, then sorted the same",
    # serve/scheduler.py
    "minitransformer.serve.scheduler.xǁSchedulerǁ__init____mutmut_10":
        "the clock starting at 1.0: never read before schedule, commit or cancel sets it "
        "(retire, _end and _admit are reached only through them)",
    "minitransformer.serve.scheduler.xǁSchedulerǁ__init____mutmut_11":
        "the admission counter starting at 1: orders are only compared with each other",
    "minitransformer.serve.scheduler.xǁSchedulerǁ_enter__mutmut_5":
        "the admission counter stepping by 2: orders are only compared with each other",
    "minitransformer.serve.scheduler.xǁSchedulerǁretire__mutmut_13":
        "close(..., returned=None): None is false, as False is: not returned yet",
    "minitransformer.serve.scheduler.xǁSchedulerǁ_prefill__mutmut_14":
        "min(under_way) without its key: under_way never holds two (a chunk that leaves its "
        "prompt unfinished spends the rest of the budget, so each plan ends with at most "
        "one prompt under way, and the one planned leaves the list), and min of one is it",
    "minitransformer.serve.scheduler.xǁSchedulerǁ_prefill__mutmut_16":
        "min(under_way, ) without its key: as mutant 14",
    "minitransformer.serve.scheduler.xǁSchedulerǁ_prefill__mutmut_17":
        "min by a key of None: as mutant 14",
    # serve/paged.py
    "minitransformer.serve.paged.xǁPagedCacheǁallocate__mutmut_5":
        "num_blocks < 1 and block_size < 1: with either 0 the arrays made first are empty, "
        "and BlockManager.__init__ raises the same error, in the same words",
    "minitransformer.serve.paged.xǁPagedCacheǁdo__mutmut_9":
        "np.array of a swap's block ids without dtype=np.int64: Python ints become int64 "
        "anyway (numpy's default integer here)",
    "minitransformer.serve.paged.xǁPagedCacheǁdo__mutmut_11": "no dtype: as mutant 9",
    "minitransformer.serve.paged.xǁPagedCacheǁdo__mutmut_19":
        "no dtype for a swap in's block ids: as mutant 9",
    "minitransformer.serve.paged.xǁPagedCacheǁdo__mutmut_21": "no dtype: as mutant 9",
    "minitransformer.serve.paged.xǁPagedCacheǁview__mutmut_18":
        "starts without dtype=np.int64: Python ints (lengths, or append's starts) become "
        "int64 anyway; no caller views an empty batch (the engine drops an empty decode, "
        "speculate's groups have rows), the one case where numpy would make float64",
    "minitransformer.serve.paged.xǁPagedCacheǁview__mutmut_20": "no dtype: as mutant 18",
    "minitransformer.serve.paged.xǁPagedCacheǁto_contiguous__mutmut_3":
        "lengths without dtype=np.int64: Python ints become int64 anyway; with no rows "
        "max() raises either way",
    "minitransformer.serve.paged.xǁPagedCacheǁto_contiguous__mutmut_5": "no dtype: as mutant 3",
    "minitransformer.serve.paged.xǁPagedViewǁslots__mutmut_23":
        "take_along_axis without axis=1: the table and the positions are (B, ...) 2-D, and "
        "-1, its default, is axis 1",
    "minitransformer.serve.paged.xǁPagedViewǁupdate__mutmut_4":
        "the slots worked out again though given: the same positions and the same books "
        "within a pass give the same slots",
    "minitransformer.serve.paged.xǁRaggedViewǁ__init____mutmut_1":
        "a ragged view's cache attribute is never read: each group's PagedView holds its own",
    "minitransformer.serve.paged.xǁRaggedViewǁpositions__mutmut_18":
        "reshape(1, -2): numpy takes any negative size as the one to infer",
    "minitransformer.serve.paged.xǁRaggedViewǁattend__mutmut_33":
        "reshape(1, -2, ...): numpy takes any negative size as the one to infer",
    "minitransformer.serve.paged.xǁRaggedViewǁupdate__mutmut_5":
        "each group's update given no slots works them out itself: as PagedView.update's "
        "mutant 4",
    "minitransformer.serve.paged.xǁRaggedViewǁupdate__mutmut_9": "no slots: as mutant 5",
    "minitransformer.serve.paged.x_block_table__mutmut_4":
        "a short row padded with its first two blocks instead of its first: the padding "
        "slots lie past the row's length, where the mask hides them (and the ids are the "
        "row's own, in the pool)",
    # serve/engine.py
    "minitransformer.serve.engine.xǁEngineǁstep__mutmut_6":
        "arrival >= clock: an arrival equal to the clock sets the clock to the value it has",
    "minitransformer.serve.engine.xǁEngineǁ_mixed__mutmut_76":
        "passes[:2] for passes[:1]: only plan.decode is kept, and it can only be the first",
}

# mutmut's exit codes -> outcome (mutmut/stats.py, status_by_exit_code)
OUTCOMES = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
            34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
            255: "timeout", 37: "killed", None: "not checked"}


# The second corpus: bugs planted by hand, one line each, of the kinds a reviewer plants in the
# newest features (a block boundary off by one, a wrong sign, a dropped term, a check skipped).
# Each is (feature, the bug in words, file, the line as it is, the line broken, the tests that
# must fail). `--planted` applies them one at a time to a scratch copy and runs those tests
# (and the file's doctests): every one must fail. A line no longer in its file is "stale".
PLANTED = [
    ("prefix cache", "a block's name ignores its parent's (the prefix before it)",
     "minitransformer/serve/blocks.py",
     "parent = hashlib.sha256(parent + block.tobytes()).digest()",
     "parent = hashlib.sha256(block.tobytes()).digest()",
     ["tests/serve/test_prefix_cache.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("prefix cache", "the most recently released kept block is evicted first",
     "minitransformer/serve/blocks.py",
     "block, _ = self.unheld.popitem(last=False)", "block, _ = self.unheld.popitem(last=True)",
     ["tests/serve/test_prefix_cache.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("prefix cache", "a kept block held again stays evictable",
     "minitransformer/serve/blocks.py",
     "self.unheld.pop(block, None)", "self.unheld.get(block, None)",
     ["tests/serve/test_prefix_cache.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("prefix cache", "a prompt cached in full is not left its last token to compute",
     "minitransformer/serve/blocks.py",
     "min(len(found) * self.block_size, len(prompt) - 1)",
     "min(len(found) * self.block_size, len(prompt))",
     ["tests/serve/test_prefix_cache.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("chunked prefill", "every chunk computes the prompt's first tokens again",
     "minitransformer/serve/engine.py",
     "np.array([seq.tokens[done:done + n]])", "np.array([seq.tokens[:n]])",
     ["tests/serve/test_engine_properties.py", "tests/serve/test_scheduler.py", "tests/serve/test_engine.py"]),
    ("chunked prefill", "a chunk in a step's one pass starts at the prompt's first token",
     "minitransformer/serve/engine.py",
     "for t in seq.tokens[first:first + work.n]]])", "for t in seq.tokens[:work.n]]])",
     ["tests/serve/test_engine_properties.py", "tests/serve/test_engine.py"]),
    ("chunked prefill", "a step's one pass picks each row's first position's logits, not its last",
     "minitransformer/serve/engine.py",
     "hidden[:, ends[picked] - 1]",
     "hidden[:, ends[picked] - np.array([w.n for _, _, w in parts])[picked]]",
     ["tests/serve/test_engine_properties.py", "tests/serve/test_engine.py"]),
    ("chunked prefill", "a step's one pass scores a chunk's prompt logprobs from position 0",
     "minitransformer/serve/engine.py",
     "ends[i] - work.n:ends[i]], first)", "ends[i] - work.n:ends[i]], 0)",
     ["tests/serve/test_engine_properties.py", "tests/test_logprobs.py",
      "tests/serve/test_server_logprobs.py"]),
    ("chunked prefill", "a step's token budget is not spent by its chunks",
     "minitransformer/serve/scheduler.py",
     "budget = None if budget is None else budget - n",
     "budget = None if budget is None else budget",
     ["tests/serve/test_engine_properties.py", "tests/serve/test_scheduler.py", "tests/serve/test_engine.py"]),
    ("chunked prefill", "a later chunk's prompt logprobs score the prompt's first tokens",
     "minitransformer/serve/engine.py",
     "self._score_prompt(seq, hidden, done)", "self._score_prompt(seq, hidden, 0)",
     ["tests/serve/test_engine_properties.py", "tests/test_logprobs.py",
      "tests/serve/test_server_logprobs.py"]),
    ("n samples", "admission forgets each sample's first-token block",
     "minitransformer/serve/scheduler.py",
     "enter += len(self._sharers(seq))", "enter += 0",
     ["tests/serve/test_engine_properties.py", "tests/serve/test_scheduler.py",
      "tests/serve/test_parallel_samples.py"]),
    ("logprobs", "the top alternatives least likely first",
     "minitransformer/logprobs.py",
     "top = top[np.lexsort((top, -logp[top]))]", "top = top[np.lexsort((top, logp[top]))]",
     ["tests/test_logprobs.py", "tests/test_logprobs_top_and_positions.py",
      "tests/serve/test_engine_properties.py"]),
    ("logprobs", "prompt logprobs score each position's own token, not the next",
     "minitransformer/logprobs.py",
     "zip(logits[:-1], ids[1:])", "zip(logits[1:], ids[1:])",
     ["tests/test_logprobs.py", "tests/test_logprobs_top_and_positions.py",
      "tests/serve/test_engine_properties.py"]),
    ("quantized KV cache", "a q4_0 cache reads back as zeros",
     "minitransformer/kvquant.py",
     "steps = split_nibbles(codes).astype(xp.float32) - 8",
     "steps = 0 * split_nibbles(codes).astype(xp.float32)",
     ["tests/test_kvquant.py", "tests/test_kvquant_bounds.py"]),
    ("quantized KV cache", "q4_0 codes decoded off by one (- 7, not - 8)",
     "minitransformer/kvquant.py",
     "split_nibbles(codes).astype(xp.float32) - 8", "split_nibbles(codes).astype(xp.float32) - 7",
     ["tests/test_kvquant.py", "tests/test_kvquant_bounds.py"]),
    ("quantized KV cache", "q8_0 scaled for 128 steps, not 127",
     "minitransformer/kvquant.py",
     "scales = (xp.abs(blocks).max(axis=-1) / 127)", "scales = (xp.abs(blocks).max(axis=-1) / 128)",
     ["tests/test_kvquant.py", "tests/test_kvquant_bounds.py"]),
    ("tiled attention", 'attention="tiled" runs the plain attention',
     "minitransformer/tiled.py",
     '"tiled": TILED}', '"tiled": Attention(on_floats(attention), causal_mask)}',
     ["tests/test_tiled.py", "tests/test_tiled_in_use.py"]),
    ("tiled attention", "a tile starting at the last query's own position is skipped",
     "minitransformer/tiled.py",
     "return keys.start > self.latest[queries].max()",
     "return keys.start >= self.latest[queries].max()",
     ["tests/test_tiled.py", "tests/test_tiled_in_use.py"]),
    ("tiled attention", "the running sum of exp * v is not rescaled",
     "minitransformer/tiled.py",
     "acc = acc * rescale + p @ vj", "acc = acc + p @ vj",
     ["tests/test_tiled.py", "tests/test_tiled_in_use.py"]),
    ("tiled attention", "the last key block is dropped",
     "minitransformer/tiled.py",
     "for j in range(0, S, block):", "for j in range(0, S - 1, block):",
     ["tests/test_tiled.py", "tests/test_tiled_in_use.py"]),
    ("trained draft", "the RMSNorm backward drops the normaliser's term",
     "minitransformer/drafts/training.py",
     "dx = r * u - (r ** 3) * x * (u * x).sum(axis=-1, keepdims=True) / x.shape[-1]",
     "dx = r * u", ["tests/drafts/test_training.py"]),
    ("trained draft", "SiLU's backward is sigmoid's",
     "minitransformer/drafts/training.py",
     "return dy * s * (1.0 + x * (1.0 - s))", "return dy * s * (1.0 - s)",
     ["tests/drafts/test_training.py"]),
    ("trained draft", "alpha sums max(p, q) instead of min(p, q)",
     "minitransformer/drafts/training.py",
     "alpha += float(np.minimum(p, q).sum())", "alpha += float(np.maximum(p, q).sum())",
     ["tests/drafts/test_distill_metrics.py", "tests/drafts/test_training.py"]),
    ("stop strings", "of two stop strings, the later one found wins",
     "minitransformer/serve/detokenize.py",
     "found = begin if found is None else min(found, begin)",
     "found = begin if found is None else max(found, begin)",
     ["tests/serve/test_stop_strings.py", "tests/serve/test_server_text.py"]),
    ("stop strings", "a mismatch falls back to nothing, not along the failure table",
     "minitransformer/serve/detokenize.py",
     "state, self.moves = table[state - 1], self.moves + 1",
     "state, self.moves = 0, self.moves + 1",
     ["tests/serve/test_stop_strings.py", "tests/serve/test_server_text.py"]),
    ("stop strings", "a stream holds back nothing that may begin a stop string",
     "minitransformer/serve/detokenize.py",
     "cut = len(self.pending) - (0 if final else self.stop.partial())",
     "cut = len(self.pending)",
     ["tests/serve/test_stop_strings.py", "tests/serve/test_server_text.py"]),
    ("fault isolation", "the blocks a failed pass never wrote keep their names",
     "minitransformer/serve/blocks.py",
     "            self.index.forget(block)", "            pass",
     ["tests/serve/test_engine_faults.py"]),
    ("fault isolation", "a pass that reads a block a failed one was to fill runs anyway",
     "minitransformer/serve/engine.py",
     "            if failed and self._reads_unwritten(work, failed):", "            if False:",
     ["tests/serve/test_engine_faults.py"]),
    ("fault isolation", "the samples waiting to share a failed prompt wait on",
     "minitransformer/serve/scheduler.py",
     "        for sharer in self._sharers(seq):", "        for sharer in []:",
     ["tests/serve/test_engine_faults.py"]),
    ("speculation", "a draft model drafts one position past its own",
     "minitransformer/serve/speculate.py",
     "max_position_embeddings - len(tokens) + 1)", "max_position_embeddings - len(tokens) + 2)",
     ["tests/serve/test_speculate.py", "tests/serve/test_engine_speculative.py"]),
    ("speculation", "a per-position counter (a /metrics line) past the longest draft",
     "minitransformer/serve/speculate.py",
     "self.per_position += [0] * (proposed - len(self.per_position))",
     "self.per_position += [0] * (proposed + 1 - len(self.per_position))",
     ["tests/serve/test_speculate.py", "tests/serve/test_engine_speculative.py"]),
    ("stop strings", "the table falls back to nothing, not to a border's border (borders nest)",
     "minitransformer/serve/detokenize.py",
     "            k = table[k - 1]", "            k = 0",
     ["tests/serve/test_stop_strings.py", "tests/serve/test_server_text.py"]),
    ("stop strings", "a stream holds back one character less than may begin a stop string",
     "minitransformer/serve/detokenize.py",
     "cut = len(self.pending) - (0 if final else self.stop.partial())",
     "cut = len(self.pending) - (0 if final else self.stop.partial() - 1)",
     ["tests/serve/test_stop_strings.py", "tests/serve/test_server_text.py"]),
    ("prefix cache", "a named block (the index's) is written in place, not copied",
     "minitransformer/serve/blocks.py",
     "return self.refcount[block] == 1 and block not in self.index.name_of",
     "return self.refcount[block] == 1",
     ["tests/serve/test_prefix_cache.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("n samples", "a block two samples share is written in place (no copy on write)",
     "minitransformer/serve/blocks.py",
     "return self.refcount[block] == 1 and block not in self.index.name_of",
     "return block not in self.index.name_of",
     ["tests/serve/test_parallel_samples.py", "tests/serve/test_blocks.py", "tests/serve/test_paged.py",
      "tests/serve/test_block_state.py"]),
    ("logprobs", "the chosen token's logprob is the most likely token's",
     "minitransformer/logprobs.py",
     "return TokenLogprob(int(token), float(logp[token]),",
     "return TokenLogprob(int(token), float(logp.max()),",
     ["tests/test_logprobs.py", "tests/test_logprobs_top_and_positions.py"]),
    ("distillation", "the held-out positions are the training text's first ones",
     "minitransformer/drafts/students.py",
     "held_ids = ids[held_range[0]:held_range[0] + s.held_tokens]",
     "held_ids = ids[train_range[0]:train_range[0] + s.held_tokens]",
     ["tests/drafts/test_distill_metrics.py"]),
    ("distillation", "a tie counts as the soft student's win in the verdict",
     "scripts/exp23_soft_labels.py",
     "wins = {label: (soft[key] > hard[key]) == higher and soft[key] != hard[key]",
     "wins = {label: (soft[key] > hard[key]) == higher or soft[key] == hard[key]",
     ["tests/drafts/test_distill_metrics.py"]),
    ("server", "a request the engine refuses is answered 500",
     "minitransformer/serve/http.py",
     "except ValueError as e:     # the engine refuses it: a client's mistake, said before",
     "except KeyError as e:     # the engine refuses it: a client's mistake, said before",
     ["tests/serve/test_server_limits.py::test_a_request_the_engine_refuses_is_a_400_before_any_stream"]),
    ("batch-invariant mode", "a decode step multiplies the rows together, not each alone",
     "minitransformer/serve/engine.py",
     "if self.batch_invariant:  # each row by the very call a batch of one makes",
     "if False:  # each row by the very call a batch of one makes",
     ["tests/serve/test_engine_properties.py", "tests/test_batched.py"]),
    ("GGUF", "a declared general.alignment is ignored (32 used)",
     "minitransformer/formats/gguf_file.py",
     "start = -(-r.pos // alignment) * alignment", "start = -(-r.pos // 32) * 32",
     ["tests/formats/test_gguf_alignment.py", "tests/formats/test_gguf_fields.py"]),
    ("server", "serve drops --max-waiting (the online engine keeps its default)",
     "minitransformer/serve/http.py",
     "online = OnlineEngine(engine, max_waiting=limits.max_waiting)",
     "online = OnlineEngine(engine)",
     ["tests/serve/test_server_doors.py::test_every_serve_flag_reaches_the_server_it_starts"]),
    ("server", "serve drops --api-key", "minitransformer/serve/http.py",
     "create_app(online, name, limit, limits.api_key),", "create_app(online, name, limit),",
     ["tests/serve/test_server_doors.py::test_every_serve_flag_reaches_the_server_it_starts"]),
    ("server", "a body under a non-JSON Content-Type is served", "minitransformer/serve/http.py",
     'if media == "application/json" or (kind and subtype.endswith("+json") and',
     'if True or (kind and subtype.endswith("+json") and',
     ["tests/serve/test_server_hostile.py::test_hostile_requests_get_openai_errors_and_the_server_lives_on"]),
    ("server", "a key given twice in a body: the last one kept", "minitransformer/serve/http.py",
     "if len(value) < len(pairs) and not twice:", "if False:",
     ["tests/serve/test_server_hostile.py::test_hostile_requests_get_openai_errors_and_the_server_lives_on"]),
    ("server", "a message field the chat template never reads is dropped",
     "minitransformer/chat.py", "    check_all_read(messages)", "    messages",
     ["tests/serve/test_server_hostile.py::test_hostile_requests_get_openai_errors_and_the_server_lives_on"]),
    ("server", "text parts joined with nothing, not a newline", "minitransformer/chat.py",
     'return "\\n".join(texts)', 'return "".join(texts)',
     ["tests/serve/test_server_doors.py::"
      "test_text_parts_are_joined_with_newlines_through_the_real_client"]),
    ("server", "a batch longer than --max-waiting is a 429", "minitransformer/serve/http.py",
     "    if len(jobs) > waiting:", "    if False:",
     ["tests/serve/test_server_prompts.py::"
      "test_a_batch_the_queue_can_never_take_is_a_400_one_it_cannot_take_now_a_429"]),
    ("server", "the API key compared with != (its time says where a guess goes wrong)",
     "minitransformer/serve/http.py", "not hmac.compare_digest(token.strip(), self.key)",
     "token.strip() != self.key",
     ["tests/serve/test_server_doors.py::"
      "test_the_openai_client_with_the_key_is_served_and_without_it_refused"]),
    ("server", "a request dripping in a byte at a time is never timed out",
     "minitransformer/serve/http.py", "            elif self.deadline is None:",
     "            elif False:",
     ["tests/serve/test_server_doors.py::"
      "test_a_request_sent_a_byte_at_a_time_gets_408_and_is_disconnected"]),
    ("server", "the read timer runs on once the request is in", "minitransformer/serve/http.py",
     "if not arriving or self.transport.is_closing():", "if self.transport.is_closing():",
     ["tests/serve/test_server_doors.py::"
      "test_the_timeout_is_per_request_and_ends_when_the_request_is_in"]),
]


def prepare(name, scratch: Path, mode: str) -> Path:
    """The scratch copy for one module -> the path of mutmut's records of it.

    mode "fresh": a new copy of the tree; "resume": keep an earlier run's copy and records and
    go on where it stopped; "recheck": keep the records, but bring in the current tree (library
    and tests alike, as the current tests may need the current library) and judge the survivors
    again. mutmut keeps each function's record only while the function's code is unchanged (it
    stores a hash of each), so a function changed since the run has its mutants run again and
    a function removed has its mutants dropped."""
    path = MODULES[name][0]
    meta = scratch / "mutants" / (path + ".meta")
    if mode != "fresh" and not meta.is_file():
        raise ValueError(f"{name}: no earlier run in {scratch} to {mode}")
    if mode == "resume":
        return meta
    if mode == "fresh":
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(parents=True)
        for item in COPIED:
            copy(ROOT / item, scratch / item)
        # mutmut copies the tree into scratch/mutants/ and runs from there; it must exist
        # before Python starts, or the import system remembers it as missing
        (scratch / "mutants").mkdir()
    else:
        refresh(scratch, path)
        records = json.loads(meta.read_text())
        codes = records["exit_code_by_key"]
        again = {0, 5, 33}                           # survived, or reached by no test yet
        records["exit_code_by_key"] = {m: None if c in again else c for m, c in codes.items()}
        meta.write_text(json.dumps(records, indent=4))
    configure(name, scratch)
    return meta


def refresh(scratch: Path, path: str) -> None:
    """The current tree brought into an earlier run's scratch copy, keeping mutmut's records.

    mutmut copies the tree into scratch/mutants/ only where a file is missing there, and makes
    the mutants of a module again only when its source is newer than its mutants: so everything
    in mutants/ but the records (.meta, .spans) goes, and the module is copied with a new time.
    The stale copies would otherwise be what the tests import (a test of a name the tree gained
    since the run failing on import, and every mutant with it)."""
    for item in COPIED:
        copy(ROOT / item, scratch / item)
    shutil.copy(ROOT / path, scratch / path)            # a new modification time
    for item in (scratch / "mutants").iterdir():
        if item.is_dir():
            for file in [f for f in item.rglob("*") if f.is_file()]:
                if file.suffix not in (".meta", ".spans"):
                    file.unlink()
        else:
            item.unlink()


def copy(source: Path, target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    elif source.is_file():
        shutil.copy2(source, target)


def configure(name, scratch: Path) -> None:
    """scratch/setup.cfg's [mutmut] section told what to mutate and which tests to run."""
    path, tests, keyword = MODULES[name]
    missing = [t for t in tests if not (ROOT / t).is_file()]
    tests = [t for t in tests if t not in missing] + [path]  # + the module's own doctests
    if missing:
        say(f"{name}: no {', '.join(missing)} here; running without")
    config = ConfigParser()
    config.read(scratch / "setup.cfg")
    if not config.has_section("mutmut"):
        raise ValueError("setup.cfg has no [mutmut] section")
    config["mutmut"]["only_mutate"] = path
    config["mutmut"]["pytest_add_cli_args_test_selection"] = "\n" + "\n".join(
        tests + (["-k", keyword] if keyword else []))
    with open(scratch / "setup.cfg", "w") as f:
        config.write(f)


def mutate(name, scratch: Path, children: int, mode: str, only=()) -> dict:
    """Run mutmut on one module (only the mutants whose names match a pattern of `only`, if
    any: the others stay as recorded) -> {mutant name: outcome}."""
    meta = prepare(name, scratch, mode)
    env = dict(os.environ, PYTHONPATH=str(scratch / "mutants"))  # subprocesses see the mutants
    with open(scratch / "mutmut.log", "w" if mode == "fresh" else "a") as log:
        done = subprocess.run(["mutmut", "run", "--max-children", str(children), *only],
                              cwd=scratch,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    if not meta.is_file():
        raise ValueError(f"{name}: mutmut made no records (exit status {done.returncode}); "
                         f"see {scratch / 'mutmut.log'}")
    return recorded(name, scratch)


def recorded(name, scratch: Path) -> dict:
    """{mutant name: outcome} from mutmut's records of a run in scratch/."""
    meta = scratch / "mutants" / (MODULES[name][0] + ".meta")
    if not meta.is_file():
        raise ValueError(f"{name}: no run recorded in {scratch}")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {mutant: OUTCOMES.get(code, "suspicious") for mutant, code in codes.items()}


def diff(mutant, scratch: Path) -> str:
    shown = subprocess.run(["mutmut", "show", mutant], cwd=scratch, capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(scratch / "mutants")))
    return shown.stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES), metavar="MODULE",
                        help=f"modules to mutate (default: all of {', '.join(MODULES)})")
    parser.add_argument("--children", type=int, default=1,
                        help="mutants tested at once (default: 1, for a shared machine)")
    parser.add_argument("--out", default=str(ROOT / "out" / "mutation"),
                        help="scratch folder, one copy of the tree per module "
                             "(default: %(default)s)")
    parser.add_argument("--resume", dest="mode", action="store_const", const="resume",
                        default="fresh",
                        help="go on where a stopped run left off (its copy and records in "
                             "--out) instead of starting afresh")
    parser.add_argument("--recheck", dest="mode", action="store_const", const="recheck",
                        help="judge an earlier run's survivors (and the mutants no test "
                             "reached) again against the current tree (the killed stay "
                             "killed where their function is unchanged; a changed function's "
                             "mutants run again)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the mutants whose names match PATTERN (fnmatch, as "
                             "mutmut's own: '*x_speculative_generate__*'), the rest left as "
                             "recorded or not run; may be given again")
    parser.add_argument("--table", dest="mode", action="store_const", const="table",
                        help="run nothing: the table of the runs recorded in --out")
    parser.add_argument("--planted", action="store_true",
                        help="run no mutmut: apply each bug of PLANTED (hand-made, one line "
                             "each) to a scratch copy in --out/planted and run its tests")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    args = parser.parse_args(argv)
    if args.planted:
        return planted(Path(args.out) / "planted", args.markdown)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    if args.children < 1:
        parser.error("--children must be >= 1")
    if shutil.which("mutmut") is None:
        parser.error("mutmut is not installed: python3 -m pip install -e '.[mutation]'")
    table = Table("Mutation testing: mutmut's mutants of each module, against its tests",
                  columns=[("module", ""), ("mutants", "d"), ("killed", "d"),
                           ("survived", "d"), ("equivalent", "d"), ("no tests", "d"),
                           ("timeout", "d"), ("not run yet", "d"), ("seconds", ".0f")],
                  chapter=False)
    version = subprocess.run(["mutmut", "--version"], capture_output=True, text=True).stdout
    table.header(f"{version.strip()}; each mutant runs the listed tests that reach it "
                 "(scripts/mutation.py, MODULES)")
    unexplained, equivalents = 0, []
    for name in args.modules:
        scratch = Path(args.out) / name
        if args.mode != "table":
            say(f"{name}: mutating {MODULES[name][0]} (log: {scratch / 'mutmut.log'})")
        start = time.perf_counter()
        outcomes = recorded(name, scratch) if args.mode == "table" else \
            mutate(name, scratch, args.children, args.mode, args.only)
        count = {o: sum(1 for v in outcomes.values() if v == o)
                 for o in ("killed", "survived", "no tests", "timeout", "not checked")}
        survivors = [m for m, o in outcomes.items() if o == "survived"]
        equivalent = [m for m in survivors if m in EQUIVALENT]
        alive = [m for m in survivors if m not in EQUIVALENT]
        stale = stale_equivalents(name, outcomes)
        table.row(MODULES[name][0], len(outcomes), count["killed"], len(alive),
                  len(equivalent), count["no tests"], count["timeout"], count["not checked"],
                  None if args.mode == "table" else time.perf_counter() - start)
        equivalents += [f"{m}: {EQUIVALENT[m]}" for m in equivalent]
        shown = [diff(m, scratch) for m in alive]
        if args.mode != "table":
            (scratch / "survivors.txt").write_text("\n\n".join(shown) + "\n")
        for text in shown:
            say(text)
        for m in stale:
            say(f"{m}: listed as equivalent but {outcomes.get(m, 'not made')}: "
                "update EQUIVALENT")
        unexplained += len(alive) + len(stale)
    if equivalents:
        table.note("Survivors that no test can kill, each with its reason:", *equivalents)
    table.show()
    if args.markdown:
        Path(args.markdown).write_text(table.markdown())
    return 1 if unexplained else 0


def stale_equivalents(name: str, outcomes: dict) -> list:
    """The module's EQUIVALENT entries a run contradicts: killed (or timed out, or reached by
    no test) where the entry says no test can kill it, or not made at all (the code moved). One
    left unchecked by an --only run is not judged.
    """
    return [m for m in EQUIVALENT if m.startswith(module_prefix(name))
            and outcomes.get(m) not in ("survived", "not checked")]


def planted(scratch: Path, markdown=None) -> int:
    """Apply each of PLANTED to a scratch copy of the tree, one at a time, and run its tests
    (stopping at the first failure) -> 1 if a bug passed them or its line is gone, else 0."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    for item in COPIED:
        copy(ROOT / item, scratch / item)
    table = Table("Planted bugs: one line of a feature broken, against the feature's tests",
                  columns=[("feature", ""), ("bug", ""), ("tests", ""), ("outcome", ""),
                           ("seconds", ".0f")], chapter=False)
    table.header("scripts/mutation.py --planted; each bug alone, its tests stop at the first "
                 "failure (python3 -m pytest -x)")
    env = dict(os.environ, PYTHONPATH=str(scratch))
    bad = 0
    for i, (feature, bug, path, line, broken, tests) in enumerate(PLANTED, 1):
        target = scratch / path
        original = target.read_text()
        start = time.perf_counter()
        if original.count(line) != 1:
            outcome = "stale: the line is not in the file once"
        else:
            target.write_text(original.replace(line, broken))
            try:
                done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x",
                                       "-p", "no:cacheprovider", *tests, path], cwd=scratch,
                                      env=env, capture_output=True, text=True)
            finally:
                target.write_text(original)
            outcome = {0: "PASSED: not caught", 1: "caught"}.get(
                done.returncode, f"error (pytest exit status {done.returncode})")
            caught = [ln for ln in done.stdout.splitlines() if ln.startswith("FAILED ")]
            if caught:
                outcome += f" by {caught[0].split()[1].split('::', 1)[-1]}"
        bad += not outcome.startswith("caught")
        say(f"[{i}/{len(PLANTED)}] {feature}: {bug}: {outcome}")
        table.row(feature, bug, ", ".join(Path(t).stem for t in tests), outcome,
                  time.perf_counter() - start)
    table.show()
    if markdown:
        Path(markdown).write_text(table.markdown())
    return 1 if bad else 0


def module_prefix(name) -> str:
    """'minitransformer.serve.paged.' for paged: the start of its mutants' names."""
    return MODULES[name][0][:-len(".py")].replace("/", ".") + "."


if __name__ == "__main__":
    run(main)
