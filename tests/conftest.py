"""Shared fixtures: tiny models, the real material under ../shared when it is there, older Tritons beside the venv."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# Triton decides interpreted vs compiled per @jit function when it is decorated, its own library included,
# so on a CPU-only machine the interpreter must be on before any test module imports triton: otherwise the
# order in which modules are collected decides whether the kernel tests can run at all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the cores torch would use: a share each, not all of them each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# backend="patch" resolves through the package's entry point; a GPU machine runs the suite from the working
# tree (PYTHONPATH=., nothing installed), where only registering it here makes the name known.
if "patch" not in torch._dynamo.list_backends(exclude_tags=()):
    from patchc.runtime.backend import patch_backend

    torch._dynamo.register_backend(patch_backend, name="patch")

# The files that take longest (seconds of work on 2 cores, `pytest --durations=0`), run first: `make test`
# hands whole files to 2 workers in collection order (--dist loadfile --no-loadscope-reorder), and a long
# file drawn last is a tail one worker runs alone. xdist's own order (most tests first) put the one-test
# real-model and multi-process files last: two minutes of tail.
LONGEST_FIRST = ("test_backend_experts.py", "test_families.py", "test_bench.py", "test_fsdp_recover.py",
                 "test_runtime.py", "test_codegen_compile.py", "test_runs.py", "test_cli.py",
                 "test_quality_stories.py", "test_quality_minilm.py", "test_hf_models.py", "test_seq_graphs.py",
                 "test_distributed.py", "test_codegen_interp.py", "test_fsdp.py", "test_generate_speed.py",
                 "test_report.py", "test_backend_packs.py", "test_peft.py", "test_grouped_grad.py",
                 "test_kolibri.py", "test_fsdp_per_length.py", "test_resume_rows.py", "test_job_device_memory.py",
                 "test_recover_resume.py", "test_family_sweep.py", "test_calibrate_experts.py",
                 "test_grouped_kernels.py", "test_one_graph.py", "test_ergo.py", "test_interpreter_patches.py",
                 "test_stopping.py", "test_unpack.py", "test_import_sparse.py", "test_experts_runtime.py",
                 "test_hf_compile_config.py", "test_recover.py", "test_transform.py", "test_splitk_fixup.py",
                 "test_longcat.py")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked `full`: the larger form of checks whose smaller form the "
                          "default run (and CI) keeps under its 10 minutes (`make test-full`)")


def pytest_collection_modifyitems(session, config, items):
    unmarked = [item.nodeid for item in items if _needs_cuda(item) and not item.get_closest_marker("gpu")]
    if unmarked:  # benchmarks/gpu_lease.sh runs `-m gpu` in the files that say `mark.gpu`: these would not run
        raise pytest.UsageError(f"tests skipped without a CUDA GPU must be marked @pytest.mark.gpu: {unmarked}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: in-file order kept
    if not config.getoption("--full"):
        skip = pytest.mark.skip(reason="the full form of a check whose smaller form runs: `make test-full`")
        for item in items:
            if item.get_closest_marker("full"):
                item.add_marker(skip)


def _needs_cuda(item) -> bool:
    """Whether a test is skipped here for want of CUDA (a true skipif whose reason names CUDA)."""
    if torch.cuda.is_available():
        return False
    return any(m.args and m.args[0] is True and "cuda" in str(m.kwargs.get("reason", "")).lower()
               for m in item.iter_markers("skipif"))


SHARED = Path(os.environ.get("PATCHC_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
STORIES = SHARED / "models" / "stories260K"
TINYSTORIES = SHARED / "data" / "tinystories_sample.txt"

def save_word_tokenizer(folder, words=("the", "cat", "sat")) -> None:
    """A word-level transformers tokenizer in `folder`: <unk> 0, <s> 1 (bos), </s> 2 (eos), then `words`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)


