"""The batched sampler on hand-built logits: exact top_k / top_p / min_p masks, sampling
frequencies, seeds, penalties (OpenAI/vLLM semantics), min_tokens and logprobs."""

import math

import numpy as np
import pytest
import torch

from gpu.sampling.sampler import TOP_CANDIDATES, Sampler
from protocol.sampling_params import SamplingParams

V, EOS = 8, 7
CPU = torch.device("cpu")
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]  # sorted, so token id == rank


def make(rows: int = 8, seed: int = 0) -> Sampler:
    return Sampler(rows, V, (EOS,), CPU, random_seed=seed)


def logits_of(probs, rows=1) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32)).repeat(rows, 1)


def no_output() -> np.ndarray:
    return np.zeros(0, np.int32)


def kept(sampler: Sampler, params: SamplingParams) -> list[int]:
    sampler.set_request(0, params, no_output(), no_output())
    sampler.sample(torch.zeros(1, V), np.array([0]))  # syncs the row's parameters to the device
    probs, ids = sampler.filter_probs(logits_of(PROBS), np.array([0]))
    kept_ids = torch.nonzero(probs[0]).flatten()
    return sorted((kept_ids if ids is None else ids[0, kept_ids]).tolist())


@pytest.mark.parametrize(
    "params, want",
    [
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_k=-1), list(range(V))),
        (SamplingParams(top_p=0.6), [0, 1]),  # mass above token 1 is 0.4 < 0.6; above token 2, 0.65
        (SamplingParams(top_p=0.66), [0, 1, 2]),
        (SamplingParams(top_p=0.01), [0]),  # the top token always stays
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # keeps p >= 0.3 * 0.4 = 0.12
        (SamplingParams(min_p=0.1), [0, 1, 2, 3, 4]),  # keeps p >= 0.04
        (SamplingParams(top_k=4, top_p=0.9, min_p=0.2), [0, 1, 2, 3]),  # the intersection
        (SamplingParams(top_k=2, min_p=0.01), [0, 1]),
    ],
)
def test_masks_are_exact(params, want):
    assert kept(make(), params) == want


@pytest.mark.parametrize(
    "params, want",
    [
        (SamplingParams(top_p=0.3), 615),  # ranks r with r / 2048 < 0.3: within the top 1024 candidates
        (SamplingParams(top_p=0.9), 1844),  # past them: the whole vocabulary is sorted
        (SamplingParams(top_k=1500), 1500),
        (SamplingParams(top_k=1500, top_p=0.25), 512),
    ],
)
def test_masks_are_exact_beyond_the_candidate_list(params, want):
    assert TOP_CANDIDATES == 1024
    sampler = Sampler(1, 2048, (0,), CPU)
    sampler.set_request(0, params, no_output(), no_output())
    sampler.sample(torch.zeros(1, 2048), np.array([0]))
    probs, ids = sampler.filter_probs(torch.zeros(1, 2048), np.array([0]))  # flat: 1/2048 each, exact
    assert int((probs > 0).sum()) == want


def test_temperature_sharpens_before_masking():
    # at temperature 0.5 the probabilities become p^2 / sum p^2: 0.4 -> 0.60, 0.25 -> 0.23
    assert kept(make(), SamplingParams(temperature=0.5, min_p=0.3)) == [0, 1]


@pytest.mark.parametrize("params, kept_n", [(SamplingParams(top_k=3), 3), (SamplingParams(), V)])
def test_samples_follow_the_kept_renormalised_probabilities(params, kept_n):
    n = 4000
    sampler = make(rows=n)
    for row in range(n):
        sampler.set_request(row, params, no_output(), no_output())
    tokens = sampler.sample(logits_of(PROBS, n), np.arange(n)).tokens.numpy()
    freq = np.bincount(tokens, minlength=V) / n
    want = np.array(PROBS[:kept_n]) / sum(PROBS[:kept_n])
    assert freq[kept_n:].sum() == 0
    np.testing.assert_allclose(freq[:kept_n], want, atol=0.03)  # > 4 sigma for n = 4000


def test_greedy_picks_argmax_whatever_else_is_in_the_batch():
    sampler = make()
    sampler.set_request(0, SamplingParams(temperature=0.0), no_output(), no_output())
    sampler.set_request(1, SamplingParams(temperature=1.0), no_output(), no_output())
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0, 0, 0, 0]] * 2)
    for _ in range(5):
        assert sampler.sample(logits.clone(), np.array([0, 1])).tokens[0] == 2


