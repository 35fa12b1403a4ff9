"""`specdec publish`: export a draft as a plain Hugging Face checkpoint with a model card (and push it).

    specdec publish --draft runs/draft --out runs/published --report runs/eval/report.json
    specdec publish --draft runs/draft --out runs/published --full-vocab-head        # reduced draft -> stock engines
    specdec publish --config recipes/smollm2-135m.yaml --push-to-hub me/smollm2-135m-draft --private

The output folder holds safetensors weights, config, tokenizer and README.md. A plain draft loads with
`AutoModelForCausalLM.from_pretrained` and serves as a draft in transformers (`assistant_model=`), vLLM
(`speculative_config={"model": OUT, "method": "draft_model", ...}`) and SGLang (`--speculative-algorithm
STANDALONE`); its reduced-vocabulary head is exported with its id map (specdec only) unless
`full_vocab_head=true` expands it to the full vocabulary (see `expand_head`). Every other kind of draft is written
by its kind (specdec/draft_kind.py) in one of its layouts (`format=`): an EAGLE-3 draft in the layout vLLM
(`"method": "eagle3"`) and SGLang (`--speculative-algorithm EAGLE3`) both load, or speculators', its reduced
vocabulary as the engines' d2t (specdec/eagle3/formats.py). OUT is written to a temporary folder and renamed.

OUT may be replaced only when it is empty or an earlier export (it holds specdec_publish.json), with
overwrite=true for the latter; never a home folder, the current folder or a folder above either
(specdec/overwrite.py). Its files are 0644 and its folders 0755, and nothing in it names a local absolute path:
a local path is written relative to the current folder when it lies inside it, else as its last part. (One
exception, not pushed: the speculators layout's verifier, a local target's path, which its loaders open.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch

import specdec
from specdec import draft_registry, models, vocab
from specdec.cli import command_help
from specdec.compat import check_compatible
from specdec.config import config_from_cli, read_recipe, split_cli, wants_help
from specdec.draft_kind import DraftKind, PublishContext
from specdec.overwrite import check_replaceable, replace_folder_atomically, set_modes, temp_sibling
from specdec.train.model_card import LEAK_WARNING, CardInfo, num_draft_tokens, render_card, traffic_facts

log = logging.getLogger(__name__)

# The embedded default target is this Hub model; stock engines and the card's metadata name it so.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROVENANCE_FILE = "specdec_publish.json"  # what was exported from where, and the expanded head's check
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Sample text for checking an expanded head on realistic hidden states (any tokenizer encodes it).
_SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Explain how a speculative decoder verifies the tokens that a small draft model proposes.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea, then list three facts about water.",
)


@dataclasses.dataclass
class PublishConfig:
    """Options of `specdec publish` (recipe section `publish:`)."""

    draft: str = ""  # the trained draft's checkpoint folder
    out: str = ""  # the folder to write (new or empty; an earlier export with overwrite=true)
    report: str | None = None  # `specdec eval` report.json whose figures go into the card
    target: str | None = None  # the target the draft was aligned to (default: the report's target)
    recipe: str | None = None  # recipe named in the card (default: the --config path)
    data: str | None = None  # training data described in the card (default: the recipe's data section)
    push_to_hub: str | None = None  # Hub repo id to upload OUT to
    private: bool = False  # create the Hub repo private
    full_vocab_head: bool = False  # expand a reduced-vocabulary head so stock engines load the draft
    license: str = "apache-2.0"  # the card's license: match the target's
    overwrite: bool = False  # replace an earlier export in OUT (a folder holding specdec_publish.json)
    dtype: str = "auto"  # export dtype; auto keeps the checkpoint's own
    # The layout, one of the draft kind's (specdec/draft_kind.py: formats). An EAGLE-3 draft's: engines (what vLLM
    # `"method": "eagle3"` and SGLang `EAGLE3` load) or speculators (vLLM speculators' own format: `vllm serve OUT`
    # detects it, speculators' Eagle3DraftModel loads it); a plain draft's: engines (a transformers checkpoint).
    format: str = "engines"

    def __post_init__(self) -> None:
        if not self.draft:
            raise ValueError("publish needs the draft checkpoint: --draft DIR (a folder written by specdec train)")
        if not self.out:
            raise ValueError("publish needs an output folder: --out DIR")
        if not self.license or not self.license.strip():
            raise ValueError("license must be a Hub license id such as apache-2.0, mit or other")
        if self.dtype != "auto":
            models.resolve_dtype(self.dtype)  # raises with the valid names
        known = sorted({f for name in draft_registry.names() for f in draft_registry.get(name).formats})
        if self.format not in known:
            raise ValueError(f"format must be one of {', '.join(known)}, got {self.format!r}")
        if self.push_to_hub is not None:
            from huggingface_hub.utils import validate_repo_id

            try:
                validate_repo_id(self.push_to_hub)
            except ValueError as err:
                raise ValueError(f"push_to_hub={self.push_to_hub!r} is not a Hub repo id (owner/name): {err}") from err


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def _read_report(path: str | None) -> dict | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"report {file} does not exist; write one with `specdec eval ... --out DIR` (DIR/report.json)")
    try:
        report = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"report {file} is not valid JSON ({err}); pass the report.json written by specdec eval") from err
    if not isinstance(report, dict):
        raise ValueError(f"report {file} must hold a JSON object (the report.json written by specdec eval)")
    return report


def _checkpoint_dtype(folder: Path) -> torch.dtype:
    """The dtype a checkpoint was saved in (float32 when its config does not say)."""
    config = json.loads((folder / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return models.resolve_dtype(name)


def _base_model(target: str) -> str | None:
    """The target's Hub id for the card's metadata, or None for a local checkpoint."""
    if models.is_embedded(target):
        return EMBEDDED_HUB_ID
    parts = target.split("/")
    if len(parts) == 2 and all(parts) and not Path(target).expanduser().exists() and not target.startswith("."):
        return target
    return None


def _hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states (what the LM head reads) for a batch of ids.  [T, H]"""
    backbone = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        hidden = backbone(input_ids=input_ids.to(model.device)).last_hidden_state  # [B, T, H]
    return hidden.reshape(-1, hidden.shape[-1])


