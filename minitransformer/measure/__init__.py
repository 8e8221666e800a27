"""Measurement: what the experiments and benchmarks use to time, check and score.

    timing    times you can trust on a noisy machine, allocator peaks, BLAS threads
    sanity    checks that a table's rows make sense before a conclusion is drawn from them
    quality   perplexity, the question battery, greedy agreement between two models
    text      the evaluation text (fetched with pip, cached under weights/)

Import each module by its own path; this package re-exports nothing.
"""
