"""Atomic writes (`drafttrain.atomic`): readers see the old content or the complete new one, and
failed writes leave nothing behind. Also checks that the leaf helpers stay leaves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from drafttrain.atomic import atomic_dir, atomic_path, write_atomic

ROOT = Path(__file__).resolve().parents[1]
LEAVES = ("atomic", "chat", "eos", "errors", "records", "textconfig")


def test_atomic_dir_replaces_a_folder_whole(tmp_path):
    final = tmp_path / "drafter"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with atomic_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not (final / "config.json").exists()  # nothing visible before the commit
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temp or old copy left


def test_atomic_dir_keeps_the_old_folder_when_the_write_fails(tmp_path):
    final = tmp_path / "drafter"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert (final / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_atomic_dir_keep_existing_keeps_the_first_finished_entry(tmp_path):
    entry = tmp_path / "cache" / "entry"
    with atomic_dir(entry, keep_existing=True) as outer:
        (outer / "who").write_text("slow writer")
        with atomic_dir(entry, keep_existing=True) as inner:  # another rank finishes first
            (inner / "who").write_text("fast writer")
    assert (entry / "who").read_text() == "fast writer"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["entry"]


def test_write_atomic_and_atomic_path(tmp_path):
    path = tmp_path / "sub" / "results.json"
    write_atomic(path, '{"a": 1}')
    write_atomic(path, b'{"a": 2}')
    assert path.read_text() == '{"a": 2}'
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text("partial")
        raise OSError(28, "No space left on device")
    assert path.read_text() == '{"a": 2}'
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


@pytest.mark.parametrize("name", LEAVES)
def test_leaf_helpers_import_nothing_of_ours(name):
    tree = ast.parse((ROOT / "drafttrain" / f"{name}.py").read_text())
    ours = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and (n.level or (n.module or "").split(".")[0] == "drafttrain")]
    ours += [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Import)
             and any(a.name.split(".")[0] == "drafttrain" for a in n.names)]
    assert ours == []


def test_the_corpus_proposer_does_not_import_the_data_pipeline():
    source = (ROOT / "decode" / "proposers" / "corpus.py").read_text()
    assert "drafttrain.data" not in source
