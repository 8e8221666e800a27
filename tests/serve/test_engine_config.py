"""EngineConfig: every knob checked where it is made, and the one config built from the command
line carried whole into the engine and the server: the attention asked for, the pool's memory
priced in its own format, and a config of another type refused naming its type."""
import argparse
import dataclasses
import json

import numpy as np
import pytest

from minitransformer import __main__ as cli
from minitransformer.serve import http
from minitransformer.serve.config import EngineConfig, SpeculativeConfig
from minitransformer.serve.engine import Engine


@pytest.mark.parametrize("field, bad", [
    ("max_num_seqs", 0), ("max_num_seqs", 2.0), ("max_num_seqs", True), ("max_num_seqs", "8"),
    ("block_size", 0), ("block_size", None), ("num_gpu_blocks_override", -1),
    ("num_gpu_blocks_override", 2.5), ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", 8),          # no more than the 8 decodes: no room for a prompt
    ("policy", "fifo"), ("policy", None), ("kv_cache_dtype", "int8"), ("kv_cache_dtype", None),
    ("attention", "flash"), ("attention", ["plain"]), ("enable_prefix_caching", 1),
    ("enable_prefix_caching", None), ("batch_invariant", "yes")], ids=str)
def test_a_bad_value_is_refused_naming_its_field(field, bad):
    with pytest.raises(ValueError, match=rf"^{field}="):
        EngineConfig(**{field: bad})


def test_numpy_numbers_and_flags_are_accepted_and_the_config_is_frozen():
    config = EngineConfig(max_num_seqs=np.int64(2), block_size=np.int16(4),
                          num_gpu_blocks_override=np.int32(8), batch_invariant=np.bool_(True))
    assert config.num_blocks == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8


def test_the_default_pool_holds_1024_tokens_a_slot():
    assert EngineConfig(max_num_seqs=3, block_size=16).num_blocks == 3 * 64
    assert EngineConfig(max_num_seqs=3, block_size=1000).num_blocks == 3 * 2   # rounded up
    assert EngineConfig(max_num_seqs=3, num_gpu_blocks_override=5).num_blocks == 5


def test_the_engine_takes_only_a_config(tiny_model):
    config = EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=10,
                          policy="static", enable_prefix_caching=False,
                          max_num_batched_tokens=7, kv_cache_dtype="q8_0")
    engine = Engine(tiny_model, config)
    assert engine.config is config and len(engine.slots) == 3
    assert (engine.cache.books.num_blocks, engine.cache.books.block_size) == (10, 4)
    assert (engine.policy, engine.prefix_caching, engine.scheduler.budget) == ("static", False, 7)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(tiny_model, {"max_num_seqs": 3})


def serve_args(*options):
    return cli.parser().parse_args(["serve", *options])


def test_the_serve_options_default_to_the_configs_defaults():
    assert cli.engine_config(serve_args()) == EngineConfig()


def test_each_serve_option_sets_its_field():
    options = ["--max-num-seqs", "3", "--block-size", "4", "--num-gpu-blocks-override", "50",
               "--policy", "static", "--no-enable-prefix-caching", "--max-num-batched-tokens",
               "9", "--kv-cache-dtype", "q4_0", "--attention", "tiled", "--batch-invariant",
               "--speculative-config", '{"num_speculative_tokens": 2}']
    expected = EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=50,
                            policy="static", enable_prefix_caching=False,
                            max_num_batched_tokens=9, kv_cache_dtype="q4_0", attention="tiled",
                            batch_invariant=True,
                            speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    assert cli.engine_config(serve_args(*options)) == expected
    # every field differs from its default above: none is left to the default by mistake
    assert all(getattr(expected, f.name) != f.default for f in dataclasses.fields(EngineConfig))
    assert cli.engine_config(serve_args("--slots", "3", "--num-blocks", "50")) == \
        EngineConfig(max_num_seqs=3, num_gpu_blocks_override=50)      # the older names


