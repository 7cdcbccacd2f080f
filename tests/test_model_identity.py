"""A known model is found by its file's content, not its name: the same GGUF loaded by a path under another name gets
the catalog's model id, so its bundled head, its calibration and its results' name."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from selfspec.config import ModelConfig
from selfspec.models import catalog
from selfspec.models.loading import (
    DEFAULT_GGUF_SHA256,
    DEFAULT_GGUF_SIZE,
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    model_id_of,
)


def test_identify_matches_by_size_then_digest_and_reads_a_file_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    body = b"gguf-bytes" * 100
    known = (("Known-Model", len(body), hashlib.sha256(body).hexdigest()),)
    same = tmp_path / "renamed.gguf"
    same.write_bytes(body)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x" * len(body))  # the known size, other bytes
    short = tmp_path / "short.gguf"
    short.write_bytes(body[:-1])
    assert catalog.identify(same, known) == "Known-Model"
    assert catalog.identify(other, known) is None and catalog.identify(short, known) is None
    assert catalog.identify(tmp_path / "missing.gguf", known) is None
    assert len(list((tmp_path / "cache" / "identity").iterdir())) == 2  # the two files of the known size, hashed
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
    assert catalog.identify(same, known) == "Known-Model" and reads == []  # the kept digest, no read
    same.write_bytes(b"y" * len(body))  # changed in place: hashed again, no longer the model
    assert catalog.identify(same, known) is None


def test_a_file_of_no_known_size_keeps_its_own_name_without_being_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "my-model.Q4_0.gguf"
    f.write_bytes(b"z" * 1000)
    assert model_id_of(ModelConfig(model=str(f))) == "my-model.Q4_0"
    assert not (tmp_path / "cache" / "identity").exists()


@pytest.mark.slow
def test_the_default_gguf_under_another_name_is_the_default_model_with_its_head(tmp_path):
    """A copy of the default model's GGUF under another name: the default model's id, and its bundled head drafts
    (not the untrained 'lm' head at L // 4)."""
    from selfspec import SelfSpec

    src = default_gguf_path()
    assert src.stat().st_size == DEFAULT_GGUF_SIZE
    copy = tmp_path / "my-download.gguf"
    shutil.copyfile(src, copy)
    assert model_id_of(ModelConfig(model=str(copy))) == DEFAULT_MODEL_NAME
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == DEFAULT_GGUF_SHA256
    ss = SelfSpec.load(str(copy))
    assert ss.model_id == DEFAULT_MODEL_NAME
    assert ss.head is not None and ss.head.source is not None and ss.head.kind != "lm"
