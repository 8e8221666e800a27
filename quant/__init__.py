"""quant: weight quantization for the chapter's experiments 15 to 21.

    schemes.py     the chapter's schemes as data (label, bits, group, levels) -> quantize, nbytes
    absmax.py      symmetric absmax at 8 and 4 bits: absmax_per_tensor / _per_row / _per_group
    nf4.py         NF4 (QLoRA's 4-bit NormalFloat), blocks of 64
    ggml_blocks.py llama.cpp's blocks of 32 (Q8_0, Q5_0, Q5_1, IQ4_NL), as llama-quantize writes
    kquants.py     llama.cpp's k-quants (Q2_K..Q6_K): super-blocks of 256, scales quantized too
    gguf_weight.py GGUFWeight: a matrix held as GGUF blocks (a k-quant, or its fallback type)
    scales.py      what the quantizers share: territory absmax, float16 scales, build a QWeight
    packing.py     two 4-bit codes per byte
    qweight.py     QWeight: packed codes + float16 scales, .dequantize() (the spec), .matmul(x)
    matmul.py      the fast multiply: a block of rows at a time through a small float buffer
    int8.py        INT8 activations (per tensor, per token, LLM.int8's outlier columns)
    qmodel.py      quantize_model (every projection matrix), dequantize_model, resident_bytes
    analysis.py    error table over all projection matrices, one matrix's outlier statistics
    activations.py outlier features in the residual stream, INT8 levels used
    techniques.py  LLM.int8, vector-wise, SmoothQuant-style, weight-only: measured on a matmul

Each quantizer returns a QWeight that carries its own reconstruction error. What a quantized
model costs in quality (perplexity, the battery, agreement) is measured by
minitransformer/measure/quality.py.
"""
