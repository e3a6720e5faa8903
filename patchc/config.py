"""User-facing configuration: what to mask, how to learn it, and the schedules.

`PatchConfig` is a frozen dataclass validated on construction, so a bad value fails where it is
written, with a message that says what to do instead.

Example:
    >>> cfg = PatchConfig(tile=(16, 16), sparsity=0.35, variant="joint", steps=300)
    >>> cfg.density
    0.65
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
from dataclasses import dataclass

VARIANTS = ("joint", "tile", "nm")
PRIORS = ("random", "magnitude", "wanda", "sparsegpt")
DENSITY_MODES = ("expected", "sampled")
SCOPES = ("global", "block")
EVAL_MASKS = ("hard", "soft")
NM_PARAMS = ("pattern", "weight")

# Weights never masked by default. Embeddings are not matmuls, but a tied LM head reads the
# embedding table through a linear, and the LM head / classifier decides every output logit,
# which one-shot and learned 2:4 methods alike leave dense (the paper masks only the
# transformer blocks' projections).
# Mixture-of-experts routers (Qwen-MoE / Mixtral / OLMoE `mlp.gate`, Qwen2-MoE's `shared_expert_gate`,
# `*.router.*`): tiny (experts x hidden), and sparsifying them changes which experts each token visits.
ROUTER_EXCLUDE: tuple[str, ...] = ("*.gate.weight", "*shared_expert_gate.weight", "*router*")
# The vision / audio side of a multimodal checkpoint (Gemma 3, Qwen3-VL / Qwen3.5, Mistral 3, Llama 4,
# SmolVLM): patchc prunes the text decoder on text, where these never run, so they would get no
# calibration and one-shot baselines would prune them blind.
ENCODER_EXCLUDE: tuple[str, ...] = ("*vision_tower.*", "*vision_model.*", "*.visual.*", "*multi_modal_projector*",
                                    "*audio_tower.*", "model.connector.*")
# How `PatchConfig.selects` says a weight is smaller than the tile (`transform` counts these to explain
# a run with nothing left to mask).
SMALLER_THAN_TILE = "is smaller than the tile"

# Seeds are int64s (torch.Generator.manual_seed), non-negative: the one range PatchConfig and `--seed` accept.
SEED_LIMIT = 2**63

DEFAULT_EXCLUDE: tuple[str, ...] = (
    "*embed*",
    "*lm_head*",
    "*wte*",
    "*wpe*",
    "output.weight",
    "*classifier*",
    *ROUTER_EXCLUDE,
    *ENCODER_EXCLUDE,
)


def _is_real(value) -> bool:
    """A finite int or float (not a bool, nor a str that reads as one): what every float field takes."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(what: str, value, low: int, high: int | None = None, example: str = "") -> None:
    """ValueError unless `value` is an int (not a bool) in [low, high): `what` names it, `example` what to pass.

    >>> _check_int("PatchConfig.steps", 2.5, 1, example="steps=300")
    Traceback (most recent call last):
    ValueError: PatchConfig.steps=2.5 must be an int >= 1, e.g. steps=300
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value < (high or math.inf):
        return
    span = f">= {low}" if high is None else f"in [{low}, {'2**63' if high == SEED_LIMIT else high})"
    raise ValueError(f"{what}={value!r} must be an int {span}" + (f", e.g. {example}" if example else ""))


def _check_real(name: str, value, example) -> None:
    """PatchConfig.<name> is a finite number (NaN and inf trained to 'loss is nan at step 1'; a str trained)."""
    if not _is_real(value):
        raise ValueError(f"PatchConfig.{name}={value!r} must be a finite number (an int or a float), "
                         f"e.g. {name}={example!r}")


def _check_pair(name: str, value: tuple, example: tuple) -> None:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ValueError(f"PatchConfig.{name} must be a pair (start, end), got {value!r}")
    if not all(_is_real(v) and v > 0 for v in value):
        raise ValueError(f"PatchConfig.{name}={value!r} must be two finite numbers > 0 "
                         f"(start, end), e.g. {name}={example!r}")


def check_tile_sides(tile: tuple[int, int], what: str, example: str) -> None:
    """The one rule every tile follows, whoever takes it: both sides multiples of 4 and >= 4 (a 2:4 group's
    four weights run along a tile's row, and a tile holds whole groups). ValueError naming `what` otherwise.

    >>> check_tile_sides((16, 18), "--tile 16 18", "e.g. --tile 16 16")
    Traceback (most recent call last):
    ValueError: --tile 16 18: both tile dims must be multiples of 4 and >= 4 (e.g. --tile 16 16)
    """
    if any(t < 4 or t % 4 for t in tile):
        raise ValueError(f"{what}: both tile dims must be multiples of 4 and >= 4 ({example})")


@dataclass(frozen=True)
class PatchConfig:
    """How to learn a hybrid dense / 2:4 tile mask.

    Args:
        tile: (b1, b2) tile of the weight (rows along out_features, columns along in_features);
            both multiples of 4. Shapes the tile does not divide get a padded grid: edge tiles
            are partial and count by their real elements.
        sparsity: global target sparsity in [0, 0.5] (density rho = 1 - sparsity). "nm" needs 0.5.
        variant: "joint" (tile and 2:4 logits train), "tile" (2:4 logits frozen at the prior's
            pattern; only tile logits train), "nm" (MaskLLM: every tile 2:4).
        prior: "random" (N(0, init_std)), or a one-shot method whose masks shift the initial logits.
        prior_strength: prior shift in units of init_std.
        steps: T, the number of optimizer steps the linear schedules run over.
        tau: temperature (start, end) of the tile logits, and of the 2:4 logits unless tau_nm is
            given; kappa_tile / kappa_nm: logit scale (start, end). All linear per optimizer step.
        lambda_density: lambda1 of the density term |density - rho|.
        lambda_norm: lambda2 of the kept-weight-magnitude term, decayed linearly to 0 over T.
        density_mode: "expected" (default: the density the hard sample has in expectation,
            0.5 + 0.5 * sigmoid(kappa * P_tile) per element; smooth, noise-free) or "sampled"
            (sum of the sampled soft mask, as the paper's code).
        scope: "global" (one parameter-weighted density over all masked layers, the paper's
            default) or "block" (one term per transformer block; an ablation that does worse).
        nm_param: how the 2:4 choice is learned: "pattern" (6 logits per group of 4, one per
            candidate, 6 bytes per weight in fp32) or "weight" (4 scores per group, one per weight,
            4 bytes per weight; a candidate's logit is the sum of its two kept weights' scores, and
            hardening keeps the top-2 scores of each group).
        hard: straight-through hard samples in training (forward hard, backward soft).
        eval_mask: mask used in eval mode: "hard" (exactly what `harden` produces) or "soft"
            (noise-free softmax at the current tau / kappa).
        include / exclude: fnmatch globs over weight FQNs; exclude wins.
        min_features: skip weights with fewer rows or columns than this (weights smaller than the
            tile in either dimension are skipped too).
        seed: seeds the logit init and the Gumbel noise stream.
    """

    tile: tuple[int, int] = (128, 128)
    sparsity: float = 0.35
    variant: str = "joint"
    prior: str = "random"
    prior_strength: float = 3.0
    steps: int = 2000
    tau: tuple[float, float] = (2.0, 0.05)
    tau_nm: tuple[float, float] | None = None
    kappa_tile: tuple[float, float] = (25.0, 350.0)
    kappa_nm: tuple[float, float] = (100.0, 500.0)
    lambda_density: float = 7.0
    lambda_norm: float = 10.0
    init_std: float = 0.014
    density_mode: str = "expected"
    scope: str = "global"
    nm_param: str = "pattern"
    hard: bool = False
    eval_mask: str = "hard"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    min_features: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        tile = tuple(self.tile) if isinstance(self.tile, (list, tuple)) else self.tile
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(t, int) for t in tile)):
            raise ValueError(f"PatchConfig.tile must be two ints (b1, b2), got {self.tile!r}")
        check_tile_sides(tile, f"PatchConfig.tile={tile}", "e.g. tile=(16, 16) or (128, 128)")
        object.__setattr__(self, "tile", tile)
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"PatchConfig.{name} must be a tuple of globs, e.g. ({value!r},)")
            object.__setattr__(self, name, tuple(value))
            if not all(isinstance(g, str) for g in getattr(self, name)):
                raise ValueError(f"PatchConfig.{name}={value!r} must be a tuple of str globs, e.g. ('*mlp*',)")
        if self.tau_nm is None:
            object.__setattr__(self, "tau_nm", tuple(self.tau))
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("tau", "tau_nm", "kappa_tile", "kappa_nm"):
            value = tuple(getattr(self, name))
            _check_pair(name, value, defaults["tau" if name == "tau_nm" else name])
            object.__setattr__(self, name, value)
        for name in ("sparsity", "prior_strength", "lambda_density", "lambda_norm", "init_std"):
            _check_real(name, getattr(self, name), defaults[name])
        _check_int("PatchConfig.steps", self.steps, 1, example="steps=300 (the schedules' length T)")
        _check_int("PatchConfig.seed", self.seed, 0, SEED_LIMIT, example="seed=0")
        _check_int("PatchConfig.min_features", self.min_features, 0, example="min_features=4")
        if not isinstance(self.hard, bool):
            raise ValueError(f"PatchConfig.hard={self.hard!r} must be True or False")
        if not 0.0 <= float(self.sparsity) <= 0.5:
            raise ValueError(
                f"PatchConfig.sparsity={self.sparsity} is outside [0, 0.5]: a tile is dense or 2:4, "
                "so at most half of the weights can be pruned"
            )
        if self.variant not in VARIANTS:
            raise ValueError(f"PatchConfig.variant={self.variant!r}: choose one of {VARIANTS}")
        if self.variant == "nm" and self.sparsity != 0.5:
            raise ValueError(
                f"PatchConfig(variant='nm') makes every tile 2:4, i.e. sparsity 0.5; got "
                f"sparsity={self.sparsity}. Pass sparsity=0.5 or use variant='joint'"
            )
        if self.prior not in PRIORS:
            raise ValueError(f"PatchConfig.prior={self.prior!r}: choose one of {PRIORS}")
        if self.variant == "tile" and self.prior == "random":
            raise ValueError(
                "PatchConfig(variant='tile') freezes the 2:4 logits at a one-shot prior's pattern: "
                "choose prior='magnitude', 'wanda' or 'sparsegpt'"
            )
        if self.density_mode not in DENSITY_MODES:
            raise ValueError(f"PatchConfig.density_mode={self.density_mode!r}: choose one of {DENSITY_MODES}")
        if self.scope not in SCOPES:
            raise ValueError(f"PatchConfig.scope={self.scope!r}: choose one of {SCOPES}")
        if self.nm_param not in NM_PARAMS:
            raise ValueError(
                f"PatchConfig.nm_param={self.nm_param!r}: choose 'pattern' (6 logits per group of 4) or "
                "'weight' (4 scores per group, one per weight: fewer bytes per weight)"
            )
        if self.eval_mask not in EVAL_MASKS:
            raise ValueError(f"PatchConfig.eval_mask={self.eval_mask!r}: choose one of {EVAL_MASKS}")
        for name in ("lambda_density", "lambda_norm", "prior_strength"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"PatchConfig.{name}={getattr(self, name)} must be >= 0")
        if self.init_std <= 0:
            raise ValueError(f"PatchConfig.init_std={self.init_std} must be > 0")

    @property
    def density(self) -> float:
        """Target density rho = 1 - sparsity."""
        return round(1.0 - float(self.sparsity), 12)

    def selects(self, fqn: str, shape: tuple[int, ...]) -> str | None:
        """None if the weight `fqn` of `shape` is masked, else the reason it is not."""
        if not any(fnmatch.fnmatchcase(fqn, g) for g in self.include):
            return f"not matched by include={self.include}"
        for g in self.exclude:
            if fnmatch.fnmatchcase(fqn, g):
                why = (" (a MoE router: sparsifying it changes routing)" if g in ROUTER_EXCLUDE else
                       " (a multimodal model's vision / audio side: patchc prunes the text decoder)"
                       if g in ENCODER_EXCLUDE else "")
                return f"excluded by {g!r}{why}"
        if len(shape) != 2:
            return f"not a 2-D weight (shape {tuple(shape)})"
        if min(shape) < self.min_features:
            return f"shape {tuple(shape)} has a dim < min_features={self.min_features}"
        if shape[0] < self.tile[0] or shape[1] < self.tile[1]:
            # e.g. Qwen3.5's (heads, hidden) gate projections under 128 x 128 tiles: a sliver, left dense
            return f"shape {tuple(shape)} {SMALLER_THAN_TILE} {tuple(self.tile)}"
        return None

    def replace(self, **changes) -> "PatchConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


__all__ = ["PatchConfig", "DEFAULT_EXCLUDE", "ENCODER_EXCLUDE", "ROUTER_EXCLUDE", "SEED_LIMIT"]