def expand_head(model, anchor_fraction: float = 0.01, centroid_weight: float = 0.05, calibration_tokens: int = 256,
                seed: int = 0) -> torch.Tensor:
    """Replace a reduced LM head by a full-vocabulary one that stock engines load; returns the kept ids [N].

    Kept ids keep their rows. Llama heads have no bias, so a dropped id cannot get a -inf logit; instead every
    dropped row is the same "anchor", a convex combination of kept rows: mostly the mean of the kept rows whose
    logits are lowest on average over the draft's own hidden states (random kept-id sequences, seeded), plus
    `centroid_weight` of the mean of all kept rows. Its logit is a weighted mean of kept logits, so it is
    strictly below the best kept logit unless every kept logit is equal: greedy proposals are unchanged.
    Picking the lowest-scoring rows makes the dropped ids' probability tiny (measured by `check_expansion`).
    """
    keep = vocab.draft_to_target_map(model)
    if keep is None:
        raise ValueError("expand_head needs a reduced-vocabulary draft (one with a draft_to_target id map)")
    keep = keep.long().cpu()
    full_vocab = model.get_input_embeddings().num_embeddings
    if keep.numel() < 2:
        raise ValueError("a reduced head with a single id cannot be expanded (its anchor would tie with that id)")
    head = model.get_output_embeddings()
    weight = head.weight.detach()  # [N, H]
    g = torch.Generator().manual_seed(seed)
    width = min(64, calibration_tokens)
    rows = max(1, calibration_tokens // width)
    ids = keep[torch.randint(0, keep.numel(), (rows, width), generator=g)]
    hidden = _hidden_states(model, ids).float()  # [T, H]
    mean_logit = (hidden @ weight.float().T).mean(0)  # [N]
    num_anchor = min(keep.numel(), max(2, int(anchor_fraction * keep.numel())))
    lowest = weight.float()[mean_logit.argsort()[:num_anchor].to(weight.device)].mean(0)  # [H]
    # A little of every kept row makes the anchor's logit strictly below the best kept logit even where the
    # lowest rows win or are duplicates (untrained tokens often share one row): no argmax tie to lose.
    anchor = (1.0 - centroid_weight) * lowest + centroid_weight * weight.float().mean(0)  # [H]
    new = torch.nn.Linear(weight.shape[1], full_vocab, bias=False).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(anchor.to(weight.dtype).expand(full_vocab, -1))
        new.weight[keep.to(weight.device)] = weight
    model.set_output_embeddings(new)
    model.config.vocab_size = full_vocab
    if hasattr(model.config, vocab.CONFIG_KEY):
        delattr(model.config, vocab.CONFIG_KEY)
    del model.draft_to_target
    return keep


def check_expansion(model, reduced_weight: torch.Tensor, keep: torch.Tensor, input_ids: torch.Tensor) -> dict:
    """Check an expanded head against the reduced head it came from, on the hidden states of `input_ids` [B, T].

    greedy_agreement: the kept rows are the reduced rows verbatim and, at every position, the best dropped id
    scores strictly below the best kept id (so the argmax is the reduced head's pick). Both sides come from one
    float32 matmul, so kernel rounding cannot fake a disagreement. Also returns the smallest such logit gap
    (min_margin) and the probability mass on dropped ids (max and median over positions).
    """
    weight = model.get_output_embeddings().weight.detach()
    hidden = _hidden_states(model, input_ids).float()  # [T, H]
    full = hidden @ weight.float().T  # [T, V]
    keep = keep.to(full.device)
    dropped = torch.ones(full.shape[-1], dtype=torch.bool, device=full.device)
    dropped[keep] = False
    margin = full[:, keep].max(-1).values - full[:, dropped].max(-1).values  # [T]
    mass = full.softmax(-1)[:, dropped].sum(-1)  # [T]
    copied = torch.equal(weight[keep.to(weight.device)], reduced_weight.to(weight.device, weight.dtype))
    return {
        "positions": int(hidden.shape[0]),
        "greedy_agreement": bool(copied and (margin > 0).all()),
        "min_margin": float(margin.min()),
        "max_dropped_mass": float(mass.max()),
        "median_dropped_mass": float(mass.median()),
    }


def _sample_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    """The sample texts as one right-padded batch of ids [B, T] (pad with the last id; hidden states only)."""
    rows = [tokenizer(text)["input_ids"] for text in _SAMPLE_TEXTS]
    rows = [[i for i in row if 0 <= i < vocab_size] for row in rows]
    rows = [row for row in rows if row]
    width = max(len(row) for row in rows)
    # Causal attention: padding after a row's end never changes that row's earlier positions; checking the
    # padded positions too is harmless (they are just more hidden states).
    return torch.tensor([row + [row[-1]] * (width - len(row)) for row in rows])


def _recipe_data(recipe: str | None) -> str | None:
    """A one-line description of a recipe's data section, for the card."""
    if recipe is None or not Path(recipe).is_file():
        return None
    section = read_recipe(recipe).get("data") or {}
    items = [f"{key}={value}" for key, value in section.items() if isinstance(value, (str, int, float, bool))]
    return ", ".join(items) or None


def _load_tokenizer(draft_dir: Path, target: str | None):
    if _has_tokenizer(draft_dir):
        return models.load_tokenizer(str(draft_dir))
    if target is None:
        raise ValueError(
            f"{draft_dir} has no tokenizer and no target was named to take it from; pass --target "
            "(the target's Hub id, local folder or embedded alias) or save the tokenizer into the draft folder"
        )
    try:
        return models.load_tokenizer(target)
    except ValueError as err:
        raise ValueError(
            f"{draft_dir} has no tokenizer, and the target's could not be loaded either ({err}); save the "
            "target's tokenizer into the draft folder or pass a reachable --target"
        ) from err


def _check_target_tokenizer(tokenizer, target: str) -> None:
    """When the target's tokenizer is at hand (local or embedded), the draft's must match it exactly."""
    if not (models.is_embedded(target) or Path(target).expanduser().is_dir()):
        return  # a Hub id: not fetched just for this check
    if not _has_tokenizer(Path(target).expanduser()) and not models.is_embedded(target):
        return
    check_compatible(models.load_tokenizer(target), tokenizer)


def _check_paths(draft_dir: Path, given_out: str, overwrite: bool) -> None:
    """The draft is a checkpoint; OUT (as the user wrote it) is new, empty, or an earlier export to overwrite."""
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"--draft {draft_dir} is not a checkpoint folder (no config.json); pass the folder "
                         "specdec train wrote")
    out = Path(given_out).expanduser()
    d, o = draft_dir.resolve(), out.resolve()
    if o == d or o in d.parents:
        raise ValueError(f"--out {out} would contain or replace the draft {draft_dir}; choose another folder")
    check_replaceable(given_out, (PROVENANCE_FILE,), "--out")  # a home folder, the current folder, foreign files
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} holds an earlier export; pass overwrite=true to replace it, or choose a "
                         "new folder")