def test_seed_reproduces_regardless_of_batch_and_resume():
    flat = torch.zeros(V)  # uniform: every draw is decided by the generator alone

    def run(batch_rows: list[int], seed_row: int, n: int = 12) -> list[int]:
        sampler = make(rows=8, seed=123)
        for row in batch_rows:
            sampler.set_request(row, SamplingParams(seed=7 if row == seed_row else None), no_output(), no_output())
        out = []
        for _ in range(n):
            tokens = sampler.sample(flat.repeat(len(batch_rows), 1), np.array(batch_rows)).tokens
            out.append(int(tokens[batch_rows.index(seed_row)]))
        return out

    alone = run([0], 0)
    assert run([3, 1, 5], 1) == alone  # other rows, another row number
    assert run([2, 0, 4, 6, 7], 0) == alone
    assert len(set(alone)) > 2  # it does sample
    other = make()
    other.set_request(0, SamplingParams(seed=8), no_output(), no_output())
    assert [int(other.sample(flat[None].clone(), np.array([0])).tokens[0]) for _ in range(12)] != alone
    # resumed after 5 tokens: set_request with the output so far continues the same sequence
    resumed = make()
    resumed.set_request(0, SamplingParams(seed=7), no_output(), np.array(alone[:5], np.int32))
    assert [int(resumed.sample(flat[None].clone(), np.array([0])).tokens[0]) for _ in range(7)] == alone[5:]


def test_seeds_differing_in_the_top_bit_sample_apart():
    """-1 and 2**63 - 1, 0 and -2**63 differ only in the bit torch's CPU generator drops
    (manual_seed(2**63) samples as manual_seed(0)); n > 1 with seed + j wraps onto such pairs."""
    flat = torch.zeros(V)

    def draws(seed: int) -> list[int]:
        sampler = make()
        sampler.set_request(0, SamplingParams(seed=seed), no_output(), no_output())
        return [int(sampler.sample(flat[None].clone(), np.array([0])).tokens[0]) for _ in range(12)]

    assert draws(-1) != draws(2**63 - 1)
    assert draws(0) != draws(-(2**63))
    assert draws(5) == draws(5)


def test_seed_reproduces_next_to_rows_with_top_k_or_top_p():
    """A seeded row without top_k/top_p beside rows with them: those rows' sorted candidate
    list must not reorder its distribution, or the same uniform picks another token (served:
    a seeded temperature-1 request gave another text when a top_p request shared its batch)."""
    unsorted = [PROBS[i] for i in (5, 0, 7, 2, 4, 1, 6, 3)]  # vocabulary order is not rank order

    def run(others: list[SamplingParams]) -> list[int]:
        sampler = make()
        sampler.set_request(0, SamplingParams(temperature=1.0, seed=7), no_output(), no_output())
        for row, params in enumerate(others, 1):
            sampler.set_request(row, params, no_output(), no_output())
        rows = np.arange(1 + len(others))
        return [int(sampler.sample(logits_of(unsorted, len(rows)), rows).tokens[0]) for _ in range(32)]

    alone = run([])
    assert len(set(alone)) > 2
    assert run([SamplingParams(temperature=1.0, top_p=0.9)]) == alone
    assert run([SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=1.0, min_p=0.1)]) == alone


def test_penalties_follow_openai_vllm_semantics():
    sampler = make()
    prompt = np.array([1, 2], np.int32)
    output = np.array([2, 3, 3, 3], np.int32)
    sampler.set_request(
        0, SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), prompt, output
    )
    sampler.sample(torch.zeros(1, V), np.array([5]))  # sync parameters via an unrelated row
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, -1.0, 0.5, 0.0, 0.0]])
    got = sampler.apply_penalties(logits.clone(), np.array([0]))[0]
    want = logits[0].clone()
    want[1] = 2.0 / 2  # prompt token, positive: divided
    want[2] = -2.0 * 2 - 0.5 * 1 - 0.25  # prompt + output once, negative: multiplied, then freq + presence
    want[3] = 4.0 / 2 - 0.5 * 3 - 0.25  # output three times
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-320),  # 0 in float32: greedy, not a division by zero
        SamplingParams(temperature=1e-5, top_k=0),
        SamplingParams(temperature=1e-5, repetition_penalty=0.01),
        SamplingParams(temperature=2.0, top_p=1e-300, min_p=1.0),
        SamplingParams(temperature=1e-5, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=2.0),
    ],
    ids=repr,
)
def test_every_valid_extreme_samples_a_token(params):
    """Parameters at their validated bounds, on large logits, never sample outside the
    vocabulary (a NaN distribution did, and the scheduler died on the out-of-range id)."""
    sampler = make()
    sampler.set_request(0, params.validate(V), np.array([0, 1], np.int32), np.array([1, 2], np.int32))
    logits = torch.tensor([[90.0, 80.0, 70.0, -60.0, 50.0, 40.0, -30.0, 20.0]])
    for _ in range(3):
        assert 0 <= int(sampler.sample(logits.clone(), np.array([0])).tokens[0]) < V


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1),
    ],
    ids=repr,
)
def test_non_finite_logits_still_sample_a_token(bad, params):
    """Logits the model got wrong (inf or NaN) give an id inside the vocabulary, never one past it."""
    sampler = make()
    sampler.set_request(0, params, no_output(), no_output())
    logits = torch.tensor([[1.0, bad, 3.0, bad, 0.5, 2.0, -1.0, 0.0]])
    for _ in range(3):
        assert 0 <= int(sampler.sample(logits.clone(), np.array([0])).tokens[0]) < V
    assert 0 <= int(sampler.sample(torch.full((1, V), bad), np.array([0])).tokens[0]) < V


