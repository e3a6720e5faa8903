"""--offload (`patchc.models.offload`): a model's blocks wait in host memory and each is copied to the device for
its own forward. On CPU the copies are host-to-host, so these tests check the mechanism (one block's copy at a
time, the host tensors stay the weights, the same numbers); the GPU test checks where the bytes are."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

import patchc
from patchc.job import memory
from patchc.job.options import PruneOptions
from patchc.models.offload import BlockStream, blocks_of, device_share, stream_blocks, streaming

transformers = pytest.importorskip("transformers")


def _llama(tied: bool = True, layers: int = 3, hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).eval()


def _ids(batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))


def _watch(model: nn.Module, stream: BlockStream) -> list[tuple[str, list[str], bool]]:
    """Inside each block's attention: (block, blocks with a copy now, whether its weights are copies)."""
    host = {n: p.data_ptr() for n, p in model.named_parameters()}
    seen = []
    for path, block in blocks_of(model):
        def look(module, args, path=path, block=block):
            names = [f"{path}.{n}" for n, _ in block.named_parameters()]
            copied = all(model.get_parameter(n).data_ptr() != host[n] for n in names)
            seen.append((path, list(stream.on_device), copied))
        block.self_attn.register_forward_pre_hook(look)
    return seen


def test_a_streamed_model_gives_its_own_logits_with_one_block_copied_at_a_time():
    model = _llama()
    ids = _ids()
    dense = model(ids).logits
    host = {n: p.data_ptr() for n, p in model.named_parameters()}
    stream = stream_blocks(model, "cpu")
    assert streaming(model) is stream and stream_blocks(model, "cpu") is stream  # streamed once
    assert [p for p, _ in stream.blocks] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    # outside the blocks: the tied embedding / head, the final norm; rotary's inv_freq sits outside too
    assert {id(t) for t in stream.resident} == {id(model.model.embed_tokens.weight), id(model.model.norm.weight),
                                                  id(model.model.rotary_emb.inv_freq),
                                                  id(model.model.rotary_emb.original_inv_freq)}
    seen = _watch(model, stream)
    assert torch.equal(model(ids).logits, dense)
    assert seen == [(f"model.layers.{i}", [f"model.layers.{i}"], True) for i in range(3)]
    assert stream.on_device == [] and stream.copies_made == 3
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == host  # the copies were dropped, not kept
    stream.remove()
    assert streaming(model) is None and torch.equal(model(ids).logits, dense) and stream.copies_made == 3


def test_generation_with_a_kv_cache_matches_the_model():
    model = _llama(tied=False)
    prompt = _ids(1, 6)
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    stream = stream_blocks(model, "cpu", poison=True)  # NaN would show a weight read outside its block
    assert id(model.lm_head.weight) in {id(t) for t in stream.resident}
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), tokens)
    assert stream.copies_made == 3 * 6 and not stream.prefetch  # every block once per forward: the prompt, 5 steps
    stream.remove()
    stream = stream_blocks(model, "cpu", poison=True, prefetch=True)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), tokens)
    assert (stream.copies_made, stream.prefetched, stream.misses) == (3 * 6, 2 * 6, 0)


def test_a_block_that_fails_still_drops_its_copy(monkeypatch):
    model = _llama()
    dense = model(_ids()).logits
    stream = stream_blocks(model, "cpu")
    host = {n: p.data_ptr() for n, p in model.named_parameters()}
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", lambda x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(_ids())
    assert stream.on_device == [] and {n: p.data_ptr() for n, p in model.named_parameters()} == host

    def interrupt(x):
        raise KeyboardInterrupt  # not an Exception: torch skips the always-called post-hooks
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(_ids())
    assert stream.on_device == ["model.layers.1"]  # its copy is still installed
    monkeypatch.undo()
    assert torch.equal(model(_ids()).logits, dense)  # the next forward drops what was left first
    assert stream.on_device == [] and {n: p.data_ptr() for n, p in model.named_parameters()} == host
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(_ids())
    stream.remove()  # and so does taking the stream off
    assert stream.on_device == [] and {n: p.data_ptr() for n, p in model.named_parameters()} == host