def _fill_generation_config(model, tokenizer) -> None:
    """Special-token ids the engines read from generation_config.json, taken from the tokenizer when unset."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(gen, name, getattr(tokenizer, name))


# An absolute local path inside a text: at its start or after a space, quote, bracket, `=`, `:` or `,` (a URL's
# `//` and a ratio's `tok/s` are not), starting with `/` or `~/` and a name character.
_LOCAL_PATH = re.compile(r"(?:^|(?<=[\s\"'=(\[{,:]))(~?/[\w.@+-][^\s\"',;:)\]}]*)")


def public_path(value: str) -> str:
    """A local absolute path as the published folder may name it: relative to the current folder when inside
    it (runs/draft), else its last part; anything else (a Hub id, a relative path) unchanged."""
    path = Path(value).expanduser()
    if not value.startswith(("/", "~")) or not path.is_absolute():
        return value
    cwd = Path.cwd()
    for candidate in (path, path.resolve()):
        if candidate.is_relative_to(cwd):
            return str(candidate.relative_to(cwd)) or "."
    return path.name or value


def scrub_paths(value):
    """`value` (a report: dicts, lists, strings) with every absolute local path in its strings made public."""
    if isinstance(value, dict):
        return {key: scrub_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [scrub_paths(item) for item in value]
    if isinstance(value, str):
        return _LOCAL_PATH.sub(lambda m: public_path(m.group(1)), value)
    return value


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Upload `folder` to the Hub model repo `repo_id` (created when missing); returns the repo URL."""
    from huggingface_hub import HfApi

    hint = (f"The export in {folder} is complete and untouched: check the network and your login "
            f"(`hf auth login` or HF_TOKEN), then retry with: hf upload {repo_id} {folder}")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set. {hint}")
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                          commit_message="Upload draft model (specdec publish)")
    except Exception as err:  # network, auth and HTTP errors all end the same way: OUT stays, retry later
        raise ValueError(f"could not push to the Hub repo {repo_id}: {type(err).__name__}: {err}. {hint}") from err
    return str(url)


