"""scripts/bench_serving.py end to end on a tiny model: two real servers, real HTTP traffic."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_bench_serving_prints_both_policies_and_the_comparison(tmp_path, run_script):
    from minitransformer.synth import make_checkpoint, qwen2_config, train_tokenizer

    tiny = make_checkpoint(tmp_path / "tiny", qwen2_config(vocab_size=320),
                           tokenizer=train_tokenizer(300))
    out, _ = run_script("bench_serving", "--model", tiny, "--requests", 6, "--median", 4,
                        "--max-len", 12, "--total", 36, "--rates", "50,inf")
    rows = [line.split() for line in out.splitlines() if line.startswith(("static ",
                                                                          "continuous "))]
    assert [(r[0], r[1]) for r in rows] == [("static", "50"), ("static", "inf"),
                                            ("continuous", "50"), ("continuous", "inf")]
    assert all("nan" not in r for r in rows)
    assert "at inf req/s continuous vs static: throughput" in out
