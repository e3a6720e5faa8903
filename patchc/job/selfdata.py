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

from patchc.job.sampling import sample_next
from patchc.models.outputs import device_of
from patchc.utils.files import atomic_path, read_state
from patchc.utils.progress import progress as progress_bar

CACHE_FORMAT = "patchc.selfdata"
# The sampling method (patchc.job.sampling), in the cache key: 2 since vocabularies past NUCLEUS_FIRST tokens
# are drawn by inverse CDF, 3 since a nucleus past them is found by binning, in fp64, 4 since its tied tokens
# are taken in token order (all 2026-12-07; a larger vocabulary's earlier text is not reused, a smaller one's
# is regenerated the same)
SAMPLER = 4


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
    device = device_of(bundle.model)
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
                if not finite(logits):  # sampling would pick tokens at random, or fail obscurely
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


def finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`: its least and greatest values are finite (both propagate NaN). One pass with no
    bool tensor: 0.25 ms for 64 x 50K logits on 2 cores, where `isfinite().all()` took 5.8 (10% of a step)."""
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


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
            state = read_state(path)
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


__all__ = ["SelfDataSpec", "generate_blocks", "prompts_from", "self_generated_blocks"]
