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
"""
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


def build_backend(meta: dict, source: str):
    """tokenizer.ggml.* metadata -> tokenizers.Tokenizer (byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model={kind!r} is not supported "
                              "(only 'gpt2', byte-level BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges "
                              "is missing")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries "
                              f"for {len(tokens)} tokens")
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} is not "
                                  "two pieces separated by one space")
        pairs.append((left, right))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    # Llama 3 looks a whole word up before merging (llama.cpp: ignore_merges); others merge.
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     ignore_merges=pre == "llama-bpe"))
    backend.pre_tokenizer = pre_tokenizer(pre, source)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    return backend


def tokenizer_from_metadata(meta: dict, source: str) -> Tokenizer | None:
    """GGUF metadata -> Tokenizer (None when the file carries no vocabulary)."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    backend = build_backend(meta, source)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(backend, None if bos is None else int(bos),
                     bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     chat_template=meta.get("tokenizer.chat_template"))
