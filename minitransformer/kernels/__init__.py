"""How the arithmetic runs fast, or strictly: the engineering under the core's products.

    blas.py      which BLAS call makes x @ w.T fastest here (chosen by timing, per shape)
    tuning.py    what blas.py measured, kept on disk per machine: measured once, remembered
    threads.py   how many threads (MT_THREADS, --threads) and the pool a product's parts run on
    attention.py attention whole or in parts across sequences or kv heads on that pool
    fused.py     q/k/v and gate/up stacked into one matrix each: one product instead of five
    strict.py    MT_BACKEND=strict: NumPy that refuses what a GPU refuses, for the test suite
"""
