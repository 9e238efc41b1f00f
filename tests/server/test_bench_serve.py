"""`loramux bench serve` end to end against the CPU server on a tiny preset: the random dataset (token ids,
always), the sonnet dataset on /v1/completions and /v1/chat/completions (with the Qwen3 tokenizer from
../shared/data; skipped loudly without it), Poisson arrivals, failed requests counted with their errors,
and --plot. Asserts the report's structure and counts. Run by scripts/test (LORAMUX_BIN = the built CLI)."""
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest

from serve_helpers import BIN, ROOT, Server

SHARED = next((d for d in (os.path.join(ROOT, "..", "shared", "data"), "/work/shared/data")
               if os.path.exists(os.path.join(d, "sonnet.txt"))), None)
QWEN3 = os.path.join(SHARED, "tokenizers", "qwen3") if SHARED else None
HAVE_TOKENIZER = bool(QWEN3 and os.path.exists(os.path.join(QWEN3, "tokenizer.json")))
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server():
    args = ["--model", "preset:tiny-moe", "--dummy-loras", "2", "--max-num-seqs", "16", "--max-model-len", str(MAX_MODEL_LEN)]
    if HAVE_TOKENIZER:
        args += ["--tokenizer", QWEN3]
    s = Server(*args)
    yield s
    s.stop()


def base_name(server):
    return server.get("/v1/models").json()["data"][0]["id"]


def bench(server, *args, expect_rc=0):
    """Runs bench serve with --result-json; returns (stdout, result dict)."""
    fd, path = tempfile.mkstemp(prefix="loramux_bench_", suffix=".json")
    os.close(fd)
    try:
        cmd = [BIN, "bench", "serve", "--base-url", server.url, "--result-json", path, "--save-detailed", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "LORAMUX_PYTHON": sys.executable})
        assert p.returncode == expect_rc, f"{' '.join(cmd)}\nrc {p.returncode}\n{p.stdout}\n{p.stderr}"
        with open(path) as f:
            return p.stdout, json.load(f)
    finally:
        os.unlink(path)


def round_robin(n, adapters, base, fraction):
    """The documented round-robin rule: base when floor((i+1)F) > floor(iF), else the next adapter."""
    out, k = [], 0
    for i in range(n):
        if math.floor((i + 1) * fraction) > math.floor(i * fraction):
            out.append(base)
        else:
            out.append(adapters[k % len(adapters)])
            k += 1
    return out


def check_figures(fig, completed, output_tokens):
    assert fig["completed"] == completed and fig["failed"] == 0
    assert fig["total_output_tokens"] == output_tokens
    assert fig["output_len_mismatches"] == 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}" in fig
        assert 0 < fig[f"median_{metric}"] <= fig[f"p99_{metric}"]
    assert fig["median_otps"] > 0 and fig["output_throughput"] > 0 and fig["request_throughput"] > 0


def test_random_dataset_two_adapters_and_base(server):
    n, input_len, output_len = 8, 12, 5
    out, r = bench(server, "--dataset-name", "random", "--input-len", str(input_len), "--output-len", str(output_len),
                   "--num-prompts", str(n), "--num-warmups", "2", "--lora-modules", "lora0", "lora1",
                   "--base-fraction", "0.25", "--ignore-eos", "--max-concurrency", "4", "--seed", "3")
    base = base_name(server)
    expected = round_robin(n, ["lora0", "lora1"], base, 0.25)
    assert "============ Serving Benchmark Result ============" in out
    for label in ("Successful requests:", "Total generated tokens:", "Median TTFT (ms):", "P99 ITL (ms):",
                  "Median OTPS (tok/s):", "Per Adapter"):
        assert label in out, label
    assert f"Successful requests:                     {n} " in out
    check_figures(r, n, n * output_len)
    assert r["total_input_tokens"] == n * input_len
    assert r["num_prompts"] == n and r["num_warmups"] == 2 and r["max_concurrency"] == 4 and r["request_rate"] == "inf"
    assert r["max_concurrent_requests"] <= 4
    assert r["models"] == expected  # warm-ups excluded, assignment as documented
    assert r["input_lens"] == [input_len] * n and r["output_lens"] == [output_len] * n
    assert r["errors"] == [""] * n and r["error_counts"] == {}
    assert set(r["per_adapter"]) == {"lora0", "lora1", base}
    for name, row in r["per_adapter"].items():
        count = expected.count(name)
        assert row["num_requests"] == count and row["is_base"] == (name == base)
        check_figures(row, count, count * output_len)


def test_poisson_arrivals_spread_the_requests(server):
    n = 6
    _, r = bench(server, "--dataset-name", "random", "--input-len", "8", "--output-len", "3", "--num-prompts", str(n),
                 "--request-rate", "20", "--lora-modules", "lora1", "--ignore-eos", "--seed", "11")
    assert r["completed"] == n and r["total_output_tokens"] == 3 * n and r["request_rate"] == 20
    starts = r["start_times"]
    assert starts == sorted(starts) and starts[0] < 0.05 and starts[-1] > 0.05  # 5 gaps of mean 50 ms
    assert list(r["per_adapter"]) == ["lora1"]


def test_failed_requests_are_counted_with_their_error(server):
    n = 3
    out, r = bench(server, "--dataset-name", "random", "--input-len", str(MAX_MODEL_LEN + 10), "--output-len", "2",
                   "--num-prompts", str(n), "--lora-modules", "lora0", expect_rc=3)
    assert r["completed"] == 0 and r["failed"] == n
    [(message, count)] = r["error_counts"].items()
    assert count == n and message.startswith("HTTP 400") and "maximum context length" in message
    assert r["per_adapter"]["lora0"]["failed"] == n
    assert "Failed requests:                         3" in out and "Errors:" in out


@pytest.mark.skipif(not HAVE_TOKENIZER, reason="SKIPPED LOUDLY: no ../shared/data/tokenizers/qwen3 — the sonnet "
                                               "dataset and the chat endpoint are untested")
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_sonnet_dataset(server, endpoint):
    n, input_len, output_len = 4, 64, 4
    _, r = bench(server, "--dataset-name", "sonnet", "--dataset-path", os.path.join(SHARED, "sonnet.txt"), "--tokenizer",
                 QWEN3, "--endpoint", endpoint, "--input-len", str(input_len), "--output-len", str(output_len),
                 "--num-prompts", str(n), "--lora-modules", "lora0", "lora1", "--ignore-eos", "--max-concurrency", "2")
    check_figures(r, n, n * output_len)
    assert r["per_adapter"]["lora0"]["completed"] == 2 and r["per_adapter"]["lora1"]["completed"] == 2
    if endpoint == "/v1/completions":  # the server counts the same text with the same tokenizer
        assert all(input_len - 2 <= x <= input_len for x in r["input_lens"]), r["input_lens"]
    else:  # the chat template adds its own tokens around the prompt
        assert all(x > input_len - 2 for x in r["input_lens"]), r["input_lens"]


def test_plot(server):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("SKIPPED LOUDLY: matplotlib is not installed in this Python (scripts/setup installs it)")
    png = tempfile.mktemp(prefix="loramux_bench_", suffix=".png")
    try:
        bench(server, "--dataset-name", "random", "--input-len", "8", "--output-len", "3", "--num-prompts", "4",
              "--lora-modules", "lora0", "lora1", "--base-fraction", "0.5", "--ignore-eos", "--plot", png)
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    finally:
        if os.path.exists(png):
            os.unlink(png)
