"""Every bad input is named in one line (exit 2), before any folder is made; random argument mutations
never end in a traceback (issue 17's findings, CPU)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from torch import nn

import patchc
from patchc.job import cli, prune, selfdata
from patchc.job.data import load_documents
from tests.conftest import STORIES, TINYSTORIES, needs_shared

QUICK = ["--steps", "2", "--batch-size", "2", "--calib-blocks", "2", "--no-progress", "--no-plots", "--no-baselines",
         "--train-data", "real", "--eval-data"]


def one_line_error(capsys, argv: list[str], *expected: str) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2
    # transformers draws its own "Loading weights" bar on stderr; everything else must be the one line
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines() if "it/s]" not in line)
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    return err


def nan_checkpoint(tmp_path):
    raw = bytearray((STORIES / "stories260K.bin").read_bytes())
    torch.frombuffer(raw, dtype=torch.float32, offset=28)[1000] = float("nan")  # inside the embedding
    (tmp_path / "nan.bin").write_bytes(bytes(raw))
    shutil.copy(STORIES / "tok512.bin", tmp_path / "tok512.bin")
    return tmp_path / "nan.bin"


@needs_shared
def test_nan_weights_are_named_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    one_line_error(capsys, ["prune", "--model", str(nan_checkpoint(tmp_path)), "--out", str(out), *QUICK],
                   "parameter embed_tokens.weight holds 1 NaN/inf values")
    assert not out.exists()


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_oneshot_names_a_nan_layer(method):
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[1].weight[2, 3] = float("inf")
    calib = patchc.calibrate(model, [torch.randn(4, 16)], progress=False) if method != "magnitude" else None
    with pytest.raises(ValueError, match=r"layer 1\.weight: the weight holds 1 NaN/inf"):
        patchc.oneshot(model, method, "2:4", calib=calib, progress=False)


def test_non_utf8_text_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("first story\nsecond story\ncaf\xe9 story\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}: line 3 \(byte 28\) is not valid utf-8.*--encoding"):
        load_documents(path)
    assert load_documents(path, encoding="latin-1")[2] == "café story"


@needs_shared
def test_non_utf8_data_is_one_line_and_encoding_flag_reads_it(tmp_path, capsys):
    text = TINYSTORIES.read_text().replace("Once", "Caf\xe9", 3)
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    out = tmp_path / "run"
    one_line_error(capsys, ["prune", "--data", str(tmp_path / "latin.txt"), "--out", str(out), *QUICK],
                   "latin.txt: line", "pass the file's --encoding")
    assert not out.exists()
    assert cli.main(["prune", "--data", str(tmp_path / "latin.txt"), "--encoding", "latin-1", "--out", str(out),
                     *QUICK]) == 0


@needs_shared
def test_a_file_of_one_document_is_named_with_the_way_out(tmp_path, capsys):
    """One document cannot be split into train and held-out text: the file and the flags that score a
    text whole are named, before any folder is made (the same text repeated is still one document)."""
    (tmp_path / "one.txt").write_text("Once upon a time there was a cat.\n" * 2)
    out = tmp_path / "run"
    one_line_error(capsys, ["prune", "--data", str(tmp_path / "one.txt"), "--out", str(out), *QUICK],
                   "one.txt: holds one document", "--eval-data", "--text")
    assert not out.exists()


@pytest.mark.parametrize("head, what", [
    (b"GGUF\x03\x00\x00\x00" + b"\0" * 64, "a GGUF file (llama.cpp), which patchc does not read"),
    (b"\x80\x02}q\x00." + b"\0" * 64, "a torch.save checkpoint: weights without the architecture"),
    (b"PK\x03\x04" + b"\0" * 64, "a torch.save checkpoint: weights without the architecture"),
    (b"\x08\0\0\0\0\0\0\0{}      ", "a safetensors file: weights without the architecture"),
    (b"\x80\0\0\0", "tried as a llama2.c checkpoint"),  # dim 128: a (short) llama2.c header, not a pickle
])
def test_a_model_file_of_another_format_is_named(tmp_path, capsys, head, what):
    (tmp_path / "model.file").write_bytes(head)
    one_line_error(capsys, ["prune", "--model", str(tmp_path / "model.file"), "--out", str(tmp_path / "run"), *QUICK],
                   what, "config.json" if "tried" not in what else "28-byte llama2.c header")
    assert not (tmp_path / "run").exists()


def test_a_transformers_folder_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"\0" * 64)
    one_line_error(capsys, ["prune", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "run"), *QUICK],
                   "holds transformers weights (pytorch_model.bin) but no config.json")
    assert not (tmp_path / "run").exists()


def test_a_folder_patchc_wrote_is_named_as_one_to_serve(tmp_path, capsys):
    """An export / import folder given as --model (it has a config.json: transformers printed its load report,
    then "checkpoint holds no ..."), to prune, eval or import again: named, with what to do instead."""
    folder = tmp_path / "served"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "patchc-llama2c"}')
    (folder / "patchc_config.json").write_text("{}")
    for argv in (["prune", "--model", str(folder), "--out", str(tmp_path / "run"), *QUICK],
                 ["import", str(folder), "--out", str(tmp_path / "again")]):
        one_line_error(capsys, argv, f"{folder}: a folder `patchc export` / `patchc import` wrote",
                       f"patchc.from_pretrained('{folder}')")
    assert not (tmp_path / "run").exists() and not (tmp_path / "again").exists()


@needs_shared
def test_stories260k_by_name_is_the_default_model():
    """The name the help's default and every report print loads (it was refused as "not in the local Hugging
    Face cache")."""
    from patchc.job.options import DEFAULT_MODEL
    from patchc.models import load_model

    by_name, by_path = load_model("stories260K"), load_model(DEFAULT_MODEL)
    assert by_name.name == by_path.name and by_name.kind == "causal"
    for (name, a), b in zip(by_name.model.state_dict().items(), by_path.model.state_dict().values()):
        assert torch.equal(a, b), name