def test_a_bad_serve_option_is_refused_before_the_model_is_looked_for(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--model", str(tmp_path / "nowhere"), "--max-num-seqs", "0"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: max_num_seqs=0: expected an integer >= 1\n"


def test_serve_carries_the_config_and_the_limits_through(tiny_model, monkeypatch):
    """http.serve hands the very config to the engine and each limit to its user: the queue's
    bound to the online engine, the body limit and the API key to the app, the address to the
    socket, the read timeout to the protocol and the drain time to uvicorn."""
    import socket

    import uvicorn

    import minitransformer as mt
    seen = {}
    monkeypatch.setattr(mt, "load", lambda path: tiny_model)
    monkeypatch.setattr(http, "create_app", lambda online, name, limit, api_key: seen.update(
        online=online, name=name, limit=limit, api_key=api_key) or "app")
    monkeypatch.setattr(http, "bound_socket", lambda host, port: seen.update(
        host=host, port=port) or socket.socket())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: seen.update(
        app=self.config.app, read_timeout=self.config.http.timeout,
        drain=self.config.timeout_graceful_shutdown - http.CUT_GRACE_S))
    config = EngineConfig(max_num_seqs=2, block_size=4, num_gpu_blocks_override=12,
                          kv_cache_dtype="f16")
    limits = http.ServerLimits(max_waiting=3, max_request_bytes=5000, drain_timeout=1.5,
                               read_timeout=2.5, api_key="sk-x")
    http.serve("anywhere", config, port=8123, limits=limits, name="tiny")
    engine = seen["online"].engine
    assert engine.config is config and engine.cache.kv_dtype == "f16"
    assert seen["online"].max_waiting == 3 and seen["limit"] == 5000 and seen["name"] == "tiny"
    assert seen["app"] == "app" and seen["port"] == 8123 and seen["host"] == "127.0.0.1"
    assert seen["drain"] == 1.5 and seen["read_timeout"] == 2.5 and seen["api_key"] == "sk-x"


@pytest.mark.parametrize("field, bad", [("max_waiting", -1), ("max_waiting", 1.5),
                                        ("max_waiting", 0), ("read_timeout", 0),
                                        ("drain_timeout", -1.0), ("drain_timeout", float("nan")),
                                        ("drain_timeout", "30")], ids=str)
def test_a_bad_server_limit_is_refused_naming_it(field, bad):
    with pytest.raises(ValueError, match=rf"^{field}="):
        http.ServerLimits(**{field: bad})


@pytest.mark.parametrize("config", [
    EngineConfig(),
    EngineConfig(max_num_seqs=3, block_size=4, num_gpu_blocks_override=50, policy="static",
                 enable_prefix_caching=False, max_num_batched_tokens=9, kv_cache_dtype="q4_0",
                 attention="tiled", batch_invariant=True)], ids=["defaults", "every field"])
def test_the_flags_of_a_config_give_it_back(config):
    """What a script passes to the server it starts is the config it means."""
    assert cli.engine_config(serve_args(*cli.engine_flags(config))) == config


def test_the_engine_and_its_pool_attend_as_configured(tiny_model):
    """Tiled attention asked for: the engine says so and its paged pool computes with it."""
    engine = Engine(tiny_model, EngineConfig(attention="tiled"))
    assert engine.attention == "tiled" and engine.cache.attention == "tiled"


def test_a_config_of_another_type_is_refused_naming_its_type(tiny_model):
    with pytest.raises(TypeError, match="^config: expected an EngineConfig, got dict$"):
        Engine(tiny_model, {"max_num_seqs": 2})


