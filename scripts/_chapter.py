"""The chapter's figures, experiment by experiment, and why ours differ: data for the tables.

Each experiment's table ends with two lines from here: what the chapter reported (Qwen2.5-0.5B,
fp16/fp32 on an 8 GB laptop GPU, through PyTorch) and one sentence on why the numbers printed
above need not match it. Written for this project from the chapter's text, so the scripts carry
their own reference point and need nothing outside the repository.
"""
GPU = "the chapter ran Qwen2.5-0.5B on a laptop GPU, we run NumPy float32 on a CPU"
RANDOM_WEIGHTS = ("random weights (the embedded default model): quality figures below measure "
                  "the method, not a language model; run with --model PATH for real ones")

# experiment -> (the chapter's figures, why ours differ)
FIGURES = {
    1: ("identical output; 9x faster with the cache over 48 new tokens after a 40-token prompt",
        f"{GPU}; the speedup grows with the tokens generated, and a small model gains less "
        "because its fixed per-step costs weigh more"),
    2: ("at n = 4,096: a 4,096 x 4,096 score matrix, 67 MB, recomputed against 16 KB cached "
        "(fp32)", "the score bytes are exact and match; the times are a CPU's, not the GPU's"),
    3: ("per step linear against quadratic in the context; summed O(T^2) against O(T^3), the "
        "ratio grows without bound", "counted, not measured: the same for any machine; the "
        "model's shape sets the constants"),
    4: ("256 new tokens in fp16 on the GPU: no cache used 8.3x the memory of the cached run",
        "we count float32 arrays through tracemalloc, PyTorch counted fp16 tensors in its CUDA "
        "allocator; the ratio depends on the model's shape (S x F activations against the cache)"),
    5: ("40-token prompt in 1.0224 s (25.6 ms/token); 47 decode steps of 166.5 ms: a decode "
        "step costs 6.5x a prompt token", f"{GPU}; the gap is matrix-matrix against "
        "matrix-vector work, narrower on a CPU whose matrix products are slower per flop"),
    6: ("the pass grows with P, the cost per token falls (matrix-matrix work)",
        f"{GPU}; on a CPU the per-token fall flattens sooner, once the matrix products are "
        "compute-bound"),
    7: ("flat: 64x more history (16 -> 1,024) changed nothing measurable; weights dominate",
        f"{GPU}; a small model's weights are small too, so the cache's share of a step shows "
        "earlier"),
    8: ("2 x 24 x 2 x 64 x 2 = 12,288 B/token; (1, 2, 295, 64) fp16 per layer = 3,624,960 B "
        "for 295 tokens; exact in every shape", "bytes are exact: the same numbers, from the "
        "arrays held"),
    9: ("32 x 2,048, 64 x 1,024 and 128 x 512 all hold 65,536 tokens = 768 MB (fp16)",
        "formula of the model's shape: identical for the chapter's model, scaled for ours"),
    10: ("full MHA 86,016 B/token = 7x GQA's 12,288 (14 kv heads against 2); MQA half of GQA",
         "formula of the model's shape: identical for the chapter's model, scaled for ours"),
    11: ("128 KB/token; at 128,000 tokens one user's cache outgrows the 13.0 GB of fp16 "
         "weights", "formula of a 7B-class shape: the same numbers on any machine"),
    12: ("1 -> 16: throughput x6.0, latency x2.67; 16 -> 32: throughput +9%, latency ~x2 (the "
         "knee)", "a GPU decode step is memory-bound up to a large batch; a CPU's matrix "
         "products turn compute-bound sooner, so the knee comes earlier and lower"),
    13: ("64 requests (output lengths median 18, max 231, 1,874 tokens) through 8 slots: "
         "continuous gives 1.6x the throughput and over 10x lower mean latency",
         "the same policies at our measured step costs: the ratios, not the seconds, carry "
         "over"),
    14: ("no table: reserving max context per sequence wastes what paging keeps free",
         "ours puts numbers on the point: exact block counts, any machine"),
    15: ("0.5 B parameters: 1.98 GB in fp32, 0.99 GB in fp16, 0.49 GB in int8",
         "bytes are exact; ours adds the packed 4-bit schemes' scales"),
    16: ("INT4 per-tensor worst matrix 0.99; per-row divides the error by 3.4; NF4 0.0952 "
         "against group-128 0.1323 (28% lower)", "the chapter's 168 matrices of Qwen2.5-0.5B "
         "against this model's: trained weights have outliers and per-tensor collapses on "
         "them; random weights have none, and it does not"),
    17: ("layers.12.mlp.down_proj: mean |w| 0.01386, std 0.01822, max 0.43945, max/std 24.1, "
         "692 of 4,358,144 beyond 6 sigma", "a different trained model (or random weights, "
         "which have no outliers): the shape of the tail, not its numbers, carries over"),
    18: ("dimension 62 reaches 1,579.6 at layer 16 while the median dimension stays under 1.6; "
         "histogram 254/283/226/93/18/9/7/5/0/0/0/1", "a different model: its outlier "
         "dimensions are its own (random weights have none)"),
    19: ("14 of 256 INT8 levels used, step 12.44; without the top 4 dimensions the scale is "
         "0.5749 (22x smaller)", "a different model: fewer or other outliers, other levels"),
    20: ("text only: LLM.int8, per-channel scales, SmoothQuant, NF4, GPTQ/AWQ against outliers",
         "a table of methods, the same everywhere"),
    21: ("perplexity fp32 23.08; INT8 per-row 22.96; INT4 per-tensor 365,416,000; per-row "
         "46.18; group-128 31.08; NF4 24.55", "a different model and text: the order of the "
         "schemes carries over, the values do not"),
    22: ("alpha 0.9, gamma 8, c 0.1: 3.40x; alpha 0.3: 0.79x; greedy and the Leviathan rule "
         "keep the target's output exactly", "on a CPU a verification pass over gamma + 1 "
         "positions costs more than one decode step, and a NumPy draft is not c = 0.1 cheap"),
    23: ("'She poured the milk into the': jug 0.1355, cup 0.1051, bowl 0.0605; top/third 2.24 "
         "at T = 1, 1.50 at T = 2", "a different model: other words and probabilities; the "
         "square-root rule of temperature 2 holds for any"),
    24: ("8 GB: 13B int4 leaves room for 337 tokens; 16 GB int8: 7B 65,378 tokens against 13B's "
         "3,136", "arithmetic on the same model shapes: the same numbers"),
}

CHAPTER = {n: (f"chapter: {figures}", f"why ours differs: {why}")
           for n, (figures, why) in FIGURES.items()}

# Why ours differs when the model is trained (not the embedded random one), where the reason
# above speaks of random weights.
TRAINED = {
    16: "the chapter's 168 matrices of Qwen2.5-0.5B against this trained model's: both have "
        "outliers, so per-tensor scales suffer in both, by how much depends on each model's "
        "outliers",
    18: "a different trained model: its outlier dimensions, and where they grow, are its own",
}