def publish(cfg: PublishConfig) -> Path:
    """Export `cfg.draft` to `cfg.out` as a plain HF checkpoint with README.md; push it when asked. Returns OUT."""
    draft_dir, out = Path(cfg.draft).expanduser(), Path(cfg.out).expanduser()
    _check_paths(draft_dir, cfg.out, cfg.overwrite)
    report = _read_report(cfg.report)
    target = _target_of(cfg, report)
    report = scrub_paths(report)  # the card's figures and the copied report name no local folder
    tokenizer = _load_tokenizer(draft_dir, target)
    _check_target_tokenizer(tokenizer, target)
    dtype = _checkpoint_dtype(draft_dir) if cfg.dtype == "auto" else models.resolve_dtype(cfg.dtype)
    log.info("loading draft %s (%s)", draft_dir, dtype)
    model = models.load_model(str(draft_dir), dtype=dtype, device="cpu")
    kind = draft_registry.of_model(model)  # its engine method, layouts and card facts
    head, num_kept, expansion = _prepare_head(cfg, model, tokenizer, kind)
    save_options = _save_options(cfg, kind, target, report)
    _fill_generation_config(model, tokenizer)
    info = _card_info(cfg, out, model, target, dtype, (head, num_kept, expansion), kind)
    provenance = {"source": public_path(str(draft_dir)), "target": public_path(target), "recipe": info.recipe, "data": info.data,
                  "head": head, "draft_vocab_size": num_kept, "expansion": expansion,
                  "specdec_version": specdec.__version__}
    _write_folder(out, model, tokenizer, save_options, render_card(info, report), report, provenance)
    log.info("published %s (%s head) to %s", draft_dir, head, out)
    if cfg.push_to_hub:
        url = push_to_hub(out, cfg.push_to_hub, cfg.private)
        log.info("pushed %s to %s", out, url)
    return out


