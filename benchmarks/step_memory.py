"""What a mask step keeps for backward per token and block, on random bf16 Llamas of real shapes (CPU).

    python benchmarks/step_memory.py                     # LLaMA-2-7B and -70B shapes, 3-4 min, ~6 GB of host memory
    python benchmarks/step_memory.py --shapes 7b --tokens 128 4096

A block's share is the difference between the model with 2 blocks and with 1 (`patchc.job.activations.saved_bytes`:
the bytes autograd saves, each storage once, while the masked weights train). Records go to
benchmarks/results/step_memory.jsonl; the README's "Mask training at scale" quotes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from patchc.job.activations import saved_bytes  # noqa: E402
from patchc.job.memory import masked_layers  # noqa: E402
from patchc.job.options import PruneOptions  # noqa: E402
from patchc.bench.record import record_run  # noqa: E402

# name: (hidden, intermediate, heads, kv heads, blocks of the real model)
SHAPES = {"7b": (4096, 11008, 32, 32, 32), "70b": (8192, 28672, 64, 8, 80)}


def block_bytes(shape: str, tokens: int) -> tuple[float, float]:
    """(bytes one block keeps for one sequence of `tokens`, bytes outside the blocks) at `shape`."""
    import transformers

    hidden, inter, heads, kv, _ = SHAPES[shape]
    kept = {}
    for blocks in (1, 2):
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                                          num_hidden_layers=blocks, num_attention_heads=heads,
                                          num_key_value_heads=kv, max_position_embeddings=max(tokens, 4096))
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
        params = [model.get_parameter(n) for n in masked_layers(model, PruneOptions(tile=(128, 128)).patch_config())]
        kept[blocks] = saved_bytes(model, params, tokens)
        del model, params
    return kept[2] - kept[1], 2 * kept[1] - kept[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[128])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/step_memory.jsonl")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        for tokens in args.tokens:
            block, rest = block_bytes(shape, tokens)
            blocks = SHAPES[shape][4]
            whole = 8 * (blocks * block + rest) / 1e9  # the default batch of 8 sequences
            rows.append({"shape": shape, "tokens": tokens, "block_kb_per_token": round(block / tokens / 1e3, 1),
                         "rest_bytes": int(rest), "model_gb_at_8_sequences": round(whole, 2)})
            print(rows[-1], flush=True)
    record_run(args.results, {"bench": "step_memory", "dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
