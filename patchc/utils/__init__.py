"""Helpers every stage uses; none of them knows about masks or tiles.

    files.py               atomic writes: readers see the old file or the new one, never half of one
    safetensors_stream.py  a safetensors file written one tensor at a time (a file larger than memory)
    env.py                 library versions and the device name, for reports, benchmarks and cache keys
    names.py               reading structure from weight names (which transformer block a weight belongs to)
    progress.py            tqdm progress bars where tqdm is installed; log lines on stderr for `patchc -v`
    lazy.py                a package's names imported on first use (`patchc --help` without torch)
    chunks.py              wide tensors (logits) a few rows at a time: loops, and a loss with its gradient
"""
