"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Mirrors vLLM's names so its users feel at home::

    from pagedllm import LLM, SamplingParams
    with LLM(model="default", kv_cache_memory=2 << 30) as llm:
        for out in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

``close()`` (or the end of the ``with``) releases what the engine started: tensor-parallel
ranks and their process group, shared memory, the disk tier's writer. An ``LLM`` that is
merely dropped releases them when it is garbage-collected, and any left at interpreter
exit are released then; either way another ``LLM`` can start in the same process.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pagedllm.engine.config import OFFLINE, make_config
from pagedllm.engine.config import OFFLINE_SCHEDULER_STEPS as OFFLINE_SCHEDULER_STEPS
from pagedllm.engine.elastic import ResizeReport
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.tool_calls.constraints import tool_call_constraint
from pagedllm.tool_calls.render import ToolPlan, render_chat, special_marker, tag_token_ids
from pagedllm.tool_calls.tools import InvalidToolRequest

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearchOutput

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """An engine for offline batches. Keyword arguments are ``EngineConfig`` fields
    (``dtype``, ``block_size``, ``kv_cache_memory`` in bytes or ``memory_fraction``,
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``preemption_mode``, ``swap_memory`` in bytes, ...); the
    old ``swap_space`` and ``kv_offload_space`` (GiB) still work, with a warning.

    Defaults are the ``OFFLINE`` preset over ``EngineConfig``'s (``engine/config.py``):
    ``num_scheduler_steps`` is ``OFFLINE_SCHEDULER_STEPS`` here (the server keeps 1), as
    an offline batch returns whole completions."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        config = make_config({"model": str(model), **kwargs}, OFFLINE, stacklevel=2)
        self._own(LLMEngine.from_config(config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (for example one on a ``FakeModelRunner``);
        ``close()`` closes it."""
        llm = cls.__new__(cls)
        llm._own(engine)
        return llm

    def _own(self, engine: LLMEngine) -> None:
        # The engine releases its parts itself when it is collected (LLMEngine.close).
        self._engine: LLMEngine | None = engine
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """The engine; ``RuntimeError`` once the LLM is closed."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed; create a new one")
        return self._engine

    def close(self) -> None:
        """Release everything the engine started (idempotent); the LLM cannot be used
        afterwards. Also done by ``with LLM(...) as llm:``, on garbage collection and at
        interpreter exit."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache``: drop the cached prompt blocks; False while
        requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def resize_kv_cache(self, size: int | str, *, preempt: bool = False) -> ResizeReport:
        """Resize the KV cache to ``size`` bytes (or ``"2GiB"``) now: compaction packs the
        blocks worth keeping low and the tail goes back to the operating system, or the
        pool grows in place; cached prompts survive where they fit. See
        ``engine/elastic.py``."""
        from pagedllm.engine.args import parse_size

        return self.engine.elastic.resize(parse_size(size), preempt=preempt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``prompts``: a string, a list of token ids, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"``: the text
        reported in the output, not re-tokenized), or a list of those.
        ``sampling_params``: one for all, or one per prompt; its ``structured_outputs``
        (a JSON Schema, regex, choice or grammar) is compiled here first, so a spec the
        engine cannot take is a ``ValueError`` naming the feature before anything runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        for p in params:  # a refused grammar is a ValueError here, before anything runs
            self.engine.structured.check(p)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params, strict=True)):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    _prompt_value(prompt),
                    p,
                    priority=priority[i] if priority else 0,
                    prompt_text=_prompt_text(prompt),
                )
                ids.append(request_id)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``)
        or to several, through the tokenizer's chat template.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``) are shown to
        the model as its template shows them (``EngineConfig.tool_call_parser``), and
        each completion's ``tool_calls`` and ``content`` hold its reply read for calls;
        ``tool_choice`` ("auto", "none", "required" or ``{"type": "function",
        "function": {"name": ...}}``) and ``parallel_tool_calls`` as in the OpenAI API.
        Earlier calls (assistant ``tool_calls``) and their results (``role: "tool"``)
        may be in the messages."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts, plans = [], []
        for conversation in conversations:
            text, plan = self._render(
                conversation, add_generation_prompt, chat_template,
                tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            )  # fmt: skip
            prompts.append({"prompt": text, "prompt_token_ids": self._encode_rendered(text)})
            plans.append(plan)
        params = _params_per_prompt(sampling_params, len(prompts))
        params = [self._tool_params(p, plan) for p, plan in zip(params, plans, strict=True)]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [_with_calls(o, plan) for o, plan in zip(outputs, plans, strict=True)]

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **tool_kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template (``tools`` and
        the other tool keywords of ``chat`` too)."""
        return self._encode_rendered(
            self.render_chat(messages, add_generation_prompt, chat_template, **tool_kwargs)
        )

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **tool_kwargs: Any,
    ) -> str:
        """A conversation rendered by the chat template, as text (``tools`` and the other
        tool keywords of ``chat`` too)."""
        return self._render(messages, add_generation_prompt, chat_template, **tool_kwargs)[0]

    def _render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        chat_template: str | None,
        **tool_kwargs: Any,
    ) -> tuple[str, ToolPlan | None]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        return render_chat(
            tokenizer,
            messages,
            tool_call_parser=self.engine.config.tool_call_parser,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **tool_kwargs,
        )

    def _tool_params(self, params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
        """A reply read for calls keeps a special-token call marker in its text; one that
        must call a tool is held to the format's grammar."""
        if plan is None or not plan.parses:
            return params
        tokenizer = self.engine.tokenizer
        if special_marker(tokenizer, plan.format) is not None:
            params = replace(params, skip_special_tokens=False)
        constraint = tool_call_constraint(plan, tag_token_ids(tokenizer, plan.format))
        if constraint is not None:
            if params.structured_outputs is not None:
                raise InvalidToolRequest(
                    "a reply that must call a tool cannot also follow structured_outputs",
                    "tool_choice",
                )
            params = replace(params, structured_outputs=constraint)
        return params

    def _encode_rendered(self, text: str) -> list[int]:
        # The template already carries its special tokens (BOS included).
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """The ``beam_width`` best sequences per prompt (see ``engine.beam_search``);
        beams share their common prefix's KV blocks."""
        from pagedllm.engine.beam_search import beam_search

        values = [_prompt_value(p) for p in _as_prompt_list(prompts)]
        return beam_search(self.engine, values, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        try:
            while pending:
                for output in self.engine.step(finished_only=True):
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _with_calls(output: RequestOutput, plan: ToolPlan | None) -> RequestOutput:
    """``output`` with each completion read for calls (when the request had tools)."""
    if plan is None or not plan.parses:
        return output
    completions = []
    for completion in output.outputs:
        reply = plan.parse(completion.text)
        completions.append(replace(completion, tool_calls=reply.tool_calls, content=reply.content))
    return replace(output, outputs=tuple(completions))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt
    return list(prompt)


def _prompt_text(prompt: Prompt) -> str | None:
    """The text to report for a prompt given as token ids with a ``"prompt"``."""
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        return prompt.get("prompt")
    return None


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
