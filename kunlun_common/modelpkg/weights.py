"""What a model folder holds: weight format, tensor dtypes, parameter count, and the memory it needs.

Only headers are read (the 8-byte length and JSON header of a safetensors file, the first bytes of the
others), never the tensors, so a 100 GB model is inspected in milliseconds and bounded memory.

Minimum device memory (one device holding the whole model), in MiB, rounded up:

    weights_bytes = parameter_count * bits(quantization) / 8   when both are known
                  = total size of the weight files               when not quantized
                  = weight file bytes * bits(quantization) / bits(source dtype)   otherwise
    min_device_memory_mb = ceil((weights_bytes * 1.2 + 512 MiB) / 1 MiB)

The 20% covers activations and a minimal KV cache, the 512 MiB the runtime's own context. bits: fp32 32;
fp16, bf16 16; int8, w8a8, fp8 8; int4, awq, gptq 4.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun_common.messages import msg
from kunlun_common.modelpkg.errors import PackInputError

SAFETENSORS_EXT = (".safetensors",)
PYTORCH_EXT = (".bin", ".pth", ".pt")
GGUF_EXT = (".gguf",)
MAX_SAFETENSORS_HEADER = 64 << 20
MiB = 1 << 20
OVERHEAD_FACTOR = 1.2
RUNTIME_RESERVE_BYTES = 512 * MiB

QUANT_BITS = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "int8": 8,
    "w8a8": 8,
    "fp8": 8,
    "int4": 4,
    "awq": 4,
    "gptq": 4,
}
_ST_DTYPES = {
    "F64": ("fp64", 64),
    "F32": ("fp32", 32),
    "F16": ("fp16", 16),
    "BF16": ("bf16", 16),
    "F8_E4M3": ("fp8", 8),
    "F8_E5M2": ("fp8", 8),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
}
_TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float": "fp32", "half": "fp16"}


@dataclass(frozen=True)
class WeightInfo:
    """What the weights of a folder are, from headers only."""

    weight_format: str  # safetensors | pytorch | gguf
    weight_files: tuple[str, ...]  # relative paths
    weight_bytes: int
    dtypes: tuple[str, ...]
    parameter_count: int | None
    parameter_count_source: str | None  # safetensors-header | config | None
    architecture: str | None
    source_bits: int  # bits per parameter of the weights as stored (16 when unknown)


def _safetensors_header(path: Path, rel: str) -> dict[str, Any]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PackInputError(
                msg(
                    "package.weights.not_safetensors_file_shorter",
                    "{rel}: not a safetensors file (shorter than its 8-byte header length)",
                    rel=rel,
                )
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or n + 8 > size:
            raise PackInputError(
                msg(
                    "package.weights.not_safetensors_file_header_2",
                    "{rel}: not a safetensors file (header length {n} does not fit the file)",
                    rel=rel,
                    n=n,
                )
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise PackInputError(
                msg(
                    "package.weights.not_safetensors_file_header_3",
                    "{rel}: not a safetensors file (header is not JSON: {e})",
                    rel=rel,
                    e=e,
                )
            ) from None
    if not isinstance(header, dict):
        raise PackInputError(
            msg(
                "package.weights.not_safetensors_file_header",
                "{rel}: not a safetensors file (header is not an object)",
                rel=rel,
            )
        )
    return header


def _check_magic(path: Path, rel: str, fmt: str) -> None:
    with path.open("rb") as f:
        head = f.read(4)
    if fmt == "gguf" and head != b"GGUF":
        raise PackInputError(
            msg(
                "package.weights.not_gguf_file_no",
                "{rel}: not a GGUF file (no GGUF magic); rename it or convert the weights",
                rel=rel,
            )
        )
    # torch.save writes a zip (PK\x03\x04) since 1.6, a pickle (0x80) before.
    if fmt == "pytorch" and not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise PackInputError(
            msg(
                "package.weights.not_pytorch_checkpoint_neither",
                "{rel}: not a PyTorch checkpoint (neither zip nor pickle); check the file",
                rel=rel,
            )
        )


def _header_len(path: Path) -> int:
    with path.open("rb") as f:
        return int(struct.unpack("<Q", f.read(8))[0])


def detect(folder: Path, files: list[str]) -> WeightInfo:
    """Inspect the weights among `files` (paths relative to `folder`). Safetensors wins when both exist."""
    st = [f for f in files if f.endswith(SAFETENSORS_EXT)]
    pt = [f for f in files if f.endswith(PYTORCH_EXT) and not f.endswith("training_args.bin")]
    gg = [f for f in files if f.endswith(GGUF_EXT)]
    config = _read_config(folder, files)
    arch = _architecture(config)
    if st:
        dtypes: set[str] = set()
        params, bits_weighted = 0, 0
        for rel in st:
            header = _safetensors_header(folder / rel, rel)
            data_bytes = (folder / rel).stat().st_size - 8 - _header_len(folder / rel)
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                if (
                    not isinstance(t, dict)
                    or t.get("dtype") not in _ST_DTYPES
                    or not isinstance(t.get("shape"), list)
                ):
                    raise PackInputError(
                        msg(
                            "package.weights.tensor_has_no_known",
                            "{rel}: tensor {name!r} has no known dtype/shape in the safetensors header",
                            rel=rel,
                            name=name,
                        )
                    )
                dt, bits = _ST_DTYPES[t["dtype"]]
                n = math.prod(int(x) for x in t["shape"])
                off = t.get("data_offsets")
                if (
                    not isinstance(off, list)
                    or len(off) != 2
                    or not 0 <= off[0] <= off[1] <= data_bytes
                    or (off[1] - off[0]) * 8 != n * bits
                ):
                    raise PackInputError(
                        msg(
                            "package.weights.tensor_data_offsets_do",
                            "{rel}: tensor {name!r}: data_offsets {off} do not match its shape and dtype within the file's {data_bytes} data bytes (a damaged or hand-made header)",
                            rel=rel,
                            name=name,
                            off=off,
                            data_bytes=data_bytes,
                        )
                    )
                dtypes.add(dt)
                params += n
                bits_weighted += n * bits
        source_bits = round(bits_weighted / params) if params else 16
        return WeightInfo(
            "safetensors",
            tuple(st),
            _size(folder, st),
            tuple(sorted(dtypes)),
            params,
            "safetensors-header",
            arch,
            source_bits,
        )
    if pt or gg:
        fmt, chosen = ("pytorch", pt) if pt else ("gguf", gg)
        for rel in chosen:
            _check_magic(folder / rel, rel, fmt)
        dtype = _TORCH_DTYPES.get(str(config.get("torch_dtype", ""))) if config else None
        count = config.get("num_parameters") if config else None
        count = count if isinstance(count, int) and count > 0 else None
        return WeightInfo(
            fmt,
            tuple(chosen),
            _size(folder, chosen),
            (dtype,) if dtype else (),
            count,
            "config" if count else None,
            arch,
            QUANT_BITS.get(dtype or "", 16),
        )
    raise PackInputError(
        msg(
            "package.weights.no_weights_found_expected",
            "{folder}: no weights found; expected *.safetensors (Hugging Face), *.bin/*.pth (PyTorch) or *.gguf",
            folder=folder,
        )
    )


def _size(folder: Path, rels: list[str]) -> int:
    return sum((folder / r).stat().st_size for r in rels)


def _read_config(folder: Path, files: list[str]) -> dict[str, Any]:
    if "config.json" not in files:
        return {}
    try:
        with (folder / "config.json").open("rb") as f:
            doc = json.loads(f.read(4 * MiB))
    except ValueError as e:
        raise PackInputError(
            msg(
                "package.weights.not_valid_json_fix",
                "{value}: not valid JSON ({e}); fix or remove it",
                value=folder / "config.json",
                e=e,
            )
        ) from None
    return doc if isinstance(doc, dict) else {}


def _architecture(config: dict[str, Any]) -> str | None:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    mt = config.get("model_type")
    return mt if isinstance(mt, str) else None


def weights_bytes(info: WeightInfo, quantization: str | None) -> int:
    """Bytes of weights on the device (see the module docstring)."""
    if quantization is None:
        return info.weight_bytes
    bits = QUANT_BITS[quantization]
    if info.parameter_count is not None:
        return math.ceil(info.parameter_count * bits / 8)
    return math.ceil(info.weight_bytes * bits / info.source_bits)


def min_device_memory_mb(info: WeightInfo, quantization: str | None) -> int:
    return math.ceil((weights_bytes(info, quantization) * OVERHEAD_FACTOR + RUNTIME_RESERVE_BYTES) / MiB)


# Which weight formats each engine loads. sglang reads Hugging Face safetensors, PyTorch checkpoints and
# GGUF; MindIE (Ascend) only safetensors; a `template` engine runs the operator's own command.
ENGINE_WEIGHT_FORMATS: dict[str, tuple[str, ...]] = {
    "sglang": ("safetensors", "pytorch", "gguf"),
    "mindie": ("safetensors",),
    "template": ("safetensors", "pytorch", "gguf"),
}


def engine_problem(engine: str, weight_format: str) -> str | None:
    """Why `engine` cannot load weights in `weight_format`, or None when it can."""
    formats = ENGINE_WEIGHT_FORMATS.get(engine)
    if formats is None:
        return f"engine {engine!r} is unknown; expected one of {', '.join(ENGINE_WEIGHT_FORMATS)}"
    if weight_format not in formats:
        return (
            f"engine {engine} cannot load {weight_format} weights (it loads {', '.join(formats)}); "
            "convert the weights or choose another engine"
        )
    return None
