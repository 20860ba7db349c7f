"""The `drafttrain` command: `train`, `prepare` (offline features) and, as they land, `eval`,
`export`.

Arguments are `key=value` pairs (see `drafttrain train --help`). Anything a user can get wrong
ends in one line `drafttrain: error: ...` and a non-zero exit, never a traceback; set
DRAFTTRAIN_DEBUG=1 to see the traceback anyway.
"""

from __future__ import annotations

import os
import sys

from drafttrain.errors import (
    ConfigError,
    DataError,
    DrafterMismatchError,
    ExportError,
    TargetError,
    TrainingError,
    first_line,
)

USAGE = """usage: drafttrain COMMAND [key=value ...]

commands:
  train     train a drafter            (drafttrain train recipe=eagle train.max_steps=100)
  prepare   cache target features      (drafttrain prepare recipe=eagle features.mode=offline)
  regenerate target-written responses  (drafttrain regenerate data.path=chat.json out=regen.jsonl)
  recipes   list the shipped recipes
  export    drafter -> hf|vllm|sglang  (drafttrain export runs/eagle/drafter --format vllm --out out/vllm)
  engine-check  serve an export with vLLM (drafttrain engine-check exports/vllm target=DIR)
  eval      measure drafters           (drafttrain eval proposers=ngram,early-exit:6 bench=mtbench)
  profile   cost model of the target   (drafttrain profile proposers=ngram,early-exit:6 batch_sizes=1,4,16)

Every command takes --help. `accelerate launch drafttrain/train.py recipe=eagle ...` is the same
as `drafttrain train` under Accelerate.
"""


def _user_errors() -> tuple[type[BaseException], ...]:
    return (ConfigError, DataError, TargetError, DrafterMismatchError, TrainingError, FileNotFoundError,
            ExportError)


def run_guarded(fn, *args) -> int:
    """Run fn; user errors become one line on stderr and exit code 2 (1 for runtime failures)."""
    try:
        fn(*args)
        return 0
    except _user_errors() as e:
        if os.environ.get("DRAFTTRAIN_DEBUG"):
            raise
        print(f"drafttrain: error: {first_line(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("drafttrain: error: out of memory; lower train.batch_size or data.max_len", file=sys.stderr)
        return 1
    except OSError as e:
        if os.environ.get("DRAFTTRAIN_DEBUG"):
            raise
        if e.errno == 28:
            print(f"drafttrain: error: disk full while writing {e.filename or ''}; free space or change output_dir",
                  file=sys.stderr)
        else:
            print(f"drafttrain: error: {e}", file=sys.stderr)
        return 1
    except torch_oom() as e:
        print(f"drafttrain: error: out of memory ({first_line(e)}); lower train.batch_size or data.max_len",
              file=sys.stderr)
        return 1


def torch_oom():
    import torch

    return getattr(torch, "OutOfMemoryError", MemoryError)


def _train_help() -> str:
    from drafttrain.config import format_help
    from drafttrain.schema import TrainConfig

    return format_help(TrainConfig, "usage: drafttrain train recipe=NAME [key=value ...]\n\nkeys (default, meaning):")


def cmd_train(argv: list[str]) -> None:
    from drafttrain.config import dump_yaml, parse_args
    from drafttrain.schema import TrainConfig
    from drafttrain.summary import format_summary
    from drafttrain.trainer import train

    cfg = parse_args(argv, TrainConfig)
    if cfg.print_config:
        print(dump_yaml(cfg), end="")
        return
    summary = train(cfg)
    if "stopped_at" not in summary and os.environ.get("RANK", "0") == "0":  # once under accelerate launch
        print(format_summary(summary))


def cmd_prepare(argv: list[str]) -> None:
    from drafttrain.config import parse_args
    from drafttrain.prepare import prepare
    from drafttrain.schema import TrainConfig

    prepare(parse_args(argv, TrainConfig))


def cmd_recipes(argv: list[str]) -> None:
    from drafttrain.config import RECIPES_DIR

    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        first = next((ln[1:].strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
        print(f"  {p.stem:<12} {first}")


def cmd_eval(argv: list[str]) -> None:
    from drafttrain.config import parse_args
    from drafttrain.eval import EvalConfig, run_eval
    from drafttrain.eval.report import markdown

    cfg = parse_args(argv, EvalConfig)
    results = run_eval(cfg)
    print(markdown(results))
    print(f"report: {cfg.output_dir}/results.json, results.md, tokens.jsonl, {len(results.files.plots)} plots")


def _eval_help() -> str:
    from drafttrain.config import format_help
    from drafttrain.eval import EvalConfig

    return format_help(EvalConfig, "usage: drafttrain eval [key=value ...]\n\nkeys (default, meaning):")


def cmd_profile(argv: list[str]) -> None:
    from drafttrain.config import parse_args
    from drafttrain.profiling import ProfileConfig, run_profile

    run_profile(parse_args(argv, ProfileConfig))


def _profile_help() -> str:
    from drafttrain.profiling import help_text

    return help_text()


def _export_command():
    from drafttrain.export import command

    return command


def cmd_export(argv: list[str]) -> None:
    _export_command().cmd_export(argv)


def cmd_engine_check(argv: list[str]) -> None:
    from drafttrain.config import parse_args
    from drafttrain.engines.check import EngineCheckConfig, engine_check, format_check

    argv = [a if "=" in a or i else f"export={a}" for i, a in enumerate(argv)]  # EXPORT may come first, bare
    print(format_check(engine_check(parse_args(argv, EngineCheckConfig))))


def _engine_check_help() -> str:
    from drafttrain.engines.check import help_text

    return help_text()


def cmd_regenerate(argv: list[str]) -> None:
    from drafttrain.regenerate import cmd_regenerate as run

    run(argv)


def _regenerate_help() -> str:
    from drafttrain.regenerate import help_text

    return help_text()


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "recipes": cmd_recipes, "eval": cmd_eval,
            "export": cmd_export, "regenerate": cmd_regenerate, "profile": cmd_profile, "engine-check": cmd_engine_check}
HELP = {"train": _train_help, "eval": _eval_help, "regenerate": _regenerate_help, "profile": _profile_help,
        "engine-check": _engine_check_help,
        "export": lambda: _export_command().HELP, "prepare": lambda: "usage: drafttrain prepare recipe=NAME [key=value ...]\n\n"
        "Computes the target features the recipe needs for every training record and writes them to\n"
        "features.cache_dir (default <output_dir>/features) in bf16 shards. Resumable: a killed run\n"
        "continues at the first missing shard. Then train with features.mode=offline.\n\n" + _train_help()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(cmd, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"drafttrain: error: unknown command {cmd!r}{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        print(HELP.get(cmd, lambda: USAGE)())
        return 0
    return run_guarded(COMMANDS[cmd], rest)


if __name__ == "__main__":
    sys.exit(main())