def _target_of(cfg: PublishConfig, report: dict | None) -> str:
    """--target, else the target the report measured."""
    report_target = (report.get("config") or {}).get("target") if report else None
    target = cfg.target or report_target
    if target is None:
        raise ValueError("name the target the draft was aligned to: --target ID_OR_PATH (or pass --report "
                         "report.json from specdec eval, which records it)")
    if cfg.target and report_target and cfg.target != report_target:
        log.warning("the report measured target %s but --target is %s: the card will state %s",
                    report_target, cfg.target, cfg.target)
    return target


def _prepare_head(cfg: PublishConfig, model, tokenizer, kind: DraftKind) -> tuple[str, int | None, dict | None]:
    """The head to publish: full, reduced (with its id map) or expanded from a reduced one (--full-vocab-head,
    checked to keep greedy proposals; not for a kind whose engines read its reduced vocabulary themselves).
    Returns (head, kept ids or None, the expansion's check or None)."""
    keep = vocab.draft_to_target_map(model)
    num_kept = None if keep is None else int(keep.numel())
    if keep is not None and cfg.full_vocab_head and not kind.maps_vocabulary:
        reduced_weight = model.get_output_embeddings().weight.detach().clone()
        keep = expand_head(model)
        expansion = check_expansion(model, reduced_weight, keep, _sample_ids(tokenizer, model.config.vocab_size))
        if not expansion["greedy_agreement"]:
            raise RuntimeError(f"expanded head disagrees with the reduced one under greedy decoding: {expansion}")
        log.info("expanded the reduced head (%d ids) to %d rows: %s", num_kept, model.config.vocab_size, expansion)
        if expansion["max_dropped_mass"] > LEAK_WARNING:
            log.warning("the expanded head puts up to %.2g of the probability on dropped ids: greedy proposals are "
                        "unchanged, sampled ones may be accepted less often (noted in the card)",
                        expansion["max_dropped_mass"])
        return "expanded", num_kept, expansion
    if cfg.full_vocab_head:
        log.info("full_vocab_head changes nothing here: %s", "the draft's head is already full" if keep is None
                 else f"the engines map this {kind.name} draft's {num_kept} ids themselves")
    elif keep is not None and not kind.maps_vocabulary:
        log.warning("exporting the reduced head (%d ids) with its id map: only specdec loads it; pass "
                    "--full-vocab-head for transformers, vLLM and SGLang", num_kept)
    return ("full" if keep is None else "reduced"), num_kept, None