def test_penalties_see_tokens_as_they_are_sampled():
    sampler = make()
    sampler.set_request(0, SamplingParams(temperature=0.0, frequency_penalty=2.0), no_output(), no_output())
    logits = torch.tensor([[3.0, 2.5, 2.0, 0, 0, 0, 0, 0]])
    # 3.0 wins, then is 1.0 behind 2.5; 2.5 wins, then 2.0, then 3.0 - 2 = 1.0 vs 0.5 vs 0.0
    tokens = [int(sampler.sample(logits.clone(), np.array([0])).tokens[0]) for _ in range(4)]
    assert tokens == [0, 1, 2, 0]


def test_greedy_rows_asking_logprobs_take_the_argmax_of_what_they_may_sample():
    """Every row greedy with logprobs: the tokens come from the normalisers' pass over the rows,
    ties and NaNs as torch.argmax; a row min_tokens masks still takes the best token it may."""
    sampler = make()
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1)
    for row in range(3):
        sampler.set_request(row, params, no_output(), no_output())
    nan = float("nan")
    logits = torch.tensor([[0.0, 3, 3, 1, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 5], [0.0, 1, nan, 0, 0, 0, 0, 0]])
    res = sampler.sample(logits.clone(), np.array([0, 1, 2]))
    assert res.tokens.tolist() == logits.argmax(dim=-1).tolist() == [1, 7, 2]
    np.testing.assert_allclose(res.logprobs[:2].numpy(), torch.log_softmax(logits[:2], -1)[[0, 1], [1, 7]], atol=1e-6)
    sampler.set_request(
        1, SamplingParams(temperature=0.0, logprobs=True, min_new_tokens=1, max_new_tokens=5), no_output(), no_output()
    )
    assert sampler.sample(logits.clone(), np.array([0, 1, 2])).tokens.tolist() == [1, 0, 2]  # EOS (7) masked


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = make()
    sampler.set_request(
        0,
        SamplingParams(temperature=0.0, min_new_tokens=2, max_new_tokens=5, stop_token_ids=(5,)),
        no_output(),
        no_output(),
    )
    sampler.set_request(
        1,
        SamplingParams(temperature=0.0, min_new_tokens=2, max_new_tokens=5, ignore_eos=True),
        no_output(),
        no_output(),
    )
    logits = torch.tensor([[0.0, 1, 0, 0, 0, 9, 0, 10]] * 2)  # EOS (7) best, then stop id 5
    steps = [sampler.sample(logits.clone(), np.array([0, 1])).tokens.tolist() for _ in range(3)]
    # row 0: EOS and 5 masked for two tokens; row 1 ignores EOS and has no stop ids: nothing masked
    assert steps == [[1, 7], [1, 7], [7, 7]]


def test_logprobs_are_the_raw_model_distribution():
    sampler = make()
    sampler.set_request(
        0,
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, repetition_penalty=2.0),
        np.array([0], np.int32),
        no_output(),
    )
    sampler.set_request(1, SamplingParams(temperature=0.0), no_output(), no_output())
    res = sampler.sample(logits_of(PROBS, 2), np.array([0, 1]))
    # the penalty moves the choice to token 1, the logprobs stay those of the model's output
    assert res.tokens.tolist() == [1, 0]
    assert res.logprobs[0].item() == pytest.approx(math.log(PROBS[1]), abs=1e-5)
    assert math.isnan(res.logprobs[1].item())
    assert res.top_ids[0].tolist() == [0, 1, 2]
    np.testing.assert_allclose(res.top_logprobs[0].numpy(), np.log(PROBS[:3]), atol=1e-5)