def test_prefetch_copies_the_next_block_while_one_runs_and_only_within_a_forward(monkeypatch):
    model = _llama()
    ids = _ids()
    dense = model(ids).logits
    stream = stream_blocks(model, "cpu", prefetch=True)  # on a CPU the copy is made at once, not overlapped
    arriving = []
    for i, block in enumerate(model.model.layers):
        block.self_attn.register_forward_pre_hook(lambda *_, i=i: arriving.append((i, stream.arriving)))
    assert torch.equal(model(ids).logits, dense)
    assert arriving == [(0, "model.layers.1"), (1, "model.layers.2"), (2, None)]
    assert (stream.copies_made, stream.prefetched, stream.misses, stream.arriving) == (3, 2, 0, None)
    assert torch.equal(model(ids).logits, dense) and (stream.copies_made, stream.prefetched) == (6, 4)
    # a prefetched copy never outlives the forward: weights written between forwards (as `patchc eval` writes
    # the plan) are the ones the next forward reads, the first block's too
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.down_proj.weight.mul_(0.5)
    halved = model(ids).logits
    stream.remove()
    assert torch.equal(model(ids).logits, halved) and not torch.equal(halved, dense)
    stream = stream_blocks(model, "cpu", prefetch=True)
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", lambda x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(ids)
    assert stream.arriving is None and stream.on_device == []  # block 2's copy, made as block 1 started: dropped
    model.model.layers[0](torch.randn(1, 4, 64), position_embeddings=model.model.rotary_emb(
        torch.randn(1, 4, 64), torch.arange(4)[None]))  # a block run outside a forward of the model
    assert stream.arriving is None and stream.prefetched == 1  # no prefetch there, nothing left behind


def test_prefetch_learns_the_order_the_blocks_run_in():
    model = _Parallel()
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids)
    stream = stream_blocks(model, "cpu", poison=True, prefetch=True)
    assert torch.equal(model(ids), out)  # listed attentions.0, attentions.1, ffns.0, ffns.1; run in turns
    assert (stream.prefetched, stream.misses) == (0, 3)
    assert torch.equal(model(ids), out)
    assert (stream.prefetched, stream.misses, stream.copies_made) == (3, 3, 4 + 3 + 4)


class _FakeStream:
    """Records what a CUDA stream is asked to wait for and record."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.events = name, log, 0

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, event: str) -> None:
        self.log.append((self.name, "waits for", event))

    def record_event(self) -> str:
        event, self.events = f"copied {self.events}", self.events + 1
        self.log.append((self.name, "records", event))
        return event


def test_prefetch_on_a_gpu_orders_its_two_streams(monkeypatch):
    """The protocol a GPU's race would break only now and then: the side stream copies only after the compute
    stream has reached the copy's allocation (its memory was the block before's), and the compute stream reads
    a copy, or lets its memory go, only after the copy's event."""
    log: list = []
    main, side = _FakeStream("main", log), _FakeStream("side", log)

    @contextlib.contextmanager
    def on(s: _FakeStream):
        log.append(("copies on", s.name))
        yield

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    model = _llama()
    ids = _ids()
    dense = model(ids).logits
    stream = stream_blocks(model, "cpu", prefetch=True)
    stream._copier = side  # what `install` makes on a GPU
    for i, block in enumerate(model.model.layers):  # after the stream's own hook: the block has its weights
        block.register_forward_pre_hook(lambda *_, i=i: log.append(("runs", i)))
    assert torch.equal(model(ids).logits, dense)
    fetch = [("side", "waits for", "main"), ("copies on", "side")]
    assert log == [*fetch, ("side", "records", "copied 0"), ("runs", 0),
                   ("main", "waits for", "copied 0"), *fetch, ("side", "records", "copied 1"), ("runs", 1),
                   ("main", "waits for", "copied 1"), ("runs", 2)]
    log.clear()
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", lambda x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(ids)
    assert log[-2:] == [("runs", 1), ("main", "waits for", "copied 3")]  # block 2's copy let go once it is done


