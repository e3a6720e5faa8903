"""`ModelBundle`: what the job holds of a model, whatever its source (`patchc.models.spec.load_model`
builds one from a spec).

A bundle carries the model (fp32, eval mode) and everything the job needs around it, so the rest of
patchc never branches on where a model came from:

  * ``tokenizer``: ``encode(text, bos=True) -> list[int]`` and ``decode(ids) -> str`` (llama2.c's own
    tokenizer, or `HFTokenizer` around a Hugging Face one; ``tokenizer.hf`` is the HF object, for
    batching sentences);
  * ``reload()``: a fresh dense copy (baselines and ``plan.apply`` start from it);
  * ``export(model, fixed_len=None)``: ``torch.export`` with dynamic batch and sequence dimensions
    (`fixed_len`: where a causal LM can only be exported per length, the length of its first graph);
  * ``logits(model_or_program, ids)`` (causal) / ``embed(model_or_program, sentences)`` (encoder);
  * ``block_len_limit``: the longest sequence the model's positions allow.

Example:
    >>> from patchc.models import load_model
    >>> b = load_model("/work/shared/models/stories260K/stories260K.bin")
    >>> b.kind, b.logits(b.model, torch.tensor([b.tokenizer.encode("Once")])).shape
    ('causal', torch.Size([1, 2, 512]))
    >>> e = load_model("minilm")
    >>> e.embed(e.model, ["A cat sat.", "A dog ran."]).shape
    torch.Size([2, 384])
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from patchc.models import hf as _hf
from patchc.models.hf_export import export_causal_lm, export_encoder
from patchc.models.llama2c import export_llama, load_llama2c
from patchc.models.llama2c_tokenizer import load_tokenizer
from patchc.models.outputs import device_of, logits_of
from patchc.utils.progress import quiet_loading

Kind = Literal["causal", "encoder"]
_TOKENIZER_NAMES = ("tokenizer.bin",)


# ----------------------------------------------------------------------------------------------- tokenizer


class HFTokenizer:
    """A Hugging Face tokenizer behind llama2.c's interface: ``encode(text, bos=True, eos=False)``, ``decode(ids)``.

    Causal models: ``bos=True`` prepends the BOS token (EOS when the model has none, as GPT-2 does), the
    text itself is encoded without special tokens. Encoders: ``bos=True`` adds the model's own special
    tokens (``[CLS] ... [SEP]`` for BERT), which is how the encoder saw text in training.
    ``hf`` is the wrapped tokenizer (use it to pad batches of sentences).

    Example:
        >>> tok = HFTokenizer(transformers.AutoTokenizer.from_pretrained(minilm_dir()), kind="encoder")
        >>> tok.encode("hello")
        [101, 7592, 102]
        >>> tok.decode([101, 7592, 102])
        'hello'
    """

    def __init__(self, hf: Any, kind: Kind) -> None:
        self.hf = hf
        self.kind = kind
        # `bos_id` (not `bos_token_id`) makes patchc.job.data treat this as a llama2.c-style tokenizer.
        self.bos_id: int | None = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id
        self.eos_id: int | None = hf.eos_token_id
        self.pad_id: int | None = getattr(hf, "pad_token_id", None)  # getattr: minimal HF-like tokenizers too

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if self.kind == "encoder":
            return list(self.hf.encode(text, add_special_tokens=bos))
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if bos:
            if self.bos_id is None:
                raise ValueError(f"{getattr(self.hf, 'name_or_path', 'tokenizer')}: tokenizer has neither a BOS nor an EOS token to start documents with; pass --no-bos (patchc prune) or bos=False")
            ids = [self.bos_id] + ids
        if eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, kind={self.kind!r}, vocab={self.vocab_size})"


# ----------------------------------------------------------------------------------------------- bundle


def _not_for(name: str, kind: str, what: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> Any:
        raise TypeError(f"{name} is a {kind} model: it has no {what}")

    return refuse


@dataclass
class ModelBundle:
    """A loaded model with its tokenizer, exporter, fresh-copy factory and output adapters.

    ``logits`` exists for causal models and ``embed`` for encoders; the other one raises TypeError.
    ``source`` is the file or folder the model came from; ``embed_max_len`` the truncation ``embed``
    applies (sentence-transformers' 256 for all-MiniLM-L6-v2).

    Example:
        >>> b = load_model("minilm")
        >>> prog = patchc.transform(b.export(b.model), patchc.PatchConfig(tile=(32, 32), sparsity=0.3))
        >>> b.embed(prog, ["A sentence."]).shape
        torch.Size([1, 384])
    """

    name: str
    kind: Kind
    model: nn.Module
    tokenizer: Any
    reload: Callable[[], nn.Module]
    export: Callable[..., torch.export.ExportedProgram]
    logits: Callable[[Any, torch.Tensor], torch.Tensor]
    embed: Callable[[Any, Sequence[str]], torch.Tensor]
    block_len_limit: int
    source: str = ""
    device: str = "cpu"
    embed_max_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hf_tokenizer(self) -> Any | None:
        """The Hugging Face tokenizer (HF models), else None."""
        return getattr(self.tokenizer, "hf", None)

    def require_tokenizer(self) -> Any:
        """The tokenizer, or a ValueError naming the model when none was found beside it."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name}: no tokenizer found beside {self.source or 'the model'}; copy the "
                             "model's tokenizer files (tokenizer.json, tokenizer_config.json, ...) into that folder")
        return self.tokenizer