def test_pinned_logprob_ids_replace_a_rows_top_ones_whatever_their_rank():
    sampler = make()
    pinned = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, logprob_token_ids=(6, 2))
    sampler.set_request(0, SamplingParams(temperature=0.0), no_output(), no_output())  # asks no logprobs
    sampler.set_request(1, pinned, no_output(), no_output())
    sampler.set_request(2, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), no_output(), no_output())
    res = sampler.sample(logits_of(PROBS, 3), np.array([0, 1, 2]))
    assert res.tokens.tolist() == [0, 0, 0]
    assert res.top_ids[1, :2].tolist() == [6, 2]  # the unlikely 6 first: the client's order
    np.testing.assert_allclose(res.top_logprobs[1, :2].numpy(), np.log([PROBS[6], PROBS[2]]), atol=1e-5)
    assert res.top_ids[2].tolist() == [0, 1, 2]  # an unpinned row keeps its likeliest
    sampler.clear_request(1)
    sampler.set_request(1, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), no_output(), no_output())
    assert sampler.sample(logits_of(PROBS, 2), np.array([1, 2])).top_ids[0, :2].tolist() == [0, 1]


def test_rows_outside_the_table_are_refused():
    sampler = make(rows=4)
    with pytest.raises(ValueError, match="row 4 is outside"):
        sampler.set_request(4, SamplingParams(), no_output(), no_output())
    with pytest.raises(ValueError, match="row -1 is outside"):
        sampler.sample(torch.zeros(2, V), np.array([0, -1]))


def _reference(logits, biases, rep, freq, pres, seen, counts):
    """logit_bias added (a token named twice gets both), then the penalties, as the sampler
    documents (vLLM's order)."""
    out = logits.clone()
    for r, bias in enumerate(biases):
        for token, value in bias:
            out[r, token] += value
    out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    return out - freq * counts - pres * (counts > 0)


def test_logit_bias_matches_a_torch_reference_before_penalties():
    n = 64
    sampler = Sampler(6, n, (n - 1,), CPU)
    gen = torch.Generator().manual_seed(0)
    biases = [((3, 100.0), (5, -100.0)), (), ((7, 2.5), (7, 1.5), (60, -3.0)), ((0, 50.0),)]
    prompt, output = np.array([3, 7], np.int32), np.array([7, 60, 60], np.int32)
    for row, bias in enumerate(biases):
        # row 3's bias is held back by min_tokens: a masked stop id stays -inf
        params = SamplingParams(
            temperature=0.0,
            logit_bias=bias,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            stop_token_ids=(0,) if row == 3 else (),
            min_new_tokens=4 if row == 3 else 0,  # it has 3: masked
            max_new_tokens=8,
        ).validate(n)
        sampler.set_request(row, params, prompt, output)
    logits = torch.randn(4, n, generator=gen) * 3
    seen = torch.zeros(4, n, dtype=torch.bool)
    seen[:, [3, 7, 60]] = True
    counts = torch.zeros(4, n)
    counts[:, 7], counts[:, 60] = 1, 2
    want = _reference(logits, biases[:3] + [()], 1.5, 0.5, 0.25, seen, counts)
    want[3, [0, n - 1]] = -math.inf  # row 3: stop id and EOS masked, its bias on 0 changes nothing
    rows = np.array([0, 1, 2, 3])
    got = logits.clone()
    res = sampler.sample(got, rows)  # modifies the logits in place: what the choice is made on
    torch.testing.assert_close(got, want)
    assert res.tokens.tolist() == want.argmax(dim=-1).tolist()
    assert res.tokens[0].item() == 3  # +100 forces its token


