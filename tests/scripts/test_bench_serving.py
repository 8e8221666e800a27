"""scripts/dev/bench_serving.py end to end on a tiny model: real servers, real HTTP traffic, each
workload with its feature off and on."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer

    path = make_checkpoint(tmp_path_factory.mktemp("bench") / "tiny",
                           qwen2_config(vocab_size=320), tokenizer=train_tokenizer(300))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template":
                                                                       TEMPLATE}))
    return str(path)


def rows(out, *labels):
    return [line.split() for line in out.splitlines() if line.startswith(labels)]


def test_bench_serving_prints_both_policies_and_the_comparison(tiny, run_script):
    out, _ = run_script("bench_serving", "--model", tiny, "--workloads", "poisson",
                        "--requests", 6, "--median", 4, "--max-len", 12, "--total", 36,
                        "--rates", "50,inf")
    found = rows(out, "static ", "continuous ")
    assert [(r[0], r[1]) for r in found] == [("static", "50"), ("static", "inf"),
                                             ("continuous", "50"), ("continuous", "inf")]
    assert all("nan" not in r for r in found)
    assert "at inf req/s continuous vs static: throughput" in out


def test_bench_serving_chat_and_long_prompt_print_each_feature_off_and_on(tiny, run_script,
                                                                          tmp_path):
    out, _ = run_script("bench_serving", "--model", tiny, "--workloads", "chat,long-prompt",
                        "--slots", 4, "--block-size", 4, "--conversations", 2, "--turns", 3,
                        "--answer-tokens", 6, "--document-words", 5, "--rounds", 1,
                        "--streams", 2, "--stream-tokens", 220, "--long-prompt", 120,
                        "--max-num-batched-tokens", 16, "--markdown", tmp_path / "both.md")
    table = out.split("time to first token per turn")[1].split("turns 2-3")[0]
    turns = [row for row in map(str.split, table.splitlines())
             if len(row) == 7 and row[0].isdigit()]
    assert [int(t[0]) for t in turns] == [1, 2, 3]
    assert int(turns[2][1]) > int(turns[0][1])                 # the history grows
    assert "answers identical with caching on and off: 6 of 6" in out
    assert "prefix cache hit rate" in out
    written = (tmp_path / "both.md").read_text()   # every table printed, not only streams'
    assert written.startswith("# Serving benchmark: chat, long-prompt\n")
    assert written.count("\n### ") == 4 and "answers identical with caching on and off: 6 of 6" \
        in written
    assert [r[:2] for r in rows(out, "caching o")] == [["caching", "off"], ["caching", "on"]]
    assert [r[:2] for r in rows(out, "whole prefill ", "chunked prefill ")] == \
        [["whole", "prefill"], ["chunked", "prefill"]] * 2        # gaps, then percentiles
    assert "chunked prefill: the streams' largest gap" in out
    assert all("nan" not in r for r in rows(out, "caching o", "whole prefill ", "chunked prefill "))


def test_bench_serving_streams_prints_before_and_after_per_concurrency(tiny, run_script,
                                                                        tmp_path):
    out, _ = run_script("bench_serving", "--model", tiny, "--workloads", "streams",
                        "--concurrency", "1,3", "--rounds", 2, "--stream-tokens", 5,
                        "--prompt-len", 4, "--markdown", tmp_path / "streams.md")
    found = [r for r in map(str.split, out.splitlines()) if r[:1] in (["1"], ["3"])]
    assert [r[0] for r in found] == ["1", "3"] and all(len(r) == 7 for r in found)
    assert all(float(v) > 0 for r in found for v in r[1:])
    assert "MT_LAYOUT=row-major" in out and "load average" in out
    written = (tmp_path / "streams.md").read_text()
    assert written.startswith("# Serving benchmark: the batched step before and after")
    assert "| 3 |" in written


def test_bench_serving_streams_before_is_row_major_and_after_measures(monkeypatch):
    """The two servers' environments: before holds the checkpoint's row-major layout, after
    measures each weight's (an MT_LAYOUT set where the benchmark runs is not inherited)."""
    import argparse

    import bench_serving
    seen = {}

    class Exited:
        returncode = 1

        def poll(self):
            return 1

    def popen(command, env, **_):
        seen[env["MT_LAYOUT"]] = env["OPENBLAS_NUM_THREADS"]
        return Exited()
    monkeypatch.setattr(bench_serving.subprocess, "Popen", popen)
    monkeypatch.setenv("MT_LAYOUT", "column-major")
    args = argparse.Namespace(threads=1, requests=1)
    for label, env in bench_serving.LAYOUTS.items():
        with pytest.raises(SystemExit, match=f"the {label} server exited"):
            bench_serving.start_server(args, label, bench_serving.EngineConfig(), "m", env)
    assert seen == {"row-major": "1", "": "1"}   # "": unset, as blas.py reads it


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "chat,nope"], "unknown workload"),
    (["--streams", "8", "--slots", "8"], "--streams must leave a slot"),
    (["--wait-tokens", "9", "--stream-tokens", "9"], "--wait-tokens must be below"),
    (["--max-num-batched-tokens", "8"], "must exceed --slots"),
    (["--concurrency", "4,2.5"], "every count of streams must be a whole number >= 1")])
def test_bench_serving_refuses_bad_options_naming_them(argv, message, run_script):
    _, err = run_script("bench_serving", "--model", "default", *argv, status=2)
    assert message in err


def test_bench_serving_threads_prints_one_and_n_threads_side_by_side(tiny, run_script):
    """Two servers, at --threads 1 and N (given, not the machine's cores): the single stream's
    time per token and the streams' tokens/s at each, with both idle servers' CPU."""
    out, _ = run_script("bench_serving", "--model", tiny, "--workloads", "threads",
                        "--rounds", 1, "--thread-streams", 2, "--stream-tokens", 6,
                        "--prompt-len", 4, "--side-threads", 3)
    assert "Threads: a server at 1 and at 3 threads, side by side" in out
    assert "servers with --threads 1 and --threads 3" in out
    table = [line.split() for line in out.split("streams  figure")[1].splitlines()[1:3]]
    assert [(r[0], r[1]) for r in table] == [("1", "ms"), ("2", "tokens/s")]
    assert "idle: the 1 thread server" in out and "the 3 threads server" in out