# ----------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Eval mode for the duration (deterministic masks for MaskedProgram); restored afterwards.
    Exported GraphModules refuse .eval(); they have no train-time behaviour to switch anyway."""
    was = None
    if isinstance(model, nn.Module):
        try:
            was = model.training
            model.eval()
        except (NotImplementedError, RuntimeError):
            was = None
    try:
        yield
    finally:
        if was:
            model.train()


def _plain_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return logits_of(model(ids))


def _hf_causal_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    # HF models and programs exported by `export_causal_lm` take use_cache=False (it is part of the
    # exported signature); a program exported without that kwarg refuses it, so fall back to plain.
    try:
        out = model(ids, use_cache=False)
    except (TypeError, ValueError, RuntimeError) as e:
        if "use_cache" not in str(e) and "keyword" not in str(e):
            raise
        out = model(ids)
    return logits_of(out)


def _make_embed(hf_tok: Any, max_len: int, device: str) -> Callable[..., torch.Tensor]:
    def embed(model: Any, sentences: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """Unit-norm mean-pooled sentence embeddings (n, H) on the CPU, as sentence-transformers computes them."""
        sentences = list(sentences)
        if not sentences:
            raise ValueError("embed: no sentences")
        dev = device_of(model, device)
        # Batch sentences of similar length together (less padding: long WikiText sentences next to
        # short ones cost ~2x otherwise); the result is put back in the caller's order.
        lengths = [len(ids) for ids in hf_tok(sentences, truncation=True, max_length=max_len)["input_ids"]]
        order = sorted(range(len(sentences)), key=lambda i: (lengths[i], i))
        out = torch.empty(0)
        with torch.no_grad(), _eval_mode(model):
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                enc = hf_tok([sentences[i] for i in idx], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
                ids, mask = enc["input_ids"].to(dev), enc["attention_mask"].to(dev)
                hidden = _hf.hidden_of(model(ids, mask)).float()
                pooled = torch.nn.functional.normalize(_hf.mean_pool(hidden, mask), dim=-1).cpu()
                if out.numel() == 0:
                    out = torch.empty(len(sentences), pooled.shape[-1])
                out[torch.tensor(idx)] = pooled
        return out

    return embed


# ----------------------------------------------------------------------------------------------- loaders


def _find_llama2c_tokenizer(path: Path, vocab_size: int) -> Path | None:
    for name in (f"tok{vocab_size}.bin", "tok512.bin", *_TOKENIZER_NAMES):
        candidate = path.parent / name
        if candidate.is_file():
            return candidate
    return None


def _is_tokenizer_file(p: Path) -> bool:
    return p.name.startswith("tok") and p.suffix == ".bin" and (p.name == "tokenizer.bin" or p.stem[3:].isdigit())


def _load_llama2c_bundle(spec: str, path: Path, device: str, dtype: torch.dtype) -> ModelBundle:
    def load() -> nn.Module:
        return load_llama2c(path).to(device=device, dtype=dtype).eval()

    model = load()
    tok_path = _find_llama2c_tokenizer(path, model.config.vocab_size)
    tokenizer = load_tokenizer(tok_path) if tok_path else None
    return ModelBundle(
        name=path.stem,
        kind="causal",
        model=model,
        tokenizer=tokenizer,
        reload=load,
        export=lambda m, fixed_len=None: export_llama(m),  # always dynamic in the sequence
        logits=_plain_logits,
        embed=_not_for(path.stem, "causal", "sentence embeddings (embed)"),
        block_len_limit=model.config.max_seq_len,
        source=str(path),
        device=device,
    )


def _sentence_bert_max_len(folder: Path) -> int | None:
    cfg = folder / "sentence_bert_config.json"
    if not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text()).get("max_seq_length")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _load_hf_bundle(spec: str, source: str, name: str, device: str, dtype: torch.dtype,
                    progress: bool = True) -> ModelBundle:
    config = _hf.hf_config(source)
    kind = _hf.hf_kind(config)
    limit = _hf.max_positions(config, default=512 if kind == "encoder" else 2048)
    loading = contextlib.nullcontext if progress else quiet_loading
    if kind == "causal":
        with loading():
            model, hf_tok = _hf.load_hf_causal(source, device, config, dtype)
        tokenizer = HFTokenizer(hf_tok, "causal") if hf_tok is not None else None
        return ModelBundle(
            name=name,
            kind="causal",
            model=model,
            tokenizer=tokenizer,
            reload=quiet_loading()(lambda: _hf.load_hf_causal(source, device, config, dtype)[0]),  # a bar per reload: noise
            export=lambda m, fixed_len=None: export_causal_lm(m, fixed_len=fixed_len),
            logits=_hf_causal_logits,
            embed=_not_for(name, "causal", "sentence embeddings (embed)"),
            block_len_limit=limit,
            source=source,
            device=device,
        )
    with loading():
        model, hf_tok = _hf.load_hf_encoder(source, device, config=config, dtype=dtype)
    if hf_tok is None:
        raise ValueError(f"{spec}: encoder found in {source} but no tokenizer files beside it (embed needs one)")
    folder = Path(source) if Path(source).is_dir() else None
    st_len = _sentence_bert_max_len(folder) if folder else None
    embed_len = min(limit, st_len or limit)
    return ModelBundle(
        name=name,
        kind="encoder",
        model=model,
        tokenizer=HFTokenizer(hf_tok, "encoder"),
        reload=quiet_loading()(lambda: _hf.load_hf_encoder(source, device, config=config, dtype=dtype)[0]),
        export=lambda m, fixed_len=None: export_encoder(m),  # always dynamic in the sequence
        logits=_not_for(name, "encoder", "LM head (logits)"),
        embed=_make_embed(hf_tok, embed_len, device),
        block_len_limit=limit,
        source=source,
        device=device,
        embed_max_len=embed_len,
    )


__all__ = ["HFTokenizer", "ModelBundle"]
