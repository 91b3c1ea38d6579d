"""Peak memory of a Hugging Face conversion, both ways, against the size of the shards it moves.

    python benchmarks/convert_memory.py [--layers 32] [--dir PARENT]

Writes a Llama 3.1 8B-shaped model directory (hidden 4096, 32 heads, 8 key-value heads, ffn
14336, vocabulary 128256, ``llama3`` RoPE scaling, bf16) with random weights as real safetensors
shards of at most ``hf_files.DEFAULT_SHARD_BYTES``, one tensor at a time (the model is never held
whole), then runs ``convert from_hf`` and ``convert to_hf`` each in a fresh process and prints,
for each, the process's peak resident memory (``VmHWM``), what the conversion added to it
(``resident_peak_added``: the interpreter, torch and the modules loaded before it are left out),
the largest shard of its input and output, and the time. ``--layers`` lowers the layer count for
a quick run (the vocabulary tables stay full size). Each directory is deleted once the next step
has read it, so the disk holds at most two copies of the model; everything is removed at the end.
Needs about twice the model's bytes of free disk (16 GB each for the full model). Prints numbers;
asserts nothing. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

SHAPE = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256}
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def _config(layers: int) -> dict:
    s = SHAPE
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": s["hidden"],
            "intermediate_size": s["ffn"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": s["hidden"] // s["heads"], "vocab_size": s["vocab"],
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": ROPE, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
            "dtype": "bfloat16"}


def _shapes(layers: int) -> dict:
    """Every tensor of the model in the order Hugging Face's files hold them."""
    h, f, v = SHAPE["hidden"], SHAPE["ffn"], SHAPE["vocab"]
    kv = SHAPE["kv_heads"] * h // SHAPE["heads"]
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        m = f"model.layers.{i}."
        out.update({m + "input_layernorm.weight": (h,), m + "self_attn.q_proj.weight": (h, h),
                    m + "self_attn.k_proj.weight": (kv, h), m + "self_attn.v_proj.weight": (kv, h),
                    m + "self_attn.o_proj.weight": (h, h), m + "post_attention_layernorm.weight": (h,),
                    m + "mlp.gate_proj.weight": (f, h), m + "mlp.up_proj.weight": (f, h),
                    m + "mlp.down_proj.weight": (h, f)})
    out.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def write_model(path: str, layers: int) -> dict:
    """The model directory, its tensors made and written one at a time into their shards; returns
    each tensor's SHA-256."""
    from megatron_hydra.convert import hf_files

    hf_files.write_config(path, _config(layers))
    gen = torch.Generator().manual_seed(0)
    shapes, digests = _shapes(layers), {}
    with hf_files.ShardWriter(path, [(n, s, torch.bfloat16) for n, s in shapes.items()]) as out:
        for name, shape in shapes.items():
            t = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=gen).mul_(0.02)
            t = t.to(torch.bfloat16)
            out.put(name, t)
            digests[name] = _digest(t)
        out.finish()
    return digests


def _exported_digests(path: str) -> dict:
    """Each exported tensor's SHA-256, read one at a time."""
    from safetensors import safe_open

    out = {}
    for file in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                out[name] = _digest(f.get_tensor(name))
    return out


def _largest_file(path: str, suffix: str) -> int:
    return max(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(suffix))


def _phase(which: str, source: str, target: str) -> None:
    """One conversion in this (fresh) process; prints its numbers as JSON."""
    from megatron_hydra.convert import api
    from megatron_hydra.training.memory_peak import peak_memory_bytes, resident_peak_added

    start = time.perf_counter()
    run = (lambda: api.from_hf(source, target)) if which == "import" else (lambda: api.to_hf(source, target))
    added = resident_peak_added(run)
    peak = peak_memory_bytes(torch.device("cpu"))
    print(json.dumps({"added": added, "hwm": peak, "seconds": time.perf_counter() - start}))


def _run(which: str, source: str, target: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--phase", which, source, target], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{which} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where the temporary directories go (default: the system's)")
    parser.add_argument("--phase", nargs=3, metavar=("WHICH", "SOURCE", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return _phase(*args.phase)
    root = tempfile.mkdtemp(prefix="convert_memory_", dir=args.dir)
    hf, ckpt, out = (os.path.join(root, n) for n in ("hf", "ckpt", "out"))
    try:
        start = time.perf_counter()
        digests = write_model(hf, args.layers)
        model_bytes = sum(os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf) if n.endswith(".safetensors"))
        largest_in = _largest_file(hf, ".safetensors")
        print(f"model: {args.layers} layers, {model_bytes / 1e9:.2f} GB of bf16 safetensors, largest shard "
              f"{largest_in / 1e9:.2f} GB (written in {time.perf_counter() - start:.0f} s)")
        imported = _run("import", hf, ckpt)
        shutil.rmtree(hf)
        exported = _run("export", ckpt, out)
        largest_out = _largest_file(out, ".safetensors")
        same = _exported_digests(out) == digests
        print(f"exported tensors bitwise equal to the input's: {same}")
        print(f"{'phase':8} {'peak RSS (VmHWM)':>17} {'added by it':>12} {'largest shard':>14} {'time':>8}")
        for name, r, shard in (("from_hf", imported, largest_in), ("to_hf", exported, largest_out)):
            print(f"{name:8} {r['hwm'] / 2**30:14.2f} GiB {r['added'] / 2**30:8.2f} GiB {shard / 2**30:10.2f} GiB "
                  f"{r['seconds']:7.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
