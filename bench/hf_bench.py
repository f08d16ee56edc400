"""Import and export of a Hugging Face Llama checkpoint: wall time and host memory beyond the arrays.

Writes a randomly initialised Llama of the Llama 3.2 1B shape (1.24B parameters, tied head) in
bfloat16 as ``model.safetensors`` (one tensor at a time), then, each in a fresh process on 8
simulated CPU devices under FSDP:

- the read alone: every tensor placed shard by shard in the FSDP storage layout;
- ``import-hf`` into a run directory (the read, then the parameters saved as the run's
  checkpoint);
- ``export-hf`` of that run back to bfloat16 safetensors (checked bit-identical to the input).

For each it reports the wall time and the peak resident memory of the process beyond its
baseline (JAX started, devices created) and beyond the float32 parameters themselves, which on
simulated CPU devices live in host memory too; the figure to compare is the largest tensor of
the file (the issue asks for at most twice it).

    PYTHONPATH=. python bench/hf_bench.py [--layers 16] [--dir /tmp/hf_bench]

Prints a markdown table; asserts nothing (the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "dtype": "bfloat16",
}

# Runs in a child process: the peak RSS of a process is only its own.
CHILD = r"""
import json, os, resource, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
jax.devices()
import theseus.hf.exporter, theseus.hf.importer
from theseus.sharding.axis import ShardingPolicy

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def current():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

what, source, target = sys.argv[1:4]
baseline = current()
start = time.perf_counter()
if what == "read":
    from theseus.hf import importer as imp
    spec = imp.read_spec(__import__("pathlib").Path(source))
    hf_spec = spec.family.family.hf
    expected = hf_spec.tensors(spec.model)
    infos = imp.match_tensors(
        expected, imp.checkpoint_tensors(imp.Path(source)), source, hf_spec.aliases
    )
    trainer = imp.import_trainer(spec, ShardingPolicy(fsdp=True), None)
    jax.block_until_ready(imp.read_params(trainer, expected, infos))
    num_params = trainer.num_params
elif what == "import":
    result = theseus.hf.importer.import_hf(
        source, target, policy=ShardingPolicy(fsdp=True)
    )
    num_params = result.num_params
else:
    theseus.hf.exporter.export_hf(source, target)
    num_params = json.load(open(os.path.join(source, "run.json")))["num_params"]
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak": rss(), "baseline": baseline, "arrays": 4 * num_params}))
"""


def write_checkpoint(folder: Path, layers: int) -> tuple[int, int]:
    """A random bfloat16 Llama as config.json + model.safetensors; (file bytes, largest tensor
    bytes)."""
    import ml_dtypes
    import numpy as np

    from theseus.hf.config import model_spec
    from theseus.hf.safetensors import write_file

    config = dict(LLAMA_1B, num_hidden_layers=layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    spec = model_spec(config, "config.json")
    tensors = spec.family.family.hf.tensors(spec.model)
    dtype = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)

    def values():
        for tensor in tensors:
            rows = tensor.shape[0]
            step = max(1, 2**24 // max(1, int(np.prod(tensor.shape[1:]))))

            def blocks(tensor=tensor, rows=rows, step=step):
                for start in range(0, rows, step):
                    shape = (min(step, rows - start), *tensor.shape[1:])
                    yield (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

            yield tensor.name, blocks()

    entries = {t.name: (dtype, t.shape) for t in tensors}
    write_file(folder / "model.safetensors", entries, values())
    largest = max(int(np.prod(t.shape)) for t in tensors) * dtype.itemsize
    return (folder / "model.safetensors").stat().st_size, largest


def child(what: str, source: Path, target: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, what, str(source), str(target)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (1B: 16)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/theseus_hf_bench"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, run, out = args.dir / "hf", args.dir / "run", args.dir / "export"
    start = time.perf_counter()
    file_bytes, largest = write_checkpoint(hf, args.layers)
    print(f"wrote {file_bytes / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    steps = (("read", hf, run), ("import", hf, run), ("export", run, out))
    for what, source, target in steps:
        result = child(what, source, target)
        beyond = result["peak"] - result["baseline"] - result["arrays"]
        rows.append((what, result, beyond))
        print(what, result, flush=True)
    same = (out / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    print()
    print(f"file {file_bytes / 1e9:.2f} GB (bfloat16), largest tensor {largest / 1e6:.0f} MB, ")
    print(f"float32 parameters {rows[0][1]['arrays'] / 1e9:.2f} GB; export bit-identical: {same}")
    print("read: the tensors placed in the device shards only; import: read + the checkpoint save")
    print()
    print("| step | wall time | peak beyond the arrays | ÷ largest tensor | ÷ file size |")
    print("|---|---|---|---|---|")
    for what, result, beyond in rows:
        print(
            f"| {what} | {result['seconds']:.1f} s | {beyond / 1e6:.0f} MB | "
            f"{beyond / largest:.2f} | {beyond / file_bytes:.2f} |"
        )


if __name__ == "__main__":
    main()
