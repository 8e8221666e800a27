"""File formats: where a model's bytes come from. The loader (``minitransformer/loader.py``)
reads through these; nothing here is needed to understand the forward pass.

    safetensors_io   the safetensors container, checked to tile its file exactly
    gguf             llama.cpp's GGUF files -> Model (config, weights, tokenizer)
    gguf_blocks      GGUF's quantized block types, dequantized to float32
    gguf_tokenizer   the tokenizer stored in a GGUF file's metadata

Import each module by its own path; this package re-exports nothing.
"""
