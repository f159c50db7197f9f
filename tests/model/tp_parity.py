"""Run one workload through ``LLM(tensor_parallel_size=N)`` and print what it produced.

``python tp_parity.py CHECKPOINT N [MASTER_PORT] [--tp-collective auto|shm|gloo]
[--kv-cache-dtype NAME]`` prints
one JSON line: every request's tokens, the sha256 of every logits tensor the runner
computed (in order, float32 bytes), their count, the engine's prefix hits and preemptions,
and which collective gathered (``kind``) and the decode route that names it. ``test_tensor_parallel.py`` runs
it for N=1 and N=2 in fresh processes (with a timeout) and compares. With MASTER_PORT this
is machine 0 of two (``nnodes=2``, one rank each): the other rank is started apart, as
``pagedllm serve --node-rank 1``.
"""

from __future__ import annotations

import hashlib
import json
import sys


def main(
    path: str,
    tp: int,
    master_port: int | None = None,
    collective: str = "auto",
    kv_cache_dtype: str = "auto",
) -> None:
    import torch

    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(
        model=path,
        dtype="float32",
        num_blocks=24,  # 96 token slots: the batch below does not fit, preemption follows
        block_size=4,
        max_num_batched_tokens=16,  # the 40-token prompt is prefilled in chunks
        num_scheduler_steps=1,
        tensor_parallel_size=tp,
        num_threads=1,
        distributed_timeout_s=60,
        tp_collective=collective,
        kv_cache_dtype=kv_cache_dtype,
        **({} if master_port is None else {"nnodes": 2, "master_port": master_port}),
    )
    runner = llm.engine.runner
    model = runner.model
    digests: list[str] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        logits = compute(hidden, float32=float32)
        digests.append(hashlib.sha256(logits.float().numpy().tobytes()).hexdigest())
        return logits

    model.compute_logits = recording
    prefix = list(range(30, 42))
    prompts = [prefix + [50 + i, 60 + i] for i in range(3)] + [list(range(100, 140))]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, n=2, seed=7, ignore_eos=True)
    first = llm.generate(prompts[:1], greedy, use_tqdm=False)  # warms the prefix cache
    # The elastic pool on every rank: grow, fill the new blocks, compact back down.
    block = runner.kv_block_bytes
    grown = llm.resize_kv_cache(48 * block)
    filler = llm.generate([list(range(150, 190)), list(range(250, 290))], greedy, use_tqdm=False)
    shrunk = llm.resize_kv_cache(24 * block)
    rest = llm.generate(prompts[1:] + [prefix + [70]], [greedy] * 3 + [sampled], use_tqdm=False)
    stats = llm.engine.get_stats()
    outputs = first + filler + rest
    print(
        json.dumps(
            {
                "tokens": [[list(c.token_ids) for c in o.outputs] for o in outputs],
                "logits": digests,
                "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
                "preemptions": stats.num_preemptions,
                "resized": [grown.blocks_after, shrunk.blocks_after, shrunk.blocks_moved],
                "collective": getattr(model, "comm", None) and model.comm.kind,
                "decode_route": llm.engine.routes.decode_loop if llm.engine.routes else None,
            }
        )
    )
    llm.close()


def parse(argv: list[str]) -> tuple[str, int, int | None, str, str]:
    options = {"--tp-collective": "auto", "--kv-cache-dtype": "auto"}
    for name in options:
        if name in argv:
            at = argv.index(name)
            options[name] = argv[at + 1]
            argv = argv[:at] + argv[at + 2 :]
    port = int(argv[2]) if len(argv) > 2 else None
    return argv[0], int(argv[1]), port, options["--tp-collective"], options["--kv-cache-dtype"]


if __name__ == "__main__":
    main(*parse(sys.argv[1:]))