def prune_tiny_folder(model, tmp_path, name: str):
    """`patchc prune` (4 steps of 2 x 16 tokens, every baseline) on `model` saved as tmp_path / name with a word
    tokenizer, over a tiny text, checking that every one-shot 2:4 baseline pruned half the planned weights: the
    run's plan; the run is in tmp_path / "run"."""
    import patchc
    from patchc.job.options import PruneOptions
    from patchc.job.prune import run_prune

    model.save_pretrained(tmp_path / name)
    save_word_tokenizer(tmp_path / name)
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(" ".join(["the cat sat"] * (20 + i)) for i in range(24)))
    report = run_prune(PruneOptions(model=str(tmp_path / name), data=(str(data),), steps=4, block_len=16,
                                    eval_context=32, batch_size=2, calib_blocks=4, progress=False, plots=False,
                                    train_data="real", eval_data=(), out=str(tmp_path / "run")))
    rows = {r["name"]: r for r in report["results"]}
    for method in ("magnitude", "wanda", "sparsegpt"):
        assert rows[f"{method} 2:4"]["sparsity"] == pytest.approx(0.5, abs=1e-6), method
    return patchc.TilePlan.load(tmp_path / "run" / "plan.patch")


def train_and_harden(prog, ids: torch.Tensor, steps: int = 3):
    """A few mask steps of a causal LM program (loss: the mean squared logit, on 2 x 16-token batches), then
    (the eval program's logits at `ids`, its hardened plan, verified)."""
    import patchc

    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    patchc.train_masks(prog, batches, lambda p, x: p(x, use_cache=False).logits.float().square().mean(), steps=steps,
                       progress=False)
    prog.eval()
    with torch.no_grad():
        masked = prog(ids, use_cache=False).logits
    plan = patchc.harden(prog)
    plan.verify()
    return masked, plan


