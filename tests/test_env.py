"""What results are stamped with (`patchc.utils.env`): the CPU's name and vector ISA, not just "x86_64"."""

from __future__ import annotations

import platform

import torch

from patchc.utils import env


def test_cpu_device_name_says_model_isa_and_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        name = env.device_name("cpu")
        torch.set_num_threads(1)
        one = env.device_name("cpu")
    finally:
        torch.set_num_threads(threads)
    assert name.startswith("cpu (") and name.endswith(", 2 threads)") and one.endswith(", 1 thread)")
    assert f", {torch.backends.cpu.get_cpu_capability()}, " in name  # AVX2 and AVX512 runs differ in the last digits
    assert env.cpu_model() in name and env.cpu_model()


def test_cpu_model_reads_cpuinfo_and_falls_back(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    real_open = open
    def fake(path, *a, **k):
        return real_open(info if path == "/proc/cpuinfo" else path, *a, **k)

    monkeypatch.setattr(env, "open", fake, raising=False)
    assert env.cpu_model() == "AMD EPYC 9654 96-Core Processor"

    def missing(path, *a, **k):
        raise FileNotFoundError(path)

    monkeypatch.setattr(env, "open", missing, raising=False)
    assert env.cpu_model() == (platform.processor() or platform.machine())


def test_proc_bytes_reads_a_kb_field_and_says_none_when_absent(tmp_path):
    from patchc.utils.env import proc_bytes

    f = tmp_path / "status"
    f.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nRssAnon:\t 512 kB\n")
    assert proc_bytes(f, "VmHWM") == 2048 * 1024 and proc_bytes(f, "RssAnon") == 512 * 1024
    assert proc_bytes(f, "VmRSS") is None and proc_bytes(tmp_path / "gone", "VmHWM") is None
