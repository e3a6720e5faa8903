"""Does the learned tile choice matter? One PATCH run, then other choices of which tiles stay dense.

    python benchmarks/tile_choice.py --seed 0                   # the README's numbers (about 2 min)
    python benchmarks/tile_choice.py --seed 0 --sparsity 0.05   # 90% of the tiles dense

Trains PATCH (35% by default) with the main job's stages and recipe, then keeps the run's learned 2:4
pattern in every group and its number of dense tiles per layer, and changes only which tiles are dense:

- learned: the run's own choice (what the job's plan keeps: the top tile logits within the budget);
- random: a uniformly random choice per layer (three draws);
- Hessian: the tiles whose 2:4 pruning costs most in the layer's output, sum over the tile's rows of
  e H e^T with e the weights the 2:4 pattern drops and H = X^T X from calibration (SparseGPT's
  statistic); and the reverse of that ranking;
- the learned choice again, over SparseGPT's one-shot 2:4 patterns instead of the learned ones.

Then the other way round: the learned choice of dense tiles over the 2:4 patterns of a learned 2:4
run (same recipe), which were learned without any dense tile.

Each is scored on the job's held-out TinyStories documents. If the learned choice is no better than
random, tile training is not doing its job.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from patchc.ir.tiles import expand_tiles, to_tiles
from patchc.job.corpus import load_data
from patchc.job.options import PruneOptions
from patchc.job.model import choose_threads, with_tile
from patchc.job.prune import cache_dir
from patchc.job.stages import calibrate, evaluate, oneshot_masks, train, train_program
from patchc.masking.harden import budget_tiles
from patchc.models import load_model
from patchc.pruning import apply_masks


def hessian_error(weight: torch.Tensor, dropped: torch.Tensor, hessian: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """(Tn, Tk) output error of pruning each tile to its 2:4 pattern: sum over its rows of e H_tt e^T."""
    e = weight.float() * dropped.float()
    b1, b2 = tile
    per_row = torch.stack([((e[:, c:c + b2] @ hessian[c:c + b2, c:c + b2]) * e[:, c:c + b2]).sum(1)
                           for c in range(0, e.shape[1], b2)], 1)  # (N, Tk): row r's error in tile column t
    return to_tiles(per_row, (b1, 1)).sum((2, 3))


def top(scores: torch.Tensor, count: int) -> torch.Tensor:
    chosen = torch.zeros(scores.numel(), dtype=torch.bool)
    chosen[torch.argsort(scores.flatten(), descending=True)[:count]] = True
    return chosen.view(scores.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sparsity", type=float, default=PruneOptions.sparsity)
    parser.add_argument("--tile-lr", type=float, default=PruneOptions.tile_lr)
    parser.add_argument("--lambda-norm", type=float, default=PruneOptions.lambda_norm)
    args = parser.parse_args()
    opts = PruneOptions(seed=args.seed, sparsity=args.sparsity, tile_lr=args.tile_lr, lambda_norm=args.lambda_norm,
                        eval_data=(), progress=False)
    bundle = load_model(opts.model)
    choose_threads(opts, bundle.model)
    opts = with_tile(opts, bundle)
    data = load_data(bundle, opts, cache_dir=cache_dir(opts))
    calib = calibrate(bundle, data, opts)
    # The program, not the plan: its logits hold a 2:4 pattern for the dense tiles too.
    prog, _ = train_program(bundle, opts.patch_config(), data, opts, calib, None, False)

    layers = prog.layers
    # As the job hardens (`exact_budget`): the top logits up to the density target, not logit > 0.
    learned = budget_tiles(prog) if opts.exact_budget else {f: m.hard_tiles().cpu() for f, m in layers.items()}
    kept24 = {f: m.hard_mask(torch.zeros(m.grid, dtype=torch.bool, device=m.nm_logits.device)).cpu()
              for f, m in layers.items()}
    counts = {f: int(t.sum()) for f, t in learned.items()}

    def score(tiles: dict[str, torch.Tensor], patterns: dict[str, torch.Tensor] = kept24) -> float:
        masks = {f: patterns[f] | expand_tiles(tiles[f].float(), m.tile, m.shape).bool() for f, m in layers.items()}
        return evaluate(bundle, apply_masks(bundle.reload(), masks), data, opts)["perplexity"]

    print(f"seed {opts.seed}, tile lr {opts.tile_lr}, lambda2 {opts.lambda_norm}: "
          f"{sum(counts.values())} dense tiles of {sum(t.numel() for t in learned.values())}")
    print(f"  learned choice          {score(learned):8.3f}")
    gen = torch.Generator().manual_seed(opts.seed)
    for draw in range(3):
        rand = {f: top(torch.rand(t.shape, generator=gen), counts[f]) for f, t in learned.items()}
        print(f"  random choice ({draw})      {score(rand):8.3f}")
    error = {f: hessian_error(prog.weight(f).detach().cpu(), ~kept24[f], calib[f].hessian.float().cpu(), m.tile)
             for f, m in layers.items()}
    print(f"  Hessian 2:4 error, top  {score({f: top(e, counts[f]) for f, e in error.items()}):8.3f}")
    print(f"  Hessian 2:4 error, last {score({f: top(-e, counts[f]) for f, e in error.items()}):8.3f}")
    sparsegpt = {f: m.bool() for f, m in oneshot_masks(bundle, "sparsegpt", calib).items()}
    print(f"  learned choice over SparseGPT's patterns {score(learned, sparsegpt):8.3f}")

    nm_opts = dataclasses.replace(opts, variant="nm", sparsity=0.5)
    nm_plan, _ = train(bundle, nm_opts.patch_config(), data, nm_opts, calib, None, False)
    nm_kept = {f: layer.mask().bool() for f, layer in nm_plan.layers.items()}
    none = {f: torch.zeros_like(t) for f, t in learned.items()}
    print(f"learned 2:4 run's patterns, no dense tile {score(none, nm_kept):8.3f}")
    print(f"  + the learned dense tiles                {score(learned, nm_kept):8.3f}")


if __name__ == "__main__":
    main()