def test_a_gpu_named_without_an_index_is_the_current_one(monkeypatch):
    """The side stream is made on the GPU current at install; the waits must name that GPU later too."""
    from patchc.models import offload

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert offload._indexed("cuda") == torch.device("cuda", 1) and offload._indexed("cuda:0") == torch.device("cuda", 0)
    assert offload._indexed("cpu") == torch.device("cpu")


class _Looped(nn.Module):
    """A block run twice in a row (ALBERT's shared layer, HRM's loops): it prefetches itself. The next block
    shares a weight with it (Zamba's layers share a block): prefetched while the first runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(2))
        self.layers[1][1].weight = self.layers[0][0].weight

    def forward(self, x):
        return self.layers[1](self.layers[0](self.layers[0](x)))


def test_a_prefetch_reads_host_memory_while_a_copy_of_the_same_weights_is_installed(monkeypatch):
    model = _Looped()
    x = torch.randn(3, 8)
    out = model(x)
    stream = stream_blocks(model, "cpu", prefetch=True)
    host = {p.data_ptr() for p in model.parameters()}
    assert len(host) == 7 and not stream.resident  # the shared weight stays in host memory: blocks hold it
    read, fetched = [], []
    sources, fetch = stream._sources, stream._fetch

    def spy(path):
        read.append(sources(path))
        return read[-1]

    monkeypatch.setattr(stream, "_sources", spy)
    monkeypatch.setattr(stream, "_fetch", lambda path: fetched.append(path) or fetch(path))
    assert torch.equal(model(x), out) and torch.equal(model(x), out)
    # learnt: layers.0 -> layers.0 on its second run, then layers.0 -> layers.1 on its third
    assert fetched.count("layers.0") == 2 and stream.misses == 4
    assert all(t.data_ptr() in host for ts in read for t in ts)  # never the installed copy


class _TiedInside(nn.Module):
    """A head tied to a weight inside the first block: the shared tensor must stay on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_weight_tied_across_a_block_boundary_stays_resident_and_a_model_without_blocks_is_named():
    model = _TiedInside()
    x = torch.randn(3, 8)
    out = model(x)
    stream = stream_blocks(model, "cpu")
    assert {id(t) for t in stream.resident} == {id(model.head.weight)}
    assert torch.equal(model(x), out)
    with pytest.raises(ValueError, match="--offload: Sequential has no transformer blocks"):
        stream_blocks(nn.Sequential(nn.Linear(4, 4)), "cpu")
    with pytest.raises(ValueError, match="streamed to cpu already, not meta"):
        stream_blocks(model, "meta")


class _Parallel(nn.Module):
    """XLM's layout: a layer's attention and FFN in parallel lists, with no block module around them."""

    def __init__(self, peek: bool = False) -> None:
        super().__init__()
        self.peek = peek
        self.embed = nn.Embedding(16, 8)
        self.attentions = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        for attention, ffn in zip(self.attentions, self.ffns):
            x = ffn(attention(x))
        if self.peek:  # a block's weight read outside its forward: on a GPU, a device mismatch
            x = x + self.ffns[0][0].weight.sum()
        return x


def test_a_model_without_blocks_streams_the_items_of_its_outermost_lists():
    model = _Parallel()
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids)
    stream = stream_blocks(model, "cpu", poison=True)
    assert [p for p, _ in stream.blocks] == ["attentions.0", "attentions.1", "ffns.0", "ffns.1"]
    assert {id(t) for t in stream.resident} == {id(model.embed.weight)}
    assert torch.equal(model(ids), out) and stream.copies_made == 4
    assert model.ffns[0][0].weight.isnan().all()  # poisoned between forwards: the weights wait aside
    stream.remove()
    assert torch.equal(model(ids), out)


