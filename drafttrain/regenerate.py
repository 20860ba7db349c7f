"""`drafttrain regenerate`: the target writes its own answers to the training prompts.

A drafter is asked at decode time to predict what the target writes, so the best training data
is the target's own answers (a small base model answers unlike ShareGPT's assistants: it echoes
and loops). Each usable conversation of `data.path` gives one prompt (its system turn(s) and
first user turn, rendered with the same template as training); drafttrain's own batched
speculative decoder answers them (`proposer` for the greedy share, n-gram by default: lossless,
and several times faster on a target that repeats itself, except on AVX2-only CPUs, see
`answering_proposer`; `sampled_proposer`, none by default, for the rest), a `greedy_share` of
prompts at T=0 and the rest at `temperature`, in batches of prompts of similar length (a batch
pads to its longest), and every finished batch is appended to `out` as JSONL lines

    {"id": "<conversation key>", "temperature": T, "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}

(OpenAI `messages` form, so `data.path=<out>` trains on it). A rerun appends: ids already in
the file are skipped, and a line cut short by a kill is dropped first. Each record samples with
its own seed (seed, id) and its temperature is a hash of (seed, id), so a resumed file holds the
same responses a single run would. Training uses it with `answers.source=target` (answers.py).

Skipped prompts: those of data.max_len tokens or more (training would truncate their answers
away) and those that contain an MT-bench or HumanEval prompt (benchmarks never enter training).
What it does not do: regenerate later turns of multi-turn conversations (the response is one
turn), or filter and score responses.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from drafttrain.config import LINEAR_BACKEND_HELP, LINEAR_BACKENDS, field_
from drafttrain.data import DataConfig
from drafttrain.eos import eos_ids
from drafttrain.errors import DataError
from drafttrain.records import jsonl_lines

ANSWER_DTYPES = ("auto", "target", "bfloat16")
ANSWER_DTYPE_HELP = ("dtype the target answers in: target (as loaded), bfloat16, or auto (bfloat16 through "
                     "drafttrain's bf16 decode kernels where a float32 target sits on a CPU that runs one, e.g. "
                     "dtype=auto on AVX2-only CPUs, 1.4x faster there; else as loaded)")


@dataclass
class RegenerateConfig:
    recipe: str = field_("", help="optional YAML file with any of these keys (e.g. a training recipe's data block)")
    target: str = field_("gemma-3-270m", help="target: packaged alias, HF hub id, local folder or .gguf file")
    target_revision: str = field_("", help="hub revision of the target")
    dtype: str = field_("auto", help="target dtype", choices=("auto", "bfloat16", "float32", "float16"))
    trust_remote_code: bool = field_(False, help="allow custom modelling code from the target's repo")
    data: DataConfig = field_(default_factory=DataConfig, help="")
    out: str = field_("", help="JSONL file to write (appended to on rerun; done ids are skipped)")
    num_prompts: int = field_(0, help="first N usable conversations; 0 = all")
    batch_size: int = field_(8, help="prompts sampled together")
    max_new_tokens: int = field_(256, help="max tokens per response")
    temperature: float = field_(1.0, help="sampling temperature of the sampled share (0 = greedy)")
    greedy_share: float = field_(0.0, help="share of prompts answered greedily (T=0), chosen by record id")
    top_p: float = field_(1.0, help="nucleus sampling mass (1 = off)")
    seed: int = field_(0, help="sampling seed (each record also mixes in its id)")
    proposer: str = field_("auto", help="drafter that speeds the greedy answers up (any proposer spec; 'none' = plain; "
                                        "auto: n-gram, none where the target answers through the AVX2 kernel)")
    sampled_proposer: str = field_("none", help="drafter for the sampled answers (none: at T=1 n-gram drafts are mostly rejected, and a batch pays to verify them)")
    skip_benchmarks: bool = field_(True, help="skip prompts that contain an MT-bench or HumanEval prompt")
    answer_dtype: str = field_("auto", help=ANSWER_DTYPE_HELP, choices=ANSWER_DTYPES)
    linear_backend: str = field_("auto", help="a bf16 target's linear layers while it answers on CPU: " + LINEAR_BACKEND_HELP,
                                 choices=LINEAR_BACKENDS)


HELP_TEXT = """usage: drafttrain regenerate target=MODEL data.path=CONVERSATIONS out=FILE.jsonl [key=value ...]

The target answers the first user turn of every training conversation (batched sampling) and the
answers are appended to FILE.jsonl in OpenAI `messages` form; train on them with data.path=FILE.jsonl.
Resumable: rerun the same command after a kill and it continues where it stopped.
"""


def read_done(path: Path) -> set[str]:
    """Ids already in `path`; a trailing partial line (a killed write) is cut off the file first."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    keep = raw.rfind(b"\n") + 1  # everything after the last newline is an unfinished line
    if keep < len(raw):
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = set()
    for line in jsonl_lines(raw[:keep].decode("utf-8")):
        if line.strip():
            done.add(json.loads(line)["id"])
    return done


