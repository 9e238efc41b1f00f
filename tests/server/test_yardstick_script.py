"""scripts/yardstick (the H200 serving benchmark of docs/benchmarks.md) end to end on the CPU: it starts the
server, waits for /health, runs `bench serve` with the sonnet dataset over two adapters, writes the result
JSON and stops the server. A tiny preset and short lengths stand in for GPT-OSS-20B; the point is that the
script a reader re-runs keeps working. Skipped loudly without ../shared/data (the sonnet text and the Qwen3
tokenizer)."""
import json
import os
import socket
import subprocess
import tempfile

import pytest

from serve_helpers import BIN, ROOT

SHARED = next((d for d in (os.path.join(ROOT, "..", "shared", "data"), "/work/shared/data")
               if os.path.exists(os.path.join(d, "sonnet.txt"))), None)
QWEN3 = os.path.join(SHARED, "tokenizers", "qwen3") if SHARED else None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (QWEN3 and os.path.exists(os.path.join(QWEN3, "tokenizer.json"))),
                    reason="SKIPPED LOUDLY: no ../shared/data — scripts/yardstick is untested")
@pytest.mark.parametrize("dataset", ["sonnet", "random"])
def test_yardstick_script_serves_benches_and_stops(dataset):
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        cmd = [os.path.join(ROOT, "scripts", "yardstick"), "--device", "cpu", "--bin", BIN, "--model", "preset:tiny-moe",
               "--tokenizer", QWEN3, "--sonnet", os.path.join(SHARED, "sonnet.txt"), "--loras", "2", "--rank", "8",
               "--concurrency", "2", "--num-prompts", "4", "--input-len", "64", "--output-len", "4", "--out", out,
               "--port", str(port), "--name", "smoke", "--max-num-batched-tokens", "512",
               "--serve-arg", "--no-enable-prefix-caching", "--dataset", dataset]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        r = json.load(open(os.path.join(out, "smoke.json")))
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["total_output_tokens"] == 16
        assert r["per_adapter"]["lora0"]["completed"] == 2 and r["per_adapter"]["lora1"]["completed"] == 2
        serve_log = open(os.path.join(out, "smoke.serve.log")).read()
        assert "decode graphs" in serve_log and "drained" in serve_log, serve_log[-2000:]
        # the step budget and the extra serve flag reached the server
        config = [line.split() for line in serve_log.splitlines() if line.startswith("  ")]
        assert ["max-num-batched-tokens", "512"] in config, serve_log[:2000]
        assert ["prefix", "caching", "off"] in config, serve_log[:2000]
        # the server's metrics summary, the refill wait's holds included
        assert "engine refill holds:" in p.stdout, p.stdout[-2000:]
        # The server is gone: its port is free again.
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_yardstick_script_rejects_unknown_dataset():
    p = subprocess.run([os.path.join(ROOT, "scripts", "yardstick"), "--bin", BIN, "--dataset", "shakespeare"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert "--dataset shakespeare: expected sonnet or random" in p.stderr
