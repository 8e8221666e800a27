"""The tokenizer of a GGUF file, rebuilt as a `tokenizers` byte-level BPE.

A GGUF holds no tokenizer.json: it stores the pieces of one under ``tokenizer.ggml.*`` keys,
the vocabulary (``tokens``, id = position), the ``merges`` in priority order, a type per
token (1 normal, 3 control, 4 user-defined, ...), the bos/eos ids, and a ``pre`` name that
tells llama.cpp how to cut text into words before merging. Byte-level BPE (``model`` =
"gpt2") writes every byte as one printable character, so the vocabulary and merges can be
handed to `tokenizers` as they are.

The trap is the pre-tokenizer: the merges were learned on words cut a particular way, and the
file gives only a name. llama.cpp maps the name to split rules; we map the names we support
to the same rules (read from llama.cpp's tokenizer source): "smollm" first splits every digit
on its own, then applies GPT-2's word pattern; "gpt2" only the pattern; "qwen2" and
"llama-bpe" their own patterns. An unknown name is an error, not a guess: a wrong split gives
plausible, wrongly merged tokens. (transformers' GGUF loader treats "smollm" as plain GPT-2 and
so tokenizes "2024" differently from llama.cpp.)

Control tokens (``<|im_start|>``) become special added tokens, matched whole in any text and
dropped by decode; user-defined ones are matched whole and kept. Leaves out SentencePiece
vocabularies (``model`` = "llama", as Llama 2 and stories260K have).

The metadata is checked before `tokenizers` sees it, each failure naming the key: every key of
its type (a list of strings, an integer, a flag), each merge two pieces of the vocabulary whose
join is in it too, no token twice, the special ids inside the vocabulary and the model's
embedding, the chat template a string. A file with none of these keys has no tokenizer (it loads
weights-only); a file with some of them but not the vocabulary is an error.
"""
from minitransformer.checks import is_integer
from minitransformer.errors import CheckpointError
from minitransformer.tokenizer import Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types that we act on

# Qwen2's and Llama 3's word patterns: contractions, letters with one leading non-letter,
# numbers (one digit / up to three), punctuation runs, newlines, spaces.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def pre_tokenizer(pre: str, source: str):
    """llama.cpp's pre-tokenizer name -> the same split as a `tokenizers` pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's pattern
    if pre in ("gpt2", "default"):
        return gpt2
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("qwen2", "llama-bpe"):
        pattern = QWEN2_PATTERN if pre == "qwen2" else LLAMA3_PATTERN
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported "
                          "(supported: gpt2, smollm, qwen2, llama-bpe)")


def strings(meta: dict, key: str, source: str) -> list:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{source}: {key} must be an array of strings, "
                              f"got {type(value).__name__}")
    return value


def build_backend(meta: dict, source: str):
    """tokenizer.ggml.* metadata -> tokenizers.Tokenizer (byte-level BPE), checked first."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model={kind!r:.100} is not supported "
                              "(only 'gpt2', byte-level BPE)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise CheckpointError(f"{source}: {key} is missing")
    tokens = strings(meta, "tokenizer.ggml.tokens", source)
    merges = strings(meta, "tokenizer.ggml.merges", source)
    if not tokens:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens is empty")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens holds {twice!r:.100} twice")
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if not isinstance(types, list) or not all(is_integer(k) for k in types):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type must be an array of "
                              "integers")
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries "
                              f"for {len(tokens)} tokens")
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r:.100} is not "
                                  "two pieces separated by one space")
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r:.100} "
                                      f"makes or uses {piece!r:.100}, which is not in "
                                      "tokenizer.ggml.tokens")
        pairs.append((left, right))
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if not isinstance(pre, str):
        raise CheckpointError(f"{source}: tokenizer.ggml.pre must be a string, got {pre!r:.100}")
    # Llama 3 looks a whole word up before merging (llama.cpp: ignore_merges); others merge.
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     ignore_merges=pre == "llama-bpe"))
    backend.pre_tokenizer = pre_tokenizer(pre, source)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    return backend


def tokenizer_from_metadata(meta: dict, vocab_size: int, source: str) -> Tokenizer | None:
    """GGUF metadata -> Tokenizer; None when the file carries no tokenizer metadata at all.
    vocab_size: the model's (its embedding rows), which every token id must be below."""
    present = sorted(k for k in meta if k.startswith("tokenizer."))
    if not present:
        return None
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{source}: partial tokenizer metadata: {', '.join(present[:4])} "
                              "but no tokenizer.ggml.tokens (a file without a tokenizer holds "
                              "no tokenizer.* key)")
    backend = build_backend(meta, source)
    count = len(meta["tokenizer.ggml.tokens"])
    if count > vocab_size:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens has {count} tokens but the "
                              f"model embeds only {vocab_size}")
    for key in sorted(k for k in present if k.endswith("_token_id")):
        value = meta[key]
        if not is_integer(value) or not 0 <= value < count:
            raise CheckpointError(f"{source}: {key}={value!r:.100} is not a token id in "
                                  f"[0, {count})")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        if not isinstance(meta.get(key, False), bool):
            raise CheckpointError(f"{source}: {key} must be a bool, got {meta[key]!r:.100}")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source}: tokenizer.chat_template must be a string, got "
                              f"{type(template).__name__}")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(backend, bos, meta.get("tokenizer.ggml.add_bos_token", False),
                     chat_template=template)