def test_poison_shows_on_a_cpu_a_weight_read_outside_its_block():
    model = _Parallel(peek=True)
    ids = torch.tensor([[1, 2, 3]])
    assert not model(ids).isnan().any()
    stream_blocks(model, "cpu", poison=True)
    assert model(ids).isnan().all()


def test_the_device_holds_the_parts_outside_the_blocks_and_one_block():
    with torch.device("meta"):
        model = _llama(tied=False, layers=4, hidden=128)
    resident, block = device_share(model)
    rotary = sum(b.numel() for b in model.model.rotary_emb.buffers())  # inv_freq and its original: 16 + 16
    assert resident == 2 * 256 * 128 + 128 + rotary and rotary == 32  # embedding, head, final norm, rotary
    assert block == sum(p.numel() for p in model.model.layers[0].parameters())


def _plan():
    """A magnitude 2:4 plan of stories260K (16 x 16 tiles), as `patchc eval` reads plans."""
    bundle = patchc.models.load_model(PruneOptions().model)
    masks = patchc.oneshot(bundle.model, method="magnitude", pattern="2:4")
    return patchc.TilePlan.from_masks(bundle.model, masks, tile=(16, 16))


def test_eval_and_sample_score_and_write_what_they_do_without_it(tmp_path, monkeypatch):
    from patchc.job.rescore import rescore
    from patchc.job.sample import write_samples

    streams = []
    install = BlockStream.install
    monkeypatch.setattr(BlockStream, "install", lambda self: streams.append(self) or install(self))
    _plan().save(tmp_path / "plan.patch")
    split = {"data": list(PruneOptions().data), "seed": 0, "eval_fraction": 0.2}
    plain = rescore(tmp_path / "plan.patch", **split)
    assert streams == []
    with pytest.warns(UserWarning, match="--offload on cpu: the weights are in host memory already"):
        streamed = rescore(tmp_path / "plan.patch", offload=True, **split)
    assert streamed["dense"] == plain["dense"] and streamed["pruned"] == plain["pruned"]
    assert plain["pruned"]["perplexity"] > plain["dense"]["perplexity"]  # the plan was applied
    assert len(streams) == 1  # the plan goes into the scored dense model: no second copy
    # 2,920 tokens: 11 windows of 256 and a shorter one, in 2 forwards of the 5 blocks (3 at 8 windows a forward),
    # for the dense model and then the pruned one
    assert streams[0].copies_made == 2 * 5 * 2
    opts = PruneOptions(train_data="self", self_tokens=60, block_len=19, threads=1, progress=False)
    write_samples(opts, tmp_path / "a.txt")
    with pytest.warns(UserWarning, match="--offload on cpu"):
        write_samples(dataclasses.replace(opts, offload=True), tmp_path / "b.txt")
    assert (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text()
    assert len(streams) == 2 and streams[-1].copies_made % 5 == 0 and streams[-1].copies_made > 5  # decode steps


def test_an_offloaded_forward_scores_as_many_windows_as_2_gb_of_logits_hold():
    from patchc.job.stages import EVAL_BATCH, eval_batch

    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4))
    assert eval_batch(PruneOptions(), llama) == EVAL_BATCH == 8
    assert eval_batch(PruneOptions(offload=True), llama) == 2 * 10**9 // (256 * 32000 * 4) == 61
    assert eval_batch(PruneOptions(offload=True, eval_context=32), llama) == 64
    llama.config.vocab_size = 250_000  # Gemma's: no fewer than without --offload
    assert eval_batch(PruneOptions(offload=True), llama) == 8