def prompts_of(cfg: RegenerateConfig, tokenizer) -> list[tuple[str, list[dict], list[int]]]:
    """(id, prompt messages, prompt ids) per usable conversation, in file order, without duplicates.

    Prompts of `data.max_len` tokens or more are skipped: training truncates every record to
    max_len, so none of their answer would be learned, and one such prompt in a batch makes the
    whole batch pad to it (ShareGPT has first turns of many thousand tokens).
    """
    from drafttrain.chat import render_prompt
    from drafttrain.data import load_conversations
    from drafttrain.eval.benchmarks import benchmark_texts, contains_benchmark

    bench = benchmark_texts() if cfg.skip_benchmarks else set()
    out, seen = [], set()
    for rec in load_conversations(cfg.data):
        messages = rec["messages"]
        if messages[0]["role"] == "text" or rec["key"] in seen:
            continue
        seen.add(rec["key"])
        first_user = next(j for j, m in enumerate(messages) if m["role"] == "user")
        prefix = messages[: first_user + 1]
        if bench and contains_benchmark(" ".join(m["content"] for m in prefix), bench):
            continue  # benchmark prompts never enter training data
        ids = render_prompt(tokenizer, prefix, cfg.data.template, cfg.data.system_prompt)
        if len(ids) >= cfg.data.max_len:
            continue
        out.append((rec["key"], prefix, ids))
        if cfg.num_prompts and len(out) >= cfg.num_prompts:
            break
    return out


def regenerate(cfg: RegenerateConfig, *, progress: bool = True, target=None, tokenizer=None) -> dict:
    """Write the target's responses to `cfg.out`; returns {"written", "skipped", "out"}.

    `target` / `tokenizer` reuse an already loaded target (training does); else `cfg.target` loads.
    """
    import torch

    from drafttrain.targets import load_target

    if not cfg.out:
        raise DataError("regenerate needs out=FILE.jsonl (where the responses go)")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1 or not 0.0 <= cfg.greedy_share <= 1.0:
        raise DataError("regenerate needs batch_size >= 1, max_new_tokens >= 1 and greedy_share in [0, 1]")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if target is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target, tokenizer, _ = load_target(cfg.target, dtype=cfg.dtype, device=device,
                                           revision=cfg.target_revision or None,
                                           trust_remote_code=cfg.trust_remote_code)
    done = read_done(out)
    todo = [p for p in prompts_of(cfg, tokenizer) if p[0] not in done]
    if not todo:
        return {"written": 0, "skipped": len(done), "out": str(out)}
    with answering_model(target, cfg.answer_dtype, cfg.linear_backend, progress) as model:
        written = _answer_all(cfg, model, tokenizer, todo, out, progress)
    return {"written": written, "skipped": len(done), "out": str(out)}


def answer_dtype_of(choice: str, target):
    """The torch dtype `target` answers in for `answer_dtype=choice` (see ANSWER_DTYPE_HELP)."""
    import torch

    from drafttrain.decode.kernels import cpu_linear

    if choice not in ANSWER_DTYPES:
        raise DataError(f"answer_dtype must be one of {ANSWER_DTYPES}, got {choice!r}")
    param = next(target.parameters())
    if choice == "bfloat16":
        return torch.bfloat16
    if choice == "auto" and param.device.type == "cpu" and param.dtype == torch.float32 and any(
            cpu_linear.available(k) for k in cpu_linear.KERNELS):
        return torch.bfloat16
    return param.dtype


@contextmanager
def answering_model(target, answer_dtype: str, linear_backend: str, progress: bool = True):
    """The model that answers: `target` itself, or a bf16 copy of it (dropped afterwards), with
    drafttrain's decode kernels routed in on CPU for the duration (an already routed target keeps
    its kernels). A float32 target on an AVX2-only CPU answers in bf16 through the AVX2 kernel
    (session 21, Zen 2, Gemma 3 270M, 32 greedy prompts x 128 tokens at batch 16: 2.73 s per answer
    in float32 with n-gram drafts, 1.89 in bf16 without). Answers' law does not depend on it beyond bf16 near-ties
    (which is also what the decoder meets at eval, where bf16 targets decode through the kernels)."""
    import copy

    import torch

    from drafttrain.decode.kernels import cpu_linear

    dtype = answer_dtype_of(answer_dtype, target)
    model = target if dtype == next(target.parameters()).dtype else copy.deepcopy(target).to(dtype)
    routed = False
    if model.device.type == "cpu" and dtype == torch.bfloat16 and cpu_linear.installed_backend(model) == "aten":
        line = cpu_linear.setup(model, linear_backend)
        routed = cpu_linear.installed_backend(model) != "aten"
        if progress:
            print(f"drafttrain: answering in {str(dtype).removeprefix('torch.')}; {line}", flush=True)
    try:
        yield model
    finally:
        if routed and model is target:
            cpu_linear.uninstall(model)


