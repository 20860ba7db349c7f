"""The cost model: JSON round trip, monotone interpolation and extrapolation, the cache (measured
once, re-measuring only what is missing), and `drafttrain profile` on a tiny target.

Tiny target: hidden 64, 4 layers, vocab 263 (real: Gemma 3 270M, 640 / 18 / 262144).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from drafttrain.cli import main
from drafttrain.decode import CostModel, costtiming, load_or_measure, load_proposer
from drafttrain.decode import costmodel as costmodel_module
from drafttrain.testing import save_tiny_run_root, tiny_target


def grid() -> CostModel:
    # a noisy measurement: (4, 2) came out faster than (4, 1) and (8, 3) faster than (4, 3)
    verify = {(1, 1): 5.0, (1, 2): 5.5, (1, 3): 6.0, (4, 1): 7.0, (4, 2): 6.8, (4, 3): 9.0,
              (8, 1): 9.0, (8, 2): 11.0, (8, 3): 8.0}
    return CostModel(verify, {"eagle": {1: 0.5, 8: 1.5}}, {"target": "tiny", "context": 16})


def test_save_load_round_trip(tmp_path):
    cm = grid()
    again = CostModel.load(cm.save(tmp_path / "sub" / "cost.json"))
    assert again.verify_ms == cm.verify_ms and again.draft_ms == cm.draft_ms and again.meta == cm.meta
    assert again.verify_time(3, 5) == cm.verify_time(3, 5)
    (tmp_path / "bad.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a drafttrain cost model"):
        CostModel.load(tmp_path / "bad.json")


def test_sampled_costs_round_trip_and_are_picked_by_temperature(tmp_path):
    greedy, sampled = grid(), CostModel({(b, t): 2 * v for (b, t), v in grid().verify_ms.items()}, {"eagle": {1: 3.0}})
    cm = CostModel(greedy.verify_ms, greedy.draft_ms, greedy.meta, sampled)
    again = CostModel.load(cm.save(tmp_path / "cost.json"))
    assert again.at(0.0).verify_time(4, 3) == 9.0 and again.at(0.7).verify_time(4, 3) == 18.0
    assert again.at(1.0).draft_time("eagle", 1) == 3.0 and again.at(0).draft_time("eagle", 1) == 0.5
    assert "sampled (temperature > 0)" in again.table()


def test_interpolation_is_monotone_and_extrapolates_linearly():
    cm = grid()
    batches, tokens = [1, 2, 3, 4, 6, 8, 12, 20], [1, 2, 3, 4, 6, 10]
    table = [[cm.verify_time(b, t) for t in tokens] for b in batches]
    for row in table:  # more tokens never cost less
        assert all(a <= b + 1e-9 for a, b in zip(row, row[1:]))
    for col in zip(*table):  # more rows never cost less
        assert all(a <= b + 1e-9 for a, b in zip(col, col[1:]))
    # (4, 1) 7.0 and (4, 2) 6.8 pool to 6.9 each (a running max would read 7.0 for both)
    assert cm.verify_time(1, 2) == 5.5 and cm.verify_time(2, 1) == pytest.approx(5.0 + 1.9 / 3)
    # beyond the grid: the last segment's slope (tokens: +0.5 ms per token at batch 1)
    assert cm.verify_time(1, 7) == pytest.approx(6.0 + 4 * 0.5)
    assert cm.verify_time(16, 1) - cm.verify_time(8, 1) == pytest.approx(8 * (9.0 - 6.9) / 4)
    assert cm.draft_time("eagle", 4) == pytest.approx(0.5 + 3 / 7) and cm.draft_time("eagle", 15) == pytest.approx(2.5)


def test_one_slow_point_is_averaged_with_its_neighbours_not_carried_to_longer_chains():
    """Session 31's sampled batch-1 row: 4 tokens read 29.2 ms, 5 tokens 26.5. A running max priced
    4, 5 and 6 tokens alike at 29.2, so every chain of 3+ drafts looked slower than it is; the
    monotone least-squares fit pools the two readings and leaves the other points as measured."""
    row = [21.4, 23.3, 26.1, 29.2, 26.5, 28.6, 29.6]
    cm = CostModel({(1, t): v for t, v in zip([1, 2, 3, 4, 5, 6, 8], row)})
    assert [cm.verify_time(1, t) for t in (1, 2, 3)] == [21.4, 23.3, 26.1]
    assert cm.verify_time(1, 4) == cm.verify_time(1, 5) == pytest.approx((29.2 + 26.5) / 2)
    assert cm.verify_time(1, 6) == 28.6 and cm.verify_time(1, 8) == 29.6
    # the same for draft costs: a slow batch-2 step is pooled with batch 4, batch 1 stays as measured
    cm = CostModel({(1, 1): 1.0}, {"eagle": {1: 1.2, 2: 2.0, 4: 1.6}})
    assert cm.draft_time("eagle", 1) == 1.2 and cm.draft_time("eagle", 2) == cm.draft_time("eagle", 4) == pytest.approx(1.8)


def test_the_points_of_a_batch_size_are_timed_round_robin(monkeypatch):
    """A slow spell of a shared machine must not land on one point's calls only: the timed calls of
    one batch size visit every token count once per round, after one untimed round."""
    from drafttrain.decode import kv as kv_module

    model = tiny_target("llama")
    seen = []
    real = kv_module.target_forward
    monkeypatch.setattr(kv_module, "target_forward", lambda target, kv, ids, *a, **k:
                        seen.append(ids.shape[1]) or real(target, kv, ids, *a, **k))
    for temperature in (0.0, 1.0):
        seen.clear()
        out = costtiming.time_verify(model, 2, [1, 3, 5], 8, 2, costtiming.NoBar(),
                                            temperature=temperature)
        assert seen == [8] + [1, 3, 5] * 3  # the prefill, then rounds 0 (untimed), 1 and 2
        assert set(out) == {(2, 1), (2, 3), (2, 5)} and all(v > 0 for v in out.values())


def test_a_slow_spell_shared_by_a_round_does_not_move_the_steps():
    """Session 35's greedy batch-1 row on a 2-core EPYC steps by 2.4 / 0.2 / 0.5 / 2.2 / 0.2 ms
    from 1 to 6 tokens (kernel tiles), small beside the ~30 ms forward and its noise. A slow spell
    moves every point of its round; read after each round's offset is removed, the steps a plan
    weighs scatter far less than between plain medians, around the true steps."""
    true = np.array([27.0, 29.4, 29.6, 30.1, 32.3, 32.5])
    centred, plain = [], []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        times = true[:, None] + rng.exponential(3.0, 9)[None, :] + rng.normal(0, 0.3, (6, 9))
        centred.append(np.diff(costtiming.centred_medians(times.tolist())))
        plain.append(np.diff(np.median(times, axis=1)))
    centred, plain = np.array(centred), np.array(plain)
    assert np.all(centred.std(0) < 0.6 * plain.std(0)), (centred.std(0), plain.std(0))
    assert np.abs(centred.mean(0) - np.diff(true)).max() < 0.1
    assert costtiming.centred_medians([[1.0, 9.0], [2.0, 3.0]]) == [5.0, 2.5]  # two rounds: plain medians


def test_small_batches_get_more_timed_rounds(monkeypatch):
    """Batch 1 and 2 are cheap to time and are where plans weigh the smallest steps: they get 4x and
    2x the rounds of the larger batch sizes."""
    seen = {}
    monkeypatch.setattr(costmodel_module, "time_verify", lambda target, b, tokens, context, rounds, bar, **k:
                        seen.setdefault(b, rounds) and {(b, t): 1.0 + b + t for t in tokens})
    monkeypatch.setattr(costmodel_module, "warm_up", lambda *a: None)
    costmodel_module.measure_cost_model(tiny_target("llama"), batch_sizes=(1, 2, 4, 8), tokens=(1, 2), context=8,
                                        repeats=5, progress=False, sampled=False)
    assert seen == {1: 20, 2: 10, 4: 5, 8: 5}


def test_a_chain_costs_its_call_once_plus_its_steps(tmp_path, monkeypatch):
    """Session 34: EAGLE's propose + observe at T=1, batch 1, took 1.6 / 2.4 / 3.2 / 4.2 ms for
    1-4 drafts: a call part of ~0.74 ms (catch-up, set-up) and 0.86 ms a step. The call at 4
    divided by 4 (1.05 ms a step) priced the third draft 20% too high. The cost model fits the
    line through the calls at 1 and 4, keeps it through JSON, and prices chains with it."""
    calls = {1: 1.6, 4: 4.2}
    monkeypatch.setattr(costtiming, "time_calls", lambda t, p, b, c, r, gamma, temp: calls[gamma])
    call, step = costtiming.time_draft(None, None, 1, 8, 3)
    assert step == pytest.approx((4.2 - 1.6) / 3) and call == pytest.approx(1.6 - step)
    calls[4] = 1.5  # noise put the longer call below the shorter: no call part, a quarter a step
    assert costtiming.time_draft(None, None, 1, 8, 3) == (0.0, pytest.approx(1.5 / 4))

    cm = CostModel({(1, 1): 20.0, (1, 4): 22.0}, {"eagle": {1: 0.86, 4: 1.5}}, {}, None, {"eagle": {1: 0.74, 4: 1.2}})
    assert cm.chain_time("eagle", 1, 0) == 0.0 and cm.chain_time("eagle", 1, 3) == pytest.approx(0.74 + 3 * 0.86)
    assert cm.draft_call_time("eagle", 2) == pytest.approx(0.74 + (1.2 - 0.74) / 3)
    assert cm.draft_call_time("ngram", 1) == 0.0 and cm.chain_time("ngram", 1, 4) == 0.0
    again = CostModel.load(cm.save(tmp_path / "cost.json"))
    assert again.draft_fixed_ms == cm.draft_fixed_ms and again.chain_time("eagle", 4, 2) == cm.chain_time("eagle", 4, 2)
    assert "draft ms / call" in again.table()


def test_the_plan_prices_a_longer_chain_by_its_steps_not_its_average():
    """Acceptance 0.51 / 0.57 / 0.50 and session 33-34's costs at T=1, batch 1: verification
    18.8 / 19.4 / 20.2 ms for 2-4 tokens; drafting 0.74 ms a call + 0.86 ms a step, which a call
    of 4 divided by 4 averaged to 1.05 ms a step. Averaged, the third draft looks too dear and
    the plan stops at 2; priced as a call plus steps, it drafts 3."""
    from drafttrain.decode.planning import best_length, expected_tokens, length_rates

    verify = {(1, 1): 17.1, (1, 2): 18.8, (1, 3): 19.4, (1, 4): 20.2}
    exp = expected_tokens(torch.tensor([[0.51, 0.57, 0.50]]))
    active = torch.ones(1, dtype=torch.bool)
    averaged = CostModel(verify, {"eagle": {1: 1.05}})
    fitted = CostModel(verify, {"eagle": {1: 0.86}}, {}, None, {"eagle": {1: 0.74}})
    assert best_length(length_rates(exp, 1, averaged, "eagle", active)) == 2
    rates = length_rates(exp, 1, fitted, "eagle", active)
    assert best_length(rates) == 3
    assert rates[1] == pytest.approx(1.51 / (18.8 + 0.74 + 0.86)) and rates[0] == pytest.approx(1 / 17.1)


def test_draft_time_of_unmeasured_proposers():
    cm = grid()
    assert cm.draft_time("ngram", 4) == 0.0  # host-side lookup: free unless measured
    with pytest.raises(KeyError, match="no draft cost for 'draft-lm'.*measured: eagle"):
        cm.draft_time("draft-lm", 4)
    with pytest.raises(ValueError, match="full batch x tokens grid"):
        CostModel({(1, 1): 1.0, (2, 2): 2.0})


def test_measured_once_then_only_missing_proposers(tmp_path, monkeypatch):
    model = tiny_target("llama")
    timed = []
    real_draft = costmodel_module.time_draft
    monkeypatch.setattr(costmodel_module, "time_draft",
                        lambda target, p, b, *a, **k: timed.append((p.name, b)) or real_draft(target, p, b, *a, **k))
    kw = dict(cache_dir=tmp_path, batch_sizes=(1, 2), tokens=(1, 3), context=8, repeats=1, progress=False)
    cm = load_or_measure(model, {"ngram": load_proposer("ngram", model)}, **kw)
    assert set(cm.verify_ms) == {(1, 1), (1, 3), (2, 1), (2, 3)} and all(v > 0 for v in cm.verify_ms.values())
    assert cm.meta["params"] == sum(p.numel() for p in model.parameters()) and cm.meta["context"] == 8
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and timed == [("ngram", 1), ("ngram", 2)] * 2  # greedy, then sampled
    assert set(cm.sampled.verify_ms) == set(cm.verify_ms) and all(v > 0 for v in cm.sampled.verify_ms.values())
    again = load_or_measure(model, {"ngram": load_proposer("ngram", model),
                                    "early-exit:2": load_proposer("early-exit:2", model)}, **kw)
    assert timed[4:] == [("early-exit", 1), ("early-exit", 2)] * 2  # only the new proposer was timed
    assert again.verify_ms == cm.verify_ms and set(again.draft_ms) == {"ngram", "early-exit:2"}
    assert again.sampled.verify_ms == cm.sampled.verify_ms and set(again.sampled.draft_ms) == {"ngram", "early-exit:2"}
    loaded = CostModel.load(files[0])
    assert loaded.draft_ms == again.draft_ms and loaded.sampled.draft_ms == again.sampled.draft_ms
    # a file from before the sampled half (session 16 and earlier) is re-measured, not trusted at T > 0
    files[0].write_text(json.dumps({k: v for k, v in json.loads(files[0].read_text()).items() if k != "sampled"}))
    old = CostModel.load(files[0])
    assert old.sampled is None and old.at(1.0) is old
    assert load_or_measure(model, {"ngram": load_proposer("ngram", model)}, **kw).sampled is not None


def test_untimed_warm_up_forwards_come_before_the_first_timed_point(monkeypatch):
    """The first greedy points are not timed cold (session 29: 10-40% high right after loading, and
    cached for every later run): warm-up forwards at the first batch size run first, untimed."""
    model = tiny_target("llama")
    calls = []
    real = costtiming.time_verify

    def recorded(target, b, tokens, *a, **k):
        calls.append((b, tuple(tokens), isinstance(a[2], costtiming.NoBar)))
        return real(target, b, tokens, *a, **k)

    monkeypatch.setattr(costmodel_module, "time_verify", recorded)  # the timed grid
    monkeypatch.setattr(costtiming, "time_verify", recorded)  # the warm-up
    kw = dict(batch_sizes=(1, 2), tokens=(1, 3, 5), context=8, repeats=1, progress=False, sampled=False)
    costmodel_module.measure_cost_model(model, **kw)
    first_timed = next(i for i, c in enumerate(calls) if not c[2])
    assert first_timed >= 1 and all(c == (1, (1, 5), True) for c in calls[:first_timed])
    assert [c[:2] for c in calls[first_timed:]] == [(1, (1, 3, 5)), (2, (1, 3, 5))]
    calls.clear()
    costmodel_module.measure_cost_model(model, warmup_s=0, **kw)
    assert not any(c[2] for c in calls)


def test_profile_help(capsys):
    assert main(["profile", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: drafttrain profile" in out and "batch_sizes" in out and "refresh" in out


def test_profile_writes_the_cache_and_the_plot(tmp_path, capsys):
    root = save_tiny_run_root(tmp_path / "root")
    png, cache = tmp_path / "out" / "cost.png", tmp_path / "cache"
    rc = main(["profile", f"target={root}/target", "dtype=float32", "device=cpu", "proposers=ngram,early-exit:2",
               "batch_sizes=1,2", "tokens=1,2", "context=8", "repeats=1", f"output={png}", f"cache_dir={cache}",
               "progress=false"])
    out = capsys.readouterr().out
    assert rc == 0 and png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    cached = list(cache.glob("*.json"))
    assert len(cached) == 1
    cm = CostModel.load(cached[0])
    assert set(cm.verify_ms) == {(1, 1), (1, 2), (2, 1), (2, 2)} and set(cm.draft_ms) == {"ngram", "early-exit:2"}
    assert set(cm.sampled.verify_ms) == set(cm.verify_ms) and set(cm.sampled.draft_ms) == set(cm.draft_ms)
    assert "verify ms" in out and "early-exit:2" in out and "sampled (temperature > 0)" in out
    assert main(["profile", f"target={root}/target", "batch_sizes=0"]) == 2  # one-line error, no traceback


def test_cost_model_cache_follows_drafttrain_cache(monkeypatch, tmp_path):
    from drafttrain.decode.costmodel import default_cache_dir

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "costs"
    monkeypatch.delenv("DRAFTTRAIN_CACHE")
    assert default_cache_dir() == Path("~/.cache/drafttrain/costs").expanduser()


def test_a_linear_kernel_gets_its_own_cost_model_cache_file(monkeypatch):
    # the kernel changes every step's cost, so a cost model measured with PyTorch's matmul must not
    # answer for a target routed through a kernel; nor one measured before the decoder's code changed
    import torch

    from drafttrain.decode.kernels import cpu_linear

    target = tiny_target("llama", dtype=torch.bfloat16, vocab_size=300)
    plain = costmodel_module._identity(target)
    assert plain["linear"] == "aten"
    runnable = [b for b in cpu_linear.KERNELS if cpu_linear.available(b)]
    if not runnable:
        pytest.skip("no bf16 linear kernel runs on this CPU")
    cpu_linear.install(target, runnable[0])
    routed = costmodel_module._identity(target)
    assert routed["linear"] == runnable[0]
    assert costmodel_module._cache_file(routed, "c") != costmodel_module._cache_file(plain, "c")
    before = costmodel_module._cache_file(plain, "c")
    with monkeypatch.context() as m:  # an edited sampler / verifier / proposer re-measures too
        m.setattr(costmodel_module, "_decoder_source_hash", lambda: "edited")
        assert costmodel_module._cache_file(plain, "c") != before
    assert costmodel_module._cache_file(plain, "c") == before
    kernel = cpu_linear.KERNELS[runnable[0]]
    source = kernel.source
    try:  # an edited kernel (a new tile, a prefetch) re-measures instead of reading stale costs
        kernel.source = source + "\n// edited"
        edited = costmodel_module._cache_file(routed, "c")
    finally:
        kernel.source = source
    assert edited != costmodel_module._cache_file(routed, "c")
