"""How fast `--offload` scores: a forward of a LLaMA-shaped model streamed block by block, with and without
prefetch, against the two bounds it sits between.

    copy     every block's bytes over PCIe at the host-to-device speed measured here (pinned memory)
    compute  the same forward with the whole model on the GPU
    ideal    max(copy, compute) per forward: what perfect overlap of the two would give

A streamed forward without prefetch takes about copy + compute (each block waits for its copy, then runs);
prefetch copies block i + 1 on a side stream while block i runs. The model has random bf16 weights (8 blocks
of LLaMA-2-7B's shape, 3.2 GB) and runs `patchc eval --offload`'s batch (61 windows of 256 tokens).

    python benchmarks/bench_offload.py --out benchmarks/results      # on a GPU: appends offload.jsonl
    python benchmarks/bench_offload.py --dry-run --out /tmp/o        # on CPU: a tiny model, the same steps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from patchc.bench.layers import cpu_timer  # noqa: E402
from patchc.bench.record import append_jsonl, environment  # noqa: E402
from patchc.models.offload import device_share, stream_blocks  # noqa: E402

SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
         "vocab_size": 32000}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 256}


def build(layers: int, shape: dict, device: str) -> torch.nn.Module:
    """A LLaMA of random-looking bf16 weights in host memory, built on the meta device and filled in place
    with one block of noise, repeated (drawing 2B numbers would take longer than the bench)."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **shape)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.to_empty(device="cpu")
    noise = torch.randn(2**22, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        for chunk in p.data.view(-1).split(noise.numel()):
            chunk.copy_(noise[:chunk.numel()])
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers were left empty on the meta device
    return model


def timer(device: str, reps: int):
    """Seconds of `fn()`: `triton.testing.do_bench`'s median on a GPU, `cpu_timer`'s on the CPU (dry runs)."""
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=300, rep=300 * reps, return_mode="median") / 1e3
    return lambda fn: cpu_timer(reps)(fn) / 1e3


def copy_speed(model: torch.nn.Module, device: str) -> float:
    """Bytes per second of one block's weights copied from pinned host memory to `device`."""
    block = [p.data.pin_memory() if device == "cuda" else p.data for p in model.model.layers[0].parameters()]
    t = timer(device, 5)(lambda: [b.to(device, non_blocking=True) for b in block])
    return sum(b.nbytes for b in block) / t


def measure(opts: argparse.Namespace) -> dict:
    device = "cpu" if opts.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_offload.py: needs a CUDA GPU (--dry-run runs its steps on the CPU)")
    model = build(opts.layers, TINY if opts.dry_run else SHAPE, device)
    ids = torch.randint(0, model.config.vocab_size, (opts.windows, opts.tokens),
                        generator=torch.Generator().manual_seed(1)).to(device)
    resident, block = device_share(model)
    weights = sum(p.nbytes for p in model.model.layers.parameters())
    row = {"layers": opts.layers, "hidden": model.config.hidden_size, "windows": opts.windows,
           "tokens": opts.tokens, "block_gb": block * 2 / 1e9, "streamed_gb": weights / 1e9,
           "h2d_gb_s": copy_speed(model, device) / 1e9}
    row["copy_s"] = weights / (row["h2d_gb_s"] * 1e9)
    with torch.inference_mode():
        for prefetch in (False, True):
            stream = stream_blocks(model, device, prefetch=prefetch)
            logits = model(ids).logits  # the numbers must not depend on prefetch
            row["prefetch_s" if prefetch else "plain_s"] = timer(device, opts.reps)(lambda: model(ids))
            if prefetch:
                row["prefetched"], row["misses"] = stream.prefetched, stream.misses
                row["same_logits"] = bool(torch.equal(logits, plain))
            plain = logits
            stream.remove()
        model.to(device)
        row["compute_s"] = timer(device, opts.reps)(lambda: model(ids))
    row["ideal_s"] = max(row["copy_s"], row["compute_s"])
    row["speedup"] = row["plain_s"] / row["prefetch_s"]
    row["of_ideal"] = row["ideal_s"] / row["prefetch_s"]
    return {**environment(device, opts.dry_run), "offload": row}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder of offload.jsonl")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--windows", type=int, default=61, help="windows a forward (`patchc eval --offload`: 61)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens a window")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: the steps, not the speed")
    opts = parser.parse_args(argv)
    if opts.dry_run:
        opts.layers, opts.windows, opts.tokens, opts.reps = 3, 2, 16, 1
    record = measure(opts)
    r = record["offload"]
    print(f"{record['device']}: {r['layers']} blocks of {r['block_gb']:.2f} GB, {r['windows']} x {r['tokens']} "
          f"tokens; host-to-device {r['h2d_gb_s']:.1f} GB/s")
    print(f"  copy bound {r['copy_s'] * 1e3:.1f} ms, whole model on the device {r['compute_s'] * 1e3:.1f} ms")
    print(f"  streamed {r['plain_s'] * 1e3:.1f} ms, with prefetch {r['prefetch_s'] * 1e3:.1f} ms: "
          f"{r['speedup']:.2f}x, {r['of_ideal']:.0%} of the ideal overlap; same logits: {r['same_logits']}")
    print(f"appended to {append_jsonl(opts.out / 'offload.jsonl', record)}")


if __name__ == "__main__":
    main()
