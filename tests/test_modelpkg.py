"""The .kunlunpkg library: detection, the memory formula, the manifest schema, pack-time refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kunlun_common.modelpkg import (
    MalformedPackageError,
    PackInputError,
    PackOptions,
    TrustedKeys,
    load_private_key,
    pack,
    parse_manifest,
    read_head,
    verify_file,
)
from kunlun_common.modelpkg.manifest import Manifest, safe_archive_path
from tests.modelpkg_helpers import make_keys, make_model, params_of

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "kunlunpkg-manifest.schema.json").read_text())
EXAMPLES = ROOT / "deploy" / "examples"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny-llama")


def _pack(model: Path, out: Path, key: Path | None = None, **kw: Any) -> Any:
    return pack(PackOptions(model_dir=model, output=out, **kw), load_private_key(key) if key else None)


def test_manifest_records_detected_facts_and_the_memory_formula(model: Path, tmp_path: Path) -> None:
    priv, pub, kid = make_keys(tmp_path / "k")
    cache = tmp_path / "cc"
    (cache / "graphs").mkdir(parents=True)
    (cache / "graphs" / "g0.om").write_bytes(b"compiled" * 100)
    res = _pack(
        model,
        tmp_path / "p.kunlunpkg",
        priv,
        quantization="w8a8",
        target_devices=("ascend:0",),
        device_config=EXAMPLES / "ascend-910b-x8.yaml",
        engine_version="0.4.6",
        compile_cache=cache,
    )
    m: Manifest = res.manifest
    assert (m.name, m.weight_format, m.architecture) == ("tiny-llama", "safetensors", "LlamaForCausalLM")
    assert m.parameter_count == params_of() and m.parameter_count_source == "safetensors-header"
    assert m.dtypes == ["fp16"] and m.quantization == "w8a8" and m.target_device_types == ["ascend"]
    assert m.weights_bytes == params_of()  # 8 bits per parameter
    assert m.min_device_memory_mb == math.ceil((params_of() * 1.2 + 512 * 2**20) / 2**20)
    assert m.compile_cache == "cache/"
    assert {f.path for f in m.files} == {
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "cache/graphs/g0.om",
    }
    prof = m.device_profiles[0]
    assert (prof["node"], prof["model"], prof["hbm_memory_mb"]) == ("ascend-01", "910B", 65536)
    assert "w8a8" in prof["supported_dtypes"]
    head = read_head(res.path)
    assert head.digest == res.digest and head.signer == kid == res.key_id
    jsonschema.validate(json.loads(head.manifest_bytes), SCHEMA)
    v = verify_file(res.path, TrustedKeys.load([pub], []))
    assert v.key_id == kid and v.bytes_checked == m.total_bytes


def test_extract_while_verifying_reproduces_the_folder(model: Path, tmp_path: Path) -> None:
    res = _pack(model, tmp_path / "p.kunlunpkg")
    out = tmp_path / "unpacked"
    verify_file(res.path, TrustedKeys({}), require_signature=False, extract_to=out)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / "model" / f).read_bytes() == (model / f).read_bytes()


def test_schema_and_parser_agree_on_fields_and_refusals(model: Path, tmp_path: Path) -> None:
    res = _pack(model, tmp_path / "p.kunlunpkg")
    doc = json.loads(res.manifest.canonical())
    assert set(SCHEMA["required"]) == set(SCHEMA["properties"]) == set(Manifest.__dataclass_fields__)
    bad_docs = [
        {**doc, "weight_format": "onnx"},
        {**doc, "quantization": "int3"},
        {**doc, "extra": 1},
        {**doc, "name": "Upper Case"},
        {**doc, "min_device_memory_mb": -1},
        {**doc, "files": [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]},
        {**doc, "files": [{"path": "model/a", "size": 1, "sha256": "XYZ"}]},
        {k: v for k, v in doc.items() if k != "engine"},
    ]
    for bad in bad_docs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
        with pytest.raises(MalformedPackageError):
            parse_manifest(json.dumps(bad).encode())
    # '..' passes the schema's pattern but the parser refuses it (no escape from the unpack folder).
    with pytest.raises(MalformedPackageError, match="not a unique relative path"):
        parse_manifest(
            json.dumps({**doc, "files": [{"path": "model/../x", "size": 1, "sha256": "0" * 64}]}).encode()
        )
    assert (
        not safe_archive_path("model/./x")
        and not safe_archive_path("weights/x")
        and safe_archive_path("cache/a/b")
    )


def test_pack_refuses_a_precision_the_target_does_not_support(model: Path, tmp_path: Path) -> None:
    with pytest.raises(PackInputError, match=r"cambricon:0 does not support w8a8 \(supported_dtypes: fp32"):
        _pack(
            model,
            tmp_path / "p.kunlunpkg",
            quantization="w8a8",
            target_devices=("cambricon:0",),
            device_config=EXAMPLES / "cambricon-mlu370-x4.yaml",
        )
    assert not (tmp_path / "p.kunlunpkg").exists() and not (tmp_path / "p.kunlunpkg.partial").exists()


def test_pack_refuses_a_model_larger_than_the_device(model: Path, tmp_path: Path) -> None:
    decl = tmp_path / "small.yaml"
    decl.write_text(
        "schema_version: 1\nnode: {name: tiny}\ndevices:\n"
        "  - {device_type: nvidia, device_id: 0, model: T4, hbm_memory_mb: 256, supported_dtypes: [fp16]}\n"
    )
    with pytest.raises(PackInputError, match=r"nvidia:0 has 256 MiB .* needs at least 515 MiB"):
        _pack(model, tmp_path / "p.kunlunpkg", target_devices=("nvidia:0",), device_config=decl)
    with pytest.raises(Exception, match=r"declares no device nvidia:3"):
        _pack(model, tmp_path / "p.kunlunpkg", target_devices=("nvidia:3",), device_config=decl)


def test_weight_formats_are_detected_and_checked_against_the_engine(tmp_path: Path) -> None:
    pt = tmp_path / "pt-model"
    pt.mkdir()
    (pt / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 1000)
    (pt / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    res = _pack(pt, tmp_path / "pt.kunlunpkg")
    assert (res.manifest.weight_format, res.manifest.dtypes, res.manifest.architecture) == (
        "pytorch",
        ["bf16"],
        "qwen2",
    )
    with pytest.raises(PackInputError, match="engine mindie cannot load pytorch weights"):
        _pack(pt, tmp_path / "pt2.kunlunpkg", engine="mindie")
    gg = tmp_path / "gg"
    gg.mkdir()
    (gg / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    assert _pack(gg, tmp_path / "gg.kunlunpkg").manifest.weight_format == "gguf"
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"this is not safetensors at all")
    with pytest.raises(PackInputError, match=r"model.safetensors: not a safetensors file"):
        _pack(fake, tmp_path / "fake.kunlunpkg")
    lying = tmp_path / "lying"
    lying.mkdir()
    header = json.dumps({"w": {"dtype": "F16", "shape": [10**9], "data_offsets": [0, 16]}}).encode()
    (lying / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(PackInputError, match=r"tensor 'w': data_offsets \[0, 16\] do not match"):
        _pack(lying, tmp_path / "lying.kunlunpkg")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(PackInputError, match="no weights found"):
        _pack(empty, tmp_path / "e.kunlunpkg")
    (tmp_path / "ln").mkdir()
    (tmp_path / "ln" / "m.gguf").symlink_to(gg / "m.gguf")
    with pytest.raises(PackInputError, match="not a regular file"):
        _pack(tmp_path / "ln", tmp_path / "ln.kunlunpkg")
