"""scripts/dev/soak_server.py end to end, shortened: a real server, mixed traffic from several
clients, the server's memory read every so many requests, /metrics checked against the sends."""
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_a_short_soak_prints_memory_per_reading_and_metrics_count_every_sample(run_script):
    out, err = run_script("soak_server", "--tiny", "--requests", 300, "--every", 100,
                          "--warmup", 100, "--clients", 4)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*[\d,]+\s+[\d.]+\s", line)]
    assert [row[0] for row in rows] == ["0", "100", "200", "300"]
    assert all(float(row[1]) > 0 for row in rows)          # RSS MiB of the server process
    assert re.search(r"slope after 100 requests: [+-]\d+\.\d\d MiB per 1,000 requests", out)
    sent = re.search(r"answered ([\d,]+) with 200, ([\d,]+) cancelled .* of 300 sent "
                     r"\(([\d,]+) samples\)", out)
    assert sent, out
    answered, cancelled, samples = (int(g.replace(",", "")) for g in sent.groups())
    assert answered + cancelled == 300 and cancelled > 0    # one in ten hangs up
    assert f"/metrics: {samples:,} samples over" in out     # every sample counted, aborts too
    assert "KV cache usage 0.000 once idle" in out          # every block back in the pool
    assert "[300/300]" in err                               # progress on stderr


def test_a_warmup_beyond_the_requests_is_refused(run_script):
    _, err = run_script("soak_server", "--tiny", "--requests", 10, "--warmup", 10, status=2)
    assert "--warmup" in err