def check_ones_and_hardened(prog, model, lengths=(16, 23)) -> None:
    """A causal LM program with every mask at one is `model` at each of `lengths`; in eval mode, its hardened
    plan applied to a copy of `model` is the program (2 x 16 tokens)."""
    import copy

    import patchc

    for length in lengths:
        ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), prog.mask_mode("ones"):
            torch.testing.assert_close(prog(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       atol=1e-5, rtol=1e-5)
    prog.eval()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        masked = prog(ids, use_cache=False).logits
        pruned = patchc.harden(prog).apply(copy.deepcopy(model))
        torch.testing.assert_close(pruned(ids, use_cache=False).logits, masked, atol=1e-5, rtol=1e-5)


def load_benchmark(name: str):
    """The script benchmarks/<name>.py as a module (the scripts are not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tune_twice(tmp_path, time_fn):
    """A mixed and an all-2:4 layer tuned for sm_90 with `time_fn` into a cache, then read back from it:
    (plan, tuned, cached). Fails if reading back timed anything."""
    from patchc.codegen.reference import random_tile_plan
    from patchc.runtime.cache import TuneCache
    from patchc.runtime.tuner import tune_plan

    plan = random_tile_plan({"mixed.weight": dict(n=128, k=256, tile=(64, 64), kinds="mixed"),
                             "sparse.weight": dict(n=64, k=256, tile=(64, 64), kinds="sparse")})
    kw = dict(batch_size=4, prefill_len=64, dtype=torch.float16, device="cpu", progress=False, arch="sm_90")
    tuned = tune_plan(plan, cache=TuneCache(tmp_path / "t.json"), time_fn=time_fn, **kw)
    untimed = []  # a cached tuning times nothing
    cached = tune_plan(plan, cache=TuneCache(tmp_path / "t.json"), cached_only=True, time_fn=untimed.append, **kw)
    assert not untimed
    return plan, tuned, cached


def in_fresh_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread: its Python frames start on a fresh data stack. CPython 3.11 maps
    frame stack chunks of 16 KiB as they fill and unmaps them as they empty; deep under pytest's frames, the
    Triton interpreter's hot calls sat on a chunk edge and mapped and unmapped one millions of times
    (3.9M page faults: the bench dry run took 85 s instead of 42)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


@pytest.fixture(autouse=True, scope="session")
def _reuse_llama2c_exports():
    """Jobs in this process export a stories260K structure once; later ones get a copy bound to their own
    model (`tests/export_cache.py`: what makes it safe)."""
    import patchc.models.bundle as bundle
    from tests.export_cache import reuse_llama2c_exports

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bundle, "export_llama", reuse_llama2c_exports(bundle.export_llama))
        yield


@pytest.fixture(autouse=True)
def _restore_threads():
    """The job's stages pick torch's thread count for their model (one thread for a tiny one); a test that
    calls them directly must not hand that count on to every test after it (the MiniLM quality test ran
    1.6x slower for it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _older_tritons() -> list[Path]:
    found = (p.parent.parent for p in Path(sys.prefix).glob("triton-*/triton/__init__.py"))
    return sorted(p for p in found if re.fullmatch(r"triton-\d+\.\d+\.\d+", p.name))  # not a .part left by a failed install


# Older Tritons installed beside the venv's own, each a folder for PYTHONPATH: `make setup` puts 3.6 (the
# one GPU machines with torch 2.11 have) in `.venv/triton-3.6.0`, so the suite checks the kernels under it.
OLDER_TRITONS = _older_tritons()


def older_triton_params() -> list:
    """One pytest param per `OLDER_TRITONS` folder; without one, a single param that skips and says why."""
    if not OLDER_TRITONS:
        return [pytest.param(None, marks=pytest.mark.skip(
            reason=f"no older Triton beside this one in {sys.prefix} (make setup installs COMPAT_TRITON)"))]
    return [pytest.param(p, id=p.name) for p in OLDER_TRITONS]


def older_triton_env(folder: Path | None, **extra: str) -> dict[str, str]:
    """A subprocess's environment that imports patchc from here and Triton (with numpy) from `folder`
    (None: the venv's own)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (folder, root, env.get("PYTHONPATH")) if p)
    return env


needs_shared = pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(), reason=f"real model not found under {SHARED}")


class TinyMLP(nn.Module):
    """Embedding -> two linears (one with bias, one whose K is not a multiple of 4) -> tied head."""

    def __init__(self, vocab: int = 32, dim: int = 24, hidden: int = 40, odd: int = 18) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, odd, bias=False)
        self.odd = nn.Linear(odd, dim, bias=False)  # K = 18: no 2:4 groups
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.odd(torch.relu(self.down(torch.relu(self.up(h)))))
        return self.out(h)


class TiedLinears(nn.Module):
    """a -> mid -> b where b shares a's weight (a block several layers share, as Zamba's), with a bias of its own
    or none; `b_first` reads the weight through b first (so dynamo names it `b.weight`)."""

    def __init__(self, b_bias: bool = True, b_first: bool = False, dim: int = 32) -> None:
        super().__init__()
        self.a, self.mid = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim, bias=b_bias)
        self.b.weight = self.a.weight
        self.b_first = b_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, last = (self.b, self.a) if self.b_first else (self.a, self.b)
        return last(torch.tanh(self.mid(first(x))))


@pytest.fixture
def tiny_mlp() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


def assert_close_fp32(got: torch.Tensor, want: torch.Tensor, ulps: float = 16.0) -> None:
    """fp32 results of one computation summed in another order: within `ulps` float32 steps of the largest
    |want|. A fixed atol is not a tolerance here: outputs of ~200 differ by ~2e-5 between vector kernels
    (AVX2 against AVX-512), while a wrong row or expert is off by the output's own size."""
    atol = ulps * torch.finfo(torch.float32).eps * float(want.detach().abs().max())
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


def prune_24(w: torch.Tensor) -> torch.Tensor:
    """`w` (..., K) keeping the 2 largest magnitudes of every group of 4 along K (a 2:4 magnitude pruning)."""
    mags = w.abs().reshape(*w.shape[:-1], -1, 4)
    return w * torch.zeros_like(mags).scatter_(-1, mags.topk(2, -1).indices, 1.0).reshape(w.shape)


def tiny_hf(kind: str):
    transformers = pytest.importorskip("transformers")
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    cfg = cfg_cls(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return model_cls(cfg).eval()


def tiny_llama_and_24_plan():
    """A tiny Llama (hidden 64, 2 layers) and a random 2:4 plan of its 14 decoder linears, 16 x 16 tiles; the
    model keeps its dense weights (`plan.apply` prunes a copy)."""
    transformers = pytest.importorskip("transformers")
    from patchc.codegen.reference import random_24_mask
    from patchc.ir import TilePlan

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    weights = {f"{n}.weight": m.weight.detach() * random_24_mask(*m.weight.shape, g)
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    return model, TilePlan.from_weights(weights, tile=(16, 16))
