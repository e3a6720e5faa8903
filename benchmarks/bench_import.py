"""Time and memory of `patchc import`, `patchc.from_pretrained` and `patchc.compile` on a Llama that is already 2:4.

Builds a random Llama of the given shape, prunes every projection 2:4 by magnitude (zeros in dense
weights, what SparseGPT / Wanda scripts save), saves it with `save_pretrained`, then runs, each in a fresh
process sampled every 5 ms: `patchc import SRC --out OUT` and `patchc.from_pretrained(OUT)`. Reports the
wall time and the peak anonymous memory (RssAnon: what the process itself allocated, not the weights it
maps from disk) above a process that only imported patchc and transformers; and `patchc.compile(model)`
(the plan read off its zeros, on a copy, tune=False) above the model transformers loaded from SRC.
Appends a record to benchmarks/results/import.jsonl.

    python benchmarks/bench_import.py --hidden 2048 --intermediate 5632 --layers 8   # ~540M parameters, bf16

glibc keeps freed blocks under its (adaptive, up to 32 MB) mmap threshold for reuse, so the peak also holds
memory already freed; `MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_import.py` returns every freed
tensor at once and measures what is live (the record notes the setting).

`--layout sparse-24-bitmask` saves the model as compressed-tensors does (kept values + bitmasks), with the
library itself: compressed-tensors 0.14, the last release that writes it, on PYTHONPATH
(`pip install --no-deps --target /tmp/ct014 compressed-tensors==0.14.0 loguru`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "import patchc, patchc.export, transformers, transformers.models.llama.modeling_llama"


def build(src: Path, hidden: int, intermediate: int, layers: int, vocab: int, layout: str = "dense",
          experts: int = 0) -> int:
    """Save a magnitude 2:4-pruned random bf16 Llama (a Mixtral with `experts` experts per layer, top-2) to `src`
    in `layout`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128)
    if experts:
        model = MixtralForCausalLM._from_config(MixtralConfig(num_local_experts=experts, num_experts_per_tok=2,
                                                              **shape), dtype=torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, dtype="bfloat16")).to(torch.bfloat16)
    with torch.no_grad():
        for name, w in model.named_parameters():  # every projection and expert slice; not embeddings, head, router
            if w.dim() >= 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")):
                mags = w.abs().reshape(*w.shape[:-1], -1, 4)
                keep = torch.zeros_like(mags).scatter_(-1, mags.topk(2, -1).indices, 1.0)
                w.mul_(keep.reshape(w.shape))
    if layout == "dense":
        model.save_pretrained(src)
    else:
        save_compressed(model, src, layout)
    return sum(p.numel() for p in model.parameters())


def save_compressed(model, src: Path, layout: str) -> None:
    """`model` as compressed-tensors 0.14 writes `layout` (as tests/data/compressed_tensors/make_fixtures.py)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.config import SparsityCompressionConfig
    from safetensors.torch import save_file

    sparsity = SparsityCompressionConfig.load_from_registry(layout, sparsity_structure="2:4", targets=["Linear"],
                                                            ignore=["lm_head"])
    compressor = ModelCompressor.from_pretrained_model(model, sparsity_config=sparsity)
    model.config.save_pretrained(src)
    state = compressor.compress(model)
    save_file({k: v.contiguous() for k, v in state.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(src)


def peak_anon(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RssAnon bytes) of `cmd`, sampled from /proc every 5 ms."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = 0

    def sample() -> None:
        nonlocal peak
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:  # read here without patchc: this parent process stays without torch
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                break
            time.sleep(0.005)

    thread = threading.Thread(target=sample)
    thread.start()
    rc = proc.wait()
    thread.join()
    if rc:
        raise SystemExit(f"bench_import: {' '.join(cmd)} exited with {rc}")
    return time.perf_counter() - start, peak


COMPILE = """
import json, sys, threading, time
import torch, patchc
from transformers import AutoModelForCausalLM

from patchc.utils.env import proc_bytes

def anon():
    return proc_bytes("/proc/self/status", "RssAnon")

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
base = peak = anon()
running = True

def sample():
    global peak
    while running:
        peak = max(peak, anon())
        time.sleep(0.005)

thread = threading.Thread(target=sample)
thread.start()
start = time.perf_counter()
fast = patchc.compile(model, tune=False)
seconds = time.perf_counter() - start
running = False
thread.join()
print(json.dumps({"s": seconds, "above_model": peak - base}))
"""


def compile_peak(src: Path) -> dict:
    """{"s": seconds, "above_model": peak RssAnon bytes above the loaded model} of `patchc.compile(model)` on `src`."""
    done = subprocess.run([sys.executable, "-c", COMPILE, str(src)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"bench_import: patchc.compile exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def git_sha() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=0, help="a Mixtral with this many experts per layer (0: a Llama)")
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--layout", choices=["dense", "sparse-24-bitmask"], default="dense",
                    help="how the checkpoint stores its 2:4 weights (default: zeros in dense weights)")
    ap.add_argument("--load-device", default="cpu",
                    help="from_pretrained(device=...): 'meta' stands in for a GPU (the host memory of a load whose "
                         "packed layers go to the device)")
    ap.add_argument("--label", default="", help="a note stored with the record (e.g. the change measured)")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/import.jsonl")
    args = ap.parse_args()

    import torch

    from patchc.utils.env import device_name, versions

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        params = build(src, args.hidden, args.intermediate, args.layers, args.vocab, args.layout, args.experts)
        src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        _, base = peak_anon([sys.executable, "-c", BASELINE])
        imp_s, imp_peak = peak_anon([sys.executable, "-m", "patchc", "import", str(src), "--out", str(out),
                                     "--tile", str(args.tile), str(args.tile)])
        out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        load = f"{BASELINE}; m = patchc.from_pretrained({str(out)!r}, device={args.load_device!r}); print(type(m).__name__)"
        load_s, load_peak = peak_anon([sys.executable, "-c", load])
        comp = compile_peak(src) if args.layout == "dense" else None  # transformers reads dense checkpoints only
    record = {
        "bench": "import", "label": args.label, "layout": args.layout, "params": params, "shape": [args.hidden, args.intermediate, args.layers],
        "experts": args.experts,
        "tile": args.tile, "checkpoint_bytes": src_bytes, "exported_bytes": out_bytes, "baseline_anon": base,
        "import_s": round(imp_s, 2), "import_anon_above_baseline": imp_peak - base,
        "load_s": round(load_s, 2), "load_anon_above_baseline": load_peak - base, "load_device": args.load_device,
        "compile_s": comp and round(comp["s"], 2), "compile_anon_above_model": comp and comp["above_model"],
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),  # set: glibc returns each freed tensor
        "device": device_name("cpu"), "date": datetime.date.today().isoformat(), "git": git_sha(), **versions(),
    }
    gb = 1e9
    print(f"{params / 1e6:.0f}M parameters, {args.layout}, checkpoint {src_bytes / gb:.2f} GB -> exported {out_bytes / gb:.2f} GB")
    print(f"patchc import          {imp_s:6.1f} s   peak anonymous {(imp_peak - base) / gb:5.2f} GB above the baseline")
    print(f"patchc.from_pretrained {load_s:6.1f} s   peak anonymous {(load_peak - base) / gb:5.2f} GB above the baseline "
          f"({base / gb:.2f} GB: Python, torch, transformers)")
    if comp:
        print(f"patchc.compile(model)  {comp['s']:6.1f} s   peak anonymous {comp['above_model'] / gb:5.2f} GB above the "
              "loaded model")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