def test_the_job_loads_into_host_memory_and_streams(monkeypatch):
    from patchc.job.model import load_bundle, parked

    with pytest.warns(UserWarning, match="--offload on cpu"):
        bundle = load_bundle(PruneOptions(offload=True, threads=1))
    stream = streaming(bundle.model)
    assert stream is not None and len(stream.blocks) == 5
    assert streaming(bundle.reload()) is None  # a plain host copy: `plan.apply` writes it, then it is streamed
    parks = []
    monkeypatch.setattr(stream, "park", lambda: parks.append("park"))
    monkeypatch.setattr(stream, "unpark", lambda: parks.append("unpark"))
    with parked(bundle.model):
        pass
    assert parks == ["park", "unpark"]
    from patchc.job.prune import run_prune

    with pytest.raises(ValueError, match="--offload streams a model for scoring and sampling"):
        run_prune(PruneOptions(offload=True))


def test_offload_refuses_what_host_or_gpu_cannot_hold(tmp_path, monkeypatch):
    _llama(tied=False, layers=4, hidden=128).config.save_pretrained(tmp_path)
    block = sum(p.numel() for p in _llama(False, 1, 128).model.layers[0].parameters())
    weights = (2 * 256 * 128 + 128 + 4 * block) * 2  # parameters in bf16: what `weight_bytes` counts
    on_gpu = (2 * 256 * 128 + 128 + 32 + block) * 2  # rotary's buffers with the resident parts
    opts = PruneOptions(model=str(tmp_path), device="cuda", offload=True)
    free = {"cpu": weights, "cuda": on_gpu}
    monkeypatch.setattr(memory, "free_bytes", lambda device: free[device.split(":")[0]])
    memory.check_loads(opts, torch.bfloat16)  # both just fit
    free["cuda"] = on_gpu - 1
    with pytest.raises(ValueError, match=r"the parts outside its blocks and its largest block take .* on cuda"):
        memory.check_loads(opts, torch.bfloat16)
    free.update(cuda=on_gpu, cpu=weights - 1)
    with pytest.raises(ValueError, match=r"--offload: its weights take .* host memory has .* available"):
        memory.check_loads(opts, torch.bfloat16)
    free.update(cuda=0, cpu=weights)  # without --offload the whole model must fit, and the refusal names it
    with pytest.raises(ValueError, match=r"`patchc eval` and `patchc sample` take --offload"):
        memory.check_loads(PruneOptions(model=str(tmp_path), device="cuda"), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the blocks are copied to it")
def test_on_a_gpu_only_the_resident_parts_and_two_blocks_take_device_memory():
    model = _llama(tied=False, layers=8, hidden=1024).to(torch.bfloat16)
    ids = _ids(1, 64)
    with torch.no_grad():
        dense = model.float()(ids).logits  # an independent fp32 computation on the CPU
    model.to(torch.bfloat16)
    resident, block = device_share(model)
    warm = torch.ones(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(warm, warm)  # cuBLAS's workspace, allocated by torch's allocator, before measuring
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stream = stream_blocks(model, "cuda")  # prefetch: this GPU has room for it
    with torch.no_grad():
        logits = model(ids.cuda()).logits.float().cpu()
    peak = torch.cuda.max_memory_allocated() - before
    whole = sum(p.numel() for p in model.parameters()) * 2
    # bf16 weights, the running block's and the next one's; activations of 64 tokens are small. The whole
    # model (151 MB) would not fit under the bound.
    assert peak < (resident + 2 * block) * 2 + 64 * 2**20 < whole
    assert (stream.prefetch, stream.prefetched, stream.misses) == (True, 7, 0)
    assert all(p.device.type == "cpu" for _, b in stream.blocks for p in b.parameters())
    assert (logits - dense).abs().max() < 0.05 * dense.abs().max()
    stream.remove()
    stream = stream_blocks(model, "cuda", prefetch=False)
    with torch.no_grad():  # the side stream's copies are the same bytes, read once they have arrived
        assert torch.equal(model(ids.cuda()).logits.float().cpu(), logits) and stream.prefetched == 0
