"""The prune job's options: everything `patchc prune` takes, validated, with the paper's defaults.

Example:
    >>> opts = PruneOptions(sparsity=0.45, steps=50, out="runs/quick")   # tile None: the model's (auto_tile)
    >>> opts.patch_config(tile=(64, 64)).density
    0.55
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from patchc.config import SEED_LIMIT, PatchConfig
from patchc.models.shared import SHARED_DIR

if TYPE_CHECKING:
    from patchc.masking.optim import MaskOptimConfig

DEFAULT_MODEL = str(SHARED_DIR / "models" / "stories260K" / "stories260K.bin")
DEFAULT_DATA = (str(SHARED_DIR / "data" / "tinystories_sample.txt"),)
# A second real text, scored unsplit (its first --eval-tokens tokens): out of the default model's domain, so
# it shows what pruning costs beyond the text the masks were fitted to (the standard WikiText-2 test split).
DEFAULT_EVAL_DATA = (str(SHARED_DIR / "data" / "wikitext2_raw_test.txt"),)
ONESHOT_METHODS = ("magnitude", "wanda", "sparsegpt")
TRAIN_DATA = ("real", "self", "mix")
MASK_IMPLS = ("fused", "compiled", "reference")
_PAPER = PatchConfig()
MAX_THREADS = 4 * (os.cpu_count() or 1)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype; `patchc.job.model.weight_dtype` resolves "auto"

# Recovery's Adam lr by model kind. Causal LMs (stories260K PATCH 35%, seed 0, KD, 300 steps; held-out /
# WikiText-2 from 7.61 / 152.5): 3e-4 6.86 / 157.5, 1e-3 6.63 / 157.8, 3e-3 6.64 / 148.1, 1e-2 8.39 / 149.8.
# all-MiniLM-L6-v2, seed 0, held-out / WikiText-2 cosine 0.939 / 0.866 before. With dropout on and the last
# layer distilled, no lr helped (300 steps: 3e-3 0.830 / 0.529, 3e-4 0.935 / 0.838, 1e-4 0.939 / 0.855);
# in eval mode, every layer distilled: 1e-4 0.953 / 0.877 at 300 steps; 1,000 steps 1e-4 0.961 / 0.888,
# 3e-4 0.960 / 0.879; with 8,000 more sentences (--train-extra) 3,000 steps 1e-4 0.971, 3e-4 0.974.
RECOVER_LR = {"causal": 3e-3, "encoder": 1e-4}


LOSSES = ("lm", "kd", "lm+kd")


@dataclass(frozen=True)
class LossSpec:
    """Which task loss: "lm" (cross-entropy on the next token), "kd" (KL to the dense model at
    `temperature`), or "lm+kd" (their sum, KD weighted by `kd_weight`)."""

    kind: str = "lm+kd"
    temperature: float = 1.0
    kd_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {self.kind!r}")
        if not self.temperature > 0:
            raise ValueError(f"--kd-temperature must be > 0, got {self.temperature}")
        if not self.kd_weight >= 0:
            raise ValueError(f"--kd-weight must be >= 0, got {self.kd_weight}")


@dataclass(frozen=True)
class PruneOptions:
    """Everything `patchc prune` takes; defaults are the paper's, scaled to a CPU-sized run.

    The paper trains 2000 steps of 256 x 4096 tokens; here 300 steps of 8 x 128 tokens keep the same
    schedule shapes (tau 2 -> 0.05, kappa 25 -> 350 for tiles and 100 -> 500 for 2:4, lambda1 7,
    Adam 1e-3, SparseGPT prior of strength 3) on the embedded default. Two settings differ, for the
    short run: the tile logits step at 3e-2, and lambda2 is 1 (at 10 its pull to keep weight norm
    makes tiles with the faster rate overshoot the density target).
    """

    model: str = DEFAULT_MODEL
    data: tuple[str, ...] = DEFAULT_DATA
    out: str | None = None  # None: the next free runs/<model>[-N]
    sparsity: float = _PAPER.sparsity
    tile: tuple[int, int] | None = None  # None: `job.model.auto_tile` picks it once the model loads
    variant: str = _PAPER.variant
    prior: str = "sparsegpt"
    prior_strength: float = _PAPER.prior_strength
    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-3
    # Tile logits at 30x lr, lambda2 1 instead of the paper's 10: on stories260K PATCH 35%, held-out, seed 0,
    # 8.60 -> 7.61 (seeds 1, 2: 8.11, 8.06); learned 2:4 under lambda2 1: 10.25 -> 9.85.
    tile_lr: float = 3e-2
    # The schedules and loss weights are PatchConfig's (the paper's), but lambda2: one place to change them.
    tau: tuple[float, float] = _PAPER.tau
    tau_nm: tuple[float, float] | None = None
    kappa_tile: tuple[float, float] = _PAPER.kappa_tile
    kappa_nm: tuple[float, float] = _PAPER.kappa_nm
    lambda_density: float = _PAPER.lambda_density
    lambda_norm: float = 1.0
    scope: str = _PAPER.scope
    nm_param: str = _PAPER.nm_param  # "pattern": 6 logits per 2:4 group; "weight": 4 scores (2/3 of the bytes)
    # bf16 Adam state + the step inside backward: ~12 bytes per masked weight (8 with nm_param="weight")
    # instead of ~24; gradient clipping per tensor
    low_memory: bool = False
    v_per_group: bool = False  # one Adam v per 2:4 group: ~6.5 bytes per weight with low_memory + nm_param="weight"
    mask_impl: str = "fused"  # "fused" (one autograd node per mask), "compiled" (torch.compile of it), "reference"
    exact_budget: bool = True
    block_len: int = 128
    eval_context: int = 256
    eval_fraction: float = 0.2
    calib_blocks: int = 32
    # Training text: "real" (--data's training documents), "self" (the dense model's own text, prompted
    # by those documents), or "mix" (both; causal LMs only, encoders always train on real text).
    train_data: str = "mix"
    # More text to train on, whole files (no split, never scored); a file holding a held-out document is
    # refused. MiniLM 35%, seed 0, recovered 3,000 steps at 1e-4 with 8,000 more sentences (TinyShakespeare
    # and stories260K's own text): held-out cosine 0.966 -> 0.971, WikiText-2 0.892 -> 0.927.
    train_extra: tuple[str, ...] = ()
    self_tokens: int = 65536
    # Sampled a little hotter than the model's own distribution: stories260K, seeds 0-2, every learned row
    # but PATCH 25% gains on held-out text and WikiText-2 (PATCH 35% 7.96 -> 7.73, WikiText-2 173 -> 138).
    self_temperature: float = 1.2
    self_top_p: float = 0.95
    # "lm", "kd" (distil the dense model's next-token distribution) or "lm+kd"; on stories260K, PATCH 35%
    # held-out: lm 8.91, kd 8.76, lm+kd 8.34 (real + generated text, seed 0; lm on real text only: 10.06)
    loss: str = "lm+kd"
    kd_temperature: float = 1.0
    eval_data: tuple[str, ...] = DEFAULT_EVAL_DATA  # more real text, scored unsplit: beyond --data's domain
    eval_tokens: int = 16384  # cap per --eval-data file
    recover: int = 0  # steps of weight recovery after hardening (masks fixed), 0 = none
    # Recovery distils the dense model by default: the LM term fits the training text past what dense does
    # and costs text of other domains (stories260K, PATCH 35%, seed 0, 300 steps; held-out / WikiText-2:
    # masks 7.61 / 152.5, kd at 3e-3 6.64 / 148.1, lm+kd at 3e-3 6.38 / 167.6, lm+kd at 1e-3 6.36 / 176.7)
    recover_loss: str = "kd"
    recover_lr: float | None = None  # None: RECOVER_LR for the model's kind
    recover_scope: str = "all"  # "all" kept weights, or "values" (2:4 tiles' values only)
    # Encoders: the fraction of each recovery batch's sentences replaced by splices of training sentences
    # (`splice_sentences`); None: 1 for encoders (causal LMs recover on generated text and take none).
    # MiniLM 35%, 1,000 steps, seeds 0-2 (held-out / WikiText-2 cosine): 0.960 / 0.883 -> 0.964 / 0.891;
    # splicing in mask training too cost the masks (seed 0: 0.939 -> 0.937), so it stays in recovery.
    recover_splice: float | None = None
    baselines: bool = True
    seed: int = 0  # mask init, Gumbel noise and batch order
    split_seed: int = 0  # which documents are held out (and the self-generated text): fixed across --seed
    device: str = "cpu"
    fsdp: bool = False  # under torchrun: FSDP2 shards each block's weights + logits; sharded checkpoint folder
    # blocks in host memory, each copied to the device for its forward (`patchc.models.offload`): `patchc eval`
    # and `patchc sample` of a model larger than the GPU; mask training and recovery need it on the device
    offload: bool = False
    dtype: str = "auto"  # weights: "auto" = bfloat16 on CUDA, float32 on CPU; logits are always fp32
    threads: int = 0
    resume: bool = False
    overwrite: bool = False  # start again in an --out that holds a finished run or a checkpoint
    encoding: str = "utf-8"  # of the --data files
    text_field: str | None = None  # records files (JSON Lines, Parquet): the text field; None: "text", else a chat
    bos: bool = True  # start every document with BOS (else EOS); False for tokenizers with neither
    progress: bool = True
    plots: bool = True  # the report's pictures (`patchc report RUN/plan.patch` draws them later)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(self.data))
        if self.tile is not None:
            object.__setattr__(self, "tile", tuple(self.tile))
        object.__setattr__(self, "eval_data", tuple(self.eval_data))
        object.__setattr__(self, "train_extra", tuple(self.train_extra))
        self._check_train_extra()
        if not self.data:
            raise ValueError("--data: give at least one text file (evaluation always needs real held-out text)")
        for name in ("steps", "batch_size", "block_len", "eval_context", "calib_blocks", "self_tokens", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads < 0 or self.threads > MAX_THREADS:
            raise ValueError(f"--threads must be in [0, {MAX_THREADS}] (0 = automatic; this machine has "
                             f"{os.cpu_count()} cores), got {self.threads}")
        for flag, value in (("--lr", self.lr), ("--tile-lr", self.tile_lr)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a positive number, got {value}")
        lr = self.recovery_lr("causal")
        if self.recover < 0 or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"--recover must be >= 0 steps and --recover-lr positive, got {self.recover} and {lr}")
        if self.recover_scope not in ("all", "values"):
            raise ValueError(f"--recover-scope must be all or values, got {self.recover_scope!r}")
        if self.recover_splice is not None and not 0.0 <= self.recover_splice <= 1.0:
            raise ValueError(f"--recover-splice is a fraction of each batch's sentences, in [0, 1]; got {self.recover_splice}")
        for name in ("seed", "split_seed"):
            if not 0 <= getattr(self, name) < SEED_LIMIT:  # PatchConfig's range (only --seed reaches it)
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 2**63), got {getattr(self, name)}")
        if self.train_data not in TRAIN_DATA:
            raise ValueError(f"--train-data must be one of {', '.join(TRAIN_DATA)}, got {self.train_data!r}")
        if not self.self_temperature > 0 or not 0 < self.self_top_p <= 1:
            raise ValueError(f"--self-temperature must be > 0 and --self-top-p in (0, 1], got "
                             f"{self.self_temperature} and {self.self_top_p}")
        LossSpec(self.loss, self.kd_temperature)  # validates --loss and --kd-temperature
        if self.recover_loss not in LOSSES:
            raise ValueError(f"--recover-loss must be one of {', '.join(LOSSES)}, got {self.recover_loss!r}")
        if self.mask_impl not in MASK_IMPLS:
            raise ValueError(f"--mask-impl must be one of {', '.join(MASK_IMPLS)}, got {self.mask_impl!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the run, or start it again")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise ValueError(f"--encoding {self.encoding!r} is not a text encoding Python knows") from None
        if self.text_field is not None and not (isinstance(self.text_field, str) and self.text_field.strip()):
            raise ValueError(f"--text-field must name a field of the records, got {self.text_field!r}")
        # validates sparsity, tile, variant, prior, schedules (an automatic tile is valid by construction)
        try:
            self.patch_config(**({} if self.tile else {"tile": (16, 16)}))
        except ValueError as e:
            raise ValueError(as_flags(str(e))) from None

    def _check_train_extra(self) -> None:
        """--train-extra files must not be --data (its held-out documents) or --eval-data (scored) files."""
        why = {"--data": "a --data file, whose held-out documents", "--eval-data": "an --eval-data file, which"}
        for flag, files in (("--data", self.data), ("--eval-data", self.eval_data)):
            same = {os.path.realpath(p) for p in files} & {os.path.realpath(p) for p in self.train_extra}
            if same:
                raise ValueError(f"--train-extra {sorted(same)[0]} is also {why[flag]} the run is scored on and "
                                 "must never train on; give --train-extra other files")

    def loss_spec(self) -> LossSpec:
        return LossSpec(self.loss, self.kd_temperature)

    def mask_optim(self) -> MaskOptimConfig:
        """The mask optimizer's settings that --low-memory and --v-per-group choose."""
        from patchc.masking.optim import MaskOptimConfig  # imports torch: not needed to parse flags

        return MaskOptimConfig(memory="low" if self.low_memory else "default", v_per_group=self.v_per_group)

    def recovery_lr(self, kind: str) -> float:
        """--recover-lr, or the default for a model of `kind` ("causal" or "encoder")."""
        return RECOVER_LR[kind] if self.recover_lr is None else self.recover_lr

    def recovery_splice(self, kind: str, name: str = "the model") -> float:
        """--recover-splice, or the default for a model of `kind`; ValueError for a causal LM given one."""
        if kind == "encoder":
            return 1.0 if self.recover_splice is None else self.recover_splice
        if self.recover_splice:
            raise ValueError(f"--recover-splice splices sentences for an encoder's distillation; {name} is a causal "
                             "LM, which recovers on its training text (--train-data mix adds generated text)")
        return 0.0

    def for_recovery(self) -> PruneOptions:
        """These options with --recover-loss as the loss: what weight recovery trains with."""
        return dataclasses.replace(self, loss=self.recover_loss)

    def patch_config(self, **changes: Any) -> PatchConfig:
        fields = {f.name for f in dataclasses.fields(PatchConfig)}
        values = {k: getattr(self, k) for k in fields if hasattr(self, k)}
        values.update(changes)
        if values["tile"] is None:
            raise ValueError("PruneOptions.tile is None (automatic): resolve it for the loaded model first, "
                             "opts = patchc.job.model.with_tile(opts, bundle)")
        return PatchConfig(**values)


