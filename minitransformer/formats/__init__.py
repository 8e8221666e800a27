"""File formats: where a model's bytes come from. The loader (``minitransformer/loader.py``)
reads through these; nothing here is needed to understand the forward pass.

    safetensors_io   the safetensors container, checked to tile its file exactly
    gguf             llama.cpp's GGUF files -> Model (config, weights, tokenizer)
    gguf_blocks      GGUF's blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), decoded
    gguf_kquants     GGUF's k-quants (Q2_K..Q6_K): super-blocks of 256, quantized scales
    gguf_types       each GGML tensor type's block and decoder; a tensor's bytes -> float32
    gguf_tokenizer   the tokenizer stored in a GGUF file's metadata

Import each module by its own path; this package re-exports nothing.
"""
