"""The `specdec` command. Each subcommand lives in its own module and is imported only when called.

    specdec data     prompts -> target-generated dataset (resumable)
    specdec train    distil a draft (same code path as `accelerate launch -m specdec.train --config ...`)
    specdec eval     baseline vs speculative report
    specdec verify   distribution equivalence of the speculative sampler
    specdec publish  HF-format draft + model card (+ push to the Hub when asked)
    specdec demo     the embedded default end to end

Every subcommand takes `--config recipes/X.yaml` (or a shipped recipe's name), `key=value` overrides and
`--key value` flags; `specdec <command> --help` (or -h, anywhere on the line) lists every key of its config classes
with its default and meaning, generated here from the classes and their comments (`command_help`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

from specdec.config import help_text, shipped_recipes, wants_help

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

_RECIPE_OPTIONS = "[--config recipes/X.yaml] [key=value ...] [--key value ...]"

# subcommand -> its --help: the usage line, the prose kept above the keys ("module:attribute", "" for none) and
# (title, "module:Class") of each config class it reads, the first one its own (plus the classes it inherits); a
# "module:function" in place of a class gives such pairs itself (the draft kinds' options blocks: a registry).
HELP: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "data": (f"specdec data {_RECIPE_OPTIONS}", "specdec.train.data.cli:INTRO",
             (("options (recipe section `data:` plus the shared keys)", "specdec.train.data.config:DataConfig"),)),
    "train": (f"specdec train [--plan] {_RECIPE_OPTIONS}\n"
              f"       accelerate launch [--config_file recipes/accelerate/X.yaml] -m specdec.train {_RECIPE_OPTIONS}",
              "", (("options (recipe section `train:` plus the shared keys)", "specdec.train.train_config:TrainConfig"),
                   ("", "specdec.train.kinds.options:help_sections"),
                   ("plan: `specdec train --plan` (also reads plan_device_gb, plan_devices)",
                    "specdec.train.plan.check:PlanOptions"))),
    "eval": ("specdec eval --target T --draft D [--prompts FILE] [--num-draft-tokens 1,2,4] [--batch-size 1,4] "
             f"--out DIR\n       specdec eval {_RECIPE_OPTIONS}", "specdec.eval.cli:EVAL_INTRO",
             (("options (recipe section `eval:` plus the shared keys)", "specdec.eval.config:EvalConfig"),)),
    "verify": ("specdec verify [--temperature 1.0,0.8 --top-k 0,6 --top-p 1.0,0.9] [--samples 16000] [--out DIR]\n"
               "       specdec verify --target T --draft D --prompts FILE [--num-prompts 2] [--samples 512]",
               "specdec.eval.cli:VERIFY_INTRO", (("options", "specdec.eval.verify:VerifyConfig"),)),
    "publish": ("specdec publish --draft DIR --out OUT [--report report.json] [--push-to-hub REPO [--private]] "
                f"{_RECIPE_OPTIONS}", "specdec.train.publish:__doc__",
                (("options (recipe section `publish:`)", "specdec.train.publish:PublishConfig"),)),
    "demo": ("specdec demo [--quick] [--plan] [key=value ...]", "specdec.demo:__doc__",
             (("options (recipe section `demo:` of the recipe it runs)", "specdec.demo:DemoConfig"),)),
}


def _attribute(ref: str):
    """The object a "module:attribute" reference names, its module imported now (lazily, as the commands are)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def command_help(name: str) -> str:
    """`specdec <name> --help`: generated from the command's config classes (`specdec.config.help_text`)."""
    usage, intro, sections = HELP[name]
    pairs = []
    for title, ref in sections:
        found = _attribute(ref)
        pairs += [(title, found)] if isinstance(found, type) else list(found())
    (title, main_class), *more = pairs
    return help_text(main_class, usage, title, _attribute(intro) if intro else "", tuple(more))


def _usage() -> str:
    lines = ["usage: specdec <command> [--config recipes/X.yaml] [key=value ...] [--key value ...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", f"--config takes a path or a shipped recipe's name ({shipped_recipes()}):",
              "  " + ", ".join(sorted(p.stem for p in shipped_recipes().glob("*.yaml"))),
              "", "Run `specdec <command> --help` for a command's options; SPECDEC_DEBUG=1 shows tracebacks."]
    return "\n".join(lines)


def configure_logging() -> None:
    """The `specdec` command's log lines (also set in a process a command spawns: the demo's evaluation)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
    configure_logging()
    if wants_help(rest):  # before any parsing: `specdec demo --quick --help` is help, whatever else the line holds
        print(command_help(name))
        return 0
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
