"""Training text the dense model writes itself: in-distribution, free, and never the held-out text.

The masks of a small model overfit ~11K real training tokens (0.6M logits). The dense model can
write as much text of its own distribution as training needs: each sequence starts from a short
prompt (the first tokens of a training document, so topics follow the real text; BOS alone when
there is none), then samples with temperature and nucleus (top-p) cut-off from a seeded generator.
Held-out documents are never used as prompts. The result is cached under `<runs>/.cache/`, keyed by
everything that changes it, so a second run (and `make demo`) does not pay for generation again.

Example:
    >>> spec = SelfDataSpec(tokens=65536, block_len=128, seed=0)
    >>> blocks = self_generated_blocks(bundle, spec, prompts, cache_dir=Path("runs/.cache"))
    >>> blocks.shape
    torch.Size([508, 129])
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from patchc.utils.files import atomic_path
from patchc.utils.progress import progress as progress_bar

CACHE_FORMAT = "patchc.selfdata"
# The sampling method, in the cache key: 2 since vocabularies past NUCLEUS_FIRST tokens are drawn by inverse
# CDF (2026-12-07; their earlier text is not reused, a smaller vocabulary's is regenerated the same)
SAMPLER = 2


@dataclass(frozen=True)
class SelfDataSpec:
    """How much text to generate and how to sample it.

    tokens: generated tokens in all (rounded up to whole blocks of `block_len + 1`).
    prompt_len: tokens of a training document's beginning given as the prompt (0: BOS only).
    """

    tokens: int
    block_len: int
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    prompt_len: int = 4
    batch: int = 64

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"--self-tokens must be >= 1 to generate text, got {self.tokens}")
        if self.block_len < 1 or self.batch < 1 or self.prompt_len < 0:
            raise ValueError(f"self-generated text: block_len={self.block_len}, batch={self.batch} must be >= 1 "
                             f"and prompt_len={self.prompt_len} >= 0")
        if not self.prompt_len < self.block_len:
            raise ValueError(f"self-generated text: prompt_len {self.prompt_len} must be shorter than the "
                             f"block length {self.block_len}")
        if not self.temperature > 0:
            raise ValueError(f"--self-temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--self-top-p must be in (0, 1], got {self.top_p}")

    @property
    def n_blocks(self) -> int:
        return -(-self.tokens // (self.block_len + 1))


# Tokens looked at first for the nucleus, then 16 times as many, then the whole row: a sort of a whole
# 50K-150K vocabulary per row and step costs more than the model's step (500 ms for 64 rows of 152K tokens on
# 2 cores, top 1,024 25 ms, top 16,384 100 ms), and hot sampling (--self-temperature 1.2) often needs more
# than the first 1,024.
NUCLEUS_FIRST = 1024
NUCLEUS_GROWTH = 16


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """(B, V) logits (any device) -> (B, 1) token ids on the CPU, sampled at `temperature` from the smallest set
    of tokens whose probability reaches `top_p` (nucleus sampling), with `gen` (a CPU generator).

    A vocabulary of up to `NUCLEUS_FIRST` tokens (stories260K's 512) is drawn by `torch.multinomial` on the
    CPU, as it always was, so its text (and every number measured on it) stays the same. A larger one is drawn
    on the logits' device by one uniform per row (from `gen`) over the nucleus's cumulative mass:
    `torch.multinomial` draws an exponential for every token of every row, and a GPU's logits would cross to
    the CPU every step (39 MB for 64 rows of 152K tokens).
    """
    if logits.shape[-1] <= NUCLEUS_FIRST:
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return torch.multinomial(nucleus(probs, top_p) if top_p < 1.0 else probs, 1, generator=gen)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    # one uniform per row, whichever group the row falls in: the text depends on the seed, not on the groups
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64).to(probs.device)
    if top_p >= 1.0:
        return pick(probs, u).cpu()
    ids = torch.empty(probs.shape[0], 1, dtype=torch.long, device=probs.device)
    for rows, kept, tokens in nucleus_groups(probs, top_p):
        ids[rows] = tokens.gather(-1, pick(kept, u[rows]))
    return ids.cpu()


def pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, 1) indices drawn from each row of (B, V) non-negative `weights` (not normalised) by inverse CDF at
    `u` (B, 1) uniforms in [0, 1): the first index whose cumulative weight exceeds u * the row's total, so a
    zero weight is never drawn."""
    cum = weights.double().cumsum(-1)
    ids = torch.searchsorted(cum, u * cum[:, -1:], right=True)
    # u * total can round up to the total itself: that row takes its most likely token
    return torch.where(ids < weights.shape[-1], ids, weights.argmax(-1, keepdim=True))


def nucleus_groups(probs: torch.Tensor, top_p: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The top-p nucleus of each row of (B, V) probabilities, most likely first, as (rows, kept (R, W), their
    token ids (R, W)) groups, 0 past a row's nucleus: the rows whose nucleus lies in their top `NUCLEUS_FIRST`
    tokens, then in their top `NUCLEUS_GROWTH` times as many, ..., then the others, sorted whole. W is the
    group's longest nucleus.

    Keeps a token while the mass of the tokens before it is below top_p, so the most likely token always
    stays. Exact: a row whose top tokens reach top_p has its nucleus inside them (the mass before every later
    token is at least theirs).
    """
    vocab, groups, first = probs.shape[-1], [], True
    rows, part, width = torch.arange(probs.shape[0], device=probs.device), probs, min(NUCLEUS_FIRST, vocab)
    while len(rows):
        # the first look is a top-k even of a whole short vocabulary, as it always was: a sort could order tied
        # tokens otherwise, and change which of them a nucleus keeps (and stories260K's text)
        last = width >= vocab and not first
        top, order = part.sort(dim=-1, descending=True) if last else part.topk(width, dim=-1)
        mass = top.cumsum(-1)  # the same sums as a whole sort's first columns
        fits = torch.ones_like(rows, dtype=torch.bool) if last else mass[:, -1] >= top_p
        if fits.any():
            kept = top[fits].masked_fill((mass - top)[fits] >= top_p, 0.0)
            size = int((kept > 0).sum(-1).max())  # the kept tokens lead each row: no more columns than that
            groups.append((rows[fits], kept[:, :size], order[fits][:, :size]))
        rows, first = rows[~fits], False
        part, width = probs[rows], min(width * NUCLEUS_GROWTH, vocab)
    return groups


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, V) probabilities with every token outside the top-p nucleus set to 0 (the rest unnormalised)."""
    out = torch.zeros_like(probs)
    for rows, kept, tokens in nucleus_groups(probs, top_p):
        out[rows] = torch.zeros_like(probs[rows]).scatter_(-1, tokens, kept)
    return out


def prompt_batch(prompts: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows start..start+size of the prompt table, cycling when generation needs more rows than prompts."""
    idx = torch.arange(start, start + size) % prompts.shape[0]
    return prompts[idx]


def stepper(bundle: Any) -> Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]:
    """`step(new_ids, state) -> (last logits (B, V), state)`: incremental with a KV cache where the model
    has one (patchc's llama2.c model, Hugging Face causal LMs), else the whole sequence re-run per token."""
    model = bundle.model
    if hasattr(model, "new_cache"):
        def step_llama(ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
            cache = model.new_cache() if cache is None else cache
            return model(ids, cache=cache)[:, -1], cache
        return step_llama
    if hasattr(model, "generate"):  # an HF causal LM (encoders never generate: corpus trains them on real text)
        # transformers renamed the KV cache argument and output `past_key_values` -> `cache` (the old name
        # warns from 5.2x and goes in 5.40); take whichever this model's forward has.
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        def step_hf(ids: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
            out = model(input_ids=ids, use_cache=True, **{name: past})
            return out.logits[:, -1], out[name]
        return step_hf

    def step_full(ids: torch.Tensor, seen: Any) -> tuple[torch.Tensor, Any]:
        seen = ids if seen is None else torch.cat([seen, ids], dim=1)
        return bundle.logits(model, seen)[:, -1], seen
    return step_full


@torch.no_grad()
def generate_blocks(bundle: Any, spec: SelfDataSpec, prompts: torch.Tensor, progress: bool = False) -> torch.Tensor:
    """(n_blocks, block_len + 1) token ids sampled from the dense model, each row continuing one prompt.

    `prompts`: (P, L) ids, each a BOS followed by a training document's first tokens. Rows are generated
    in batches of `spec.batch`; the random numbers come from one seeded CPU generator, so the text depends
    only on (model, spec, prompts) and the device's arithmetic, not on the batch's timing.
    """
    gen = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(prompts.shape[0], generator=gen)
    prompts, rows = prompts[order], []
    device = next(bundle.model.parameters()).device
    step = stepper(bundle)
    was_training = bundle.model.training
    bundle.model.eval()
    starts = range(0, spec.n_blocks, spec.batch)
    try:
        for start in progress_bar(starts, desc=f"generating {spec.n_blocks} training blocks", unit="batch",
                                  disable=not progress):
            ids = prompt_batch(prompts, start, min(spec.batch, spec.n_blocks - start))
            logits, state = step(ids.to(device), None)
            while ids.shape[1] < spec.block_len + 1:
                if not bool(torch.isfinite(logits).all()):  # sampling would pick tokens at random, or fail obscurely
                    raise FloatingPointError(
                        f"{getattr(bundle, 'name', 'the model')}: NaN or inf in its logits at token {ids.shape[1]} of "
                        "the text it writes for training; float16 overflows in some models (try --dtype bfloat16 "
                        "or float32), or pass --train-data real to train on real text alone")
                nxt = sample_next(logits, spec.temperature, spec.top_p, gen)
                ids = torch.cat([ids, nxt], dim=1)
                if ids.shape[1] < spec.block_len + 1:
                    logits, state = step(nxt.to(device), state)
            rows.append(ids)
    finally:
        bundle.model.train(was_training)
    return torch.cat(rows)


def prompts_from(docs: list[str], tokenizer: Any, prompt_len: int, bos: bool = True) -> torch.Tensor:
    """(P, L): the first L token ids (BOS included when `bos`) of every training document that has them,
    L = prompt_len + 1 with BOS, else prompt_len (at least 1)."""
    from patchc.job.data import tokenize_documents

    length = max(1, prompt_len + int(bos))
    heads = [ids[:length] for ids in (tokenize_documents([d], tokenizer, bos=bos) for d in docs) if ids.numel() >= length]
    if not heads:
        raise ValueError(f"self-generated text: no training document has {length} tokens to use as a prompt")
    return torch.stack(heads).long()


def cache_key(model_id: str, spec: SelfDataSpec, prompts: torch.Tensor) -> str:
    """Everything that changes the generated text: the model, the sampling settings and method, the prompts."""
    h = hashlib.sha256()
    h.update(json.dumps({"model": model_id, "sampler": SAMPLER, **asdict(spec)}, sort_keys=True).encode())
    h.update(prompts.numpy().tobytes())
    return h.hexdigest()[:16]


def model_id(bundle: Any) -> str:
    """The model's identity for the cache: its source file's size and mtime plus a weight checksum
    (a model edited in place gets new text)."""
    # the resolved path: `patchc recover` reopens the model by the absolute path its run recorded
    parts = [bundle.name, os.path.realpath(bundle.source) if bundle.source else str(bundle.source)]
    if bundle.source and os.path.exists(bundle.source):
        st = os.stat(bundle.source)
        parts += [str(st.st_size), str(st.st_mtime_ns)]
    with torch.no_grad():
        checksum = sum(float(p.detach().double().sum()) for p in bundle.model.parameters())
    return "|".join(parts + [f"{checksum:.12e}", str(next(bundle.model.parameters()).dtype)])


def self_generated_blocks(bundle: Any, spec: SelfDataSpec, prompts: torch.Tensor, cache_dir: Path | None,
                          progress: bool = False) -> tuple[torch.Tensor, bool]:
    """(blocks, from_cache): the cached text for this model/spec/prompts, else freshly generated and cached."""
    key = cache_key(model_id(bundle), spec, prompts)
    path = cache_dir / f"selfdata-{key}.pt" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if state.get("format") == CACHE_FORMAT and state.get("key") == key:
                return state["blocks"], True
        except Exception:  # noqa: BLE001 - a damaged cache entry is regenerated, never trusted
            pass
    blocks = generate_blocks(bundle, spec, prompts, progress=progress)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                torch.save({"format": CACHE_FORMAT, "key": key, "spec": asdict(spec), "blocks": blocks}, tmp)
        except OSError as exc:  # the cache only saves time: a read-only or odd folder must not stop the run
            warnings.warn(f"generated training text not cached in {path.parent}: {exc}", stacklevel=2)
    return blocks, False


__all__ = ["SelfDataSpec", "sample_next", "nucleus", "nucleus_groups", "pick", "generate_blocks", "prompts_from",
           "self_generated_blocks"]
