"""The serving engines' commands a model card's usage section shows (train/kinds/: each kind's `card_usage`)."""

from __future__ import annotations


def vllm_lines(target: str, vllm_config: str, q) -> list[str]:
    """vLLM's offline API (7 lines) then `vllm serve`, both with this speculative config; `q` quotes a string."""
    return [
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f"llm = LLM(model={q(target)}, speculative_config={vllm_config})",
        'print(llm.generate(["Hello!"], SamplingParams(temperature=0, max_tokens=128))[0].outputs[0].text)',
        "```",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{vllm_config}'",
        "```",
        "",
    ]


def sglang_lines(target: str, draft: str, algorithm: str, k: int) -> list[str]:
    """SGLang's server with this draft as a chain of k proposals."""
    return [
        "```bash",
        f"python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm {algorithm} --speculative-draft-model-path {draft} \\",
        f"    --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
        "```",
    ]