# PatchConfig's ways of naming a field in its messages, most specific first
_CONFIG_CALL = re.compile(r"PatchConfig\((\w+)=('?[\w.]+'?)\)")                   # PatchConfig(variant='nm')
_ASSIGNED = re.compile(r"(?:PatchConfig\.)?\b(\w+)=('[\w.]+'|\([^)]*\)|[\w.+-]+)")  # sparsity=0.5, tile=(0, 16)
_FIELD = re.compile(r"PatchConfig\.(\w+)")                                          # PatchConfig.kappa_tile


def as_flags(message: str) -> str:
    """PatchConfig's message in `patchc prune`'s words: each field that is a flag (one per PruneOptions field),
    `PatchConfig.sparsity=0.7`, `sparsity=0.5`, `PatchConfig(variant='nm')`, reads `--sparsity 0.7`, ...

    Example:
        >>> as_flags("PatchConfig(variant='nm') makes every tile 2:4; got sparsity=0.35. Pass sparsity=0.5")
        '--variant nm makes every tile 2:4; got --sparsity 0.35. Pass --sparsity 0.5'
    """
    flags = {f.name for f in dataclasses.fields(PruneOptions)}

    def flag(m: re.Match) -> str:
        if m[1] not in flags:
            return m[0]
        value = m[2] if m.re is not _FIELD else None
        if value is not None and value.startswith("("):  # tile=(16, 16) -> --tile 16 16
            value = " ".join(value.strip("()").replace(",", " ").split())
        return f"--{m[1].replace('_', '-')}" + ("" if value is None else " " + value.strip("'"))

    for pattern in (_CONFIG_CALL, _ASSIGNED, _FIELD):
        message = pattern.sub(flag, message)
    return message
