"""CPU decode ms per step, kvcompile against HF eager, SmolLM2-135M's shape (random weights).

    python benchmarks/cpu_decode_time.py bf16,fp8_e4m3,auto 5

Per path and repetition: (CPU time of generate(33) - CPU time of generate(1)) / 32, process
CPU time, 1 thread, prompt 256, inner eager; paths run in turn (the order rotating) within a
repetition, and the ratio HF / path is taken pair by pair. No model file needed (the shape of
benchmarks/cpu_decode_counts.py); bench_cpu_generate.py times the real model.
"""

import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from cpu_decode_counts import smollm2_shaped  # noqa: E402

import kvcompile  # noqa: E402


def main() -> None:
    kvs = (sys.argv[1] if len(sys.argv) > 1 else "bf16,fp8_e4m3").split(",")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    n = 33
    torch.set_num_threads(1)
    model = smollm2_shaped()
    ids = torch.randint(3, 49000, (1, 256), generator=torch.Generator().manual_seed(0))
    models = {"hf": model}
    for kv in kvs:
        m = copy.deepcopy(model)
        kvcompile.compile(m, kvcompile.KVConfig(kv_dtype=kv, inner="eager", max_kv_bytes=1 << 28))
        models[kv] = m

    def gen(m, k):
        c0 = time.process_time()
        with torch.no_grad():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                       min_new_tokens=k, do_sample=False, pad_token_id=0)
        return time.process_time() - c0

    for m in models.values():
        for _ in range(2):
            gen(m, 3)
    names = list(models)
    res = {k: [] for k in names}
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t1 = gen(models[k], 1)
            res[k].append((gen(models[k], n) - t1) / (n - 1) * 1e3)
    print("| path | ms/step min | median | HF / path median (min, max) |\n|---|---|---|---|")
    for k in names:
        ratio = [h / x for h, x in zip(res["hf"], res[k])]
        print(f"| {k} | {min(res[k]):.2f} | {statistics.median(res[k]):.2f} | "
              f"{statistics.median(ratio):.3f} ({min(ratio):.3f}, {max(ratio):.3f}) |")


if __name__ == "__main__":
    main()
