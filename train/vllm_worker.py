"""The data stage's vLLM worker, run by the Python of vLLM's own environment (never imported by specdec).

    <vLLM's python> train/vllm_worker.py '{"model": "/path/to/target", "dtype": "float32", "seed": 0}'

Standalone on purpose (stdlib + vllm only): vLLM pins its own torch and transformers, so specdec reaches it across
a process boundary (specdec/vllm_env.py). `VLLMBackend` in train/data.py starts it once per `specdec data` run and
speaks JSON lines with it; the argument holds `vllm.LLM`'s keyword arguments. stdout carries the protocol only
(vLLM's logs and prints go to stderr):

    worker -> {"ready": true, "vllm": "0.32.0"}                     once the engine is up
    parent -> {"prompts": [[ids]], "seeds": [int], "temperature": t, "top_k": k, "top_p": p, "max_tokens": n,
               "top_logprobs": n, "stop_token_ids": [ids]}
    worker -> {"completions": [{"tokens": [ids], "top_ids": [[ids]], "top_logprobs": [[floats]]}]}  in order
    worker -> {"error": "..."}                                      instead, when something fails

It exits when its stdin closes, and (Linux) when its parent dies.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback


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
    params = [vllm.SamplingParams(
        n=1, temperature=request["temperature"], top_k=max(int(request["top_k"]), 0),
        top_p=request["top_p"], max_tokens=request["max_tokens"], seed=seed, logprobs=n or None,
        stop_token_ids=request.get("stop_token_ids") or None, detokenize=False)
        for seed in request["seeds"]]
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    completions = []
    for out in llm.generate(prompts, sampling_params=params, use_tqdm=False):
        seq = out.outputs[0]
        comp = {"tokens": [int(t) for t in seq.token_ids]}
        if n:
            tops = [_top(position, n) for position in seq.logprobs]
            comp["top_ids"], comp["top_logprobs"] = [t[0] for t in tops], [t[1] for t in tops]
        completions.append(comp)
    return completions


def main() -> int:
    """Start the engine, then answer one request per stdin line until stdin closes."""
    parent = int(os.environ.get("SPECDEC_VLLM_PARENT", os.getppid()))
    _die_with_parent(parent)
    stream = _protocol_stream()
    print(f"specdec vllm worker pid {os.getpid()}", file=sys.stderr, flush=True)
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