@needs_shared
def test_nan_loss_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    def diverge(*args, **kwargs):
        raise FloatingPointError("mask training: loss is nan at step 3 (task nan)")

    monkeypatch.setattr(prune, "train", diverge)
    argv = ["prune", "--out", str(tmp_path / "run"), *QUICK]
    one_line_error(capsys, argv, "mask training: loss is nan at step 3")
    assert not (tmp_path / "run").exists()  # nothing of the failed run is left
    with pytest.raises(FloatingPointError):
        cli.main(["--debug", *argv])
    with pytest.raises(FloatingPointError):  # after the command too
        cli.main([*argv, "--debug"])


@needs_shared
def test_out_of_memory_names_the_stage_what_to_shrink_and_resume(tmp_path, capsys, monkeypatch):
    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity"
                                     " of 79.11 GiB\nOf the allocated memory 70.1 GiB is allocated by PyTorch")

    monkeypatch.setattr(prune, "train", too_big)
    one_line_error(capsys, ["prune", "--out", str(tmp_path / "run"), *QUICK],
                   "error: out of memory in the train stage (CUDA out of memory. Tried to allocate 20.00 GiB.",
                   "try a smaller --batch-size or --block-len", "--low-memory", "rerun with --resume")
    monkeypatch.setattr(prune, "calibrate", too_big)  # the SparseGPT prior's, before training
    one_line_error(capsys, ["prune", "--out", str(tmp_path / "run2"), *QUICK],
                   "out of memory in the calibrate stage", "fewer --calib-blocks")

    def too_big_for_ram(*args, **kwargs):
        torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator's own error: a RuntimeError

    monkeypatch.setattr(prune, "calibrate", too_big_for_ram)
    one_line_error(capsys, ["prune", "--out", str(tmp_path / "run3"), *QUICK],
                   "out of memory in the calibrate stage ([enforce fail", "can't allocate memory")

    from patchc.job.memory import out_of_memory

    error = torch.OutOfMemoryError("CUDA out of memory.")
    assert out_of_memory("recover", error) == ("out of memory (CUDA out of memory.): try a smaller --batch-size; "
                                               "--resume goes on from its last checkpoint")


def test_cuda_device_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line_error(capsys, ["prune", "--device", "cuda", "--out", str(tmp_path / "run"), *QUICK],
                   "--device cuda: this machine has no CUDA GPU")


@pytest.mark.parametrize("flags, expected", [
    (["--tau", "inf", "1"], "--tau inf 1.0 must be two finite numbers > 0"),
    (["--kappa-nm", "inf", "inf"], "--kappa-nm inf inf must be two finite numbers > 0"),
    (["--lambda-norm", "nan"], "--lambda-norm nan must be a finite number"),
    (["--prior-strength", "nan"], "--prior-strength nan must be a finite number"),
])
def test_nan_and_inf_schedule_flags_are_one_line_before_any_work(tmp_path, capsys, flags, expected):
    """They trained to 'loss is nan at step 1', after loading the model and data."""
    one_line_error(capsys, ["prune", *flags, "--out", str(tmp_path / "run"), *QUICK], expected)
    assert not (tmp_path / "run").exists()


# -- random mutations -------------------------------------------------------------------------------------

VALUES = ["-1", "0", "1", "nan", "inf", "-inf", "1e309", str(2**70), "abc", "", "/nonexistent", "0.5", "99999",
          "--", "-", "é", "cuda:3", "float16", "3 4"]


