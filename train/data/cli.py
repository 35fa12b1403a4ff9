"""`specdec data` / `python -m specdec.train.data`: the command line of the data stage."""

from __future__ import annotations

import os
import sys

from specdec.cli import command_help
from specdec.config import config_from_cli, wants_help
from specdec.train.data.config import DataConfig
from specdec.train.data.run_loop import run

# The prose above the keys of `specdec data --help` (specdec/cli.py builds the help from DataConfig).
INTRO = """Generate the target's own completions for a prompt set (resumable; rerun the same command to continue).

prompts: a local .jsonl/.json/.parquet/.csv file, a Hub dataset, embedded:train, embedded:heldout, or self:N
(N requests the target writes itself, as in Magpie), or several of these joined by commas."""


def main(argv: list[str] | None = None) -> int:
    """`specdec data` / `python -m specdec.train.data` / `accelerate launch -m specdec.train.data`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(command_help("data"))
        return 0
    cfg = config_from_cli(DataConfig, argv, section="data")
    manifest = run(cfg)
    if os.environ.get("RANK", "0") != "0":
        return 0  # one summary line per launch, from the main process
    counts = manifest["counts"]
    state = "complete" if manifest["complete"] else f"{len(manifest['shards'])}/{manifest['num_shards']} shards"
    print(f"specdec data: {counts['examples']} examples, {counts['generated_tokens']} generated tokens, "
          f"{counts['skipped_too_long']} prompt(s) skipped as too long -> {cfg.output_dir} ({state})")
    return 0
