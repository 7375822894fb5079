"""Sampler: greedy is exact argmax, draws are a pure function of (seed, position, probabilities),
filters never leak, and the empirical distribution is the requested one."""

from __future__ import annotations

import pytest
import torch

from model_executor.sampler import (
    Sampler,
    SamplingBatchInfo,
    _thresholds_by_full_sort,
    _top_k_top_p_thresholds,
    filter_probs,
)

sampler = Sampler()


def make_info(
    bs: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    seed: int = 0,
    positions: list[int] | None = None,
    seeds: list[int] | None = None,
) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_lists(
        temperatures=[temperature] * bs,
        top_ps=[top_p] * bs,
        top_ks=[top_k] * bs,
        min_ps=[min_p] * bs,
        seeds=seeds if seeds is not None else [seed] * bs,
        output_positions=positions if positions is not None else list(range(bs)),
    )


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def spread_logits(probs: list[float], vocab: int, token_ids: list[int]) -> torch.Tensor:
    """One row: log(probs) at token_ids (spread over vocab blocks), -inf elsewhere."""
    row = torch.full((vocab,), float("-inf"))
    row[token_ids] = torch.tensor(probs).log()
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(16, 3000) * 3).to(dtype)
    logits[3, [10, 2000]] = 50.0  # a tie: argmax picks the first
    info = make_info(16, temperature=0.0)
    tokens = sampler(logits, info)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_keeps_greedy_rows_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    bs = 64
    logits = torch.randn(bs, 1000).to(dtype)  # flat: sampled rows rarely hit the argmax
    greedy = [i % 2 == 0 for i in range(bs)]
    info = SamplingBatchInfo.from_lists(
        temperatures=[0.0 if g else 1.5 for g in greedy],
        top_ps=[0.9] * bs,
        top_ks=[-1] * bs,
        min_ps=[0.0] * bs,
        seeds=list(range(bs)),
        output_positions=[0] * bs,
    )
    tokens = sampler(logits, info)
    argmax = logits.argmax(dim=-1)
    g = torch.tensor(greedy)
    assert torch.equal(tokens[g], argmax[g])
    assert (tokens[~g] != argmax[~g]).sum() > bs // 4


