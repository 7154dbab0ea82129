"""The embedded tiny checkpoint: deterministic bytes, real HF format, safe concurrent first use."""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading

import pytest

from epdq.models.tiny import SPECIAL_TOKENS, TinySpec, default_model_dir, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)


def digests(path: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m")


def test_two_builds_are_byte_identical(tiny, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again")
    assert digests(again) == digests(tiny)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(digests(tiny))


def test_refuses_to_overwrite_unless_asked(tiny):
    with pytest.raises(FileExistsError):
        write_tiny_checkpoint(tiny)


def test_overwrite_replaces_only_what_epdq_wrote(tmp_path):
    # `epdq make-model . --overwrite` in the wrong directory must not delete that directory
    precious = tmp_path / "project"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint epdq wrote"):
        write_tiny_checkpoint(precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    with pytest.raises(FileExistsError, match="not a directory"):
        write_tiny_checkpoint(a_file, overwrite=True)
    assert a_file.read_text() == "mine"
    # an empty directory and an earlier checkpoint are replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (write_tiny_checkpoint(empty, overwrite=True) / ".complete").is_file()
    again = write_tiny_checkpoint(empty, seed=1, overwrite=True)
    assert (again / ".complete").read_text() == "seed=1\n"


def test_make_model_cli_refuses_a_foreign_directory(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    (tmp_path / "keep.txt").write_text("mine")
    res = CliRunner().invoke(app, ["make-model", str(tmp_path), "--overwrite"])
    # a ConfigError: `epdq` (cli.main.main) prints it as one line and exits 2
    assert type(res.exception).__name__ == "ConfigError" and "refusing to replace it" in str(res.exception)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    res = CliRunner().invoke(app, ["make-model", "--seed", "3"])
    assert res.exit_code == 2 and "need OUT" in res.output, res.output
    res = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--seed", "-1"])  # was numpy's traceback
    assert res.exit_code == 2 and "--seed must be in [0, 2**63)" in res.output and not (tmp_path / "m").exists()


def test_config_token_ids_match_tokenizer(tiny):
    from transformers import AutoTokenizer

    config = json.loads((tiny / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == config["text_config"]["vocab_size"] == TinySpec().vocab_size
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    assert tok.eos_token == "<|im_end|>"
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(
        range(2048 - len(SPECIAL_TOKENS), 2048)
    )
    assert tok.decode(tok.encode("A red kite, 42 times.")) == "A red kite, 42 times."


def test_processor_loads_without_torchvision(tiny):
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny, trust_remote_code=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = proc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    out = proc(text=[prompt], images=[Image.new("RGB", (112, 112))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]  # 16 image tokens after the 2x2 merge
    with pytest.raises(ValueError):
        proc.video_processor([[Image.new("RGB", (56, 56))] * 2])


def test_default_model_dir_is_built_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("EPDQ_HOME", str(tmp_path / "home"))
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def call():
        try:
            results.append(default_model_dir())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 3 and len(set(results)) == 1
    path = results[0]
    assert path == tmp_path / "home" / "models" / "tiny-qwen2-vl-v1"
    # Only the finished checkpoint (plus the lock file) is left; no staging directories.
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny-qwen2-vl-v1.lock", "tiny-qwen2-vl-v1"]
    assert default_model_dir() == path