def test_logit_bias_is_per_row_and_cleared_with_the_row():
    sampler = make()
    sampler.set_request(0, SamplingParams(temperature=0.0, logit_bias=((4, 100.0),)), no_output(), no_output())
    sampler.set_request(1, SamplingParams(temperature=0.0), no_output(), no_output())
    logits = logits_of(PROBS, 2)
    assert sampler.sample(logits.clone(), np.array([0, 1])).tokens.tolist() == [4, 0]
    assert sampler.sample(logits.clone(), np.array([1, 0])).tokens.tolist() == [0, 4]  # any batch order
    sampler.clear_request(0)
    sampler.set_request(0, SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)), no_output(), no_output())
    assert sampler.sample(logits.clone(), np.array([0, 1])).tokens.tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_tokens_a_row_takes(temperature):
    """vLLM's allowed_token_ids: per row, after logit_bias (a bias cannot reach a token outside),
    cleared with the row; logprobs stay the model's own distribution."""
    sampler = make()
    allowed = (2, 5)
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed, logit_bias=((0, 100.0),), logprobs=True)
    sampler.set_request(0, params, no_output(), no_output())
    sampler.set_request(1, SamplingParams(temperature=0.0), no_output(), no_output())
    seen = set()
    for _ in range(200 if temperature else 1):
        res = sampler.sample(logits_of(PROBS, 2), np.array([0, 1]))
        seen.add(res.tokens[0].item())
        assert res.tokens[1].item() == 0  # the unrestricted row is untouched
    assert seen == ({2} if temperature == 0.0 else set(allowed))
    assert res.logprobs[0].item() == pytest.approx(math.log(PROBS[res.tokens[0].item()]), rel=1e-4)
    sampler.clear_request(0)
    sampler.set_request(0, SamplingParams(temperature=0.0), no_output(), no_output())
    assert sampler.sample(logits_of(PROBS, 1), np.array([0])).tokens.tolist() == [0]


def _bitmask(allowed: list[list[int]], n: int) -> torch.Tensor:
    """xgrammar's layout: bit j of word k allows token 32k + j."""
    bits = np.zeros((len(allowed), -(-n // 32) * 32), np.uint8)
    for i, ids in enumerate(allowed):
        bits[i, ids] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_token_mask_applies_to_its_rows_only_after_bias_and_penalties():
    from gpu.forward_batch import TokenMask

    n = 40  # two bitmask words, the second part-used
    sampler = Sampler(4, n, (n - 1,), CPU, random_seed=1)
    sampler.set_request(0, SamplingParams(temperature=0.0, logit_bias=((33, 100.0),)), no_output(), no_output())
    sampler.set_request(1, SamplingParams(temperature=0.0, logit_bias=((33, 100.0),)), no_output(), no_output())
    sampler.set_request(2, SamplingParams(temperature=1.0), no_output(), no_output())
    # sampled sequences 0 and 2 are masked (bitmask rows 0 and 2); row 1 of the bitmask is garbage
    bitmask = _bitmask([[2, 35], [], [5, 6, 38]], n)
    mask = TokenMask(bitmask, np.array([0, 2]))
    logits = torch.randn(3, n, generator=torch.Generator().manual_seed(3))
    for _ in range(20):
        got = logits.clone()
        tokens = sampler.sample(got, np.array([0, 1, 2]), mask).tokens.tolist()
        assert tokens[0] in (2, 35) and tokens[1] == 33 and tokens[2] in (5, 6, 38)
        assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [2, 35]
        assert torch.isfinite(got[1]).all()  # the unmasked sequence beside them is untouched
        assert got[0, 2] == logits[0, 2] and got[0, 35] == logits[0, 35]
    # the bias (+100 on 33) cannot take a token the grammar forbids
    assert sampler.sample(logits[:1].clone(), np.array([0]), TokenMask(bitmask, np.array([0]))).tokens.item() in (2, 35)


def held_bytes(sampler: Sampler) -> int:
    """The bytes of every array the sampler holds, in its attributes and their lists."""
    total = 0
    for value in vars(sampler).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, np.ndarray):
                total += item.nbytes
            elif isinstance(item, torch.Tensor):
                total += item.untyped_storage().nbytes()
    return total


def test_state_does_not_scale_with_rows_times_vocabulary():
    """256 rows of Gemma 3's 262k vocabulary held 335 MB of penalty counts whether or not any
    row was penalized: the sampler's state is the same bytes for a 262k vocabulary as for 8,
    penalized rows included (they hold their tokens, not a row of the vocabulary)."""
    prompt, output = np.arange(100, dtype=np.int32) % V, np.array([3, 5, 5], np.int32)
    sizes = []
    for vocab in (V, 262_144):
        sampler = Sampler(256, vocab, (EOS,), CPU)
        for row in range(0, 256, 2):
            sampler.set_request(row, SamplingParams(presence_penalty=0.5), prompt, output)
        sampler.sample(torch.zeros(128, vocab), np.arange(0, 256, 2))
        sizes.append(held_bytes(sampler))
    assert sizes[0] == sizes[1]
    assert sizes[1] < 1 << 20
