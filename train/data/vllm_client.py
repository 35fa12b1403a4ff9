"""The data stage's link to vLLM: train/vllm_worker.py run by vLLM's own Python (one engine, JSON lines over its
stdin and stdout), and the engine's arguments and environment for this process."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from specdec.models import resolve_path
from specdec.train.data.config import DataConfig
from specdec.train.data.processes import Processes
from specdec.vllm_env import activated, child_env

# The worker script, beside this package (standalone: it imports only the stdlib and vLLM).
VLLM_WORKER = Path(__file__).resolve().parents[1] / "vllm_worker.py"
START_TIMEOUT_S = 1800.0  # a first start may download the model, and on a CPU compiles it for minutes
CPU_KVCACHE_GIB = "2"  # GiB of KV cache on a CPU: 1 is plenty for small models; 2 holds a batch of 64 SmolLM2 rows


class VLLMWorker:
    """train/vllm_worker.py under vLLM's own Python (its venv active in `env`): one engine, spoken to in JSON lines
    over stdin/stdout.

    Its stderr (vLLM's log) goes to `log_path`, whose tail every error quotes. It runs in a session of its own, so
    that closing it also ends any engine process vLLM started, and it dies with this process (see the worker)."""

    def __init__(self, python: Path, engine_args: dict, env: dict, log_path: Path, what: str):
        self.log_path, self.what = log_path, what
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(python), str(VLLM_WORKER), json.dumps(engine_args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=activated(python, env), text=True,
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.version = self._receive(START_TIMEOUT_S, "start").get("vllm", "?")
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the worker closed its stdout: it has exited

    def tail(self, chars: int = 3000) -> str:
        """The end of vLLM's log (where its own error message is)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        if len(text) > chars:
            text = text[-chars:].partition("\n")[2]  # whole lines only
        return text.strip()

    def _fail(self, message: str) -> ValueError:
        self.close()  # first: a stopped worker has written all of its log
        return ValueError(f"{message}\n--- the end of vLLM's log ({self.log_path}) ---\n{self.tail()}")

    def _receive(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise self._fail(f"vLLM did not {doing} within {timeout_s:.0f} s ({self.what}); it is stopped. "
                                     f"See its log below; use backend=transformers to do without it") from None
                continue
            if line is None:
                try:
                    code = self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    code = "unknown"
                raise self._fail(f"vLLM exited (code {code}) before it could {doing} ({self.what}); its message is "
                                 f"below. Fix what it names (target=, dtype=, memory: VLLM_CPU_KVCACHE_SPACE in GiB "
                                 f"on a CPU), or use backend=transformers")
            message = json.loads(line)
            if "error" in message:
                raise self._fail(f"vLLM could not {doing} ({self.what}): {message['error']}. Fix what it names "
                                 f"(target=, dtype=, memory: VLLM_CPU_KVCACHE_SPACE in GiB on a CPU), or use "
                                 f"backend=transformers")
            return message

    def request(self, message: dict, timeout_s: float) -> dict:
        """Send one request and wait (at most timeout_s) for its answer."""
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: _receive reports why
        return self._receive(timeout_s, "generate")

    def close(self) -> None:
        """Let an idle worker exit (it does once its stdin closes); else (a run interrupted mid-request) end its
        whole session."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def engine_settings(cfg: DataConfig, device, dtype: str, prefill_model_loaded: bool, procs: Processes | None = None,
                     states_dir: Path | None = None, extracted_layers: list[int] | None = None) -> tuple[dict, dict]:
    """vllm.LLM's keyword arguments and the worker's environment for this run (this process's engine)."""
    procs = procs or Processes()
    args = {"model": resolve_path(cfg.target), "dtype": dtype, "seed": cfg.seed, "max_num_seqs": cfg.batch_size}
    # What vLLM reads of this environment (vllm_env.child_env): not specdec's venv paths, no credentials of other
    # services, and not the launcher's rank variables (each process's engine is a world of its own).
    env = child_env(settings={"SPECDEC_VLLM_PARENT": str(os.getpid())})
    engine_devices = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if engine_devices > 1:  # a target sharded over several devices: vLLM's own worker per shard
        args.update(tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size)
    if device.type == "cpu":
        _cpu_settings(args, env, procs, engine_devices)
    elif device.type == "cuda":
        if procs.count > 1 or engine_devices > 1:  # this process's GPUs only, as the engine's cuda:0, 1, ...
            env["CUDA_VISIBLE_DEVICES"] = ",".join(_engine_gpus(device, procs, engine_devices))
        if prefill_model_loaded or torch.cuda.is_initialized():
            # Leave the prefill model (and this process's CUDA context, under a launch) their room.
            free, total = torch.cuda.mem_get_info(device)
            args["gpu_memory_utilization"] = round(0.9 * free / total, 3)
    if extracted_layers is not None:
        args["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {
                                          "eagle_aux_hidden_state_layer_ids": extracted_layers}}}
        args["kv_transfer_config"] = {"kv_connector": "SpecdecHiddenStatesConnector",
                                      "kv_connector_module_path": "vllm_worker", "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": str(states_dir),
                                                                    "use_synchronization_lock": False}}
    args.update(cfg.vllm_args or {})
    return args, env


