"""The data stage's vLLM worker, run by the Python of vLLM's own environment (never imported by specdec).

    <vLLM's python> train/vllm_worker.py '{"model": "/path/to/target", "dtype": "float32", "seed": 0}'

Standalone on purpose (stdlib + vllm only): vLLM pins its own torch and transformers, so specdec reaches it across
a process boundary (specdec/vllm_env.py). `VLLMBackend` (train/data/backend_vllm.py) starts it once per `specdec data`
run and speaks JSON lines with it (train/data/vllm_client.py); the argument holds `vllm.LLM`'s keyword arguments.
stdout carries the protocol only (vLLM's logs and prints go to stderr):

    worker -> {"ready": true, "vllm": "0.32.0"}                     once the engine is up
    parent -> {"prompts": [[ids]], "seeds": [int], "temperature": t, "top_k": k, "top_p": p, "max_tokens": n,
               "top_logprobs": n, "stop_token_ids": [ids], "states": bool}
    worker -> {"completions": [{"tokens": [ids], "top_ids": [[ids]], "top_logprobs": [[floats]], "states": path}]}
    worker -> {"error": "..."}                                      instead, when something fails

With "states": true the engine runs with vLLM's `extract_hidden_states` speculative method (its speculative_config,
set by the parent) and `SpecdecHiddenStatesConnector` below as its KV connector: each request's hidden states at
every fed position (prompt + completion - 1) land in one safetensors file (`hidden_states` [T, layers, H],
`token_ids` [T]), whose path the answer gives once the file is complete. The parent reads and deletes it.

It exits when its stdin closes, and (Linux) when its parent dies. $SPECDEC_VLLM_CPUS (e.g. "0,1") pins it, and the
engine it runs in this process, to those CPUs: data-parallel processes on one CPU machine split its cores.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

CONNECTOR = "SpecdecHiddenStatesConnector"  # kv_transfer_config's kv_connector, in this module (kv_connector_module_path)
_STATES_TIMEOUT_S = 600.0  # for the last requests' files, written by the engine's steps after generate returns


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent exits (an orphaned engine would hold its memory)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    try:
        os.kill(parent, 0)  # the parent may have died before the request took effect
    except ProcessLookupError:
        print(f"specdec vllm worker: parent {parent} is gone; exiting", file=sys.stderr)
        sys.exit(1)
    except PermissionError:
        pass  # it exists


def _protocol_stream():
    """A private copy of stdout for the JSON lines; fd 1 then points at stderr, so library prints go there."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def _send(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _top(position: dict, n: int) -> tuple[list[int], list[float]]:
    """The n most likely tokens of one position (vLLM adds the sampled token when it ranks lower)."""
    best = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:n]
    return [int(t) for t, _ in best], [float(lp.logprob) for _, lp in best]


def _generate(llm, vllm, request: dict) -> list[dict]:
    """Completions of one request's prompts, in order; each prompt samples with its own seed."""
    n = int(request.get("top_logprobs", 0))
    states = bool(request.get("states"))
    # The connector keeps a request's states at its output tokens' positions too (all but the last token's).
    extra = {"kv_transfer_params": {"include_output_tokens": True}} if states else None
    params = [vllm.SamplingParams(
        n=1, temperature=request["temperature"], top_k=max(int(request["top_k"]), 0),
        top_p=request["top_p"], max_tokens=request["max_tokens"], seed=seed, logprobs=n or None,
        stop_token_ids=request.get("stop_token_ids") or None, detokenize=False, extra_args=extra)
        for seed in request["seeds"]]
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    completions = []
    for out in llm.generate(prompts, sampling_params=params, use_tqdm=False):
        seq = out.outputs[0]
        comp = {"tokens": [int(t) for t in seq.token_ids]}
        if n:
            tops = [_top(position, n) for position in seq.logprobs]
            comp["top_ids"], comp["top_logprobs"] = [t[0] for t in tops], [t[1] for t in tops]
        if states:
            comp["states"] = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not comp["states"]:
                raise RuntimeError("vLLM returned no hidden_states_path: is the engine running with the "
                                   "extract_hidden_states method and this module's connector?")
        completions.append(comp)
    if states:
        _wait_for_states(llm, [c["states"] for c in completions])
    return completions


def _wait_for_states(llm, paths: list[str]) -> None:
    """Until every file is written. The connector writes a request's states one engine step after it finishes, so
    the last ones come after generate returns: an engine in this process is stepped here; one in its own process
    (vLLM's default on a GPU) steps by itself while it holds finished requests' blocks."""
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    deadline = time.monotonic() + _STATES_TIMEOUT_S
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [p for p in paths if not os.path.exists(p)]
            raise RuntimeError(f"vLLM wrote no hidden states for {len(missing)} request(s) within "
                               f"{_STATES_TIMEOUT_S:.0f} s, e.g. {missing[0]}")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.005)


def __getattr__(name: str):
    """The connector class, built on first use (by vLLM's connector factory): this module imports vLLM lazily."""
    if name != CONNECTOR:
        raise AttributeError(name)
    cls = _connector_class()
    globals()[name] = cls
    return cls


def _connector_class():
    """vLLM's ExampleHiddenStatesConnector, made to write each file whole (under a temporary name, then renamed, so
    an existing file is a complete one: no lock files) and, on a CPU, to copy synchronously (its pinned memory
    and CUDA streams need a GPU)."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Done:
        @staticmethod
        def query() -> bool:
            return True

    class SpecdecHiddenStatesConnector(ExampleHiddenStatesConnector):
        @staticmethod
        def _write_tensors(tensors, event, filename, lock_fd) -> None:
            tmp = f"{filename}.tmp"
            ExampleHiddenStatesConnector._write_tensors(tensors, event, tmp, lock_fd)
            os.replace(tmp, filename)

        def _submit_async_write(self, pending) -> None:
            if self._kv_cache is None or self._kv_cache.is_cuda:
                return super()._submit_async_write(pending)
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size)
            states = extract_from_kv_cache(self._kv_cache, slots.flatten(), pending.token_ids.shape[0])
            tmp = f"{pending.filename}.tmp"
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
            self._req_copy_events[pending.req_id] = _Done()  # get_finished then frees the request's blocks

    return SpecdecHiddenStatesConnector


def _pin_cpus() -> None:
    """$SPECDEC_VLLM_CPUS: this process (and the engine in it) runs on these CPUs only."""
    cpus = os.environ.get("SPECDEC_VLLM_CPUS")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def main() -> int:
    """Start the engine, then answer one request per stdin line until stdin closes."""
    parent = int(os.environ.get("SPECDEC_VLLM_PARENT", os.getppid()))
    _die_with_parent(parent)
    _pin_cpus()  # before torch starts its threads
    stream = _protocol_stream()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "all"
    print(f"specdec vllm worker pid {os.getpid()} on cpus {cpus}", file=sys.stderr, flush=True)
    try:
        import vllm

        llm = vllm.LLM(**json.loads(sys.argv[1]))
    except BaseException as err:  # noqa: BLE001 - any start failure goes back to the parent, with the traceback
        traceback.print_exc()
        _send(stream, {"error": f"{type(err).__name__}: {err}"})
        return 1
    _send(stream, {"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            _send(stream, {"completions": _generate(llm, vllm, json.loads(line))})
        except Exception as err:  # noqa: BLE001 - reported to the parent, which stops the run
            traceback.print_exc()
            _send(stream, {"error": f"{type(err).__name__}: {err}"})
    return 0


if __name__ == "__main__":  # vLLM starts processes with spawn: creating the engine needs this guard
    sys.exit(main())
