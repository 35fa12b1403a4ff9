"""Target-generated distillation data: prompts -> the target's own completions (+ its top-n log-probs).

    specdec data --config recipes/smollm2-135m.yaml                      # one process
    python -m specdec.train.data prompts=my.jsonl target=HuggingFaceTB/SmolLM2-1.7B-Instruct output_dir=runs/data
    accelerate launch --multi_gpu --num_processes 4 -m specdec.train.data --config recipes/X.yaml  # shards split
    specdec data prompts=sharegpt.jsonl responses=dataset record_features=true eagle_aux_layer_ids=[2,15,27]

Prompts come from a local .jsonl/.json/.parquet/.csv file, a Hub dataset name, the embedded prompt set
(`embedded:train`, `embedded:heldout`: train/assets, rendered by train/prompt_templates.py), or `self:N`: N
requests the target writes itself (train/self_prompts.py).
Every row goes through `specdec.prompts.normalise_record`. With responses=dataset nothing is generated: each
assistant answer of a conversation (`messages`, ShareGPT `conversations`) becomes a row of the dataset's own tokens.

Output, resumable (rerun the same command after a crash; finished shards are kept):

    <output_dir>/manifest.json                 settings, prompt source, counts, shard list, complete flag
    <output_dir>/shards/shard-00000.parquet     prompt_id, category, sample_index, turn, input_ids (prompt +
                                                completion), prompt_length [, top_ids, top_logprobs]
    <output_dir>/shards/shard-00000.features.safetensors   with record_features=true: the target's states
                                                (specdec/eagle3/) at each row's fed positions, tensor
                                                "<row index>" [prompt + completion - 1, W] bfloat16, so an EAGLE-3
                                                draft trains with no target forward
    <output_dir>/vllm-worker.log               with backend=vllm: the engine's own log (of the latest run;
                                                vllm-worker-<i>.log per process under accelerate launch)

Backends: `transformers` (specdec's batched decoder, in this process) or `vllm`: vLLM's offline engine in its own
environment (`make vllm-env`), reached through train/vllm_worker.py (vllm_client.py), started once per run and kept across shards
(one engine per process under accelerate launch: its GPU, or its share of a CPU's cores). With record_features
vLLM's features come from its own forwards (its extract_hidden_states method, `vllm_states=extract`) or from one
batched transformers prefill over each prompt + completion (`prefill`), so the stored result has the same format
whichever backend made it. `auto` picks vllm where its environment exists.

The work list (prompt x sample, shuffled) is cut into shards of `shard_size` items; shard s belongs to
process s % num_processes. A shard is written to a temporary file and renamed, then recorded in the manifest,
so a shard is either complete and listed or absent/ignored: a rerun redoes exactly the missing ones. Its features
are written as each generation batch is done (to a spool beside it, assembled into its features file at the end),
so a process holds one batch's features, not a shard's.
Each shard samples from its own generator seeded by (seed, shard), so for a given batch_size and batch_tokens
the result does not depend on where a run was interrupted or on the number of processes (greedy data does not
depend on either, up to floating-point near-ties).

The package, one job a module (backend.py declares the interface every backend implements):

    config.py                DataConfig, and the settings a folder's fingerprint covers
    sources.py               prompt sources -> Prompt objects
    planning.py              the work list (prompt x sample items) and its fingerprint
    backend.py               Backend / GenerationBackend, Completion, the turn-by-turn loop of a shard
    backend_transformers.py  backend=transformers
    backend_vllm.py          backend=vllm (the states extracted by vLLM, or prefilled)
    vllm_client.py           the vLLM worker process and its engine settings
    backend_dataset.py       responses=dataset
    target_states.py         the target's recorded states: while decoding, or by a prefill
    features.py              a shard's features file (spooled as they come) and reading them back
    shards.py                shard and manifest files, loading a finished folder
    processes.py             this process's place under `accelerate launch`
    run_loop.py              the run: plan, deal the shards, make and record each
    cli.py                   `specdec data` / `python -m specdec.train.data`
"""


from specdec.train.data.backend import Backend, Completion, GenerationBackend
from specdec.train.data.backend_dataset import DatasetBackend
from specdec.train.data.backend_transformers import TransformersBackend
from specdec.train.data.backend_vllm import VLLMBackend, states_mode
from specdec.train.data.cli import main
from specdec.train.data.config import DataConfig
from specdec.train.data.features import FeatureSpool, features_file, recorded_features, write_features
from specdec.train.data.planning import conversation, plan_items
from specdec.train.data.run_loop import make_backend, run
from specdec.train.data.shards import load_generated, read_manifest, write_shard
from specdec.train.data.sources import load_prompt_set

__all__ = [
    "Backend", "Completion", "DataConfig", "DatasetBackend", "FeatureSpool", "GenerationBackend", "TransformersBackend",
    "VLLMBackend", "conversation", "features_file", "load_generated", "load_prompt_set", "main", "make_backend",
    "plan_items", "read_manifest", "recorded_features", "run", "states_mode", "write_features", "write_shard",
]
