"""perf/quality.py's measure on a slice of the corpus: the exact mode against itself (a
separate ModelRunner) is KL 0 and top-1 agreement 1; gguf-q8 differs from it, by little."""

from __future__ import annotations

import pytest

from perf import quality


def test_the_corpus_is_several_documents_of_thousands_of_tokens():
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    windows = quality.corpus_windows(AutoTokenizer.from_pretrained(resolve_model_dir(None)), 512)
    assert len(list(quality.CORPUS.glob("*.txt"))) >= 5
    assert 6000 <= sum(len(w) for w in windows) <= 10000
    assert max(len(w) for w in windows) == 512


def test_exact_against_itself_is_zero_and_gguf_q8_is_close():
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    hf_dir = str(resolve_model_dir(None))
    windows = [quality.corpus_windows(AutoTokenizer.from_pretrained(hf_dir), 512)[0][:64]]
    modes = quality.modes(hf_dir)
    out = quality.measure({"none": modes["none"], "gguf-q8": modes["gguf-q8"]}, windows, 32, modes["none"])
    exact, q8 = out["none"], out["gguf-q8"]
    assert exact["tokens"] == q8["tokens"] == 63
    assert exact["mean_kl"] == pytest.approx(0.0, abs=1e-7)
    assert exact["top1_agreement"] == 1.0
    assert (q8["quantization"], exact["quantization"]) == ("gguf-q8", "none")
    assert 0.0 < q8["mean_kl"] < 0.05
    assert q8["perplexity"] == pytest.approx(exact["perplexity"], rel=0.05)
    assert q8["top1_agreement"] > 0.8
