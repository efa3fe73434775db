"""perf/peer_bench.py: its pure parts (per-token ITL, the prompts of its workloads, the
completions parser's token counts, the rounds' medians, ratios and targets), and one small
end-to-end run on the null model with llama.cpp absent: skipped with a message, every
workload measured on ringserve, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf import peer_bench as pb
from perf import serving_bench as sb

ROOT = Path(__file__).resolve().parents[2]


def test_itl_per_token_splits_a_chunk_of_n_tokens_into_n_gaps():
    # chunks at 0, 10, 40 and 41 ms carrying 1, 1, 3 and 1 tokens
    itl = sb.itl_per_token([0.0, 0.010, 0.040, 0.041], [1, 1, 3, 1])
    assert itl == pytest.approx([0.010, 0.010, 0.010, 0.010, 0.001])
    assert sb.itl_per_token([0.5], [4]) == []  # the first chunk's tokens are the TTFT's


@pytest.fixture(scope="module")
def tokenizer():
    return sb.load_tokenizer(None)


def test_shared_prefix_prompts_are_groups_of_one_system_prompt(tokenizer):
    prompts = pb.shared_prefix_prompts(tokenizer, groups=3, per_group=4, system_tokens=200, question_tokens=20, seed=1)
    assert len(prompts) == 12 and len(set(prompts)) == 12
    count = pb.RawCounter(tokenizer)
    systems = [p.split("\n\n")[0] for p in prompts]
    for g in range(3):
        assert len(set(systems[4 * g : 4 * g + 4])) == 1  # in order, group after group, as SGLang sends them
        assert 200 <= count(systems[4 * g]) <= 201
    assert len(set(systems)) == 3
    for p in prompts:
        assert 20 <= count(p.split("\n\n")[1]) <= 21
    assert prompts == pb.shared_prefix_prompts(tokenizer, 3, 4, 200, 20, seed=1)  # the same on every server


def test_repetitive_prompts_hold_the_code_and_differ(tokenizer):
    prompts = pb.repetitive_prompts(10, seed=0)
    assert len(set(prompts)) == 10 and all(pb.CODE in p and p.endswith("```python\n") for p in prompts)
    assert 280 <= pb.RawCounter(tokenizer)(pb.CODE) <= 360


def test_transcript_holds_the_earlier_turns_and_answers():
    text = pb.transcript([("q1", " a1"), ("q2", " a2")], "q3")
    assert text == "User: q1\nAssistant: a1\nUser: q2\nAssistant: a2\nUser: q3\nAssistant:"
    assert pb.transcript([], "q1").startswith(text.split("\nAssistant: a1")[0])


def _feed(chunks: list[dict]) -> sb.RequestResult:
    """A streamed completions response through StreamConnection's parser, in one read."""
    conn = sb.StreamConnection("127.0.0.1", 1, pb.COMPLETIONS)
    conn.state, conn.result = "headers", sb.RequestResult(0.0)
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    conn.buf += b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body

    class Done:
        def set_result(self, r):
            self.result = r

    conn.done = Done()
    conn.data_received(b"")
    return conn.result


