"""Small real model folders for the package tests: safetensors weights, config.json, a tokenizer."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from controlplane.cli.main import main
from kunlun_common.modelpkg import generate_keypair


def make_model(folder: Path, *, layers: int = 4, hidden: int = 256, dtype: str = "float16") -> Path:
    """A tiny llama-shaped model (about `layers` x 4 x hidden^2 parameters) in Hugging Face layout."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    tensors = {
        f"model.layers.{i}.self_attn.{p}.weight": rng.standard_normal((hidden, hidden)).astype(dtype)
        for i in range(layers)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    tensors["model.embed_tokens.weight"] = rng.standard_normal((1000, hidden)).astype(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"vocab": {"a": 0, "b": 1}}})
    )
    return folder


def params_of(layers: int = 4, hidden: int = 256) -> int:
    return layers * 4 * hidden * hidden + 1000 * hidden


def add_sparse_safetensors(folder: Path, name: str, size: int) -> None:
    """A safetensors shard of `size` bytes that is a hole on disk: one U8 tensor of zeros."""
    n = size - 8
    for _ in range(3):  # the header's length changes the data size; settle on a fixed point
        header = json.dumps({"big": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
        header += b" " * (-len(header) % 8)
        n = size - 8 - len(header)
    with (folder / name).open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(size)


def make_keys(folder: Path, name: str = "release") -> tuple[Path, Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    priv, pub = folder / f"{name}.key", folder / f"{name}.pub"
    kid = generate_keypair(priv, pub)
    return priv, pub, kid


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI in this process (a process per call costs seconds on a busy machine); exit code, output."""
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("KUNLUN_CONFIG")
    os.environ["KUNLUN_CONFIG"] = str(home / ".config" / "kunlun" / "config.yaml")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        if old is None:
            del os.environ["KUNLUN_CONFIG"]
        else:
            os.environ["KUNLUN_CONFIG"] = old
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