def mutations(rng: random.Random, n: int) -> list[list[str]]:
    """Valid-looking command lines with one or two flags given random values."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    out = []
    for _ in range(n):
        name = rng.choice(["prune", "prune", "prune", "eval", "generate", "tune", "report", "export"])
        # --debug raises what it would have printed: its own test checks it
        flags = [a for a in sub.choices[name]._actions if a.option_strings and a.dest not in ("help", "debug")]
        argv = [name]
        if name in ("eval", "generate", "tune", "report"):
            argv.append(rng.choice(["/nonexistent/plan.patch", str(TINYSTORIES), ""]))
        if name == "export":
            argv += [rng.choice(["/nonexistent/run", ""]), "--out", "/nonexistent/out"]
        for action in rng.sample(flags, k=min(2, len(flags))):
            argv.append(action.option_strings[-1])
            if action.nargs != 0:
                argv += [rng.choice(VALUES) for _ in range(action.nargs if isinstance(action.nargs, int) else 1)]
        out.append(argv)
    return out


@needs_shared
def test_random_argument_mutations_never_end_in_a_traceback(tmp_path, capsys, monkeypatch):
    """Each mutated command either is refused by argparse (exit 2), fails with one line (exit 2), or gets as
    far as real work (stopped there: the test is about input handling, not about running jobs)."""

    class ReachedWork(Exception):
        pass

    def stop(*args, **kwargs):
        raise ReachedWork

    def quick_text(bundle, spec, prompts, progress=False):  # sampling 65K tokens is work, not input handling
        return torch.zeros(spec.n_blocks, spec.block_len + 1, dtype=torch.long)

    monkeypatch.setattr(prune, "_run", stop)
    monkeypatch.setattr(selfdata, "generate_blocks", quick_text)
    monkeypatch.chdir(tmp_path)
    for argv in mutations(random.Random(0), 150):
        if argv[0] == "prune":
            argv += ["--out", str(tmp_path / "run"), "--no-progress"]
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's usage error
            code = e.code
        except ReachedWork:
            continue
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, code, err)
        assert "Traceback" not in err and err.splitlines(), (argv, err)
        if not err.startswith("usage:"):
            assert len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def tiny_hf_dir(tmp_path, bos: bool | None):
    """A tiny HF Llama folder; `bos=None`: without a tokenizer; False: a tokenizer with neither BOS nor EOS."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    if bos is not None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = ["<unk>", "<s>", *sorted(set(TINYSTORIES.read_text().lower().split()))[:62]]
        tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        special = {"bos_token": "<s>"} if bos else {}
        transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", **special).save_pretrained(
            tmp_path / "m")
    return tmp_path / "m"


@needs_shared
def test_a_model_folder_without_tokenizer_is_one_line(tmp_path, capsys):
    model = tiny_hf_dir(tmp_path, bos=None)
    one_line_error(capsys, ["prune", "--model", str(model), "--out", str(tmp_path / "run"), *QUICK],
                   "no tokenizer found beside", "copy the model's tokenizer files")
    assert not (tmp_path / "run").exists()


@needs_shared
def test_a_tokenizer_without_bos_or_eos_names_the_flag_and_no_bos_runs(tmp_path, capsys):
    model = tiny_hf_dir(tmp_path, bos=False)
    argv = ["prune", "--model", str(model), "--out", str(tmp_path / "run"), "--block-len", "32", *QUICK]
    one_line_error(capsys, argv, "neither a BOS nor an EOS token", "pass --no-bos")
    assert cli.main([*argv, "--no-bos"]) == 0
    assert cli.main(["eval", str(tmp_path / "run" / "plan.patch")]) == 0  # eval reads --no-bos from the plan


def test_a_tile_the_gpu_kernels_cannot_serve_warns_before_training(tmp_path, monkeypatch):
    """--tile 8 8 trains and applies, but patchc.compile refuses its plan (blocks are powers of two >= 16):
    said before the model loads, not after the training; 48 x 48 and 16 x 32 serve, so they do not warn."""
    import warnings

    def stop(opts):
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(prune, "load_bundle", stop)
    with pytest.warns(UserWarning, match=r"--tile 8 8: .*multiples of 16: patchc.compile and the backend will"):
        with pytest.raises(RuntimeError, match="stopped before loading"):
            prune._prune(patchc.job.PruneOptions(tile=(8, 8), out=str(tmp_path / "run")), None)
    for tile in ((48, 48), (16, 32), None):
        with warnings.catch_warnings(), pytest.raises(RuntimeError, match="stopped before loading"):
            warnings.simplefilter("error")
            prune._prune(patchc.job.PruneOptions(tile=tile, out=str(tmp_path / "run")), None)
