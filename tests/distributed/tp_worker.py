"""One rank of the tensor-parallel tests (tests/distributed/test_tensor_parallel.py).

Started twice by `torch.multiprocessing` with the environment torchrun would set (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); gloo on the CPU. Each rank compiles its shard of the
saved tiny Llama three ways (tp_plan="auto" with fp32 pages, the same with fp8_e4m3 pages, and a
model sharded by hand with parallelize_module) and (KVCOMPILE_TEST_FULL=1) a tiny Qwen2 with
tp_plan="auto", generates greedily, runs the cases of tp_cases.py (rotation + SnapKV, the Engine,
a gpt-fast model with its own sharding), and writes what it saw to `out/rank{R}.json`; the
parent compares that with the unsharded model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import traceback

import torch


def _generate(model, prompts, new):
    return model.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None).tolist()


def _compiled_run(model, prompts, new, **cfg) -> dict:
    import kvcompile
    from kvcompile.api import state_of
    from kvcompile.runtime.hooks import RuntimeHook
    from tests.engine.tiny import config

    kvcompile.compile(model, config(**cfg))
    class PoolWatch(RuntimeHook):  # pool tokens after every forward: no eager fallback passes
        def __init__(self, state):
            self.state, self.seen = state, []

        def after_forward(self, ctx):
            s = self.state.pool.stats()
            self.seen.append((s.tokens, s.pages_used))

    st = state_of(model)
    hook = PoolWatch(st)
    st.hooks.append(hook)
    tokens = _generate(model, prompts, new)
    rep = kvcompile.report(model)
    attn = model.model.layers[0].self_attn
    return dict(
        tokens=tokens,
        sites=[dict(name=s.name, rewritten=s.rewritten, reason=s.reason,
                    num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
                    k_format=s.k_format) for s in rep.sites],
        bytes_per_token=kvcompile.stats(model)["bytes_per_token"],
        stats_tp={k: kvcompile.stats(model)[k] for k in (
            "tp_rank", "tp_size", "bytes_per_token_all_ranks")},
        report=str(rep).splitlines()[:2] + [str(rep).splitlines()[-1]],
        report_tp=[rep.as_dict()["tp_rank"], rep.as_dict()["tp_size"]],
        pool_seen=hook.seen,
        k_proj_local=list(getattr(attn.k_proj.weight, "to_local", lambda: attn.k_proj.weight)()
                          .shape),
    )


def _hand_sharded(model_dir: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mesh = init_device_mesh("cpu", (world,))
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, plan)
    return model


def run_rank(rank: int, world: int, port: int, model_dir: str, uneven_dir: str, out: str,
             prompts, new: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TRITON_INTERPRET="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tests.distributed import tp_cases

    res: dict = {}
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    res["accelerate"] = has_accelerate

    def case(name, fn):
        t0 = time.monotonic()
        try:
            res[name] = fn()
            res[name]["seconds"] = round(time.monotonic() - t0, 1)
        except Exception as e:  # the parent reports it; the other cases still run
            res[name] = dict(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())

    def tp_plan(kv_dtype):
        m = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto",
                                                 dtype=torch.float32).eval()
        return _compiled_run(m, prompts, new, kv_dtype=kv_dtype)

    def uneven():
        import kvcompile

        m = AutoModelForCausalLM.from_pretrained(uneven_dir, tp_plan="auto",
                                                 dtype=torch.float32).eval()
        r = {}
        try:  # what the model does on its own, without kvcompile
            m(torch.tensor(prompts))
            r["eager"] = "ran"
        except Exception as e:
            r["eager"] = f"{type(e).__name__}: {e}"
        try:
            kvcompile.compile(m, kvcompile.KVConfig(kv_dtype="auto"))
            r["compile"] = "accepted"
        except Exception as e:
            r["compile"] = f"{type(e).__name__}: {e}"
        return r

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto",
                                                    dtype=torch.float32).eval()

    def engine():
        m = load()
        r = tp_cases.engine(m, kv_heads=1)
        r.update(tp_cases.engine_diverging(m, rank))
        return r

    qwen2 = os.path.join(os.path.dirname(model_dir), "qwen2")
    if has_accelerate:  # from_pretrained(tp_plan=...) needs it; hand sharding does not
        case("tp_plan_fp32", lambda: tp_plan("auto"))
        case("tp_plan_fp8", lambda: tp_plan("fp8_e4m3"))
        case("uneven", uneven)
        if os.path.isdir(qwen2):
            # Qwen2 (q/k/v biases, its own tp_plan), saved beside the Llama by the parent
            # with KVCOMPILE_TEST_FULL=1
            case("qwen2_fp32", lambda: _compiled_run(AutoModelForCausalLM.from_pretrained(
                qwen2, tp_plan="auto", dtype=torch.float32).eval(), prompts, new,
                kv_dtype="auto"))
        case("rotate_snapkv", lambda: tp_cases.rotate_snapkv(load(), prompts, new))
        case("rotate_snapkv_batched", lambda: tp_cases.rotate_snapkv(load(), prompts, new,
                                                                     batched=True))
        case("engine", engine)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    case("hand_fp32", lambda: _compiled_run(_hand_sharded(model_dir, world), prompts, new,
                                            kv_dtype="auto"))
    case("gptfast", lambda: tp_cases.gptfast(rank, world, prompts, new))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
