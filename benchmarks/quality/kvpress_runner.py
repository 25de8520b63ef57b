"""Runs kvpress presses on given token ids; executed by quality.py inside kvpress's own venv
(kvpress pins transformers<5.3). Same protocol as kvcompile's retrieval suites: the prompt minus
its last token is prefilled under the press, then the last token and the answer are decoded
greedily from the compressed cache.

    python kvpress_runner.py job.json out.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(job_path: str, out_path: str) -> None:
    import kvpress
    from quality_data import load_smollm2
    from transformers import DynamicCache

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(job.get("threads", 1))
    model, _ = load_smollm2()
    results = []
    for press_name in job["presses"]:
        if press_name == "ObservedAttentionPress":
            model.config._attn_implementation = "eager"
        else:
            model.config._attn_implementation = "sdpa"
        for ratio in job["ratios"]:
            press = getattr(kvpress, press_name)(compression_ratio=ratio)
            for item in job["items"]:
                ids = torch.tensor(item["ids"])[None]
                cache = DynamicCache()
                t = time.time()
                with torch.no_grad():
                    with press(model):
                        model.model(input_ids=ids[:, :-1], past_key_values=cache)
                    kept = cache.get_seq_length()
                    gen, nxt = [], ids[:, -1:]
                    pos = ids.shape[1] - 1
                    for _ in range(job["max_new"]):
                        out = model(input_ids=nxt, past_key_values=cache,
                                    position_ids=torch.tensor([[pos]]))
                        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                        gen.append(int(nxt))
                        pos += 1
                results.append({"press": press_name, "ratio": ratio, "key": item["key"],
                                "answer": item["answer"], "generated": gen, "kept": kept,
                                "tokens": ids.shape[1] - 1, "seconds": time.time() - t})
                print(press_name, ratio, item["key"], kept, ids.shape[1] - 1, gen, flush=True)
                with open(out_path, "w") as f:
                    json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
