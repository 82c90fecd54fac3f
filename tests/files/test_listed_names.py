"""A file name that one file lists for its directory is read only inside that directory: a
Hugging Face index whose weight_map names a shard by an absolute path or one above the model's
directory, a checksum manifest naming a file above the checkpoint, and a tokenizer auto_map
naming a module above the model are each refused, naming the file, the field and the name,
even where the file named exists. (torch.distributed.checkpoint's index: test_plain_data.py.)"""

from __future__ import annotations

import json
import zlib

import pytest

from megatron_rl.files.checksums import MANIFEST, record_checksums, verify_checksums
from megatron_rl.files.hf_checkpoint import INDEX_NAME, HFCheckpoint, tokenizer_code_files
from megatron_rl.files.listed_names import listed_path


@pytest.mark.parametrize("name", ["a", "a/b.safetensors", "./a", "a/../b", "..a", "a/.."], ids=repr)
def test_names_inside_the_directory_are_joined(tmp_path, name):
    assert listed_path(tmp_path, name, tmp_path / "index.json", "files") == tmp_path / name


@pytest.mark.parametrize("name", ["..", "../x", "a/../../x", "/etc/passwd", "//x"], ids=repr)
def test_names_outside_the_directory_are_refused(tmp_path, name):
    listed_in = tmp_path / "index.json"
    with pytest.raises(ValueError) as refused:
        listed_path(tmp_path, name, listed_in, "files")
    assert str(refused.value) == (
        f"{listed_in}: files lists {name!r}, which is outside {tmp_path}; refused (a name listed "
        "there must be a file inside that directory)"
    )


@pytest.mark.parametrize("name", ["", None, 3], ids=repr)
def test_what_is_not_a_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=rf"files lists {name!r}, which is not a file name"):
        listed_path(tmp_path, name, tmp_path / "index.json", "files")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "OUTSIDE"], ids=["dotdot", "absolute"])
def test_a_hugging_face_index_naming_a_shard_outside_the_model_is_refused(tmp_path, shard):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"")  # it exists: only its place is wrong
    shard = str(outside) if shard == "OUTSIDE" else shard
    weight_map = {"a.weight": "model-00001.safetensors", "b.weight": shard}
    (model / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    (model / "model-00001.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as refused:
        HFCheckpoint(model)
    assert str(refused.value).startswith(
        f"{model / INDEX_NAME}: weight_map lists {shard!r}, which is outside {model}; refused"
    )


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainer.json").write_text('{"step": 1}\n')
    record_checksums(ckpt, {})
    outside = tmp_path / "x"
    outside.write_bytes(b"outside")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    # the outside file's true checksum: read, it would pass
    manifest["files"]["../x"] = {"size": 7, "crc32": f"{zlib.crc32(b'outside'):08x}"}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as refused:
        verify_checksums(ckpt)
    assert str(refused.value).startswith(
        f"{ckpt / MANIFEST}: files lists '../x', which is outside {ckpt}; refused"
    )


def test_a_tokenizer_module_outside_the_model_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "evil.py").write_text("")
    config = {"auto_map": {"AutoTokenizer": ["../evil.Tokenizer", None]}}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: auto_map lists '\.\./evil\.py'"):
        tokenizer_code_files(model)
