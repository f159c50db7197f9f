"""``pagedllm generate``: offline generation from the command line.

    pagedllm generate --chat --prompt "What is the capital of France?"
    pagedllm generate --model ./my-model --prompt "Once upon a time" --temperature 0.8

Without ``--model`` it runs the default model (SmolLM2-135M-Instruct). Sampling is
greedy unless ``--temperature`` says otherwise. A single prompt streams its text as
it is generated; the KV-cache report goes to stderr (``--quiet`` hides it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedllm.engine.args import add_engine_arguments, config_from_args
from pagedllm.engine.config import GENERATE
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pagedllm generate``."""
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt (repeat for several; default: read stdin)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256)
    sampling.add_argument("--min-tokens", type=int, default=0)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--logprobs", type=int, default=None)
    sampling.add_argument("--beam-width", type=int, default=None, help="beam search instead")
    sampling.add_argument("--length-penalty", type=float, default=1.0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object per prompt")
    out.add_argument("--quiet", action="store_true", help="no start-up report or progress")
    add_engine_arguments(parser, GENERATE)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs,
    )


def run(args: argparse.Namespace) -> int:
    """Generate for every prompt; 0 on success, 2 on bad input."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        prompts = _prompts(args)
        params = sampling_params_from_args(args)
        beam = (
            BeamSearchParams(
                args.beam_width,
                args.max_tokens,
                args.ignore_eos,
                length_penalty=args.length_penalty,
            )
            if args.beam_width
            else None
        )
        config = config_from_args(args, GENERATE)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pagedllm.engine.llm import LLM
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        llm = LLM.from_engine(LLMEngine.from_config(config))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet and llm.engine.startup_report:
        print(llm.engine.startup_report, file=sys.stderr)
    try:
        inputs = [_encode(llm, p, args) for p in prompts]
        if beam is not None:
            _print_beams(llm, inputs, beam, args)
        elif len(inputs) == 1 and params.n == 1 and not args.json:
            _stream(llm, inputs[0], params)
        else:
            _print_outputs(llm.generate(inputs, params, use_tqdm=not args.quiet), args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        if text.strip():
            return [text.rstrip("\n")]
    raise ValueError("give --prompt (or a prompt on stdin)")


def _encode(llm: Any, prompt: str, args: argparse.Namespace) -> Any:
    if not args.chat:
        return prompt
    messages = [{"role": "user", "content": prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return {"prompt_token_ids": llm.encode_chat(messages)}


def _stream(llm: Any, prompt: Any, params: SamplingParams) -> None:
    engine = llm.engine
    value = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    engine.add_request("cli", value, params)
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")


def _print_outputs(outputs: list[Any], args: argparse.Namespace) -> None:
    for output in outputs:
        if args.json:
            print(json.dumps(_as_json(output)))
            continue
        for completion in output.outputs:
            label = f"[{output.request_id}.{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{completion.text}")


def _as_json(output: Any) -> dict[str, Any]:
    return {
        "prompt": output.prompt,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "cumulative_logprob": c.cumulative_logprob,
            }
            for c in output.outputs
        ],
    }


def _print_beams(
    llm: Any, inputs: list[Any], beam: BeamSearchParams, args: argparse.Namespace
) -> None:
    for output in llm.beam_search(inputs, beam):
        for rank, seq in enumerate(output.sequences):
            if args.json:
                print(
                    json.dumps(
                        {
                            "rank": rank,
                            "text": seq.text,
                            "score": seq.score,
                            "cum_logprob": seq.cum_logprob,
                        }
                    )
                )
            else:
                print(f"[beam {rank} score {seq.score:.3f}] {seq.text}")