def _mixed_rows(bs: int, vocab: int, seed: int) -> tuple[torch.Tensor, dict[str, list]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, vocab, generator=gen) * 2
    settings: dict[str, list] = {
        "temperatures": [[0.0, 0.7, 1.0, 1.3][i % 4] for i in range(bs)],
        "top_ps": [[1.0, 0.9, 0.999, 0.5][i % 4] for i in range(bs)],
        "top_ks": [[-1, 40, -1, 3000][(i // 2) % 4] for i in range(bs)],
        "min_ps": [[0.0, 0.0, 0.05][i % 3] for i in range(bs)],
        "seeds": [1000 + 7 * i for i in range(bs)],
        "output_positions": [(13 * i) % 50 for i in range(bs)],
    }
    return logits, settings


def _sample_rows(logits: torch.Tensor, settings: dict[str, list], order: list[int]) -> torch.Tensor:
    info = SamplingBatchInfo.from_lists(**{k: [v[i] for i in order] for k, v in settings.items()})
    return sampler(logits[order], info)


def test_draw_is_independent_of_batch_companions_and_order() -> None:
    logits, settings = _mixed_rows(24, 5000, seed=2)
    full = _sample_rows(logits, settings, list(range(24)))
    reversed_order = list(range(23, -1, -1))
    assert torch.equal(_sample_rows(logits, settings, reversed_order), full[reversed_order])
    for i in (1, 2, 5, 7, 22):
        assert torch.equal(_sample_rows(logits, settings, [i]), full[[i]])
    # The same request next to a different crowd (other logits, other settings).
    others, other_settings = _mixed_rows(24, 5000, seed=3)
    both = torch.cat([others[:9], logits[5:6], others[9:]])
    both_settings = {k: v[:9] + [settings[k][5]] + v[9:] for k, v in other_settings.items()}
    assert _sample_rows(both, both_settings, list(range(25)))[9] == full[5]


def test_draw_is_independent_of_thread_count() -> None:
    logits, settings = _mixed_rows(32, 5000, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _sample_rows(logits, settings, list(range(32)))
        torch.set_num_threads(2)
        two = _sample_rows(logits, settings, list(range(32)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_draw_ignores_global_rng_state() -> None:
    logits, settings = _mixed_rows(16, 2000, seed=5)
    torch.manual_seed(123)
    first = _sample_rows(logits, settings, list(range(16)))
    torch.manual_seed(456)
    torch.rand(1000)
    assert torch.equal(_sample_rows(logits, settings, list(range(16))), first)


def test_draws_vary_with_position_and_seed() -> None:
    vocab, n = 1000, 300
    logits = torch.zeros(n, vocab)  # uniform
    by_position = sampler(logits, make_info(n, seed=9, positions=list(range(n))))
    by_seed = sampler(logits, make_info(n, positions=[5] * n, seeds=list(range(n))))
    # 300 uniform draws from 1000 tokens: about 257 distinct expected.
    assert by_position.unique().numel() > 200
    assert by_seed.unique().numel() > 200
    assert not torch.equal(by_position, by_seed)


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(6)
    logits = torch.randn(200, 3000)
    tokens = sampler(logits, make_info(200, temperature=1.0, top_k=1))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    # top_k == 1 is routed to argmax; the filter itself keeps exactly the top k of distinct values.
    kept = filter_probs(torch.softmax(logits, dim=-1), make_info(200, top_k=2)) > 0
    expected = torch.zeros_like(kept).scatter_(1, logits.topk(2, dim=-1).indices, True)
    assert torch.equal(kept, expected)


PROBS = [0.5, 0.3, 0.12, 0.05, 0.03]
SPREAD_IDS = [7, 1500, 300, 2999, 256]  # one token per vocab block, out of rank order


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "allowed"),
    [
        (2, 1.0, 0.0, 2),
        (-1, 0.75, 0.0, 2),  # mass above: 0, 0.5, 0.8 -> keep 2
        (-1, 0.85, 0.0, 3),
        (-1, 1.0, 0.2, 3),  # drop p < 0.1
        (4, 0.9, 0.07, 3),  # top-k 4 (mass 0.97) -> top-p keeps 3 -> min-p keeps 3 (0.12 >= 0.035)
        (3, 0.5, 0.0, 1),
        (3, 0.85, 0.0, 2),  # top-p counts against top-k's mass 0.92: 0.8 >= 0.85 * 0.92 -> keep 2
    ],
)
def test_filters_never_emit_filtered_tokens(top_k: int, top_p: float, min_p: float, allowed: int) -> None:
    vocab, n = 3000, 3000
    logits = spread_logits(PROBS, vocab, SPREAD_IDS).expand(n, vocab).contiguous()
    tokens = sampler(logits, make_info(n, top_k=top_k, top_p=top_p, min_p=min_p, seed=11))
    assert set(tokens.tolist()) == set(SPREAD_IDS[:allowed])


def test_top_p_stops_once_the_mass_is_reached() -> None:
    probs = torch.tensor([[0.5, 0.125, 0.25, 0.125]])  # exact in float32: no rounding at the boundary
    kept = filter_probs(probs, make_info(1, top_p=0.75)) > 0
    assert kept.tolist() == [[True, False, True, False]]


def test_filtered_draws_keep_relative_probabilities() -> None:
    vocab, n = 3000, 8000
    logits = spread_logits(PROBS, vocab, SPREAD_IDS).expand(n, vocab).contiguous()
    freq = frequencies(sampler(logits, make_info(n, top_k=3, seed=12)), vocab)[SPREAD_IDS]
    expected = torch.tensor([0.5, 0.3, 0.12, 0.0, 0.0], dtype=torch.float64) / 0.92
    assert (freq - expected).abs().max() < 0.02, freq


def _reference_keep(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Obvious per-row version of the filters (threshold semantics, ties kept)."""
    values = probs.sort(descending=True).values
    t = 0.0
    if 0 < top_k < probs.numel():
        t = values[top_k - 1].item()
    kept = values[values >= t]
    if top_p < 1:
        mass = kept.sum().item() if t > 0 else 1.0
        above = 0.0
        for v in kept.tolist():
            if above >= top_p * mass:
                break
            t_p, above = v, above + v
        t = max(t, t_p)
    t = max(t, min_p * values[0].item())
    return probs >= t


def test_filter_probs_matches_reference_including_wide_searches() -> None:
    gen = torch.Generator().manual_seed(13)
    vocab = 6000
    # Peaked and flat rows: flat ones with top-p 0.99 need the search widened to the full row,
    # bf16-rounded logits make ties at the boundaries.
    scales = [8.0, 1.0, 0.2, 4.0]
    configs = [
        (-1, 0.9, 0.0),
        (50, 1.0, 0.0),
        (-1, 0.99, 0.0),
        (700, 0.95, 0.0),
        (5000, 0.5, 0.0),
        (-1, 1.0, 0.1),
        (20, 0.8, 0.02),
        (600, 1.0, 0.0),
    ]
    rows, params = [], []
    for scale in scales:
        for config in configs:
            logits = (torch.randn(vocab, generator=gen) * scale).bfloat16().float()
            rows.append(torch.softmax(logits, dim=-1))
            params.append(config)
    probs = torch.stack(rows)
    bs = len(rows)
    info = SamplingBatchInfo.from_lists(
        [1.0] * bs,
        [p for _, p, _ in params],
        [k for k, _, _ in params],
        [m for _, _, m in params],
        [0] * bs,
        [0] * bs,
    )
    kept = filter_probs(probs, info) > 0
    for i, (k, p, m) in enumerate(params):
        assert torch.equal(kept[i], _reference_keep(probs[i], k, p, m)), (i, k, p, m)
    # The GPU's path (one full sort, no host sync) finds the same thresholds as the CPU's search.
    sampled = info.temperatures > 0
    use_k = sampled & (info.top_ks > 0) & (info.top_ks < vocab)
    use_p = sampled & (info.top_ps < 1)
    assert torch.equal(
        _thresholds_by_full_sort(probs, info.top_ks, info.top_ps, use_k, use_p),
        _top_k_top_p_thresholds(probs, info.top_ks, info.top_ps, use_k, use_p),
    )


@pytest.mark.parametrize("vocab", [4, 1000])
def test_empirical_distribution_matches_probs(vocab: int) -> None:
    n = 10000
    probs = [0.1, 0.2, 0.3, 0.4]
    ids = [0, 1, 2, 3] if vocab == 4 else [900, 5, 600, 255]
    logits = spread_logits(probs, vocab, ids).expand(n, vocab).contiguous()
    freq = frequencies(sampler(logits, make_info(n, seed=14)), vocab)
    assert freq.sum() == 1 and freq[ids].sum() == 1
    assert (freq[ids] - torch.tensor(probs, dtype=torch.float64)).abs().max() < 0.02, freq[ids]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_distribution(temperature: float) -> None:
    n = 10000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = probs.log().float().expand(n, 4).contiguous()
    freq = frequencies(sampler(logits, make_info(n, temperature=temperature, seed=15)), 4)
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    assert (freq - expected).abs().max() < 0.02, (freq, expected)
    assert (freq - probs).abs().max() > 0.05  # the temperature did something


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperatures", -0.1),
        ("temperatures", float("nan")),
        ("top_ps", 0.0),
        ("top_ps", 1.5),
        ("top_ks", 0),
        ("top_ks", -2),
        ("min_ps", 1.1),
        ("output_positions", -1),
    ],
)
def test_from_lists_rejects_out_of_range_values(field: str, value: float) -> None:
    kwargs: dict[str, list] = {
        "temperatures": [1.0],
        "top_ps": [1.0],
        "top_ks": [-1],
        "min_ps": [0.0],
        "seeds": [0],
        "output_positions": [0],
    }
    kwargs[field] = [value]
    with pytest.raises(ValueError, match=f"^{field[:-1]} must be"):
        SamplingBatchInfo.from_lists(**kwargs)


def test_from_lists_flags_and_seed_wrapping() -> None:
    info = SamplingBatchInfo.from_lists([0.0, 1.0], [0.5, 1.0], [-1, -1], [0.3, 0.0], [2**64 + 5, -1], [0, 3])
    assert not info.is_all_greedy and info.has_greedy
    assert not info.need_top_k_top_p and not info.need_min_p  # only the greedy row asked for filters
    assert info.seeds.tolist() == [5, -1]
    with pytest.raises(ValueError, match="top_ps"):
        SamplingBatchInfo.from_lists([1.0], [1.0, 1.0], [-1], [0.0], [0], [0])


def test_penalties_follow_the_openai_and_transformers_formulas() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    from model_executor.sampler import apply_penalties

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g) * 3
    prompts, outputs = [[1, 2, 3], [4, 4], [7]], [[5, 5, 5, 9, 2], [], [8, 8]]
    out = apply_penalties(logits, [(0.5, 0.25, 1.3), None, (0.0, -1.0, 1.0)], outputs, prompts)
    want = logits.clone()
    seen = torch.tensor([prompts[0] + outputs[0]])
    want[0] = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits[:1].clone())[0]
    for token, count in ((5, 3), (9, 1), (2, 1)):
        want[0, token] -= 0.5 * count + 0.25
    want[2, 8] += 1.0  # a negative presence penalty favours what was said
    torch.testing.assert_close(out, want)
    assert torch.equal(out[1], logits[1])  # no penalty: untouched
    assert apply_penalties(logits, [None] * 3, outputs, prompts) is logits


def test_ban_tokens_masks_only_the_banned_ids_of_their_row() -> None:
    from model_executor.sampler import ban_tokens

    logits = torch.randn(3, 10)
    out = ban_tokens(logits, [[2, 7], [], [0]])
    assert torch.isneginf(out[0, [2, 7]]).all() and torch.isneginf(out[2, 0])
    assert torch.isfinite(out).sum() == 30 - 3 and torch.equal(out[1], logits[1])
    assert ban_tokens(logits, [[], [], []]) is logits
