"""The `specdec` command. Each subcommand lives in its own module and is imported only when called.

    specdec data     prompts -> target-generated dataset (resumable)
    specdec train    distil a draft (same code path as `accelerate launch -m specdec.train --config ...`)
    specdec eval     baseline vs speculative report
    specdec verify   distribution equivalence of the speculative sampler
    specdec publish  HF-format draft + model card (+ push to the Hub when asked)
    specdec demo     the embedded default end to end

Every subcommand takes `--config recipes/X.yaml` (or a shipped recipe's name), `key=value` overrides and
`--key value` flags.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

from specdec.config import shipped_recipes

# subcommand -> (module, function, one-line help). Modules are imported lazily: `specdec` must not import
# `train` or `eval` at module level (docs/design.md).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "data": ("specdec.train.data", "main", "prompts -> target-generated dataset (resumable)"),
    "train": ("specdec.train.distill", "main", "distil a draft on target-generated data"),
    "eval": ("specdec.eval.cli", "main_eval", "baseline vs speculative report (report.json, report.md, plots)"),
    "verify": ("specdec.eval.cli", "main_verify", "check that speculative sampling is distributed as the target"),
    "publish": ("specdec.train.publish", "main", "export a draft as a plain HF checkpoint with a model card"),
    "demo": ("specdec.demo", "main", "the embedded default end to end"),
}


def _usage() -> str:
    lines = ["usage: specdec <command> [--config recipes/X.yaml] [key=value ...] [--key value ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", f"--config takes a path or a shipped recipe's name ({shipped_recipes()}):",
              "  " + ", ".join(sorted(p.stem for p in shipped_recipes().glob("*.yaml"))),
              "", "Run `specdec <command> --help` for a command's options; SPECDEC_DEBUG=1 shows tracebacks."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `specdec` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"specdec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, func_name, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except ValueError as err:
        # Boundary errors carry the fix in their message; a traceback would only bury it. SPECDEC_DEBUG=1 shows
        # it anyway, for a ValueError that comes from a bug rather than from the input.
        if os.environ.get("SPECDEC_DEBUG"):
            traceback.print_exc()
        print(f"specdec {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specdec {name}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
