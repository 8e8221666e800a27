"""A request checked before the engine takes it: every field against the model and the slots.

``Engine.submit`` and ``Engine.check`` call ``check_request`` before anything is queued or
held, so a malformed request is a ValueError naming its field, never a failure mid-step, and
the server can answer 400 before a stream starts (docs/serving.md, "The server's limits").
What it gives back is what the fan-out needs: the prompt's ids, one generator per sample
(sample i seeded seed + i) and the ids that end a sequence.

>>> from minitransformer.checkpoints.synth import qwen2_config, random_model
>>> model = random_model(qwen2_config())
>>> prompt, rngs, eos = check_request(model, Request((1, 2), 3, n=2, seed=5), slots=4)
>>> prompt, len(rngs)
([1, 2], 2)
>>> check_request(model, Request((1, 2), 3, n=5), slots=4)
Traceback (most recent call last):
...
ValueError: n must be an integer in [1, 4] (the engine's slots), got 5
"""
import math

from minitransformer.checks import is_integer, is_real
from minitransformer.generate import check_prompt, eos_ids, seeded_rng
from minitransformer.logprobs import check_top
from minitransformer.sampling import check_sampling
from minitransformer.serve.records import Request


def check_request(model, request, slots: int) -> tuple:
    """A request's fields, checked against the model and the engine's slots -> (prompt ids, a
    generator per sample (seed + i for sample i), its eos ids); a ValueError names the field."""
    if not isinstance(request, Request):
        raise ValueError(f"expected a minitransformer.serve.records.Request, got "
                         f"{type(request).__name__}")
    check_sampling(request.sampling)
    t = request.arrival
    if not is_real(t) or not 0 <= t < math.inf:
        raise ValueError(f"arrival must be a finite number of seconds >= 0, got {t!r}")
    prompt = check_prompt(model, request.prompt, request.max_new_tokens).tolist()
    n = request.n
    if not is_integer(n) or not 1 <= n <= slots:
        raise ValueError(f"n must be an integer in [1, {slots}] (the engine's slots), got {n!r}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(request, name) is not None:
            check_top(getattr(request, name), name)
    seeded_rng(request.seed)        # checked once: then seed + i is an integer too
    rngs = [seeded_rng(None if request.seed is None else request.seed + i) for i in range(n)]
    return prompt, rngs, eos_ids(model, request.eos_token_id)