def test_parser_counts_a_chunks_tokens_by_its_logprobs():
    usage = {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}
    ringserve = _feed(
        [
            {"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}]},
            {"choices": [{"text": "bcd", "logprobs": {"tokens": ["b", "c", "d"], "token_logprobs": [0, 0, 0]}}]},
            {"choices": [], "usage": usage},
        ]
    )
    assert (ringserve.event_tokens, ringserve.text) == ([1, 3], ["a", "bcd"])
    assert (ringserve.completion_tokens, ringserve.cached_tokens, ringserve.error) == (4, 3, None)
    llama = _feed(  # llama.cpp: logprobs.content, one entry per chunk; a token may carry no text
        [
            {"choices": [{"text": "a", "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}}]},
            {"choices": [{"text": "", "logprobs": {"content": [{"token": "\\xe2", "logprob": -1.0}]}}]},
            {"choices": [{"text": "", "logprobs": None}], "usage": usage},
        ]
    )
    assert (llama.event_tokens, len(llama.content_times), llama.completion_tokens) == ([1, 1], 2, 4)
    chat = _feed([{"choices": [{"delta": {"content": "hi"}}]}])  # serving_bench's chat stream: unchanged
    assert (chat.event_tokens, chat.text) == ([0], ["hi"])


def _level(c: int, tok_s: float, ttft: float, itl: float, failed: int = 0, **extra) -> dict:
    stat = {"p50": None}
    return {
        "concurrency": c,
        "num_requests": 8,
        "failed": failed,
        "output_throughput": tok_s,
        "request_throughput": tok_s / 64,
        "ttft_ms": {"p50": ttft},
        "itl_token_ms": {"p50": itl},
        "tpot_ms": {"p50": itl},
        "e2e_ms": stat,
        "loadavg_before": [1.0, 1.0, 1.0],
        **extra,
    }


def test_medians_ratios_and_targets():
    spec = "ringserve --speculative-algorithm none"  # the defaults speculate
    rounds = [
        {
            "workloads": {
                "random": {
                    pb.LLAMA: [_level(1, 100, 50, 10), _level(8, 200, 60, 20)],
                    pb.RINGSERVE: [_level(1, 160 + 20 * r, 40, 6), _level(8, 700, 60, 10)],
                    spec: [_level(1, 150, 40, 3), _level(8, 600, 60, 10)],
                },
                "repetitive": {
                    pb.LLAMA: [_level(1, 100, 50, 10)],
                    pb.RINGSERVE: [_level(1, 300, 40, 3 + r)],
                    spec: [_level(1, 100, 40, 8, text_compared=4, text_mismatches=r)],
                },
            }
        }
        for r in range(2)
    ]
    rows = pb.summarize_rounds(rounds, [pb.LLAMA, pb.RINGSERVE, spec])
    assert [(r["workload"], r["concurrency"]) for r in rows] == [("random", 1), ("random", 8), ("repetitive", 1)]
    c1 = rows[0]["servers"][pb.RINGSERVE]
    assert c1["output_throughput"] == 170 and c1["vs_llama.cpp"]["output_throughput"] == pytest.approx(1.7)
    assert c1["vs_llama.cpp"]["itl_p50"] == pytest.approx(0.6) and c1["failed"] == 0
    off_ratio = rows[2]["servers"][spec]["vs_ringserve"]["itl_p50"]
    assert off_ratio == pytest.approx((8 / 3 + 8 / 4) / 2)
    assert (rows[2]["servers"][spec]["text_mismatches"], rows[2]["servers"][spec]["text_compared"]) == (1, 8)
    targets = {t["target"]: t for t in pb.check_targets(rows, [pb.LLAMA, pb.RINGSERVE, spec], [spec])}
    assert targets["random c=1: output tok/s / llama.cpp's >= 1.5"]["met"]
    assert targets["random c=1: ITL p50 / llama.cpp's <= 0.8"]["met"]
    assert targets["random c=1: TTFT p50 / llama.cpp's <= 1"]["met"]
    assert targets["random c=8: output tok/s / llama.cpp's >= 3, no failed request"]["met"]  # 3.5x
    (spec_target,) = [t for k, t in targets.items() if k.startswith("repetitive")]
    assert spec_target["value"] == pytest.approx(1 / off_ratio) and not spec_target["met"]  # a text differed
    assert "random c=32" not in " ".join(targets)  # not measured: not checked
    off_c1 = targets[f"random c=1, `{spec}`: output tok/s / llama.cpp's >= 1.0"]
    assert off_c1["value"] == pytest.approx(1.5) and off_c1["met"]


def test_memory_and_startup_against_llama_cpp():
    servers = {
        pb.LLAMA: {"rss_mb": {"rss": 1000.0, "peak": 1100.0}, "startup_s": 3.0},
        pb.RINGSERVE: {"rss_mb": {"rss": 1600.0, "peak": 2000.0}, "startup_s": 5.0},
    }
    targets = {t["target"]: t for t in pb.check_server_targets(servers)}
    rss = targets["RSS of all processes / llama.cpp's <= 1.5"]
    assert rss["value"] == pytest.approx(1.6) and not rss["met"]
    start = targets["time to healthy / llama.cpp's <= 2"]
    assert start["value"] == pytest.approx(5 / 3) and start["met"]
    assert pb.check_server_targets({pb.RINGSERVE: servers[pb.RINGSERVE]}) == []  # no peer: nothing to check


def test_llama_build_reads_the_cmake_cache_of_the_binarys_build(tmp_path):
    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    (tmp_path / "build" / "CMakeCache.txt").write_text(
        "GGML_AVX2:BOOL=ON\nGGML_AMX_INT8:BOOL=OFF\nGGML_NATIVE:BOOL=OFF\nGGML_F16C:BOOL=OFF\n"
        "GGML_CUDA_GRAPHS:BOOL=ON\nCMAKE_BUILD_TYPE:STRING=Release\nOTHER:BOOL=ON\n"
    )
    want = "CMAKE_BUILD_TYPE=Release GGML_AMX_INT8=OFF GGML_AVX2=ON GGML_NATIVE=OFF"  # no other backend's
    assert pb.llama_build(str(binary)) == want
    assert pb.llama_build(str(tmp_path / "elsewhere")).startswith("unknown")


def test_null_model_run_without_llama_cpp(tmp_path):
    out = tmp_path / "peer.json"
    absent = tmp_path / "llama-server"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "perf.peer_bench",
            "--null-model",
            "--llama-server",
            str(absent),
            "--ringserve-args",
            "",
            "--ringserve-tree",
            str(ROOT),
            "--idle-s",
            "1",
            "--rounds",
            "2",
            "--concurrency",
            "1,4",
            "--num-requests",
            "3,6",
            "--output-tokens",
            "16",
            "--sp-groups",
            "2",
            "--sp-per-group",
            "3",
            "--sp-system-tokens",
            "128",
            "--sp-question-tokens",
            "16",
            "--sp-output-tokens",
            "8",
            "--sp-concurrency",
            "3",
            "--mt-conversations",
            "2",
            "--mt-turns",
            "3",
            "--mt-first-tokens",
            "48",
            "--mt-next-tokens",
            "8",
            "--rep-requests",
            "2",
            "--rep-output-tokens",
            "32",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"llama.cpp skipped: no llama-server at '{absent}'" in proc.stdout
    result = json.loads(out.read_text())
    assert result["complete"] and result["rounds_run"] == 2
    assert result["llama_cpp"]["skipped"].startswith("no llama-server at")
    tree = f"{pb.RINGSERVE} @{pb.tree_name(ROOT)}"
    assert list(result["servers"]) == [pb.RINGSERVE, tree] and result["servers"][tree]["tree"] == str(ROOT)
    assert all("--null-model" in s["argv"] for s in result["servers"].values())
    for s in result["servers"].values():  # each process's RSS, at each time
        by_time = s["rss_by_role_mb"]
        assert list(by_time) == ["healthy", "end", "idle"]
        for by_role in by_time.values():
            assert {"granian main", "http worker", "ringserve::scheduler", "ringserve::detokenizer"} <= set(by_role)
            assert by_role["total"] == pytest.approx(sum(v for k, v in by_role.items() if k != "total"), abs=0.5)
    expected = {("random", 1): 6, ("random", 4): 12, ("shared_prefix", 3): 12, ("multi_turn", 2): 12}
    expected[("repetitive", 1)] = 4
    assert {(r["workload"], r["concurrency"]): r["servers"][pb.RINGSERVE]["requests"] for r in result["summary"]} == (
        expected
    )
    for row in result["summary"]:
        s = row["servers"][pb.RINGSERVE]
        assert s["failed"] == 0 and s["output_throughput"] > 0 and s["uncounted_tokens"] == 0, row
    for rd in result["rounds"]:
        (lv,) = rd["workloads"]["multi_turn"][pb.RINGSERVE]
        turns = lv["turns"]
        assert [t["requests"] for t in turns] == [2, 2, 2]
        assert turns[0]["prompt_tokens_mean"] < turns[1]["prompt_tokens_mean"] < turns[2]["prompt_tokens_mean"]
    assert result["targets"] == []  # nothing to compare with
    left = result["leftovers"][pb.RINGSERVE]
    assert left["stopped_by_sigint"] and left["processes"] == left["shm_segments"] == left["engine_files"] == []
    md = out.with_suffix(".md").read_text()
    assert f"| {tree} | idle |" in md
    assert "**llama.cpp skipped**" in md and "| shared_prefix | 3 | ringserve |" in md