def _save_options(cfg: PublishConfig, kind: DraftKind, target: str, report: dict | None) -> dict:
    """models.save_model's options: the kind's layout `cfg.format` and what a layout may name (the verifier)."""
    if cfg.format not in kind.formats:
        raise ValueError(f"format={cfg.format} is not a layout of {kind.name} drafts ({', '.join(kind.formats)}): "
                         "drop format= to publish the default")

    def verifier() -> str:  # resolving the embedded target converts it: only when a layout names it
        hub_id = _base_model(target)
        if hub_id is not None:
            return hub_id
        # A local target: the loaders (speculators, `vllm serve OUT`) open the verifier from this path, so the
        # folder keeps it whole; pushed, it is the folder's name, and the loader must be told the target's Hub id.
        local = str(Path(models.resolve_path(target)).resolve())
        if not cfg.push_to_hub:
            return local
        log.warning("the %s layout names its verifier, the local target %s, as %r on the Hub: set "
                    "verifier.name_or_path in config.json to the target's Hub id", cfg.format, target, public_path(local))
        return public_path(local)

    return {"format": cfg.format, "context": PublishContext(verifier, num_draft_tokens(report))}


def _card_info(cfg: PublishConfig, out: Path, model, target: str, dtype, head_facts: tuple, kind: DraftKind) -> CardInfo:
    """The card's facts: the checkpoint's, the head's (head, kept ids, expansion check) and the kind's."""
    head, num_kept, expansion = head_facts
    return CardInfo(
        name=cfg.push_to_hub or out.resolve().name, model_ref=cfg.push_to_hub or public_path(str(out.absolute())),
        target=public_path(target), target_ref=_base_model(target) or public_path(target),
        base_model=_base_model(target),
        architecture=(model.config.architectures or [type(model).__name__])[0],
        num_layers=int(model.config.num_hidden_layers), hidden_size=int(model.config.hidden_size),
        num_parameters=sum(p.numel() for p in model.parameters()), dtype=str(dtype).removeprefix("torch."),
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        head=head, draft_vocab_size=num_kept, expansion=expansion,
        recipe=cfg.recipe and public_path(cfg.recipe), data=scrub_paths(cfg.data or _recipe_data(cfg.recipe)),
        traffic=traffic_facts(read_recipe(cfg.recipe).get("data")
                              if cfg.recipe and Path(cfg.recipe).is_file() else None),
        license=cfg.license.strip(),
        model_on_hub=cfg.push_to_hub is not None, format=cfg.format,
        kind=kind.name, method=kind.vllm_method, sglang_algorithm=kind.sglang_algorithm,
        engines_map_vocabulary=kind.maps_vocabulary, kind_facts=kind.card_facts(model),
    )


def _write_folder(out: Path, model, tokenizer, save_options: dict, card: str, report: dict | None,
                  provenance: dict) -> None:
    """Everything into a temporary folder beside OUT, then swapped in: a failed export leaves OUT as it was."""
    tmp = temp_sibling(out)
    try:
        models.save_model(model, tokenizer, tmp, **save_options)  # weights, config, tokenizer (+ a plain id map)
        (tmp / "README.md").write_text(card)
        if report is not None:
            (tmp / "specdec_eval_report.json").write_text(json.dumps(report, indent=2))
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
        set_modes(tmp)  # 0755 / 0644 as any model folder, whatever the umask
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # OUT is untouched
        if isinstance(err, OSError):  # a full disk, a read-only folder: say where, not a traceback
            raise ValueError(f"could not write the export beside --out {out} ({err}); nothing changed there: "
                             "check free space and permissions, then retry") from err
        raise
    replace_folder_atomically(tmp, out)  # which deletes tmp itself if the swap fails


def main(argv: list[str]) -> int:
    """`specdec publish [--config R] --draft DIR --out OUT [--report R] [--push-to-hub REPO [--private]]`."""
    if wants_help(argv):
        print(command_help("publish"))
        return 0
    cfg = config_from_cli(PublishConfig, argv, section="publish")
    recipe_path = split_cli(argv, PublishConfig)[0]
    if cfg.recipe is None and recipe_path is not None:
        cfg = dataclasses.replace(cfg, recipe=recipe_path)
    out = publish(cfg)
    print(out)
    return 0