def test_the_memory_check_prices_the_pool_in_its_own_format(tiny_model, monkeypatch):
    """A backend with exactly the bytes a q4_0 pool of 64 blocks x 16 tokens and 2 slots
    needs: the engine of that pool is made, the same pool in f32 is refused."""
    from minitransformer.serve import paged
    per_token = paged.cache_bytes_per_token(tiny_model.config, "q4_0")
    need = 64 * 16 * per_token + 8 * 2
    assert paged.cache_bytes_per_token(tiny_model.config, "f32") > per_token
    monkeypatch.setattr(paged, "memory_bytes", lambda: (need, "physical memory"))
    sizes = dict(max_num_seqs=2, num_gpu_blocks_override=64, block_size=16)
    Engine(tiny_model, EngineConfig(kv_cache_dtype="q4_0", **sizes))
    with pytest.raises(ValueError, match="more than the"):
        Engine(tiny_model, EngineConfig(**sizes))


# ------------------------------------------------ the speculative config, built in Python
PYTHON_BAD = [  # (fields, what the message names): each was once accepted, or misnamed
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1, got 2.5"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens must be an integer >= 1, got -2"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1, got True"),
    ({"num_speculative_tokens": 2, "weight_rows": -1}, "weight_rows must be a finite number"),
    ({"num_speculative_tokens": 2, "weight_rows": True}, "weight_rows must be a finite number"),
    ({"num_speculative_tokens": 2, "min_acceptance": 1.5}, "min_acceptance must be a number"),
    ({"num_speculative_tokens": 2, "min_acceptance": -0.1}, "min_acceptance must be a number"),
    ({"num_speculative_tokens": 2, "method": "medusa"}, "method 'medusa' is not served here"),
    ({"num_speculative_tokens": 2, "method": None}, "method None is not served here"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2.0}, "prompt_lookup_max must be"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": None}, "prompt_lookup_min must be"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": False}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 2},
     "prompt_lookup_min (2) is more than prompt_lookup_max (1)"),
    ({"num_speculative_tokens": 2, "method": "ngram", "model": "/m"}, "is for method 'draft_model', not 'ngram'"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs model"),
]


@pytest.mark.parametrize("fields, named", PYTHON_BAD, ids=[m for _, m in PYTHON_BAD])
def test_a_speculative_config_built_in_python_is_refused_as_the_server_refuses_it(fields, named):
    """One home for each rule: the dataclass's own check, whose message the command line's
    --speculative-config (the server's) gives for the same JSON, word for word."""
    with pytest.raises(ValueError) as built:
        SpeculativeConfig(**fields)
    assert str(built.value).startswith("speculative config: ") and named in str(built.value)
    given = {name: value for name, value in fields.items() if value is not None}
    if given == fields:             # JSON's null is the field left out: not the same mistake
        with pytest.raises(argparse.ArgumentTypeError) as parsed:
            cli.speculative_config(json.dumps(fields))
        assert str(parsed.value) == str(built.value)


def test_the_engine_serves_generates_tokens_after_a_refused_setting(tiny_model):
    """A refused setting never reaches the engine: a change made with dataclasses.replace is
    checked as a new config is, and the engine it was meant for decodes on as before."""
    import minitransformer as mt
    from minitransformer.serve.records import Request
    spec = SpeculativeConfig(num_speculative_tokens=3)
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, speculative_config=spec))
    for change in ({"num_speculative_tokens": 2.5}, {"weight_rows": -1},
                   {"min_acceptance": 2.0}, {"method": "medusa"}):
        with pytest.raises(ValueError, match="^speculative config: "):
            dataclasses.replace(spec, **change)
        with pytest.raises(ValueError, match="^speculative config: "):
            Engine(tiny_model, EngineConfig(speculative_config=SpeculativeConfig(
                **{"num_speculative_tokens": 3} | change)))
    with pytest.raises(ValueError, match="^max_num_seqs="):
        dataclasses.replace(engine.config, max_num_seqs=0)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    run = engine.run([Request(tuple(prompt), 8, eos_token_id=[])])
    assert run.results[0].tokens == mt.generate(tiny_model, prompt, 8, eos_token_id=[])
