"""Planning a run on this machine: `specdec train --plan` (its options, the printed plan) and the check every run
makes before anything loads (`check_run`), against the device's memory."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from specdec.config import _build, _CliText, help_text, load_config, split_cli
from specdec.models import resolve_device, resolve_mixed_precision
from specdec.train.data import DataConfig
from specdec.train.plan.memory import plan_run
from specdec.train.plan.report import GiB, Plan
from specdec.train.plan.target import target_config

log = logging.getLogger(__name__)


@dataclass
class PlanOptions:
    """`specdec train --plan` options that are not training settings (the shape of the data to plan disk for,
    the target's config where it cannot be read)."""

    plan: bool = False  # print the plan and exit
    target_config: str = ""  # the target's config.json path or inline JSON, when the target cannot be resolved
    plan_samples: int = 0  # data stage: samples to plan disk for; 0 = the recipe's data limit x num_samples
    plan_mean_length: int = 0  # data stage: mean tokens per sample (prompt + completion); 0 = half of max_length


def split_plan_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Take `--plan` and the `PlanOptions` keys out of a `specdec train` command line. -> (options, the rest)"""
    names = {f.name for f in fields(PlanOptions)}
    values, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        key, sep, value = arg.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if arg == "--plan":
            values["plan"] = True
        elif key in names and (sep or arg.startswith("--")):
            if not sep:  # --target-config VALUE
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            values[key] = value
        else:
            rest.append(arg)
        i += 1
    return _build(PlanOptions, {k: v if isinstance(v, bool) else _CliText(v) for k, v in values.items()}), rest


def device_memory(device: torch.device, override_gb: float = 0.0, local_processes: int = 1) -> tuple[int, str]:
    """The bytes one process may plan for, and where the figure comes from: `override_gb` GiB when given; a
    CUDA device's total memory; on a CPU the RAM available now, shared by this machine's processes."""
    if override_gb:
        return int(override_gb * GiB), f"plan_device_gb={override_gb:g}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name}"
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:
        available = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if not available:
        return 0, "unknown"
    share = f", shared by {local_processes} processes" if local_processes > 1 else ""
    return available // max(local_processes, 1), f"this machine's available RAM{share}"


def plan_for(cfg, options: PlanOptions | None = None, *, device: torch.device | None = None,
             mixed_precision: str | None = None, devices: int | None = None, data=None,
             convert_embedded: bool = False) -> Plan:
    """The plan of `cfg` on this machine (or the one `plan_device_gb` / `plan_devices` describe)."""
    options = options or PlanOptions()
    if cfg.plan_device_gb < 0 or cfg.plan_devices < 0:
        raise ValueError(f"plan_device_gb and plan_devices must be >= 0 (0 = this machine's), got "
                         f"{cfg.plan_device_gb} and {cfg.plan_devices}")
    if device is None:
        if cfg.plan_device_gb:  # planning another machine: device=auto means a GPU's
            device = torch.device("cuda" if cfg.device == "auto" else cfg.device)
        else:
            device = resolve_device(cfg.device)
    if mixed_precision is None:
        here = device.type == "cpu" or torch.cuda.is_available()
        auto_elsewhere = "bf16" if cfg.mixed_precision == "auto" else cfg.mixed_precision  # a GPU's, planned
        mixed_precision = resolve_mixed_precision(cfg.mixed_precision, cfg.device) if here else auto_elsewhere
    devices = devices or cfg.plan_devices or int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    memory, source = device_memory(device, cfg.plan_device_gb, local)
    target_cfg = target_config(cfg.target, options.target_config or None, convert_embedded)
    return plan_run(cfg, target_cfg, device_type=device.type, mixed_precision=mixed_precision, devices=devices,
                    memory=memory, memory_source=source, data=data, samples=options.plan_samples,
                    mean_length=options.plan_mean_length)


def recipe_data_config(path: str | None):
    """The recipe's `data:` section (None without a recipe or one that does not validate here)."""
    if not path:
        return None
    try:
        return load_config(DataConfig, path, section="data")
    except ValueError as err:
        log.warning("plan: the recipe's data section is not read (%s); disk is planned without it", err)
        return None


def check_run(cfg, device: torch.device, mixed_precision: str, world: int, main: bool) -> None:
    """A run's plan, logged by the main process, and its check: raises (on every process) when the total
    exceeds the device's memory. A plan that cannot be made (an unreadable config) only warns."""
    try:
        plan = plan_for(cfg, device=device, mixed_precision=mixed_precision, devices=world, convert_embedded=True)
    except Exception as err:  # noqa: BLE001 - the plan informs; loading reports the real error
        log.warning("no memory plan for this run (%s)", err)
        return
    if main:
        log.info("%s", plan.render())
    plan.check()


def show(cfg, options: PlanOptions, argv: list[str]) -> int:
    """`specdec train --plan`: print the plan (with the recipe's data section for disk); 1 when it does not fit."""
    path, _ = split_cli(argv, type(cfg))
    plan = plan_for(cfg, options, data=recipe_data_config(path))
    print(plan.render())
    if not plan.fits():
        big = plan.culprit
        print(f"does not fit: {plan.naming(big)}. {big.fix}")
        return 1
    return 0


def help_lines() -> str:
    """`specdec train --help`'s lines for the plan options."""
    text = help_text(PlanOptions, "", "plan: `specdec train --plan` (also reads plan_device_gb, plan_devices)")
    return "\n" + "\n".join(text.splitlines()[2:-2])