def temperature_of(cfg: RegenerateConfig, key: str) -> float:
    """The record's temperature: greedy for a `greedy_share` of records (by a hash of its id and
    the seed, so a rerun and a resumed run agree), `cfg.temperature` for the rest."""
    h = int(hashlib.sha256(f"{cfg.seed}:{key}".encode()).hexdigest()[:12], 16) / 16**12
    return 0.0 if h < cfg.greedy_share else cfg.temperature


def _answer_all(cfg: RegenerateConfig, target, tokenizer, todo: list, out: Path, progress: bool) -> int:
    """Answers `todo` in batches of one temperature, appending each finished batch to `out`."""
    from tqdm.auto import tqdm

    from drafttrain.decode import load_proposer
    from drafttrain.progress import keep_alive

    target.eval()
    greedy_spec = answering_proposer(cfg.proposer, target)
    specs = {0.0: greedy_spec, cfg.temperature: cfg.sampled_proposer} if cfg.temperature > 0 else {0.0: greedy_spec}
    proposers = {t: None if spec in ("", "none") else load_proposer(spec, target, tokenizer=tokenizer)
                 for t, spec in specs.items()}
    eos = eos_ids(target, tokenizer)
    groups: dict[float, list] = {}
    # by prompt length within a temperature: a batch pads to its longest prompt, and ShareGPT's first
    # turns run from 5 to 500 tokens (900 prompts in file order padded to 4.5x their tokens)
    for item in sorted(todo, key=lambda item: len(item[2])):
        groups.setdefault(temperature_of(cfg, item[0]), []).append(item)
    bar = tqdm(total=len(todo), desc="regenerate", unit="answer", disable=not progress, dynamic_ncols=True)
    written = 0
    with open(out, "a", encoding="utf-8") as f, keep_alive(bar):  # a batch takes tens of seconds
        for temp, items in sorted(groups.items()):
            for lo in range(0, len(items), cfg.batch_size):
                batch = items[lo: lo + cfg.batch_size]
                for rec in answer_batch(cfg, target, tokenizer, proposers[temp], batch, temp, eos):
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())  # a finished batch survives a kill
                written += len(batch)
                bar.update(len(batch))
    bar.close()
    return written


def answering_proposer(spec: str, model) -> str:
    """The greedy answers' proposer spec: `spec`, or for "auto" n-gram drafts (lossless, several times
    faster on a target that repeats itself while its batch of decode steps is memory-bound) except
    where the model answers through the AVX2 kernel, whose batch steps are compute-bound: there a
    batch of 16 pays for 5 verified rows per prompt (session 21, Zen 2, Gemma 3 270M, 32 prompts x
    128 greedy tokens: 1.89 s per answer without drafts, 2.45 with n-gram at batch 16, 2.08 at 8)."""
    if spec != "auto":
        return spec
    from drafttrain.decode.kernels import cpu_linear

    return "none" if cpu_linear.installed_backend(model) == "avx2" else "ngram"


def answer_batch(cfg: RegenerateConfig, target, tokenizer, proposer, batch: list, temperature: float,
                 eos: list[int]) -> list[dict]:
    """One batch of prompts answered by drafttrain's speculative decoder (lossless: the answers
    follow the target's own law); each row keyed by its record's seed, so resuming is exact."""
    import torch

    from drafttrain.decode import speculative_generate

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = max(len(ids) for _, _, ids in batch)
    ids = torch.full((len(batch), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (_, _, p) in enumerate(batch):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, P - len(p):] = 1
    device = next(target.parameters()).device
    seeds = [(cfg.seed * 1_000_003 + int(key[:12], 16)) % 2**62 for key, _, _ in batch]
    if hasattr(proposer, "reset"):  # adaptive proposers start each batch cold, as a fresh run would
        proposer.reset()
    res = speculative_generate(target, proposer, ids.to(device), attention_mask=mask.to(device),
                               max_new_tokens=cfg.max_new_tokens, temperature=temperature, top_p=cfg.top_p,
                               seed=seeds if temperature > 0 else None, eos_token_id=eos)
    out = []
    for (key, prefix, _), toks in zip(batch, res.sequences):
        text = tokenizer.decode([t for t in toks if t not in eos], skip_special_tokens=True)
        out.append({"id": key, "temperature": temperature,
                    "messages": [*prefix, {"role": "assistant", "content": text}]})
    return out


def cmd_regenerate(argv: list[str]) -> None:
    """Entry point for `drafttrain regenerate`."""
    from drafttrain.config import parse_args

    res = regenerate(parse_args(argv, RegenerateConfig))
    print(f"drafttrain: regenerate wrote {res['written']} responses to {res['out']} "
          f"({res['skipped']} already there); train with data.path={res['out']}")


def help_text() -> str:
    from drafttrain.config import format_help

    return format_help(RegenerateConfig, HELP_TEXT + "\nkeys (default, meaning):")