def _cpu_settings(args: dict, env: dict, procs: Processes, engine_devices: int) -> None:
    """vLLM on a CPU: one process (it starts faster than with vLLM's default engine process) and a KV cache of a set
    size (vLLM's CPU default is a share of the machine's memory); a sharded target (engine_devices > 1) gets a
    worker process per shard, each on its own part of this process's cores."""
    args["distributed_executor_backend"] = "uni" if engine_devices == 1 else "mp"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    if procs.count == 1 and engine_devices == 1:
        return
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    cpus = cpu_share(procs.index, procs.count, bind) if procs.count > 1 else \
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < engine_devices:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {engine_devices} CPU workers need a core "
                         f"each, but this process has {len(cpus)}; lower them or launch fewer processes")
    # The in-process engine runs on the cores the worker pins itself to, with one OpenMP thread each;
    # VLLM_CPU_OMP_THREADS_BIND is the same list for vLLM's own worker processes, one part per shard ("|").
    parts = [cpus[i::engine_devices] for i in range(engine_devices)]
    env.update(SPECDEC_VLLM_CPUS=",".join(map(str, cpus)), OMP_NUM_THREADS=str(len(parts[0])),
               VLLM_CPU_OMP_THREADS_BIND="|".join(",".join(map(str, part)) for part in parts))


def _engine_gpus(device, procs: Processes, engine_devices: int) -> list[str]:
    """The GPUs of this process's engine: its own one, or (a sharded target) the process's block of
    engine_devices GPUs; ValueError when there are not that many."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if engine_devices == 1:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [gpus[index] if visible else str(index)]
    first = procs.index * engine_devices
    if first + engine_devices > len(gpus):
        raise ValueError(f"{procs.count} process(es) x tensor_parallel_size x pipeline_parallel_size = "
                         f"{procs.count * engine_devices} GPUs, but {len(gpus)} are visible; launch "
                         f"{max(len(gpus) // engine_devices, 1)} process(es) or lower the parallel sizes")
    return gpus[first: first + engine_devices]


def cpu_share(index: int, count: int, bind: str | None) -> list[int]:
    """Process `index`'s CPUs of `count` processes on this machine: its part of a '|'-separated
    VLLM_CPU_OMP_THREADS_BIND (e.g. "0-15|16-31"), else an even split of the CPUs this process may use."""
    if bind and bind not in ("auto", "nobind") and len(bind.split("|")) == count:
        cpus = []
        for part in bind.split("|")[index].split(","):
            first, _, last = part.partition("-")
            cpus += list(range(int(first), int(last or first) + 1))
        return cpus
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if len(allowed) < count:
        return [allowed[index % len(allowed)]]
    return allowed[index * len(allowed) // count: (index + 1) * len(allowed) // count]
