"""``pagedllm env``: what this machine runs and how.

    pagedllm env                      # the default model, --dtype auto
    pagedllm env --model ./m --dtype float32 --json
    pagedllm env --kv-cache-dtype int8   # attention's route over a quantized cache
    pagedllm env --model ./m --quantization q4_0   # linears quantized at load

The CPU (model, the feature flags the kernels use, the CPUs this process may use), the
threads (torch's intra-op threads and the OpenMP settings), the kernel library (where it was
built, with how many compiler warnings), and for the given model each capability's route:
attention (the kernel's ISA), linears (pagedllm's own kernel or oneDNN), the decode loop
(one fused C++ call or layer by layer), the sampler, and the dtype with the reason for it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pagedllm.engine.args import json_config
from pagedllm.engine.config import DTYPES, QUANTIZATIONS
from pagedllm.kv_dtypes import KV_CACHE_DTYPES
from pagedllm.spec_decode.config import SpeculativeConfig

# OpenMP settings that change how the kernels' threads run beside other processes.
OMP_VARIABLES = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "OMP_PROC_BIND",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="HF directory, .gguf file or 'default'")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "reference"))
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="the cache's routes"
    )
    parser.add_argument(
        "--quantization", default=None, choices=QUANTIZATIONS, help="linears quantized at load"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--speculative-config",
        default=None,
        type=json_config(SpeculativeConfig),
        metavar="JSON",
        help="speculative decoding's route under this config (as pagedllm serve takes it)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")


def environment(
    model: str,
    dtype: str,
    attention_backend: str,
    kv_cache_dtype: str = "auto",
    speculative_config: SpeculativeConfig | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The report as plain data: cpu, threads, kernels and the model's routes (over a
    ``kv_cache_dtype`` cache; speculative decoding's under ``speculative_config``)."""
    import torch

    from pagedllm.attention.select import get_backend
    from pagedllm.engine.speculator import speculative_route
    from pagedllm.kernels.build import build_status
    from pagedllm.kernels.ops import layer_ops
    from pagedllm.kernels.probe import cpu_info
    from pagedllm.model.loader import load_model
    from pagedllm.worker.model_runner import TorchModelRunner

    cpu = cpu_info()
    ops = layer_ops()
    loaded = load_model(
        model,
        dtype,
        get_backend(attention_backend),
        load_tokenizer=False,
        quantization=quantization,
    )
    runner = TorchModelRunner(
        loaded.model, block_size=16, num_blocks=4, kv_cache_dtype=kv_cache_dtype
    )
    routes = runner.routes()
    return {
        "cpu": {
            "model": cpu.model,
            "cpus": cpu.num_cpus,
            "isa": cpu.isa,
            "max_isa": cpu.cap,
            "flags": cpu.kernel_flags(),
            "bf16_dot_products": cpu.bf16_dot,
        },
        "threads": {
            "torch": torch.get_num_threads(),
            **{name: os.environ.get(name) for name in OMP_VARIABLES},
        },
        "torch": torch.__version__,
        "kernels": {
            "library": build_status(),
            "small_gemm_bf16": ops.small_gemm_isa() if ops is not None else "none",
            "small_gemm_f32": ops.small_gemm_f32_isa() if ops is not None else "none",
            "quant_gemm": ops.quant_gemm_isa() if ops is not None else "none",
        },
        "model": loaded.name,
        "weight_bytes": loaded.weight_bytes,
        "routes": {
            **routes.as_dict(),
            "dtype_reason": loaded.dtype_reason,
            "speculative": speculative_route(speculative_config),
        },
        "tensor_parallel_gathers": tensor_parallel_gathers(),
    }


def tensor_parallel_gathers() -> str:
    """How tensor-parallel ranks would gather here (``--tp-collective auto``)."""
    from pagedllm.engine.executor.shm_collective import SHM_DIR, shm_available

    if shm_available():
        free = os.statvfs(SHM_DIR)
        gib = free.f_bavail * free.f_frsize / (1 << 30)
        local = f"shared memory ({SHM_DIR}, {gib:.1f} GiB free)"
    else:
        local = f"gloo (no shared memory here: needs x86-64 and a writable {SHM_DIR})"
    return f"{local} for ranks on this CPU machine; gloo across machines, NCCL on CUDA"


def format_environment(env: dict[str, Any]) -> str:
    cpu, threads, kernels = env["cpu"], env["threads"], env["kernels"]
    omp = ", ".join(f"{k}={v}" for k, v in threads.items() if k != "torch" and v is not None)
    lines = [
        f"cpu: {cpu['model']} ({cpu['cpus']} CPUs usable)",
        f"cpu flags: {' '.join(cpu['flags']) or '-'}; best ISA for the kernels: {cpu['isa']}"
        + (f" (capped: PAGEDLLM_MAX_ISA={cpu['max_isa']})" if cpu["max_isa"] else ""),
        f"bf16 dot products: {'yes' if cpu['bf16_dot_products'] else 'no'}",
        f"threads: torch {threads['torch']}" + (f" ({omp})" if omp else ""),
        f"torch: {env['torch']}",
        f"kernels: {kernels['library']}",
        f"small_gemm bf16 route: {kernels['small_gemm_bf16']}",
        f"small_gemm float32 route: {kernels['small_gemm_f32']}",
        f"quant_gemm route (GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q5_K / Q6_K weights): {kernels['quant_gemm']}",
        f"tensor-parallel gathers: {env['tensor_parallel_gathers']}",
        f"model: {env['model']}",
        f"weights: {env['weight_bytes'] / (1 << 20):,.0f} MiB as held (the engine's start-up "
        "report splits its resident set: weights, KV cache, the rest)",
        "routes:",
    ]
    lines += [
        f"  {name.replace('_', ' ')}: {value}" for name, value in env["routes"].items() if value
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    env = environment(
        args.model,
        args.dtype,
        args.attention_backend,
        args.kv_cache_dtype,
        args.speculative_config,
        args.quantization,
    )
    print(json.dumps(env) if args.json else format_environment(env))
    return 0
